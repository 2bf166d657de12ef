"""A bounded soak: steady load with faults at random, and the ledger at the end.

Two workers and a beat take a steady stream of business transactions for
``OUTBOX_TEST_SOAK_SECONDS`` (60 by default; ``make soak`` runs an hour)
while, every few seconds, one fault picked at random strikes: a worker
SIGKILLed (and replaced), the broker flushed, the relay's database backends
terminated, or a spell of lost receiver responses. Every two seconds the
test samples the workers' memory (RSS of every process in their groups), the
database connections of the outbox's database, and the age of the oldest
undelivered message (pending or processing); those must stay flat. With
``OUTBOX_TEST_SOAK_CSV`` set the samples are written there
(``python -m tests.faults.report --plot`` draws them).
"""

from __future__ import annotations

import csv
import os
import random
import statistics
import threading
import time
from pathlib import Path

import psycopg
import pytest

from .harness import LEASE_LOST, LOST_RESPONSE, TEST_SESSION, Run
from .servers import OwnedRedis

pytestmark = [pytest.mark.faults, pytest.mark.celery]

RATE = 40  # messages per second, steady
SAMPLE_SECONDS = 2.0


def _group_rss_mb(pgid: int) -> float:
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            with open(f"/proc/{entry}/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return total / 1024


def test_soak_with_random_faults(
    dsn: str, fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    text = os.environ.get("OUTBOX_TEST_SOAK_SECONDS", "60")
    try:
        seconds = float(text)
    except ValueError:
        pytest.fail(f"OUTBOX_TEST_SOAK_SECONDS (SOAK_SECONDS) must be seconds, got {text!r}")
    # Thirds of samples every 2 s, after a first fault at 5 s: less says nothing.
    if seconds < 30:
        pytest.fail(f"OUTBOX_TEST_SOAK_SECONDS (SOAK_SECONDS) must be 30 or more, got {text}")
    run = Run("soak", dsn, fresh_database, tmp_path, broker=owned_redis.url)
    rng = random.Random(7)
    samples: list[dict[str, float]] = []
    faults: dict[str, int] = {}
    try:
        run.workers(2)
        run.beat()
        started = time.monotonic()

        def produce(stopping: threading.Event) -> None:
            while not stopping.is_set():
                tick = time.monotonic()
                run.enqueue(RATE // 4, threads=1)
                stopping.wait(max(0.0, 0.25 - (time.monotonic() - tick)))

        def strike() -> None:
            kind = rng.choice(["sigkill", "flushall", "terminate", "lost responses"])
            faults[kind] = faults.get(kind, 0) + 1
            # Only a terminate can cost a published row its lease by the
            # clock (its finalize cut); a kill's evidence is its victims, and
            # a flush or a lost response never costs one. Windows for every
            # fault spanned the whole soak: it passed a relay that skipped
            # every 20th done (2026-12-06).
            with run.fault(kind, window=kind == "terminate"):
                inject(kind)

        def inject(kind: str) -> None:
            if kind == "sigkill":
                run.kill(rng.choice(run.live_workers()))
                run.procs.worker(concurrency=2)
            elif kind == "flushall":
                owned_redis.flushall()
            elif kind == "terminate":
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE"
                        " datname = current_database() AND pid <> pg_backend_pid()"
                        " AND application_name <> %s",
                        (TEST_SESSION,),
                    )
            else:
                run.receiver.behaviour.lose_every = 5
                threading.Timer(
                    3.0, lambda: setattr(run.receiver.behaviour, "lose_every", 0)
                ).start()

        def sample(conn: psycopg.Connection) -> None:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()),"
                " coalesce(extract(epoch FROM now() - min(created_at)), 0)"
                # Pending and processing: a row waiting out a killed worker's
                # lease is processing, and is as late as a pending one.
                " FROM outbox WHERE status IN ('pending', 'processing')"
            ).fetchone()
            assert row is not None
            samples.append(
                {
                    "t": round(time.monotonic() - started, 1),
                    "rss_mb": round(sum(_group_rss_mb(w.popen.pid) for w in run.live_workers()), 1),
                    "connections": float(row[0]) - 1,  # not this one
                    "oldest_waiting_s": round(float(row[1]), 2),
                }
            )

        with (
            run.background(produce),
            psycopg.connect(dsn, autocommit=True, application_name=TEST_SESSION) as conn,
        ):
            next_fault = time.monotonic() + 5
            while time.monotonic() - started < seconds:
                sample(conn)
                if time.monotonic() >= next_fault:
                    strike()
                    next_fault = time.monotonic() + rng.uniform(4, 10)
                time.sleep(SAMPLE_SECONDS)
        run.faults.append(
            f"{seconds:g} s at {RATE}/s; faults at random: "
            + ", ".join(f"{k} x{n}" for k, n in sorted(faults.items()))
        )
        run.wait_finished(120)
        run.ledger(allow={LEASE_LOST, LOST_RESPONSE})
    finally:
        run.close()

    out = os.environ.get("OUTBOX_TEST_SOAK_CSV")
    if out:
        with open(out, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(samples[0]))
            writer.writeheader()
            writer.writerows(samples)
    # Flat: the last third against the middle third (the first is warm-up).
    third = len(samples) // 3
    middle, last = samples[third : 2 * third], samples[2 * third :]

    def median(part: list[dict[str, float]], key: str) -> float:
        return statistics.median(s[key] for s in part)

    assert median(last, "rss_mb") <= median(middle, "rss_mb") * 1.25 + 20, samples
    assert median(last, "connections") <= max(s["connections"] for s in middle) + 4, samples
    assert max(s["oldest_waiting_s"] for s in last) < 30, samples
