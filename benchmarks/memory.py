"""A long run of the relay at a steady rate: is its memory flat?

``python -m benchmarks.memory --minutes 30`` starts the relay as the docs do
(``celery worker -P prefork -c 4`` and ``celery beat``, chunks of 50, the
no-op publisher), commits messages at ``--rate`` per second in transactions
of 100 for ``--minutes``, and samples every ``--every`` seconds: the worker's
resident memory (main process and each pool process), the bench database's
connections, the messages waiting, and the oldest one's age. Finished rows
stay in the table (nothing purges them during the run), so the run also
shows whether claim and finalize slow down as done rows pile up.

Writes ``benchmarks/results/memory.csv`` (every sample) and
``benchmarks/results/memory.md`` (a summary: first and last ten minutes side
by side) and prints the summary. It asserts nothing.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.run import (
    RESULTS,
    CeleryProcs,
    Probe,
    _warm_up,
    celery_env,
    database,
    redis_client,
    services,
)
from outbox_relay.table import OutboxTable

BATCH = 100


def _rss_mb(pid: int) -> tuple[float, list[float]]:
    """(the worker's main process, each pool process) resident memory, MB."""
    import psutil

    try:
        root = psutil.Process(pid)
        children = root.children(recursive=True)
        main = root.memory_info().rss / 2**20
    except psutil.Error:
        return 0.0, []
    pool = []
    for child in children:
        try:
            pool.append(child.memory_info().rss / 2**20)
        except psutil.Error:
            continue
    return main, sorted(pool)


def _produce(dsn: str, rate: float, stop: threading.Event, committed: list[Any]) -> None:
    """Commit ``BATCH`` messages per transaction, paced to ``rate`` a second."""
    try:
        _produce_until(dsn, rate, stop, committed)
    except BaseException as exc:
        committed[1] = exc
        raise


def _produce_until(dsn: str, rate: float, stop: threading.Event, committed: list[Any]) -> None:
    with psycopg.connect(dsn) as conn:
        start = time.monotonic()
        sent = 0
        while not stop.is_set():
            due = start + sent / rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            conn.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
                " SELECT 'order', g::text, 'order.created', jsonb_build_object('order', g)"
                " FROM generate_series(%s::bigint, %s::bigint) AS g",
                (sent + 1, sent + BATCH),
            )
            conn.execute("SELECT pg_notify(%s, '')", (OutboxTable.parse(None).channel,))
            conn.commit()
            sent += BATCH
            committed[0] = sent


def run(minutes: float, rate: float, every: float, procs: int) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    with services() as (admin, broker), database(admin) as dsn:
        redis_client(broker).delete("outbox")
        env = celery_env(
            dsn,
            broker,
            publisher="benchmarks.publishers:noop",
            chunk_size=50,
            batch_size=500,
        )
        folder = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        runner = CeleryProcs(env, folder)
        probe = Probe(dsn)
        stop = threading.Event()
        committed: list[Any] = [0, None]  # messages committed, the producer's error
        try:
            worker = runner.worker(
                concurrency=procs, ready=False, events=False, args=("-l", "warning")
            )
            runner.beat()
            _warm_up(dsn, probe, worker, "memory")
            producer = threading.Thread(
                target=_produce, args=(dsn, rate, stop, committed), daemon=True
            )
            t0 = time.monotonic()
            producer.start()
            end = t0 + minutes * 60
            while time.monotonic() < end:
                if committed[1] is not None:
                    raise RuntimeError(f"the producer failed: {committed[1]!r}")
                if not worker.alive():
                    raise RuntimeError(f"the worker exited:\n{worker.text()[-3000:]}")
                main, pool = _rss_mb(worker.popen.pid)
                waiting, oldest = probe.conn.execute(
                    "SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)"
                    " FROM outbox WHERE status IN ('pending', 'processing')"
                ).fetchone() or (0, 0.0)
                samples.append(
                    {
                        "seconds": round(time.monotonic() - t0, 1),
                        "committed": committed[0],
                        "waiting": int(waiting),
                        "oldest_s": round(float(oldest), 2),
                        "worker_main_mb": round(main, 1),
                        "pool_mb": " ".join(f"{p:.1f}" for p in pool),
                        "total_mb": round(main + sum(pool), 1),
                        "connections": probe.connections(),
                    }
                )
                time.sleep(every)
            stop.set()
            producer.join()
            done = probe.one("SELECT count(*) FROM outbox WHERE status = 'done'")
            samples[-1]["done"] = int(done)
            samples[-1]["committed"] = committed[0]
        finally:
            stop.set()
            probe.close()
            runner.stop_all()
            shutil.rmtree(folder, ignore_errors=True)
    return samples


def summary(samples: list[dict[str, Any]], minutes: float, rate: float, procs: int) -> str:
    window = max(1, len(samples) // 3)
    first, last = samples[:window], samples[-window:]

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(float(r[key]) for r in rows)

    def span(rows: list[dict[str, Any]], key: str) -> str:
        values = [float(r[key]) for r in rows]
        return f"{min(values):g} to {max(values):g}"

    lines = [
        f"# Memory over a long run ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        f"{minutes:g} minutes at {rate:,.0f} messages/s committed in transactions of {BATCH}; "
        f"`celery worker -P prefork -c {procs}` and beat, chunks of 50, no-op publisher; "
        f"{len(samples)} samples; load average at the end {os.getloadavg()[0]:.2f}. "
        f"{samples[-1]['committed']:,} committed, {samples[-1].get('done', 0):,} done "
        "(finished rows stay in the table).",
        "",
        "| | first third | last third |",
        "| --- | --- | --- |",
        f"| worker RSS, main + pool, MB (median) | {med(first, 'total_mb'):.1f} "
        f"| {med(last, 'total_mb'):.1f} |",
        f"| worker main process RSS, MB (median) | {med(first, 'worker_main_mb'):.1f} "
        f"| {med(last, 'worker_main_mb'):.1f} |",
        f"| database connections (range) | {span(first, 'connections')} "
        f"| {span(last, 'connections')} |",
        f"| messages waiting (median) | {med(first, 'waiting'):.0f} | {med(last, 'waiting'):.0f} |",
        f"| oldest waiting message, s (median) | {med(first, 'oldest_s'):.2f} "
        f"| {med(last, 'oldest_s'):.2f} |",
        "",
        "Every sample is in `benchmarks/results/memory.csv`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=1000.0, help="messages per second")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--procs", type=int, default=4, help="Celery pool processes (-c)")
    args = parser.parse_args(argv)
    samples = run(args.minutes, args.rate, args.every, args.procs)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "memory.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*samples[0].keys(), "done"])
        writer.writeheader()
        writer.writerows(samples)
    text = summary(samples, args.minutes, args.rate, args.procs)
    (RESULTS / "memory.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
