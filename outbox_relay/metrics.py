"""Prometheus metrics: queue gauges read from the database, delivery counters from workers.

Two sources, one ``/metrics`` endpoint (``outbox-relay metrics --port 9808``):

* **Gauges from the database**, computed at scrape time by ``OutboxCollector``
  with cheap queries (unfinished rows through their partial indexes; ``done``
  estimated from ``pg_class.reltuples`` once the table is large):
  ``outbox_messages{status}``, ``outbox_oldest_pending_age_seconds``,
  ``outbox_expired_leases``, plus ``outbox_database_up``.
* **Counters and histograms from the processes that deliver**, recorded by
  ``MetricsObserver`` (a ``RelayObserver``): ``outbox_published_total{event_type,
  outcome}``, ``outbox_lost_leases_total``, ``outbox_stale_deliveries_total``,
  ``outbox_publish_duration_seconds``, ``outbox_delivery_latency_seconds``.

Celery's prefork pool delivers in forked children, and the exporter is yet
another process, so worker metrics need prometheus_client's multiprocess mode:

1. Set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory in the environment
   of the worker *before it starts* (prometheus_client reads it at import),
   and of the exporter on the same host. Every process then writes its
   samples to its own files there; a forked child notices its new PID and
   starts files of its own, so observers created in the parent are safe.
2. Empty the directory whenever the workers restart (e.g. systemd
   ``ExecStartPre``); files of dead processes still count, which is right for
   counters but makes scrapes slower as they pile up.
3. Run ``outbox-relay metrics`` with the same variable: ``serve`` then
   aggregates every process's files with ``MultiProcessCollector``.

With several worker hosts, run one exporter per host; the database gauges are
then the same on each, so run all but one with ``--no-database`` (or
aggregate them with ``max`` in queries, as deploy/prometheus/alerts.yml does).

Without ``PROMETHEUS_MULTIPROC_DIR``, ``serve`` exposes the counters of its own
process: right only when the relay runs in that process (``dispatch_once``
loops, or ``serve`` started inside a solo/threads worker).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from ._redact import connect_error
from .db import UNPREPARED
from .model import Claimed, LeaseRef, Outcome
from .store import ops
from .store.producer import missing_table
from .table import OutboxTable

__all__ = [
    "DEFAULT_ADDR",
    "DEFAULT_PORT",
    "EXACT_DONE_BELOW",
    "MULTIPROC_ENV",
    "MetricsObserver",
    "MetricsServer",
    "OutboxCollector",
    "WorkerMetrics",
    "build_registry",
    "serve",
    "worker_metrics",
]

log = logging.getLogger("outbox_relay.metrics")

DEFAULT_PORT = 9808
# Loopback unless told otherwise: /metrics names event types and queue
# depths, and nothing authenticates a scrape. Opening it to other hosts
# (addr="0.0.0.0", `outbox-relay metrics --addr 0.0.0.0`) is a decision to
# make knowingly, behind a firewall or a network policy.
DEFAULT_ADDR = "127.0.0.1"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Below this many rows (by the planner's estimate) done rows are counted exactly.
EXACT_DONE_BELOW = 100_000

# Publishing is network I/O: milliseconds to the publish timeout.
PUBLISH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Commit to done spans claim intervals, backoff and backlogs: seconds to a day.
LATENCY_BUCKETS = (
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0,
    1800.0, 3600.0, 3 * 3600.0, 6 * 3600.0, 86400.0,
)  # fmt: skip

_OUTCOME = {"done": "done", "pending": "retry", "dead": "dead"}
_STATUSES = ("pending", "processing", "done", "dead")


# ---------------------------------------------------------------- workers
@dataclass(frozen=True)
class WorkerMetrics:
    """The metric objects the delivering processes update."""

    published: Counter
    lost_leases: Counter
    stale: Counter
    publish_duration: Histogram
    delivery_latency: Histogram


_created: weakref.WeakKeyDictionary[CollectorRegistry, WorkerMetrics] = weakref.WeakKeyDictionary()
_created_lock = threading.Lock()


def worker_metrics(registry: CollectorRegistry | None = None) -> WorkerMetrics:
    """The worker metrics registered in ``registry`` (default: the global one).

    Created once per registry: prometheus_client refuses a second metric of
    the same name, and every observer of a process must share the same ones.
    """
    reg = REGISTRY if registry is None else registry
    with _created_lock:
        found = _created.get(reg)
        if found is None:
            found = WorkerMetrics(
                published=Counter(
                    "outbox_published_total",
                    "Delivery attempts whose outcome the database accepted, by event type and "
                    "outcome (done|retry|dead). Attempts that lost their lease are counted in "
                    "outbox_lost_leases_total instead.",
                    ["event_type", "outcome"],
                    registry=reg,
                ),
                lost_leases=Counter(
                    "outbox_lost_leases_total",
                    "Messages published whose fenced finalize changed nothing (another worker "
                    "held the row by then), or whose done could not be written before their "
                    "lease ended (the database was away): the receiver sees a duplicate.",
                    registry=reg,
                ),
                stale=Counter(
                    "outbox_stale_deliveries_total",
                    "Delivery tasks turned away before publishing: the lease was no longer "
                    "theirs, or too little of it was left.",
                    registry=reg,
                ),
                publish_duration=Histogram(
                    "outbox_publish_duration_seconds",
                    "Time spent in the publisher per message, whatever the outcome.",
                    buckets=PUBLISH_BUCKETS,
                    registry=reg,
                ),
                delivery_latency=Histogram(
                    "outbox_delivery_latency_seconds",
                    "From the message's created_at (its producer's transaction) to done.",
                    buckets=LATENCY_BUCKETS,
                    registry=reg,
                ),
            )
            _created[reg] = found
        return found


class MetricsObserver:
    """A ``RelayObserver`` that records delivery metrics.

    Safe to create in Celery's main process before the pool forks (see the
    module docstring for ``PROMETHEUS_MULTIPROC_DIR``). Every hook is a few
    in-memory (or mmap) writes.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.metrics = worker_metrics(registry)
        # The counter's children by (event type, outcome): labels() looks
        # its arguments up anew on every call, once per delivered message.
        self._published: dict[tuple[str, str], Any] = {}

    def published(self, msg: Claimed, outcome: Outcome, seconds: float) -> None:
        self.metrics.publish_duration.observe(max(seconds, 0.0))

    def finalized(self, msg: Claimed, outcome: Outcome, age_seconds: float) -> None:
        # Counted here, not in published(): only what the fenced finalize
        # wrote happened; a lost lease's outcome was thrown away.
        key = (msg.event_type, _OUTCOME.get(outcome.status, outcome.status))
        child = self._published.get(key)
        if child is None:
            child = self.metrics.published.labels(event_type=key[0], outcome=key[1])
            self._published[key] = child
        child.inc()
        if outcome.status == "done":
            self.metrics.delivery_latency.observe(max(age_seconds, 0.0))

    def lost_lease(self, ref: LeaseRef, where: str) -> None:
        self.metrics.lost_leases.inc()

    def stale(self, ref: LeaseRef, reason: str) -> None:
        self.metrics.stale.inc()


