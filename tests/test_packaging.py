"""The package as a user installs it: a fresh virtualenv, ``pip install``, a real worker.

``pip install outbox-relay`` must bring everything ``celery -A
outbox_relay.app worker`` needs for the brokers the README names. It once
did not: the project depended on bare ``redis`` and ``kombu``, and kombu's
Redis transport imports ``packaging``, which only kombu's ``redis`` extra
pulls in, so the first worker of a fresh environment died with
``ModuleNotFoundError: No module named 'packaging'``. The development
virtualenv never noticed, because a dev tool had installed ``packaging``.

The test builds a virtualenv in tmp_path, installs this checkout into it
(non-editable, from a copy, so the build writes nothing into the work tree),
then, with that environment alone (no PYTHONPATH to the checkout), starts a
worker and a beat per broker, enqueues one message from the test process and
waits for it to be ``done``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import outbox_relay

from . import services
from .apps import kit

pytestmark = [pytest.mark.slow, pytest.mark.celery]

ROOT = Path(__file__).resolve().parent.parent
# What a build of the project never needs; everything else is copied as is.
NOT_COPIED = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    "*.egg-info",
    "build",
    "dist",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    ".outbox-relay",
    "tests",
    "benchmarks",
)

PUBLISHER = '''\
"""A user's publisher module, importable through PYTHONPATH only."""
import os


def publish(message):
    with open(os.environ["PROBE_OUT"], "a") as out:
        out.write(f"{message.id} {message.idempotency_key}\\n")
