"""Progress at the in-flight cap: a worker dies holding a full cap of leases.

The scenario that froze the relay for good: one worker (``-c 2``) with
``OUTBOX_MAX_IN_FLIGHT=200`` works through 2,000 messages at 40 ms per
publish. At the moment ``processing`` reaches the cap, the worker is frozen
(SIGSTOP, so nothing finishes while we look), confirmed to hold the full cap,
and SIGKILLed with its pool children; then the broker loses every queued task
(FLUSHDB of the test's Redis database) and a fresh worker starts.

Every lease the dead worker held is now stale but still counted as
``processing``. The relay must rescue those leases on its own tick, whatever
the room under the cap, and carry on: every message ends ``done`` (none
``dead``, none unpublished) within a bounded time, and in no sample does
``processing`` exceed the cap plus one claim batch.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import psycopg
import pytest

from . import services
from .apps import kit
from .celery_procs import CeleryProcs, standalone_relay

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.faults]

MESSAGES = 2000
CAP = 200  # OUTBOX_MAX_IN_FLIGHT
BATCH = 100  # OUTBOX_BATCH_SIZE: one claim takes at most this many
CONCURRENCY = 2  # celery worker -c
DELAY = 0.040  # seconds per publish
LEASE = 6.0
PUBLISH_TIMEOUT = 1.0
CLAIM_INTERVAL = 1.0
WORKER_START_SLACK = 10.0


def _freeze_at_cap(worker, dsn: str, *, timeout: float = 30.0) -> dict[str, int]:
    """SIGKILL ``worker`` at a moment it holds at least CAP leases; return the counts then.

    The group is stopped first so no delivery finishes between the check and
    the kill; when the count fell below the cap meanwhile, it resumes and we
    look again.
    """
    deadline = time.monotonic() + timeout
    last: dict[str, int] = {}
    while time.monotonic() < deadline:
        last = kit.status_counts(dsn)
        if last.get("processing", 0) >= CAP:
            os.killpg(worker.popen.pid, signal.SIGSTOP)
            frozen = kit.status_counts(dsn)
            if frozen.get("processing", 0) >= CAP:
                worker.kill(signal.SIGKILL)
                worker.popen.wait(10)
                return frozen
            os.killpg(worker.popen.pid, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError(f"processing never reached the cap {CAP} in {timeout}s; saw {last}")


def test_worker_killed_at_the_in_flight_cap_and_broker_flushed(dsn, tmp_path: Path, owned_redis):
    broker = owned_redis.url
    queue = kit.unique("outbox-cap")
    kit.prepare_receiver(dsn)
    procs = CeleryProcs(
        {
            "OUTBOX_DSN": dsn,
            "CELERY_BROKER_URL": broker,
            "OUTBOX_QUEUE": queue,
            "OUTBOX_PUBLISHER": "tests.apps.receiver:record",
            "RECEIVER_DSN": dsn,
            "RECEIVER_DELAY_SECONDS": str(DELAY),
            "OUTBOX_LEASE_SECONDS": str(LEASE),
            "OUTBOX_PUBLISH_TIMEOUT_SECONDS": str(PUBLISH_TIMEOUT),
            "OUTBOX_CLAIM_INTERVAL_SECONDS": str(CLAIM_INTERVAL),
            "OUTBOX_BATCH_SIZE": str(BATCH),
            "OUTBOX_MAX_IN_FLIGHT": str(CAP),
            # Deliveries slower than claims, so that the leases pile up to the
            # cap: with chunks of up to 50 published 32 at a time the relay
            # kept up now and then (100 to 120 in flight for 30 s, the cap never
            # reached, in 1 of 3 runs before and after 2026-12-07).
            "OUTBOX_CHUNK_SIZE": "4",
            "OUTBOX_PUBLISH_CONCURRENCY": "2",
        },
        tmp_path,
    )
    sampler = kit.StatusSampler(dsn, interval=0.2)
    try:
        victim = procs.worker(concurrency=CONCURRENCY)
        procs.beat()
        sampler.start()
        started = time.monotonic()
        ids = kit.enqueue(dsn, MESSAGES)
        enqueued = time.monotonic() - started

        at_kill = _freeze_at_cap(victim, dsn)
        assert at_kill.get("processing", 0) >= CAP, at_kill
        # The broker loses every queued task (a Redis server of this test's own).
        owned_redis.flushall()

        procs.worker(concurrency=CONCURRENCY)
        ready = time.monotonic()

        # Stranded leases expire within LEASE of the kill, the rescuer frees
        # them within a tick or two, then the work itself: what is left at
        # CONCURRENCY publishes of DELAY each, with room for the relay's own
        # cost per message (measured at about 1.3x the bare publish time on a
        # 2-CPU machine without the kill) and a busy machine.
        left = MESSAGES - at_kill.get("done", 0)
        budget = (
            LEASE
            + 2 * CLAIM_INTERVAL
            + math.ceil(left * DELAY / CONCURRENCY * 2.0)
            + WORKER_START_SLACK
        )
        try:
            took = kit.wait_until(
                lambda: kit.status_counts(dsn).get("done", 0) == MESSAGES,
                timeout=budget,
                interval=0.5,
                describe=lambda: kit.status_counts(dsn),
                what=f"all {MESSAGES} messages done after the kill and the flush",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\ncounts at the kill: {at_kill}\n{procs.logs()}") from None
        samples = sampler.stop()
        final = kit.status_counts(dsn)
    finally:
        sampler.halt()
        procs.stop_all()

    worst = max(samples, key=lambda s: s.get("live"))
    stall = kit.longest_stall(samples, since=ready, total=MESSAGES)
    print(
        f"\nenqueue {enqueued:.1f}s; at kill {at_kill}; all done {took:.1f}s after the fresh "
        f"worker was ready (budget {budget:.0f}s); {len(samples)} samples, most live leases "
        f"{worst.get('live')} (most processing, expired included: "
        f"{max(s.get('processing') for s in samples)}), longest stall {stall:.1f}s"
    )
    assert final == {"done": MESSAGES}, final  # none dead, none left behind
    assert kit.delivered_ids(dsn) == set(ids)  # every message really went out

    # The cap bounds live leases (expired ones wait for the rescuer, which
    # may run after a claim on a busy machine): never more than the cap and
    # one claim batch.
    assert worst.get("live") <= CAP + BATCH, (
        f"live leases reached {worst.get('live')} (cap {CAP} + batch {BATCH}): {worst.counts}"
    )
    # No freeze short of the end either: after the fresh worker is up, done
    # grows again once the stranded leases expire and keeps growing.
    assert stall <= 2 * LEASE, f"done stood still for {stall:.1f}s after the fresh worker started"


def test_a_claim_rescues_when_no_rescue_task_reaches_its_worker(dsn, tmp_path: Path):
    """A rescue task can be starved: two relays of different databases that
    shared one RabbitMQ queue took each other's tasks, and beat's claim and
    rescue, sent on the same tick, went round-robin to one worker each; one
    relay never rescued again and its rows stayed leased for good (a new
    user's walkthrough, 2026-12-06). A claim rescues too when its process has
    not for a rescue interval: here no beat runs at all, and the claim a
    starting worker sends itself must free leases left by a dead worker."""
    kit.prepare_receiver(dsn)
    ids = kit.enqueue(dsn, 5)
    with psycopg.connect(dsn, autocommit=True) as conn:
        # What a worker killed mid-delivery leaves: leases that ran out.
        conn.execute(
            "UPDATE outbox SET status = 'processing', lease_owner = 'gone:1', attempts = 1,"
            " lease_version = lease_version + 1, lease_until = now() - interval '1 second'"
            " WHERE id = ANY(%s)",
            (ids,),
        )
    procs = standalone_relay(dsn, tmp_path, services.redis_url(), kit.unique("outbox-starved"))
    try:
        procs.worker(concurrency=1)  # and no beat: no rescue task is ever sent
        kit.wait_until(
            lambda: kit.status_counts(dsn) == {"done": 5},
            timeout=30,
            describe=lambda: kit.status_counts(dsn),
            what="the expired leases rescued and delivered by a claim",
        )
        assert kit.delivered_ids(dsn) == set(ids)
        assert "rescued 5 expired lease(s)" in procs.logs()
    finally:
        procs.stop_all()


def test_a_rescue_claims_when_no_claim_task_reaches_its_worker(dsn, tmp_path: Path):
    """The other way round: on a queue two relays shared, beat's claim went
    to the other relay's worker every tick and only the rescue came here,
    so this relay's pending rows were never claimed. A rescue claims too:
    here no beat and no NOTIFY listener run, and a lone rescue task must get
    rows out that no claim task ever will."""
    kit.prepare_receiver(dsn)
    queue = kit.unique("outbox-unclaimed")
    broker = services.redis_url()
    procs = standalone_relay(dsn, tmp_path, broker, queue, OUTBOX_LISTEN="false")
    try:
        procs.worker(concurrency=1)  # no beat; ready when this returns
        ids = kit.enqueue(dsn, 5)
        time.sleep(2.0)
        assert kit.status_counts(dsn) == {"pending": 5}  # nothing claims them
        kit.client_app(broker).send_task("outbox_relay.rescue", queue=queue)
        kit.wait_until(
            lambda: kit.status_counts(dsn) == {"done": 5},
            timeout=30,
            describe=lambda: kit.status_counts(dsn),
            what="the pending rows claimed by a rescue and delivered",
        )
        assert kit.delivered_ids(dsn) == set(ids)
    finally:
        procs.stop_all()