# ---------------------------------------------------------------- database
def _families() -> dict[str, GaugeMetricFamily]:
    return {
        "messages": GaugeMetricFamily(
            "outbox_messages",
            "Outbox rows per status. pending, processing and dead are exact counts; done is "
            f"exact while the table holds under {EXACT_DONE_BELOW} rows, else estimated as "
            "pg_class.reltuples minus the other statuses.",
            labels=["status"],
        ),
        "oldest": GaugeMetricFamily(
            "outbox_oldest_pending_age_seconds",
            "How long (database clock) the longest-waiting message has awaited delivery "
            "(pending or processing): from when it became due, or was retried from dead, "
            "its failures and backoff included (a message scheduled for later is not "
            "waiting yet); 0 when none waits.",
        ),
        "expired": GaugeMetricFamily(
            "outbox_expired_leases",
            "Processing rows whose lease has expired: their worker died or stalled, and "
            "they wait to be re-claimed.",
        ),
        "up": GaugeMetricFamily(
            "outbox_database_up",
            "1 when the last scrape read the outbox table, 0 when it failed.",
        ),
    }


class OutboxCollector:
    """Reads the queue gauges from PostgreSQL at each scrape.

    Holds one connection (reopened after a failure); a scrape that cannot
    read the database reports ``outbox_database_up 0`` instead of failing
    the whole endpoint, so the worker counters are still scraped.
    """

    def __init__(
        self,
        dsn: str,
        *,
        table: OutboxTable | str | None = None,
        exact_done_below: int = EXACT_DONE_BELOW,
        timeout_seconds: float = 5.0,
    ) -> None:
        self.dsn = dsn
        self.table = OutboxTable.parse(table)
        self.exact_done_below = exact_done_below
        self.timeout_seconds = timeout_seconds
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()  # scrapes may arrive concurrently
        # What the last scrape reported as outbox_database_up (None before one).
        self.up: bool | None = None

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.dsn,
            autocommit=True,
            connect_timeout=max(1, int(self.timeout_seconds)),
            application_name="outbox-relay-metrics",
            # One connection for every scrape: prepared on the server after
            # five, which a pooler in transaction mode turned into failed
            # scrapes (outbox_database_up 0) now and then.
            **UNPREPARED,
        )

    def read(self) -> ops.QueueGauges:
        """One reading; raises ``psycopg.Error`` when the database cannot answer."""
        with self._lock:
            for attempt in (1, 2):
                if self._conn is None or self._conn.closed:
                    self._conn = self._connect()
                try:
                    return ops.gauges(
                        self._conn,
                        table=self.table,
                        exact_done_below=self.exact_done_below,
                        timeout_ms=int(self.timeout_seconds * 1000),
                    )
                except psycopg.errors.QueryCanceled:
                    # The scrape's own statement_timeout (a lock, a slow disk):
                    # the connection is fine, and trying again would wait as
                    # long once more, past Prometheus's scrape_timeout.
                    raise
                except psycopg.OperationalError:
                    # A restarted server or a failover breaks the connection
                    # we held; try once more on a new one.
                    self._close()
                    if attempt == 2:
                        raise
        raise AssertionError("unreachable")  # pragma: no cover

    def describe(self) -> Iterator[Metric]:
        # Names only, so a registry can check for clashes without a query.
        yield from _families().values()

    def collect(self) -> Iterator[Metric]:
        families = _families()
        try:
            g = self.read()
        except psycopg.Error as exc:
            if isinstance(exc, (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn)):
                # A new release's exporter on a table an earlier one migrated.
                behind = missing_table(self.table, exc.diag.message_primary)
                log.warning("metrics scrape: %s", behind)
            else:
                # Scrubbed: libpq's message for a DSN it cannot parse quotes
                # the part it choked on, which may be the password.
                shown = connect_error(exc, self.dsn)
                log.warning("metrics scrape could not read %s: %s", self.table.qualified, shown)
            families["up"].add_metric([], 0)
            self.up = False
            yield families["up"]
            return
        counts = {"pending": g.pending, "processing": g.processing, "done": g.done, "dead": g.dead}
        for status in _STATUSES:
            families["messages"].add_metric([status], counts[status])
        families["oldest"].add_metric([], g.oldest_pending_age_seconds)
        families["expired"].add_metric([], g.expired_leases)
        families["up"].add_metric([], 1)
        self.up = True
        yield from families.values()

    def _close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    def close(self) -> None:
        with self._lock:
            self._close()


