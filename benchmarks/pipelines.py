"""The Celery pipelines' rows of ``make bench`` (``--only durable,canvas``).

* durable: ``DurableTask``s doing the ceiling's UPDATE through
  ``self.outbox_conn`` (with their fenced done), claimed and sent by the
  relay on the same pool, against the pre-queued plain UPDATE task.
* canvas: ``--canvas-messages`` business transactions each sending a no-op
  Celery task, into one worker: ``outbox_relay.apply_async`` in the
  transaction and relayed (per-message, and chunked ``--chunk``), against
  ``sig.apply_async()`` right after each commit (the on_commit style).

Driven by ``benchmarks/run.py``, with its services and figures.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from benchmarks import timeline
from benchmarks.run import (
    Bench,
    Costs,
    CpuMeter,
    Figure,
    Probe,
    celery_env,
    database,
    redis_client,
    worker_groups,
)
from tests.celery_procs import CeleryProcs


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


class Progress(Probe):
    """run.Probe, plus the two probes these groups poll."""

    def started(self) -> bool:
        # Walks the leased index only; done rows are found through ix_done.
        return bool(
            self.one(
                "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 'processing')"
                " OR EXISTS (SELECT 1 FROM outbox WHERE status = 'done')"
            )
        )

    def done(self) -> int:
        return int(self.one("SELECT count(*) FROM outbox WHERE status = 'done'"))


def fill_durable(dsn: str, n: int, *, follow: bool = True) -> None:
    """``n`` durable task rows, as ``write_durable`` writes them (in one
    statement), with the headers it writes for the benchmark's task: its
    attempt limit, and whether its runs take its rows (``follow``)."""
    from benchmarks.durable_app import app
    from outbox_relay.celery.durable import prepare_durable

    task = app.tasks["bench.durable_update"]
    # As the worker's copy of the app has it (BENCH_DURABLE_FOLLOW there).
    task.outbox_follow = follow
    task.__dict__.pop("_outbox_follows", None)  # durable.follows' cached answer
    message, _ = prepare_durable(task.s(0), {})
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_items (id int PRIMARY KEY, done bool DEFAULT false)")
        conn.execute("INSERT INTO bench_items SELECT g FROM generate_series(1, %s) g", (n,))
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, headers, payload)"
            " SELECT 'celery.task', 'bench.durable_update', 'celery.durable', %s,"
            " jsonb_build_object('task', 'bench.durable_update', 'id', gen_random_uuid()::text,"
            " 'args', jsonb_build_array(g), 'kwargs', '{}'::jsonb, 'options', '{}'::jsonb,"
            " 'chain', '[]'::jsonb, 'track', true)"
            " FROM generate_series(1, %s) AS g",
            (Jsonb(message.headers), n),
        )
        conn.execute("VACUUM ANALYZE outbox")


def durable(
    b: Bench, n: int, *, in_flight: int, ack_emulation: bool = True, follow: bool = True
) -> Figure:
    """Durable tasks doing the baseline's UPDATE, sent by the relay on the same pool.

    With beat, as in production: the in-flight cap (``in_flight``) bounds
    how many tasks wait in the queue; sized so that they run within their
    lease, or they expire there and are sent again a lease later.
    ``follow=False``: the task's ``outbox_follow`` off, every row run from a
    message of its own (what a trickle of rows costs, one at a time).
    """
    with database(b.admin) as dsn:
        fill_durable(dsn, n, follow=follow)
        client = redis_client(b.broker)
        client.delete("outbox", "bench-durable")
        folder = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        env = celery_env(dsn, b.broker, max_in_flight=in_flight)
        env["BENCH_ACK_EMULATION"] = "true" if ack_emulation else "false"
        env["BENCH_DURABLE_FOLLOW"] = "true" if follow else "false"
        env["BENCH_TIMELINE_DIR"] = str(folder / "timeline")
        env["BENCH_COUNT_DIR"] = str(folder / "counts")
        runner = CeleryProcs(env, folder, app="benchmarks.durable_app")
        progress = Progress(dsn)
        try:
            # From before the worker starts (the rows wait in the table): every
            # statement of every claim, send and run, and the start-up's few.
            costs = Costs(progress, folder / "counts")
            costs.start()
            runner.beat()
            worker = runner.worker(
                concurrency=b.procs, ready=False, events=False, args=("-l", "warning")
            )
            cpu = CpuMeter(progress, worker_groups(worker.popen.pid))
            next_sample = [0.0]
            window = [0.0]

            def started() -> bool:
                if not worker.alive():
                    raise RuntimeError(f"durable: worker exited:\n{worker.text()[-2000:]}")
                # The window starts at the last look before the first row is
                # taken: the worker's start-up is not charged.
                cpu.begin()
                window[0] = time.time()
                return progress.started()

            def finished() -> bool:
                if time.monotonic() >= next_sample[0]:
                    cpu.sample()  # pool processes and backends as they come and go
                    next_sample[0] = time.monotonic() + 0.5
                return progress.finished()

            seconds = wait_progress(started, finished, timeout=900, poll=0.05)
            window_end = time.time()
            if progress.done() != n:
                raise RuntimeError(f"durable: only {progress.done()} of {n} done")
            row = progress.conn.execute(
                "SELECT count(*) FROM bench_items WHERE NOT done"
            ).fetchone()
            if row is None or row[0]:
                raise RuntimeError(f"durable: {row} items without their effect")
            acks = "" if ack_emulation else ", Redis ack_emulation off"
            acks += "" if follow else ", following off"
            figure = Figure(
                f"durable task (UPDATE with its done), relay-sent, in-flight cap {in_flight}{acks}",
                n,
                seconds,
            )
            cpu.charge(figure)
            costs.finish(figure, stop=runner.stop_all)
            figure.pool = timeline.shares(folder / "timeline", window[0], window_end)
        finally:
            progress.close()
            runner.stop_all()
            shutil.rmtree(folder, ignore_errors=True)
    return figure


# ------------------------------------------------------------------ report
def canvas(b: Bench, n: int, *, outbox: bool, chunk: int = 1) -> Figure:
    """A no-op task sent from ``n`` business transactions, until a worker ran them all.

    ``outbox``: ``outbox_relay.apply_async`` inside each transaction (written
    first, then relayed: the figure is the relay's, from the first row
    claimed to the last task consumed); else the on-commit style,
    ``sig.apply_async()`` right after each commit, with the worker already
    consuming (from the first send to the last task consumed).
    """
    from benchmarks.canvas_app import app, noop

    app.conf.broker_url = b.broker
    client = redis_client(b.broker)
    client.delete("bench-canvas", "outbox")
    with database(b.admin) as dsn:
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
        env = celery_env(dsn, b.broker, chunk_size=chunk, **chunked)
        runner = CeleryProcs(env, folder, app="benchmarks.canvas_app")
        try:
            if outbox:
                # As in production: beat's tick claims what a retry put back.
                runner.beat()
            worker = runner.worker(
                concurrency=b.procs, ready=False, events=False, args=("-l", "warning")
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
