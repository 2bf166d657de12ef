"""docker-compose.yml, Dockerfile and .env.example agree with each other and the repo.

No Docker engine runs in CI, so these are static checks: the YAML parses, the
expected services are there, every file it mounts or builds from exists, every
variable it reads is documented in .env.example, the relay settings it passes
exist, and no secret is written into it.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from outbox_relay import Settings

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_TEXT = (ROOT / "docker-compose.yml").read_text()
COMPOSE: dict[str, Any] = yaml.safe_load(COMPOSE_TEXT)
SERVICES: dict[str, Any] = COMPOSE["services"]
# ${VAR}, ${VAR:-default}, ${VAR:?error}; $${...} is escaped for the container's shell.
INTERPOLATED = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)")
REQUIRED = re.compile(r"^\$\{([A-Z_][A-Z0-9_]*):\?[^}]*\}$")
# A secret that only some setups need: from .env, empty when it is not set.
OPTIONAL = re.compile(r"^\$\{([A-Z_][A-Z0-9_]*):-\}$")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|AUTH|TOKEN")
RELAY_SERVICES = ("migrate", "worker", "beat", "outbox-relay-metrics")


def env_example() -> dict[str, str]:
    found = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            found[name.strip()] = value.strip()
    return found


def environment(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in (SERVICES[service].get("environment") or {}).items()}


def test_services() -> None:
    assert set(SERVICES) == {
        "postgres",
        "redis",
        "migrate",
        "worker",
        "beat",
        "outbox-relay-metrics",
        "flower",
        "prometheus",
    }
    assert SERVICES["migrate"]["command"] == ["outbox-relay", "migrate"]
    assert SERVICES["migrate"]["restart"] == "no"
    for name in ("worker", "beat"):
        depends = SERVICES[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"
        assert depends["redis"]["condition"] == "service_healthy"
        assert "celery -A outbox_relay.app " + name in " ".join(SERVICES[name]["command"])
    assert "-E" in " ".join(SERVICES["worker"]["command"]).split()  # task events for Flower
    assert "flower" in SERVICES["flower"]["command"]


def test_referenced_files_exist() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", dockerfile, re.M | re.I))
    for name, service in SERVICES.items():
        build = service.get("build")
        if build:
            context = ROOT / build["context"]
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
            assert build["target"] in targets, name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).is_file(), f"{name} mounts missing {source}"
            else:
                assert source in COMPOSE["volumes"], f"{name} uses undeclared volume {source}"
    # What the image is built from. A plain source must exist; a pattern may
    # match nothing (README.m[d]: copied when present) if the line copies
    # something else, as Docker requires.
    for line in re.findall(r"^COPY\s+(.+)$", dockerfile, re.M):
        *sources, _ = [part for part in line.split() if not part.startswith("--")]
        matched = [list(ROOT.glob(source)) for source in sources]
        assert any(matched), f"Dockerfile: COPY {line} copies nothing"
        for source, found in zip(sources, matched):
            assert found or re.search(r"[*?[]", source), f"Dockerfile copies missing {source}"


def test_prometheus_scrapes_the_exporter_with_the_alerts() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    mounts = {v.split(":")[1] for v in SERVICES["prometheus"]["volumes"] if v.startswith("./")}
    assert "/etc/prometheus/prometheus.yml" in mounts
    for rule_file in config["rule_files"]:
        assert (ROOT / "deploy/prometheus" / rule_file).is_file()
        assert f"/etc/prometheus/{rule_file}" in mounts
    jobs = config["scrape_configs"]
    targets = [t for job in jobs for static in job["static_configs"] for t in static["targets"]]
    for target in targets:
        host, port = target.split(":")
        assert host in SERVICES, f"prometheus scrapes {host}, which is not a service"
        assert port in SERVICES[host]["command"]


def test_relay_settings_exist_and_match_the_defaults() -> None:
    names = {f"OUTBOX_{f.name.upper()}" for f in fields(Settings)}
    defaults = Settings()
    example = env_example()
    for service in RELAY_SERVICES:
        env = environment(service)
        assert env["OUTBOX_DSN"].startswith("host=postgres ")
        assert "password" not in env["OUTBOX_DSN"].lower()
        for key, value in env.items():
            if key.startswith("OUTBOX_") and not key.startswith("OUTBOX_WEBHOOK_"):
                assert key in names, f"{service}: {key} is not a relay setting"
                default = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
                if default:
                    # The compose fallback is the relay's own default (an
                    # empty one leaves an optional setting unset) ...
                    assert Settings.load(environ={key: default.group(1)}) == defaults, key
                    # ... and so is the value .env.example suggests.
                    assert Settings.load(environ={key: example[key]}) == defaults, key


def test_the_worker_is_passed_every_relay_setting() -> None:
    # A setting written in .env reaches the relay only if compose passes it:
    # .env itself only fills in the ${...} of docker-compose.yml.
    passed = set(environment("worker"))
    for f in fields(Settings):
        name = f"OUTBOX_{f.name.upper()}"
        assert name in passed, f"docker-compose.yml does not pass {name} to the worker"


def test_every_variable_is_in_env_example() -> None:
    used = set(INTERPOLATED.findall(COMPOSE_TEXT))
    example = env_example()
    assert used == set(example), (used - set(example), set(example) - used)


def test_no_hard_coded_secrets() -> None:
    example = env_example()
    for name in SERVICES:
        for key, value in environment(name).items():
            if SECRET_NAME.search(key):
                match = REQUIRED.match(value) or OPTIONAL.match(value)
                assert match, f"{name}: {key} must come from .env as ${{VAR:?...}} or ${{VAR:-}}"
                assert example[match.group(1)] == "", f".env.example ships a {key}"
            # Credentials inside URLs come from variables too.
            for password in re.findall(r"://[^/\s@]*:([^@/\s]*)@", value):
                assert REQUIRED.match(password), f"{name}: {key} holds a literal password"
    for key, value in example.items():
        if SECRET_NAME.search(key):
            assert value == "", f".env.example must not ship a value for {key}"
    assert ".env" in (ROOT / ".dockerignore").read_text().split()
