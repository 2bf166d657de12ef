"""Workers that die, freeze and crash on a message, while messages flow."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from .harness import CHUNKED, LATE_REQUEST, LEASE_LOST, LOST_RESPONSE, PER_MESSAGE, Run
from .servers import OwnedRedis

pytestmark = [pytest.mark.faults, pytest.mark.celery]


def test_no_faults_no_duplicates(
    dsn: str, fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    """The control: without faults the receiver sees each message once."""
    run = Run("control", dsn, fresh_database, tmp_path, broker=owned_redis.url, env=PER_MESSAGE)
    try:
        run.receiver.behaviour.reject_every = 97
        run.workers(1)
        run.beat()
        run.enqueue(300)
        run.wait_finished(90)
        ledger = run.ledger(allow=set())
        assert ledger.duplicates == 0
        assert ledger.dead > 0  # the rejected ones, checked by the ledger
    finally:
        run.close()


@pytest.mark.parametrize("mode", [PER_MESSAGE, CHUNKED], ids=["per-message", "chunked"])
def test_workers_sigkilled_repeatedly(
    mode: dict[str, str], dsn: str, fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    """Every couple of seconds a random worker (with its pool) is SIGKILLed and replaced."""
    run = Run("sigkill", dsn, fresh_database, tmp_path, broker=owned_redis.url, env=mode)
    try:
        run.workers(2)
        run.beat()
        run.enqueue(1200)
        kills = 0

        def kill_one() -> None:
            nonlocal kills
            alive = run.live_workers()
            victim = alive[kills % len(alive)]
            with run.fault("SIGKILL", window=False):  # the killed processes are the evidence
                run.kill(victim)
            kills += 1
            run.procs.worker(concurrency=2)
            # More business keeps arriving: every kill strikes a relay at work,
            # however fast it drained the first batch.
            run.enqueue(300)

        with run.producing():
            run.every(2.0, kill_one, until=lambda: kills >= 4)
        run.faults.append(f"{kills} workers SIGKILLed at random moments, each replaced")
        run.wait_finished(120)
        ledger = run.ledger(allow={LEASE_LOST})
        print(ledger)
    finally:
        run.close()


def test_worker_frozen_past_its_lease(
    dsn: str, fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    """SIGSTOP a worker holding leases for longer than the lease, then SIGCONT it.

    Its rows are rescued and delivered by the other worker meanwhile; when it
    wakes, its finalizes carry a stale lease version and change nothing
    (the ledger: one effect per message).
    """
    run = Run("sigstop", dsn, fresh_database, tmp_path, broker=owned_redis.url, env=PER_MESSAGE)
    try:
        frozen, _ = run.workers(2)
        run.beat()
        run.receiver.behaviour.slow_every = 5  # answers late, within the timeout:
        run.receiver.behaviour.slow_seconds = 0.5  # easy to catch a worker mid-call
        run.enqueue(600)
        run.freeze_mid_publish(frozen)
        time.sleep(float(run.env["OUTBOX_LEASE_SECONDS"]) + 6)
        frozen.kill(signal.SIGCONT)
        run.faults.append("a worker SIGSTOPped inside a publish for lease + 6 s, then resumed")
        run.wait_finished(120)
        # A call frozen after the receiver applied it ends in the soft time
        # limit when it wakes: applied, but an error to the relay (lost response).
        # One frozen before its request was out sends it on waking, after the
        # other worker applied the rescued row under a newer lease (a late
        # request; the ledger checks the call log's lease versions). CI froze
        # a worker at that moment once.
        ledger = run.ledger(allow={LEASE_LOST, LOST_RESPONSE, LATE_REQUEST})
        # Whether its late finalize was refused ("lost lease") depends on
        # whether the rescuer had freed the row by the time it woke; either
        # way the ledger above holds (one effect, nothing lost).
        print("fenced off:", "lost lease on outbox message" in frozen.text())
        print(ledger)
    finally:
        run.close()


def test_poison_message_kills_its_worker_every_time(
    dsn: str, fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    """A message that kills the process publishing it ends dead at the attempt
    limit (never a loop); two beats and three workers share the work."""
    run = Run(
        "poison",
        dsn,
        fresh_database,
        tmp_path,
        broker=owned_redis.url,
        env={"OUTBOX_MAX_ATTEMPTS": "3"},
    )
    try:
        run.workers(3, concurrency=1)
        run.beat()
        run.beat()
        run.enqueue(300, poison_every=150)
        run.faults.append("2 poison messages (os._exit in the publisher), two beats, three workers")
        run.wait_finished(150)
        ledger = run.ledger(allow={LEASE_LOST})
        assert ledger.dead == len(run.poison) == 2
    finally:
        run.close()