# ---------------------------------------------------------------- exporter
def build_registry(
    *,
    dsn: str | None,
    table: OutboxTable | str | None = None,
    registry: CollectorRegistry | None = None,
    multiprocess_dir: str | None = None,
    exact_done_below: int = EXACT_DONE_BELOW,
) -> tuple[CollectorRegistry, OutboxCollector | None]:
    """The registry an exporter serves, and its database collector (if ``dsn``).

    With no ``registry``: the multiprocess aggregate of ``multiprocess_dir``
    (default ``$PROMETHEUS_MULTIPROC_DIR``) when set, else this process's
    global registry. A given ``registry`` is served as it is, plus the
    database collector.
    """
    if registry is None:
        registry = CollectorRegistry()
        folder = multiprocess_dir or os.environ.get(MULTIPROC_ENV)
        if folder:
            MultiProcessCollector(registry, path=folder)  # type: ignore[no-untyped-call]
        else:
            registry.register(REGISTRY)
    collector = None
    if dsn:
        collector = OutboxCollector(dsn, table=table, exact_done_below=exact_done_below)
        registry.register(collector)
    return registry, collector


@dataclass
class MetricsServer:
    """A running ``/metrics`` HTTP server; ``close()`` stops it."""

    httpd: Any
    thread: threading.Thread
    registry: CollectorRegistry
    collector: OutboxCollector | None

    @property
    def port(self) -> int:
        return int(self.httpd.server_port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
        if self.collector is not None:
            self.collector.close()


def serve(
    port: int = DEFAULT_PORT,
    *,
    dsn: str | None,
    table: OutboxTable | str | None = None,
    registry: CollectorRegistry | None = None,
    addr: str = DEFAULT_ADDR,
    multiprocess_dir: str | None = None,
    exact_done_below: int = EXACT_DONE_BELOW,
) -> MetricsServer:
    """Serve ``/metrics`` on ``addr:port`` in a daemon thread (port 0 picks a free one).

    ``addr`` is loopback by default (``DEFAULT_ADDR``); pass ``"0.0.0.0"``
    (or ``"::"``) for a Prometheus on another host.

    The database gauges come from ``dsn`` (none when ``dsn`` is ``None``), the
    worker counters from ``build_registry``'s choice of registry.
    """
    served, collector = build_registry(
        dsn=dsn,
        table=table,
        registry=registry,
        multiprocess_dir=multiprocess_dir,
        exact_done_below=exact_done_below,
    )
    httpd, thread = start_http_server(port, addr=addr, registry=served)
    return MetricsServer(httpd, thread, served, collector)
