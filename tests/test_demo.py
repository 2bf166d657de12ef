"""``outbox-relay demo`` run for real: the installed script in a subprocess, real
worker and beat, then checks that it cleaned up after itself (also on Ctrl-C).

The demo uses the CI services when ``OUTBOX_TEST_DSN`` / ``OUTBOX_TEST_REDIS_URL``
are set (a fresh database from the ``dsn`` fixture), and otherwise starts its own
embedded servers, which is what a bare machine does.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from outbox_relay.demo.receiver import Receiver, verdict

from . import services

pytestmark = pytest.mark.celery

DEMO = [str(Path(sys.executable).parent / "outbox-relay"), "demo"]
QUEUE = re.compile(r"queue outbox-demo-([0-9a-f]{8})")
FOLDER = re.compile(r"logs in (\S+)")
PASSWORD = "demo-s3cret-pw"


@pytest.fixture
def demo_env(request: pytest.FixtureRequest) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OUTBOX_DSN", "CELERY_BROKER_URL")}
    env.update(PYTHONIOENCODING="utf-8", COLUMNS="160")
    if os.environ.get("OUTBOX_TEST_DSN"):
        # A password the server (trust auth) never asks for: it must not be printed.
        env["OUTBOX_DSN"] = request.getfixturevalue("dsn") + f" password={PASSWORD}"
    if os.environ.get("OUTBOX_TEST_REDIS_URL"):
        env["CELERY_BROKER_URL"] = services.redis_url()
    return env


def processes_with(token: str) -> list[str]:
    """Command lines of live processes mentioning ``token`` (worker, pool children, beat)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(") ", 1)[1][:1]
        except (OSError, IndexError):
            continue
        if token in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline}")
    return found


def assert_cleaned_up(output: str) -> None:
    token = QUEUE.search(output)
    folder = FOLDER.search(output)
    assert token and folder, output
    deadline = time.monotonic() + 5
    while processes_with(token.group(1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(token.group(1)) == []
    assert not Path(folder.group(1)).exists()


@pytest.mark.timeout(150)
def test_demo_runs_end_to_end_and_stops_everything(demo_env: dict[str, str]) -> None:
    result = subprocess.run(
        [*DEMO, "--orders", "40", "--timeout", "90"],
        env=demo_env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        timeout=140,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # Order 17 is the one the receiver always rejects with HTTP 400.
    assert "All 40 orders settled" in output
    assert "39 delivered, 1 dead" in output
    for row in ("pending messages", "done messages", "dead messages", "expired leases"):
        assert row in output  # the CLI's status table
    assert re.search(r"done messages\s*│\s*39 │", output), output
    assert "HTTP 400" in output  # the dead message's last_error, listed
    assert "Where to look next" in output
    assert "outbox-relay --table outbox_demo.outbox dead list" in output
    assert "Traceback" not in output
    assert PASSWORD not in output
    assert_cleaned_up(output)


@pytest.mark.timeout(120)
def test_demo_cleans_up_on_ctrl_c(demo_env: dict[str, str]) -> None:
    proc = subprocess.Popen(
        [*DEMO, "--orders", "5000"],
        env=demo_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "✓ celery" in line:
            break
    time.sleep(1.5)  # orders are being written and delivered now
    proc.send_signal(
        signal.SIGINT
    )  # what Ctrl-C sends (the celery processes have their own session)
    rest, _ = proc.communicate(timeout=60)
    output = "".join(lines) + rest
    assert proc.returncode == 130, output
    assert "interrupted" in output
    assert "Traceback" not in output
    assert_cleaned_up(output)


def test_receiver_fails_on_purpose_and_counts_duplicates() -> None:
    receiver = Receiver().start()
    try:

        def post(order: int, attempt: int, key: str) -> httpx.Response:
            headers = {
                "Outbox-Aggregate-Id": str(order),
                "Outbox-Attempt": str(attempt),
                "Idempotency-Key": key,
            }
            return httpx.post(receiver.url, json={"order_id": order}, headers=headers)

        assert post(17, 1, "k17").status_code == 400
        assert post(17, 5, "k17").status_code == 400  # never accepted: ends dead
        first = post(3, 1, "k3")
        assert (first.status_code, first.headers["Retry-After"]) == (429, "1")
        assert post(3, 2, "k3").status_code == 200
        assert post(4, 2, "k4").status_code == 503  # 503 twice for every 25th order
        assert post(2, 1, "k2").status_code == 200
        assert post(2, 1, "k2").status_code == 200  # a duplicate is acknowledged ...
        statuses, accepted, duplicates = receiver.stats.snapshot()
        assert (accepted, duplicates) == (2, 1)  # ... and not acted on twice
        assert statuses == {200: 3, 400: 2, 429: 1, 503: 1}
    finally:
        receiver.close()
    assert [verdict(n, 1).status for n in (1, 2, 3, 4, 17)] == [503, 200, 429, 503, 400]


@pytest.mark.skipif(os.geteuid() != 0, reason="the hint is for root, whom pgserver cannot run as")
def test_a_root_shell_without_useradd_on_path_is_told_what_to_add(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from outbox_relay.demo.services import _root_hint

    monkeypatch.setenv("PATH", "/nonexistent")
    assert "/usr/sbin" in _root_hint() and "useradd" in _root_hint()
    monkeypatch.setenv("PATH", "/usr/local/sbin:/usr/sbin:/sbin:/usr/bin:/bin")
    if shutil.which("useradd"):  # where the system has it at all
        assert _root_hint() == ""