'''


def _run(cmd: list[str], *, timeout: float, env: dict[str, str], cwd: Path) -> str:
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, (
        f"{' '.join(cmd)} failed ({result.returncode}):\n{output[-4000:]}"
    )
    return output


def _clean_env() -> dict[str, str]:
    """This environment without anything that points at the checkout or its virtualenv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.pop("PYTHONHOME", None)
    return env


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("fresh-install")
    source = base / "src"
    shutil.copytree(ROOT, source, ignore=NOT_COPIED)
    venv = base / "venv"
    # Every command runs in ``base``: ``python -c`` puts its cwd on sys.path,
    # and the checkout must not be reachable that way.
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120, env=_clean_env(), cwd=base)
    python = venv / "bin" / "python"
    _run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", str(source)],
        timeout=240,  # inside pytest's own 300 s limit, with the venv and the runs
        env=_clean_env(),
        cwd=base,
    )
    where = _run(
        [str(python), "-c", "import outbox_relay, sys; print(outbox_relay.__file__)"],
        timeout=60,
        env=_clean_env(),
        cwd=base,
    ).strip()
    # Installed into the virtualenv, not found through the checkout.
    assert Path(where).resolve().is_relative_to(venv.resolve()), where
    return venv


def _broker_run(venv: Path, broker: str, dsn: str, folder: Path) -> None:
    folder.mkdir()
    modules = folder / "user_code"
    modules.mkdir()
    (modules / "probe_publisher.py").write_text(PUBLISHER)
    run_dir = folder / "run"  # an empty cwd: no celeryconfig.py, no checkout
    run_dir.mkdir()
    out = folder / "published.txt"
    env = {
        **_clean_env(),
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(modules),
        "CELERY_BROKER_URL": broker,
        "OUTBOX_DSN": dsn,
        "OUTBOX_PUBLISHER": "probe_publisher:publish",
        "OUTBOX_QUEUE": kit.unique("outbox-pkg"),
        "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
        "PROBE_OUT": str(out),
    }
    celery = str(venv / "bin" / "celery")
    node = kit.unique("pkg")
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = folder / f"{name}.log"
        with log.open("wb") as handle:
            popen = subprocess.Popen(
                [celery, "-A", "outbox_relay.app", *args],
                cwd=str(run_dir),
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        procs.append((popen, log))
        return popen, log

    def logs() -> str:
        return "\n".join(f"===== {log.name}\n{log.read_text()[-4000:]}" for _, log in procs)

    try:
        worker, worker_log = start("worker", ["worker", "-l", "info", "-n", f"{node}@%h"])
        start("beat", ["beat", "-l", "info", "-s", str(folder / "beat-schedule")])
        deadline = time.monotonic() + 60
        while " ready." not in worker_log.read_text(errors="replace"):
            assert worker.poll() is None, f"the worker died at start:\n{logs()}"
            assert time.monotonic() < deadline, f"the worker never got ready:\n{logs()}"
            time.sleep(0.2)
        with psycopg.connect(dsn) as conn, conn.transaction():
            message_id = outbox_relay.enqueue(
                conn,
                aggregate_type="order",
                aggregate_id="1",
                event_type="order.created",
                payload={"order": 1},
            )
        try:
            kit.wait_until(
                lambda: kit.row(dsn, message_id)["status"] == "done",
                timeout=30,
                describe=lambda: kit.row(dsn, message_id),
                what="the message to be done",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{logs()}") from None
        assert out.read_text().split() == [str(message_id), f"outbox-{message_id}"]
    finally:
        for popen, _ in procs:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGTERM)
        for popen, _ in procs:
            try:
                popen.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(10)
        if broker.startswith("amqp"):
            _delete_queue(broker, env["OUTBOX_QUEUE"])


def _delete_queue(broker: str, queue: str) -> None:
    """RabbitMQ keeps a durable queue after its consumers leave; this one was ours alone."""
    from kombu import Connection

    with contextlib.suppress(Exception), Connection(broker, connect_timeout=5) as conn:
        conn.channel().queue_delete(queue)


def test_fresh_install_runs_a_worker_on_redis(fresh_venv: Path, dsn: str, tmp_path: Path) -> None:
    _broker_run(fresh_venv, services.redis_url(), dsn, tmp_path / "redis")


@pytest.fixture
def rabbitmq() -> Iterator[str]:
    url = services.amqp_url()
    if url is None:
        pytest.skip("RabbitMQ not configured: set OUTBOX_TEST_AMQP_URL to run the AMQP half")
    yield url


def test_fresh_install_runs_a_worker_on_rabbitmq(
    rabbitmq: str, fresh_venv: Path, dsn: str, tmp_path: Path
) -> None:
    _broker_run(fresh_venv, rabbitmq, dsn, tmp_path / "rabbitmq")


# ----------------------------------------------- the example celeryconfig.py
def _example_config_worker(tmp_path: Path, **env: str) -> str:
    """Start the standalone app with the repository's celeryconfig.py; return its log."""
    from .celery_procs import CeleryProcs

    procs = CeleryProcs(
        {"CELERY_CONFIG_MODULE": "celeryconfig", "CELERY_BROKER_URL": services.redis_url(), **env},
        tmp_path,
    )
    for name in ("OUTBOX_DSN", "OUTBOX_PUBLISHER"):
        if name not in env:
            procs.env.pop(name, None)  # unset, as on a machine nobody configured
    try:
        worker = procs.worker(ready=False)
        kit.wait_until(
            lambda: not worker.alive() or " ready." in worker.text(),
            timeout=60,
            what="the worker to exit or get ready",
        )
        log = worker.text()
        assert " ready." not in log, f"started without being configured:\n{log[-3000:]}"
        worker.popen.wait(20)
        assert worker.popen.returncode != 0, log[-3000:]
        return log
    finally:
        procs.stop_all()


def test_example_config_without_a_publisher_starts_and_dead_letters_events(
    dsn: str, tmp_path: Path
) -> None:
    # It once defaulted to https://example.invalid/... (and delivered nowhere),
    # then refused to start. Rows written by outbox_relay.apply_async need no
    # publisher, so the relay starts, says so, and any other row ends dead
    # with a reason naming the setting (nothing is sent anywhere by guess).
    from .celery_procs import CeleryProcs

    procs = CeleryProcs(
        {
            "CELERY_CONFIG_MODULE": "celeryconfig",
            "CELERY_BROKER_URL": services.redis_url(),
            "OUTBOX_DSN": dsn,
            "OUTBOX_QUEUE": kit.unique("nopub"),
            "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
        },
        tmp_path,
    )
    procs.env.pop("OUTBOX_PUBLISHER", None)
    try:
        worker = procs.worker()
        assert "OUTBOX_PUBLISHER is not set" in worker.text()
        with psycopg.connect(dsn) as conn, conn.transaction():
            message_id = outbox_relay.enqueue(
                conn, aggregate_type="a", aggregate_id="1", event_type="e", payload={}
            )
        kit.wait_until(
            lambda: kit.row(dsn, message_id)["status"] == "dead",
            timeout=60,
            what="the row to end dead",
            describe=worker.text,
        )
        assert "OUTBOX_PUBLISHER is not set" in kit.row(dsn, message_id)["last_error"]
    finally:
        procs.stop_all()


def test_example_config_refuses_to_start_without_a_dsn(tmp_path: Path) -> None:
    # It used to default to a guessed database (postgres on 127.0.0.1).
    log = _example_config_worker(tmp_path, OUTBOX_PUBLISHER="tests.apps.receiver:record")
    assert "OUTBOX_DSN" in log, log[-3000:]


def test_example_config_refuses_a_bad_value_in_one_line(dsn: str, tmp_path: Path) -> None:
    # It used to float() the variable itself: a ValueError traceback from celeryconfig.py.
    log = _example_config_worker(
        tmp_path,
        OUTBOX_DSN=dsn,
        OUTBOX_PUBLISHER="tests.apps.receiver:record",
        OUTBOX_LEASE_SECONDS="sixty",
    )
    assert "outbox-relay cannot start: " in log and "OUTBOX_LEASE_SECONDS" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
