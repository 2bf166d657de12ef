"""The relay as installed into one Celery app: settings, checks, per-process services.

``Installation`` is what ``install(app)`` returns and stores as
``app.outbox_relay``. It owns the validated settings (the producer part from
the app's ``Outbox``) and builds the services for each process on first use.
Everything that holds a socket (the pool, the publisher's clients, the
keeper's thread) is created in the process that uses it and rebuilt when the
PID changes, so nothing crosses a fork: Celery's prefork pool forks children
from the main process, and a connection shared by two processes corrupts both.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from celery.exceptions import SoftTimeLimitExceeded

from .. import store
from .._redact import MASK, connect_error, mask_dsn, mask_spec, scrub
from ..config import (
    REDIS_VISIBILITY_SECONDS,
    Settings,
    conceal,
    env_name,
    hide_secrets,
    lookup_setting,
    producer_settings_in_conf,
)
from ..db import PoolDatabase, bounded_connection_kwargs
from ..errors import ConfigError, OutboxError, PermanentError, RetryableError
from ..model import Message
from ..outbox import Outbox
from ..publishers import CeleryTaskPublisher, Router, publisher_timeout, resolve_publisher
from ..publishers.protocol import is_async_publisher
from ..services import (
    Claimer,
    Completer,
    Deliverer,
    LeaseKeeper,
    Observer,
    Publisher,
    Purger,
    Rescuer,
)
from ..services.policy import RetryPolicy
from . import names
from .canvas import CANVAS_EVENT_TYPE, CanvasPublisher
from .durable import is_durable
from .durable_run import follow_hold
from .events import Observers, TaskEvents
from .identity import identity_of
from .options import annotations_for, retry_policy, time_limits
from .wake import WakeSchedule

__all__ = ["STARTUP_WAIT_SECONDS", "Installation", "Services", "outbox_for", "session_advice"]

# How long a worker or beat starting up waits for a database that refuses
# connections (down, restarting) before it gives up.
STARTUP_WAIT_SECONDS = 30.0


def _unreachable(exc: psycopg.OperationalError) -> bool:
    """A server that is not there (yet), as opposed to one that said no."""
    text = str(exc).lower()
    return any(
        hint in text
        for hint in (
            "connection refused",
            "no such file or directory",  # a Unix socket not created yet
            "the database system is starting up",
            "the database system is shutting down",
            "the database system is in recovery mode",
            "timeout expired",
            "not yet accepting connections",
        )
    )


log = logging.getLogger("outbox_relay.celery")

_KEEPERS_LOCK = threading.Lock()


@dataclass
class Services:
    """The services of one process."""

    db: PoolDatabase
    claimer: Claimer
    deliverer: Deliverer
    rescuer: Rescuer
    purger: Purger
    keeper: LeaseKeeper
    # Durable tasks' rows may have leases of their own: one keeper per length.
    keepers: dict[float, LeaseKeeper] = dataclasses.field(default_factory=dict)
    # The sessions durable task runs hold (made on first use, see durable_run).
    runs_db: PoolDatabase | None = None

    def keeper_for(self, lease_seconds: float) -> LeaseKeeper:
        """The keeper that renews leases of ``lease_seconds`` (made on first use)."""
        if lease_seconds == self.keeper.lease_seconds:
            return self.keeper
        with _KEEPERS_LOCK:
            keeper = self.keepers.get(lease_seconds)
            if keeper is None:
                keeper = LeaseKeeper(
                    self.db, timedelta(seconds=lease_seconds), table=self.claimer.table
                )
                self.keepers[lease_seconds] = keeper
            return keeper

    def close(self) -> None:
        self.deliverer.close()
        self.db.close()
        if self.runs_db is not None:
            self.runs_db.close()


def _translate_celery_retry(publisher: Publisher) -> Publisher:
    """Let a publisher raise ``celery.exceptions.Retry`` (as a task would).

    It becomes a ``RetryableError`` whose ``when`` is the minimum delay; the
    relay never calls ``Task.retry`` itself (the retry lives in the database).
    """
    from celery.exceptions import Retry

    def translated(exc: Retry) -> RetryableError:
        when = exc.when
        delay = float(when) if isinstance(when, (int, float)) else None
        return RetryableError(f"publisher asked to retry: {exc}", retry_after=delay)

    if is_async_publisher(publisher):
        # A coroutine publisher stays one, so that the deliverer awaits it.
        async def publish_async(message: Message) -> Any:
            try:
                return await publisher(message)
            except Retry as exc:
                raise translated(exc) from exc

        return publish_async

    def publish(message: Message) -> Any:
        try:
            return publisher(message)
        except Retry as exc:
            raise translated(exc) from exc

    return publish


def _no_publisher(message: Message) -> None:
    """What a relay with no OUTBOX_PUBLISHER does with a row that is not a canvas."""
    raise PermanentError(
        f"no publisher for event type {message.event_type!r}: OUTBOX_PUBLISHER is not set "
        "(this relay sends only Celery tasks: rows written by outbox_relay.apply_async and "
        "durable tasks); set it, then retry this row with `outbox-relay dead retry`"
    )


def _secret_strings(name: str, value: Any) -> list[str]:
    """The strings inside ``value`` that printing setting ``name`` would mask."""
    if isinstance(value, str):
        return [value] if conceal(name, value) is not value else []
    if isinstance(value, Mapping):
        found: list[str] = []
        for key, item in value.items():
            found += _secret_strings(name if name == "publisher" else str(key), item)
        if name != "publisher" and conceal(name, value) is not value:
            found += [v for v in value.values() if isinstance(v, str)]
        return found
    return []


def _scrub_publisher(text: str, settings: Settings) -> str:
    """``text`` without the publisher's URL passwords or its options' secrets."""
    for spec in _secret_strings("publisher", settings.publisher):
        # Whole, as it is printed elsewhere (query dropped: it may hold a
        # token); then any piece of its password quoted on its own.
        text = scrub(text.replace(spec, mask_spec(spec)), spec)
    for name, value in settings.publisher_options.items():
        for secret in sorted(_secret_strings(name, value), key=len, reverse=True):
            text = text.replace(secret, MASK)
    return text


def _celery_targets(publisher: Any) -> list[CeleryTaskPublisher]:
    """The Celery task publishers in ``publisher`` (itself, or a Router's routes)."""
    if isinstance(publisher, CeleryTaskPublisher):
        return [publisher]
    if isinstance(publisher, Router):
        return [t for p in publisher.publishers for t in _celery_targets(p)]
    return []


def _slowest(publisher: Any) -> Any:
    """The publisher whose timeout is the one declared (a Router's slowest route)."""
    if isinstance(publisher, Router):
        routes = [p for p in publisher.publishers if publisher_timeout(p) is not None]
        if routes:
            return _slowest(max(routes, key=lambda p: publisher_timeout(p) or 0.0))
    return publisher


def _timeout_advice(publisher: Any, declared: float, budget: float) -> str:
    """What to change, and to what, when a publish may outlast its budget."""
    need = math.ceil(declared * 10 - 1e-6) / 10  # rounded up to a tenth
    fixes = [f"raise OUTBOX_PUBLISH_TIMEOUT_SECONDS to at least {need:g}"]
    slowest = _slowest(publisher)
    parts = getattr(slowest, "timeout_parts", None) or []
    detail = ""
    if parts:
        detail = (
            " ("
            + " + ".join(
                f"{n} x {name} {seconds:g}" if n > 1 else f"{name} {seconds:g}"
                for name, seconds, n in parts
            )
            + ")"
        )
        excess = declared - budget
        for name, seconds, n in parts:
            # Rounded down to a hundredth, so the advice is enough on its own.
            lower = math.floor((seconds - excess / n) * 100 + 1e-6) / 100
            if lower > 0:
                fixes.append(f"lower {name} to at most {lower:g}")
    else:
        fixes.append("lower the publisher's own timeouts")
    return (
        f"the publisher may take {declared:g}s per publish{detail}, more than "
        f"OUTBOX_PUBLISH_TIMEOUT_SECONDS ({budget:g}): " + ", or ".join(fixes)
    )


class Installation:
    """The relay installed into one Celery app (``app.outbox_relay``)."""

    def __init__(
        self,
        app: Any,
        outbox: Outbox,
        overrides: Mapping[str, Any],
        task_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.app = app
        self.outbox = outbox
        self.overrides = dict(overrides)
        # Celery retry options given to install(); task_annotations win over them.
        self.task_options = dict(task_options or {})
        self.observers: list[Observer] = [TaskEvents(outbox.table.qualified)]
        self._settings: Settings | None = None
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._services: Services | None = None
        # Set by install(): a settings error Celery's configure signal would
        # only have logged, and whether the worker was started with -Q.
        self.config_error: OutboxError | None = None
        self.explicit_queues = False
        # What install() was given, to tell the same call again from another.
        self.given: tuple[Any, ...] = ()
        # This worker's pool processes (its --concurrency) and
        # worker_prefetch_multiplier, recorded at worker setup, before the pool
        # forks; 0 when unknown. fan_out keeps chunks small enough for each
        # process to hold one under the in-flight cap, and places a drain's
        # next claim by what the worker prefetches (``prefetched``).
        self.concurrency = 0
        self.prefetch_multiplier = 0
        # Whether this worker sends task events (-E): a durable task's run
        # that follows sends them for the rows it runs (durable_run._follow).
        self.task_events = False
        # Whether this worker has a time limit of its own (--time-limit,
        # --soft-time-limit, or the app's settings): it counts from the
        # message, so a run that follows would leave the rows after it less.
        self.time_limited = False
        # celery/identity.py: read at start (check_database) or at first
        # use; "" when the table has no record to read it from.
        self._identity: str | None = None
        self._identity_retry_at = 0.0
        # The claims this process sent for when waiting rows fall due.
        self.wake = WakeSchedule()

    @property
    def prefetched(self) -> int:
        """Tasks this worker takes from the queue ahead of time (0: unknown)."""
        return self.concurrency * self.prefetch_multiplier

    # ----------------------------------------------------------- settings
    @property
    def settings(self) -> Settings:
        if self._settings is None:
            # The producer part comes from the Outbox: the relay can never
            # disagree with producers about the table or ordering.
            producer = dataclasses.asdict(self.outbox.settings)
            self._settings = Settings.load(self.app.conf, **{**self.overrides, **producer})
            # Whatever was set on app.conf since it was configured: masked
            # from now on in what Celery prints (inspect conf, Flower).
            hide_secrets(self.app.conf)
        return self._settings

    def relay_queue(self) -> str:
        """The queue the relay's tasks are routed to: the user's ``task_routes``
        for ``outbox_relay.*`` when they name one, else ``OUTBOX_QUEUE``."""
        return self._routed_queue() or self.settings.queue

    def queue_as_written(self) -> str:
        """``relay_queue`` without validating the other settings: the queue a
        worker with an invalid configuration would relay from."""
        try:
            routed = self._routed_queue()
        except ConfigError:
            # The relay's own route, after the user's, reads the settings:
            # none of the user's routes named a queue.
            routed = None
        if routed:
            return routed
        found, raw, _ = lookup_setting("queue", self.app.conf, os.environ, self.overrides)
        return str(raw) if found and raw else Settings.queue

    def _routed_queue(self) -> str | None:
        from celery.exceptions import QueueNotFound

        try:
            route = self.app.amqp.router.route({}, names.CLAIM, (), {})
        except QueueNotFound as exc:
            # A worker stopped on a traceback through Celery's router.
            raise ConfigError(
                f"the relay's tasks are routed (task_routes) to a queue this app does not "
                f"declare ({exc.args[0] if exc.args else exc}): add it to task_queues, or "
                "set task_create_missing_queues"
            ) from None
        queue = route.get("queue")
        return str(getattr(queue, "name", queue) or "") or None

    def identity(self) -> str | None:
        """What tells this relay's tasks from another relay's on one queue
        (celery/identity.py); None while it could not be read.

        A relay worker reads it at start, before its pool forks; a process
        that did not (a worker of durable tasks only, which sends claim
        hints) reads it once on a connection of its own, not through the
        relay's services, which it may never need, and after a failure not
        again for a minute (its tasks would otherwise wait on a database
        that is away twice)."""
        if self._identity is None:
            now = time.monotonic()
            if now < self._identity_retry_at:
                return None
            s = self.settings
            try:
                kwargs = bounded_connection_kwargs(s.database_timeout)
                with psycopg.connect(s.require_dsn(), autocommit=True, **kwargs) as conn:
                    found = store.relay_identity(conn, table=s.outbox_table)
            except Exception:
                self._identity_retry_at = now + 60.0
                log.debug("could not read the relay's identity", exc_info=True)
                return None
            self._record_identity(found)
        return self._identity or None

    def _record_identity(self, found: tuple[str, str] | None) -> None:
        table = self.settings.outbox_table
        self._identity = identity_of(found[0], table, found[1]) if found else ""

    @property
    def dsn(self) -> str | None:
        """The relay's DSN (InboxTask reads it); None when not configured."""
        return self.settings.dsn

    @property
    def owner(self) -> str:
        return self.settings.owner or f"{socket.gethostname()}:{os.getpid()}"

    def policy(self) -> RetryPolicy:
        return retry_policy(
            self.settings, self.task_options, annotations_for(self.app, names.DELIVER)
        )

    # --------------------------------------------------------- validation
    def check_start(self) -> None:
        """What a relay worker or beat checks before it starts: settings that
        could not even be read, the settings themselves, and the database
        (waited for up to STARTUP_WAIT_SECONDS while it refuses connections
        or is starting). Raises ConfigError naming the problem."""
        if self.config_error is not None:
            raise self.config_error
        self.validate()
        self.check_database(wait_seconds=STARTUP_WAIT_SECONDS)

    def validate(self) -> None:
        """Check the settings and that the timeouts nest; raise ConfigError naming them.

        publisher timeout < task time limit < lease < broker visibility timeout.
        """
        s = self.settings
        s.require_dsn()
        self._check_producer_settings()
        self._check_publisher()
        _warn_unsafe_content(self.app)
        lease = s.lease_seconds
        worst = s.worst_delivery_seconds
        delivery = names.DELIVER_BATCH if s.chunk_size > 1 else names.DELIVER
        options = {**self.task_options, **annotations_for(self.app, delivery)}
        self.policy()  # the retry options' values, refused here rather than at the first failure
        for name in ("time_limit", "soft_time_limit"):
            limit = options.get(name)
            if limit is None:
                limit = self.app.conf.get(f"task_{name}")
            if limit is not None and not worst < float(limit) < lease:
                raise ConfigError(
                    f"task {name} ({limit}s) must lie between the worst-case delivery time "
                    f"({worst:g}s) and OUTBOX_LEASE_SECONDS ({lease:g}s)"
                )
        transport = self.app.conf.get("broker_transport_options") or {}
        visibility = transport.get("visibility_timeout")
        broker = str(self.app.conf.get("broker_url") or "")
        if broker.startswith(("redis", "rediss", "sqs")):
            visibility = REDIS_VISIBILITY_SECONDS if visibility is None else visibility
        if visibility is not None and not float(visibility) > lease:
            raise ConfigError(
                f"broker_transport_options['visibility_timeout'] ({visibility}s) must be "
                f"greater than OUTBOX_LEASE_SECONDS ({lease:g}s), or the broker redelivers "
                "tasks that are still running"
            )

    def _check_producer_settings(self) -> None:
        """The Outbox holds the producer settings (table, ordering ...): an
        ``outbox_*`` Celery setting that says otherwise was silently ignored
        when an Outbox was given to install() (ordering off, say, or another
        table). Without one, install() made its Outbox from them."""
        if self.given and self.given[0] is None:
            return
        outbox = self.outbox.settings
        for field, (label, value) in producer_settings_in_conf(self.app.conf).items():
            if value != getattr(outbox, field):
                raise ConfigError(
                    f"{label}={value!r} is a producer setting, and the Outbox given to "
                    f"install() has {field}={getattr(outbox, field)!r}: producers and the "
                    f"relay follow the Outbox. Give it to Outbox({field}=...) (with Django: "
                    f"{env_name(field)} in settings.py), or remove {label}"
                )

    def _check_publisher(self) -> None:
        s = self.settings
        base = self._resolve_publisher()
        if not s.publisher:
            # Not a warning: the docs' own apply_async and durable setups
            # need no publisher, and would warn at every start. A row that
            # needs one ends dead, its reason naming the setting.
            log.info(
                "outbox-relay: OUTBOX_PUBLISHER is not set: this relay sends the Celery tasks "
                "written with outbox_relay.apply_async and durable tasks; any other row ends "
                "dead, its reason naming OUTBOX_PUBLISHER (set it, then "
                "`outbox-relay dead retry --all`)"
            )
        for target in _celery_targets(base):
            # A task name nobody registers: refused (relay's own app) or warned.
            warning = target.check_registered(self.app)
            if warning:
                log.warning("%s", warning)
        declared = publisher_timeout(base)
        budget = s.publish_timeout_seconds
        if declared is not None and declared > budget + 1e-9:
            raise ConfigError(_timeout_advice(base, declared, budget))

    def check_database(self, *, wait_seconds: float = 0.0) -> None:
        """Connect once and check the table is migrated (then disconnect).

        A server that refuses connections, or ends the check's session
        before it is done (a failover, an operator terminating backends), is
        waited for up to ``wait_seconds`` (a relay started with its database,
        or during a restart, as Celery waits for its broker at start);
        anything else (a bad DSN or password, a missing table) fails at once.
        A beat that gave up on a terminated session never sent a claim or a
        rescue again (the fault suite's terminated-backends scenario).
        """
        table = self.settings.outbox_table
        dsn = self.settings.require_dsn()
        deadline = time.monotonic() + wait_seconds
        role: str | None = None
        defaults: dict[str, str] = {}
        database = ""
        # Whose chains the worker writes (see the warning below).
        durable = sorted(name for name, task in self.app.tasks.items() if is_durable(task))
        try:
            kwargs = bounded_connection_kwargs(self.settings.database_timeout)
            while True:
                connected = False
                try:
                    with psycopg.connect(dsn, **kwargs) as conn:
                        connected = True
                        role = conn.info.user
                        exists = store.table_exists(conn, table=table)
                        missing = store.missing_migrations(conn, table=table) if exists else []
                        if exists and not missing:
                            # Before the pool forks: every process has it.
                            self._record_identity(store.relay_identity(conn, table=table))
                        inserts = not (durable and exists) or store.may_insert(conn, table=table)
                        lacks = store.relay_lacks(conn, table=table) if exists else []
                        if self.settings.transaction_pooling:
                            defaults = store.session_defaults(conn)
                            database = conn.info.dbname
                    break
                except psycopg.OperationalError as exc:
                    # After a connect, an OperationalError is a lost session,
                    # never a setting (a refusal is another error class).
                    transient = connected or _unreachable(exc)
                    if time.monotonic() >= deadline or not transient:
                        raise
                    log.warning(
                        "outbox-relay: database %s not reachable yet, retrying: %s",
                        mask_dsn(dsn),
                        connect_error(exc, dsn),
                    )
                    time.sleep(1.0)
        except psycopg.errors.InsufficientPrivilege as exc:
            if role is None:  # refused at connect (no CONNECT on the database)
                raise ConfigError(
                    f"cannot connect to OUTBOX_DSN ({mask_dsn(dsn)}): {connect_error(exc, dsn)}"
                ) from None
            # Connected: "cannot connect" would send the reader to the DSN.
            raise ConfigError(
                f"the relay's role {role!r} may not use the outbox table {table.qualified} "
                f"({exc.diag.message_primary}): print its grants with "
                f"`{table.grant_command(role, 'relay')}` and run them as the table's owner"
            ) from None
        except (psycopg.Error, ValueError, OSError) as exc:
            # libpq's text may quote the DSN, or pieces of its password read
            # as a host: connect_error scrubs it, or withholds it. (psycopg
            # resolves host names itself, and a "host" made of a password's
            # tail can fail there with a UnicodeError, not a psycopg.Error.)
            raise ConfigError(
                f"cannot connect to OUTBOX_DSN ({mask_dsn(dsn)}): {connect_error(exc, dsn)}"
            ) from None
        if not exists:
            raise ConfigError(
                f"the outbox table {table.qualified} does not exist: run "
                f"`{table.migrate_command}` (or {table.migrate_call}) first"
            )
        if missing:
            raise ConfigError(
                f"the outbox table {table.qualified} lacks migration(s) "
                f"{', '.join(map(str, missing))}: run `{table.migrate_command}` first"
            )
        if lacks:
            raise ConfigError(
                f"the relay's role {role!r} lacks {', '.join(lacks)} on the outbox table "
                f"{table.qualified} (every claim would fail with 'permission denied'): print "
                f"its grants with `{table.grant_command(role, 'relay')}` and run them as the "
                "table's owner"
            )
        advice = session_advice(defaults, self.settings.database_timeout, role, database)
        if advice:
            log.warning("outbox-relay: %s", advice)
        if not inserts:
            log.warning(
                "outbox-relay: this app has durable tasks (%s) and the relay's role %r may not "
                "insert into %s: a durable chain's next step, written by the worker that ran "
                "the step before, would fail and end dead. Give the role the producer's "
                "grants too: `%s`",
                ", ".join(durable[:5]) + (" ..." if len(durable) > 5 else ""),
                role,
                table.qualified,
                table.grant_command(role, "producer"),
            )

    # ----------------------------------------------------- process state
    def _resolve_publisher(self) -> Publisher:
        s = self.settings
        if not s.publisher:
            # A relay for apply_async alone needs no publisher of its own.
            return _no_publisher
        try:
            return resolve_publisher(
                s.publisher,
                publish_timeout_seconds=s.publish_timeout_seconds,
                **dict(s.publisher_options),
            )
        except ConfigError as exc:
            # A mistyped URL (amqp//user:pw@host) is echoed by the resolver
            # as the setting's value; the worker logs this message.
            raise ConfigError(_scrub_publisher(str(exc), s)) from None

    def publisher(self) -> Publisher:
        """The configured publisher, except for rows written by ``apply_async``:
        those are always a Celery canvas, sent through this app's broker."""
        base = self._resolve_publisher()
        wrapped = _translate_celery_retry(base)
        wrapped.timeout_seconds = publisher_timeout(base)  # type: ignore[attr-defined]
        s = self.settings
        canvas = CanvasPublisher(
            self.app, budget=s.publish_timeout_seconds, concurrency=s.publish_concurrency
        )
        return Router({CANVAS_EVENT_TYPE: canvas}, default=wrapped)

    def services(self) -> Services:
        with self._lock:
            pid = os.getpid()
            if self._pid != pid:
                # Forked (or first use): forget, without closing, whatever the
                # parent built; its sockets belong to the parent.
                self._services = None
                self._pid = pid
            if self._services is None:
                self._services = self._build()
            return self._services

    def _build(self) -> Services:
        s = self.settings
        table = s.outbox_table
        lease = timedelta(seconds=s.lease_seconds)
        policy = self.policy()
        db = PoolDatabase(
            s.require_dsn(),
            size=s.pool_size,
            name=f"outbox-relay-{os.getpid()}",
            synchronous_finalize=s.synchronous_finalize,
            timeout=s.database_timeout,
            transaction_pooling=s.transaction_pooling,
        )
        keeper = LeaseKeeper(db, lease, table=table)
        observers = Observers(list(self.observers))
        completer = (
            Completer(db, table=table, observer=observers, window=s.finalize_window_seconds)
            if s.finalize_window_seconds > 0
            else None
        )
        deliverer = Deliverer(
            self.publisher(),
            db=db,
            table=table,
            policy=policy,
            publish_timeout=s.publish_timeout_seconds,
            idempotency_key_prefix=s.idempotency_key_prefix,
            concurrency=s.publish_concurrency,
            observer=observers,
            keeper=keeper,
            # The delivery task counts the attempt when it begins, so a task
            # that expired in the broker unrun costs its row nothing.
            count_attempt=True,
            # Raised inside a publisher published inline (one row, or a
            # concurrency of 1): it ends the chunk, not that row's attempt.
            interruptions=(SoftTimeLimitExceeded,),
            # A first attempt's done (per message, small chunks), written with
            # the process's others.
            completer=completer,
        )
        claimer = Claimer(
            db,
            table=table,
            owner=lambda: self.owner,
            batch_size=s.batch_size,
            max_in_flight=s.max_in_flight,
            lease=lease,
            max_attempts=policy.max_attempts,
            # A durable task's rows wait in the table for its runs to take
            # (durable_run, following) while this many of its messages are
            # queued: twice what one worker takes ahead, so that a worker
            # whose prefetch is full leaves messages for the others.
            follow_queue=2 * (self.prefetched or 4 * (os.cpu_count() or 1)),
            hold=follow_hold(s),
        )
        rescuer = Rescuer(db, table=table, max_attempts=policy.max_attempts)
        purger = Purger(
            db,
            table=table,
            older_than=timedelta(seconds=s.purge_after_seconds),
            batch_size=s.purge_batch_size,
        )
        return Services(db, claimer, deliverer, rescuer, purger, keeper)

    def time_limits(self) -> tuple[float, float]:
        return time_limits(self.settings)

    def reset(self) -> None:
        """Drop per-process state (after fork); closes nothing the parent owns."""
        with self._lock:
            self._pid = None
            self._services = None
        self.wake.reset()

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid() and self._services is not None:
                self._services.close()
            self._services = None


def outbox_for(app: Any) -> Outbox:
    """The outbox whose table ``app``'s relay reads, when the relay is
    installed in it; else the process's default (``configure()``, the first
    ``install()``, the environment). A task's call written anywhere else is
    never sent: with two apps in one process, the first install's table is
    the default, and the second app's tasks must go to the second's."""
    inst = getattr(app, "outbox_relay", None) if app is not None else None
    if isinstance(inst, Installation):
        return inst.outbox
    from ..outbox import default_outbox

    return default_outbox()


# Content types whose decoding runs code: pickle.
_UNSAFE_CONTENT = frozenset({"pickle", "application/x-python-serialize"})


def _warn_unsafe_content(app: Any) -> None:
    """Say so when the app accepts pickle: any process that can write to the
    broker can then run code in this worker, through a message for any task,
    the relay's own included (they need and send JSON only). It is the app's
    setting, not the relay's, so a warning rather than a refusal."""
    accept = app.conf.get("accept_content") or ["json"]
    unsafe = sorted({str(kind) for kind in accept} & _UNSAFE_CONTENT)
    if unsafe:
        log.warning(
            "outbox-relay: this Celery app's accept_content allows %s: whoever can write to "
            "the broker can run code in this worker with a message for any task, the relay's "
            "included; the relay needs only JSON (accept_content=['json'])",
            ", ".join(unsafe),
        )


def session_advice(
    defaults: dict[str, str], timeout: float, role: str | None, database: str
) -> str:
    """What a relay behind a pooler in transaction mode lacks of the session
    settings it sets on a connection of its own (queries.sql, relay_session),
    as sessions of ``role`` in ``database`` start (``store.session_defaults``),
    and the ALTER ROLE that gives them; empty when nothing is missing."""
    if not defaults:
        return ""
    limit = int(timeout * 1000)
    wanted = {
        "statement_timeout": f"{limit}ms",
        "idle_in_transaction_session_timeout": f"{limit}ms",
        "jit": "off",
        "enable_bitmapscan": "off",
    }
    missing = []
    for name, value in wanted.items():
        have = defaults.get(name)
        if have is None:
            continue
        if name.endswith("timeout"):
            if have.isdigit() and 0 < int(have) <= limit:
                continue
        elif have == "off":
            continue
        missing.append((name, have, value))
    if not missing:
        return ""
    found = ", ".join(
        f"{name} {'0 (none)' if have == '0' else have + ('ms' if name.endswith('timeout') else '')}"
        for name, have, _ in missing
    )
    who = '"' + (role or "ROLE").replace('"', '""') + '"'
    where = '"' + (database or "DATABASE").replace('"', '""') + '"'
    sets = "; ".join(
        f"ALTER ROLE {who} IN DATABASE {where} SET {name} = '{value}'" for name, _, value in missing
    )
    return (
        "OUTBOX_TRANSACTION_POOLING=true: the relay sets no session setting of its own, and "
        f"sessions of role {role!r} in database {database!r} start with {found}. Bound them "
        f"for a role the relay alone uses (`outbox-relay grant --kind relay`): {sets}; then "
        "RECONNECT in PgBouncer's admin console (server sessions it holds keep the settings "
        "they started with)"
    )
