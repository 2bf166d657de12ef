"""Per-process state of the relay inside a Celery app.

Everything that holds a socket (the connection pool, the publisher's
clients, the lease keeper's thread) is created lazily in the process that
uses it and rebuilt when the PID changes, so nothing crosses a fork: Celery's
prefork pool forks children from the main process, and a connection shared by
two processes corrupts both.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from ..config import Settings
from ..errors import ConfigError, RetryableError
from ..model import Claimed, LeaseRef, Message
from ..publishers import publisher_timeout, resolve_publisher
from ..sql.queries import queries_for
from ..relay import LeaseKeeper, Publisher, Relay, RelayObserver, RetryPolicy
from ..model import Outcome

__all__ = ["PoolDatabase", "RelayRuntime"]

log = logging.getLogger("outbox_relay.celery")
T = TypeVar("T")


class PoolDatabase:
    """A per-process connection pool that retries once on a broken connection.

    A terminated backend, a restarted server or a failover surfaces as
    ``OperationalError`` on the next statement. Every store call is safe to
    repeat (reads, or writes fenced on ``lease_version``), so one retry on a
    fresh connection turns most of those into a blip instead of a lost lease.
    """

    def __init__(
        self, dsn: str, *, size: int, name: str, synchronous_finalize: bool = True
    ) -> None:
        def configure(conn: psycopg.Connection[Any]) -> None:
            if not synchronous_finalize:
                # Finalizes stop waiting for the WAL flush; claims still
                # commit durably (store.claim sets it back for its transaction).
                conn.execute("SET synchronous_commit = off")

        self.pool = ConnectionPool(
            dsn,
            min_size=1,
            max_size=max(1, size),
            kwargs={"autocommit": True},
            configure=configure,
            name=name,
            open=True,
        )

    def run(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        for attempt in (1, 2):
            with self.pool.connection() as conn:
                try:
                    return fn(conn)
                except psycopg.OperationalError:
                    if attempt == 2 or not conn.broken:
                        raise
                    log.warning("database connection lost; retrying on a new connection")
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self.pool.close()


def _translate_celery_retry(publisher: Publisher) -> Publisher:
    """Let a publisher raise ``celery.exceptions.Retry`` (as a task would).

    It becomes a ``RetryableError`` whose ``when`` is the minimum delay; the
    relay never calls ``Task.retry`` itself (the retry lives in the database).
    """
    from celery.exceptions import Retry

    def publish(message: Message) -> Any:
        try:
            return publisher(message)
        except Retry as exc:
            when = exc.when
            delay: float | None = None
            if isinstance(when, (int, float)):
                delay = float(when)
            raise RetryableError(f"publisher asked to retry: {exc}", retry_after=delay) from exc

    return publish


class TaskEvents:
    """Relay observer that emits Celery task events (shown in Flower) and logs.

    Custom event types: ``task-outbox-lost-lease`` and ``task-outbox-stale``,
    sent on behalf of the delivery task running in this thread (workers
    started with ``-E``).
    """

    def _send(self, kind: str, **fields: Any) -> None:
        from celery import current_task

        task = current_task
        if task is None or not getattr(task.request, "id", None):
            return
        try:
            task.send_event(kind, **fields)
        except Exception:  # events are best effort; never fail a delivery for one
            log.debug("could not send task event %s", kind, exc_info=True)

    def published(self, msg: Claimed, outcome: Outcome, seconds: float) -> None:
        pass

    def finalized(self, msg: Claimed, outcome: Outcome, age_seconds: float) -> None:
        pass

    def lost_lease(self, ref: LeaseRef, where: str) -> None:
        self._send("task-outbox-lost-lease", outbox_id=ref.id, lease_version=ref.lease_version)

    def stale(self, ref: LeaseRef, reason: str) -> None:
        self._send(
            "task-outbox-stale", outbox_id=ref.id, lease_version=ref.lease_version, reason=reason
        )


class RelayRuntime:
    """The relay as installed into one Celery app."""

    def __init__(
        self,
        app: Any,
        overrides: Mapping[str, Any],
        task_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.app = app
        self.overrides = dict(overrides)
        # Celery retry options given to install(); task_annotations win over them.
        self.task_options = dict(task_options or {})
        self._settings: Settings | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()
        self._db: PoolDatabase | None = None
        self._relay: Relay | None = None
        self.events = TaskEvents()
        self.observers: list[RelayObserver] = []

    # ----------------------------------------------------------- settings
    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.load(self.app.conf, **self.overrides)
        return self._settings

    def lease(self) -> timedelta:
        return timedelta(seconds=self.settings.lease_seconds)

    @property
    def owner(self) -> str:
        return self.settings.owner or f"{socket.gethostname()}:{os.getpid()}"

    def policy(self) -> RetryPolicy:
        """The retry policy, read from the deliver task's Celery retry options.

        ``max_retries`` -> attempts (max_retries + 1), ``retry_backoff`` ->
        backoff base seconds (``False`` means a constant ``default_retry_delay``),
        ``retry_backoff_max`` -> cap, ``retry_jitter`` -> full jitter on/off,
        ``autoretry_for`` -> exception classes treated as transient.
        """
        from .tasks import DELIVER, task_annotations

        s = self.settings
        options = {**self.task_options, **task_annotations(self.app, DELIVER)}
        max_attempts = s.max_attempts
        if "max_retries" in options:
            max_retries = options["max_retries"]
            max_attempts = 2**31 - 1 if max_retries is None else int(max_retries) + 1
        cap = float(options.get("retry_backoff_max", s.backoff_cap_seconds))
        jitter = bool(options.get("retry_jitter", True))
        backoff = options.get("retry_backoff", s.backoff_base_seconds)
        if backoff is False or backoff is None:
            # Celery without backoff retries after a constant default_retry_delay.
            base = float(options.get("default_retry_delay", 180))
            cap = base
            jitter = bool(options.get("retry_jitter", False))
        else:
            base = 1.0 if backoff is True else float(backoff)
        retry_on = tuple(options.get("autoretry_for", ()) or ())
        return RetryPolicy(
            max_attempts=max_attempts,
            backoff_base=base,
            backoff_cap=cap,
            jitter=jitter,
            max_defer=timedelta(seconds=s.max_defer_seconds),
            retry_on=retry_on,
        )

    def worst_publish_seconds(self) -> float:
        """The longest a delivery task may spend publishing (bounded waves)."""
        s = self.settings
        waves = -(-s.chunk_size // s.publish_concurrency) if s.chunk_size > 1 else 1
        return waves * s.publish_timeout_seconds

    def time_limits(self) -> tuple[float, float]:
        """(soft, hard) task time limits: after the worst publish, before the lease ends."""
        worst = self.worst_publish_seconds()
        lease = self.settings.lease_seconds
        return worst + 0.25 * (lease - worst), worst + 0.5 * (lease - worst)

    # --------------------------------------------------------- validation
    def validate(self) -> None:
        """Check settings and that the timeouts nest; raise ConfigError naming them.

        publisher timeout < task time limit < lease < broker visibility timeout.
        """
        s = self.settings
        s.require_dsn()
        lease = s.lease_seconds
        worst_publish = self.worst_publish_seconds()
        if worst_publish >= lease:
            raise ConfigError(
                f"a delivery chunk may publish for {worst_publish:g}s "
                f"(ceil(OUTBOX_CHUNK_SIZE {s.chunk_size} / OUTBOX_PUBLISH_CONCURRENCY "
                f"{s.publish_concurrency}) x OUTBOX_PUBLISH_TIMEOUT_SECONDS "
                f"{s.publish_timeout_seconds:g}), which does not fit inside "
                f"OUTBOX_LEASE_SECONDS ({lease:g})"
            )
        from .tasks import DELIVER, task_annotations

        options = {**self.task_options, **task_annotations(self.app, DELIVER)}
        for name in ("time_limit", "soft_time_limit"):
            limit = options.get(name)
            if limit is None:
                limit = self.app.conf.get(f"task_{name}")
            if limit is None:
                continue
            if not worst_publish < float(limit) < lease:
                raise ConfigError(
                    f"task {name} ({limit}s) must lie between the worst-case publish time "
                    f"({worst_publish:g}s) and OUTBOX_LEASE_SECONDS ({lease:g}s)"
                )
        options = self.app.conf.get("broker_transport_options") or {}
        visibility = options.get("visibility_timeout")
        broker = str(self.app.conf.get("broker_url") or "")
        if broker.startswith(("redis", "rediss", "sqs")):
            visibility = 3600 if visibility is None else visibility
        if visibility is not None and not float(visibility) > lease:
            raise ConfigError(
                f"broker_transport_options['visibility_timeout'] ({visibility}s) must be "
                f"greater than OUTBOX_LEASE_SECONDS ({lease:g}s), or the broker redelivers "
                "tasks that are still running"
            )
        # Resolve the publisher now (a bad OUTBOX_PUBLISHER fails at start), but
        # build nothing that holds a connection in this, possibly parent, process.
        publisher = self.publisher()
        timeout = getattr(publisher, "timeout_seconds", None)
        if timeout is not None and float(timeout) > s.publish_timeout_seconds:
            raise ConfigError(
                f"the publisher's own timeout ({float(timeout):g}s) exceeds "
                f"OUTBOX_PUBLISH_TIMEOUT_SECONDS ({s.publish_timeout_seconds:g}s)"
            )

    def check_database(self) -> None:
        """Connect once and check the outbox table exists (then disconnect)."""
        table = self.settings.outbox_table
        try:
            with psycopg.connect(self.settings.require_dsn(), connect_timeout=10) as conn:
                row = conn.execute(
                    queries_for(table).table_exists, {"schema": table.schema, "name": table.name}
                ).fetchone()
        except psycopg.Error as exc:
            raise ConfigError(f"cannot connect to OUTBOX_DSN: {exc}") from exc
        if not row or not row[0]:
            raise ConfigError(
                f"the outbox table {table.qualified} does not exist: run "
                "`outbox-relay migrate` (or outbox_relay.migrate(conn)) first"
            )

    # ----------------------------------------------------- process state
    def _check_pid(self) -> None:
        pid = os.getpid()
        if self._pid != pid:
            # Forked (or first use): forget, without closing, whatever the
            # parent built; its sockets belong to the parent.
            self._db = None
            self._relay = None
            self._pid = pid

    def db(self) -> PoolDatabase:
        with self._lock:
            self._check_pid()
            if self._db is None:
                self._db = PoolDatabase(
                    self.settings.require_dsn(),
                    size=self.settings.pool_size,
                    name=f"outbox-relay-{os.getpid()}",
                    synchronous_finalize=self.settings.synchronous_finalize,
                )
            return self._db

    def publisher(self) -> Publisher:
        s = self.settings
        base = resolve_publisher(
            s.publisher,
            publish_timeout_seconds=s.publish_timeout_seconds,
            **dict(s.publisher_options),
        )
        wrapped = _translate_celery_retry(base)
        # Kept for the start-up check that the publisher's own timeout fits.
        wrapped.timeout_seconds = publisher_timeout(base)  # type: ignore[attr-defined]
        return wrapped

    def relay(self) -> Relay:
        db = self.db()
        with self._lock:
            if self._relay is None:
                s = self.settings
                self._relay = Relay(
                    self.publisher(),
                    table=s.outbox_table,
                    policy=self.policy(),
                    publish_timeout=s.publish_timeout_seconds,
                    idempotency_key_prefix=s.idempotency_key_prefix,
                    concurrency=s.publish_concurrency,
                    observer=_Fanout([self.events, *self.observers]),
                    keeper=LeaseKeeper(db, self.lease(), table=s.outbox_table),
                )
            return self._relay

    def reset(self) -> None:
        """Drop per-process state (after fork); closes nothing the parent owns."""
        with self._lock:
            self._pid = None
            self._db = None
            self._relay = None

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                if self._relay is not None:
                    self._relay.close()
                if self._db is not None:
                    self._db.close()
            self._db = None
            self._relay = None


class _Fanout:
    """Calls several observers; one failing observer never breaks delivery."""

    def __init__(self, observers: list[RelayObserver]) -> None:
        self.observers = observers

    def _each(self, name: str, *args: Any) -> None:
        for observer in self.observers:
            try:
                getattr(observer, name)(*args)
            except Exception:
                log.debug("observer %r failed in %s", observer, name, exc_info=True)

    def published(self, msg: Claimed, outcome: Outcome, seconds: float) -> None:
        self._each("published", msg, outcome, seconds)

    def finalized(self, msg: Claimed, outcome: Outcome, age_seconds: float) -> None:
        self._each("finalized", msg, outcome, age_seconds)

    def lost_lease(self, ref: LeaseRef, where: str) -> None:
        self._each("lost_lease", ref, where)

    def stale(self, ref: LeaseRef, reason: str) -> None:
        self._each("stale", ref, reason)
