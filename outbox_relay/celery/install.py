"""``install(app)``: adopt the relay into an existing Celery app.

It registers the ``outbox_relay.*`` tasks, routes them to ``OUTBOX_QUEUE``
after the app's own ``task_routes``, adds the beat entries (claim, rescue,
purge), wires the per-process signal handlers and adds the worker bootstep
(start-up checks and the NOTIFY listener). Celery's conventions decide the
rest: a worker started without ``-Q`` also consumes the outbox queue; one
started with ``-Q billing`` consumes only ``billing`` and runs none of the
relay's start-up work. The app's own tasks, routes and schedule are kept.

It also hides the relay's secrets from what Celery prints (``celery report``,
``celery inspect conf``, Flower): ``outbox_*`` settings that may hold one are
replaced in ``app.conf`` by ``Secret`` values that print masked
(``config.hide_secrets``).
"""

from __future__ import annotations

import logging
from contextlib import suppress
from typing import Any

import kombu.entity
from celery import signals

from .. import _defaults
from ..config import (
    KEYWORD,
    ProducerSettings,
    hide_secrets,
    refuse_bad_values,
    refuse_unknown_names,
)
from ..errors import ConfigError, OutboxError
from ..metrics import MetricsObserver
from ..outbox import Outbox
from ..table import OutboxTable
from . import names
from .options import check_task_options
from .runtime import Installation
from .tasks import register_tasks

__all__ = ["install"]

log = logging.getLogger("outbox_relay.celery")

# kombu is untyped.
_Exchange: Any = kombu.entity.Exchange
_Queue: Any = kombu.entity.Queue

_PRODUCER_FIELDS = frozenset(ProducerSettings.field_names())


def install(
    app: Any,
    *,
    outbox: Outbox | None = None,
    beat: bool = True,
    consume: bool = True,
    task_options: dict[str, Any] | None = None,
    **settings: Any,
) -> Installation:
    """Install the relay into ``app`` and return it (also ``app.outbox_relay``).

    ``outbox`` is the ``Outbox`` your producers use (its table and ordering);
    without one, the producer settings among ``settings`` make one, which
    becomes this process's default for ``outbox_relay.enqueue``. ``settings``
    override ``outbox_*`` Celery settings and ``OUTBOX_*`` environment
    variables (``install(app, dsn=..., publisher="pkg.mod:send")``).
    ``beat=False`` adds no beat entries (schedule them yourself);
    ``consume=False`` never adds the outbox queue to a worker (start the
    relay's workers with ``-Q outbox``). ``task_options`` are Celery retry
    options read as the relay's retry policy; ``task_annotations`` for
    ``outbox_relay.deliver`` override them.
    """
    # A misspelled keyword, or a value of the wrong type, is refused here,
    # where it was written, not only when a worker or beat starts (a web
    # process never would).
    refuse_unknown_names(dict.fromkeys(settings, KEYWORD))
    refuse_bad_values(settings, KEYWORD)
    check_task_options(task_options or {})
    if isinstance(settings.get("table"), str):
        OutboxTable.parse(settings["table"])  # a bad name fails here too
    existing = getattr(app, "outbox_relay", None)
    given = (outbox, beat, consume, task_options, settings)
    if isinstance(existing, Installation):
        # The same call again (a module imported twice) is harmless; another
        # one would be ignored without a word, and its table never relayed.
        if existing.given == given:
            return existing
        raise ConfigError(
            f"install(): the relay is already installed in Celery app {app.main!r}, "
            "differently; an app relays one outbox table. For a second table make a "
            "Celery app of its own with its own queue (OUTBOX_QUEUE), see "
            "docs/configuration.md"
        )
    if outbox is None:
        outbox = Outbox.from_settings(settings, conf=app.conf)
    # The process's default unless configure() or an earlier install() set
    # one: outbox_relay.enqueue then writes where this relay reads.
    chosen = outbox
    _defaults.register(lambda: chosen.settings, explicit=False)
    relay_settings = {k: v for k, v in settings.items() if k not in _PRODUCER_FIELDS}
    inst = Installation(app, outbox, relay_settings, task_options)
    inst.given = given
    app.outbox_relay = inst
    register_tasks(app, inst)
    # Counters and histograms for Prometheus (see outbox_relay.metrics for
    # PROMETHEUS_MULTIPROC_DIR under the prefork pool).
    inst.observers.append(MetricsObserver())

    _hide_secrets(app)
    _when_configured(app, lambda: _add_route(app, inst))
    if beat:
        _when_configured(app, lambda: _add_beat_entries(app, inst))
        _check_beat(app, inst)
    _when_finalized(app, lambda: _lift_rate_limits(app))
    _when_finalized(app, lambda: _expire_ticks(app, inst))
    _wire_worker(app, inst, consume)
    return inst


# Every relay task; none of them may wait in a rate limit.
_RELAY_TASKS = (names.CLAIM, names.DELIVER, names.DELIVER_BATCH, names.RESCUE, names.PURGE)


def _when_finalized(app: Any, fn: Any) -> None:
    _when(app.finalized, app.on_after_finalize, fn)


def _lift_rate_limits(app: Any) -> None:
    """A rate limit from the app (``task_annotations={"*": {"rate_limit":
    ...}}`` or ``task_default_rate_limit``) applies to the relay's tasks too.
    A delivery then waits in the worker's bucket past its expiry and is
    dropped, and its row waits out its lease: 300 messages took 2.5 minutes
    behind "50/s", and the rescuer's "delivery tasks were lost or stuck"
    pointed the wrong way. The relay's pace is the in-flight cap's."""
    limited = []
    for name in _RELAY_TASKS:
        task = app.tasks.get(name)
        if task is not None and task.rate_limit:
            limited.append(f"{name} ({task.rate_limit})")
            task.rate_limit = None
    if limited:
        log.warning(
            "outbox-relay: this app's task_annotations or task_default_rate_limit give the "
            "relay's tasks a rate limit, which the relay ignores (a rate-limited delivery "
            "expires in the worker and its row waits out its lease): %s. Limit the relay with "
            "OUTBOX_MAX_IN_FLIGHT, and annotate your own tasks by name",
            ", ".join(limited),
        )


def _expire_ticks(app: Any, inst: Installation) -> None:
    """A tick nobody picked up within its interval is replaced by the next
    one: the claim, rescue and purge tasks expire after their interval by
    default, whoever sends them. The relay's beat entries say so in their
    options too, but a scheduler that keeps its entries in a database
    (django-celery-beat) stores only some options and dropped that one: the
    ticks of a day without workers waited in the broker, and a worker's
    first minutes went on thousands of claims that found nothing. The
    relay's own hints pass ``expires`` themselves (tasks._send)."""
    try:
        s = inst.settings
    except OutboxError:
        return  # the worker's or beat's start check reports it
    intervals = {
        names.CLAIM: s.claim_interval_seconds,
        names.RESCUE: s.rescue_interval,
        names.PURGE: names.PURGE_EVERY_SECONDS,
    }
    for name, interval in intervals.items():
        task = app.tasks.get(name)
        if task is not None:
            task.expires = interval


def _when_configured(app: Any, fn: Any) -> None:
    _when(app.configured, app.on_after_configure, fn)


def _when(done: bool, signal: Any, fn: Any) -> None:
    """``fn`` now if the app already got there, else when ``signal`` fires."""
    if done:
        fn()
    else:
        signal.connect(lambda sender=None, **kw: fn(), weak=False)


def _hide_secrets(app: Any) -> None:
    """Mask the relay's secrets in ``app.conf`` wherever Celery could print them.

    Three moments cover every way a value arrives: when the configuration is
    first read (``celeryconfig``, ``config_from_object``, anything set before
    that), when a command imports the app's modules (``celery report`` and
    ``celery worker`` do, after the app module has run whatever assignments
    it makes), and whenever the relay reads its settings (``Installation``).
    """
    _when_configured(app, lambda: hide_secrets(app.conf))

    def on_import_modules(sender: Any = None, **kwargs: Any) -> None:
        if sender is app:
            hide_secrets(app.conf)

    signals.import_modules.connect(on_import_modules, weak=False)


def relay_queue_entity(app: Any, name: str) -> Any:
    """The relay's queue ``name`` in ``app.amqp.queues``, bound to ``RELAY_EXCHANGE``.

    Made here, not by Celery on first use, so that sends, ``-Q`` and the
    worker's consumer all see the same exchange (names.RELAY_EXCHANGE says
    why it is not Celery's own choice). A queue of that name in the app's
    ``task_queues`` is the user's and is kept as it is.
    """
    queues = app.amqp.queues
    present = queues.get(name)  # get(): no KeyError, and no queue made by Celery
    if present is not None:
        exchange = getattr(present.exchange, "name", None)
        if exchange == names.RELAY_EXCHANGE or name in _declared_queues(app):
            return present
    # Celery's own missing queue, for its arguments (task_create_missing_queue_type).
    made = queues.new_missing(name)
    return queues.add(
        _Queue(
            name,
            _Exchange(names.RELAY_EXCHANGE, type="direct"),
            routing_key=name,
            queue_arguments=made.queue_arguments,
        )
    )


def _own_queue(app: Any, inst: Installation, queue: str) -> Any:
    """``queue`` as the worker should consume it: the relay's entity when it
    is ``OUTBOX_QUEUE``; a queue the user's own route names stays theirs."""
    return relay_queue_entity(app, queue) if queue == inst.settings.queue else queue


def _declared_queues(app: Any) -> set[str]:
    declared = app.conf.task_queues or ()
    if isinstance(declared, dict):
        return set(declared)
    return {str(getattr(q, "name", q)) for q in declared}


def _add_route(app: Any, inst: Installation) -> None:
    """Route relay tasks to OUTBOX_QUEUE, after the user's own ``task_routes``.

    The route is added to Celery's router, not to ``app.conf.task_routes``:
    the user's setting stays the object they wrote (a dict they may
    ``update()`` later; it was turned into a tuple before), and it follows
    Celery's own rebuilds of the router (``app.conf.update(task_routes=...)``).
    The queue is read when a task is routed, not now, so a bad setting
    surfaces where it can be reported (worker or beat start), never inside
    Celery's configure signal, which only logs.
    """

    def route(name: str, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        if name.startswith("outbox_relay."):
            return {"queue": relay_queue_entity(app, inst.settings.queue)}
        return None

    amqp = app.amqp
    rebuild = amqp.flush_routes

    def flush_routes() -> None:
        rebuild()  # Celery's: the routes prepared from app.conf.task_routes
        amqp._rtable = [*amqp._rtable, route]

    # Celery calls it whenever task_routes change through conf.update().
    amqp.flush_routes = flush_routes
    flush_routes()
    # Celery caches its router; rebuild it from the new routes.
    amqp.__dict__.pop("router", None)


def _add_beat_entries(app: Any, inst: Installation) -> None:
    try:
        s = inst.settings
    except OutboxError as exc:
        # Celery only logs errors raised in on_after_configure; keep it for
        # beat_init (below), which stops beat with this message.
        inst.config_error = exc
        return
    schedule = dict(app.conf.beat_schedule or {})
    # A tick nobody picked up within one interval is replaced by the next one;
    # don't let them pile up in the broker.
    schedule.setdefault(
        names.BEAT_CLAIM,
        {
            "task": names.CLAIM,
            "schedule": s.claim_interval_seconds,
            "options": {"expires": s.claim_interval_seconds},
        },
    )
    schedule.setdefault(
        names.BEAT_RESCUE,
        {
            "task": names.RESCUE,
            "schedule": s.rescue_interval,
            "options": {"expires": s.rescue_interval},
        },
    )
    schedule.setdefault(
        names.BEAT_PURGE,
        {
            "task": names.PURGE,
            "schedule": names.PURGE_EVERY_SECONDS,
            "options": {"expires": names.PURGE_EVERY_SECONDS},
        },
    )
    app.conf.beat_schedule = schedule


def _check_beat(app: Any, inst: Installation) -> None:
    """Fail ``celery beat`` at start on bad settings, a bad publisher or no
    migration; say so when the relay's entries are not in its schedule."""

    def on_beat_init(sender: Any = None, **kwargs: Any) -> None:
        if getattr(sender, "app", app) is not app:
            return
        try:
            inst.check_start()
        except ConfigError as exc:
            log.critical("outbox-relay: beat cannot start: %s", exc)
            # Celery's signal dispatch swallows exceptions; SystemExit is not
            # an Exception, so it stops beat with status 1. A status, not the
            # message: Python would print that to stderr, which beat logs
            # again as a WARNING line.
            raise SystemExit(1) from None
        _warn_missing_entries(app)

    signals.beat_init.connect(on_beat_init, weak=False)


def _warn_missing_entries(app: Any) -> None:
    """``app.conf.beat_schedule = {...}`` assigned after install() on a
    configured app replaced the relay's entries: beat then never claimed,
    rescued or purged (only NOTIFY claimed, and retries waited for good)."""
    tasks = {entry.get("task") for entry in (app.conf.beat_schedule or {}).values()}
    missing = [name for name in (names.CLAIM, names.RESCUE) if name not in tasks]
    if missing:
        log.warning(
            "outbox-relay: beat's schedule has no entry for %s: expired leases and retries "
            "wait for good. Something replaced app.conf.beat_schedule after install(); "
            "add to it instead (app.conf.beat_schedule.update(...) or "
            "app.add_periodic_task), or install(app, beat=False) and schedule them yourself",
            " and ".join(missing),
        )


def _wire_worker(app: Any, inst: Installation, consume: bool) -> None:
    def on_init(sender: Any = None, instance: Any = None, options: Any = None, **kw: Any) -> None:
        if instance is not None and instance.app is app:
            # -Q given on the command line: the operator decides what this
            # worker consumes, so the relay adds no queue of its own.
            inst.explicit_queues = bool((options or {}).get("queues"))
            # Before the worker reads -Q: "-Q outbox" must find the relay's
            # queue, not make one bound to an exchange named after it.
            with suppress(ConfigError):  # reported at start (after_setup, the worker step)
                _own_queue(app, inst, inst.relay_queue())

    def after_setup(sender: Any = None, instance: Any = None, **kwargs: Any) -> None:
        if instance is None or instance.app is not app:
            return
        inst.concurrency = int(getattr(instance, "concurrency", None) or 0)
        inst.prefetch_multiplier = int(getattr(instance, "prefetch_multiplier", None) or 0)
        inst.task_events = bool(getattr(instance, "task_events", False))
        inst.time_limited = bool(
            getattr(instance, "time_limit", None) or getattr(instance, "soft_time_limit", None)
        )
        if consume and not inst.explicit_queues:
            # The queue the relay's tasks are routed to (the user's route wins).
            try:
                queue = inst.relay_queue()
            except ConfigError as exc:
                # Reported, in one line, by the worker step at start.
                inst.config_error = exc
                return
            instance.app.amqp.queues.select_add(_own_queue(app, inst, queue))

    def process_init(**kwargs: Any) -> None:
        inst.reset()  # a forked child must not reuse the parent's sockets

    def process_shutdown(**kwargs: Any) -> None:
        inst.close()

    def worker_shutdown(sender: Any = None, **kwargs: Any) -> None:
        # After a warm shutdown's last task: under -P threads or solo the
        # deliveries ran in this process, and its completer writes the done it
        # gathered now (a no-op where the pool processes held the services).
        if sender is None or getattr(sender, "app", None) is app:
            inst.close()

    signals.celeryd_init.connect(on_init, weak=False)
    signals.celeryd_after_setup.connect(after_setup, weak=False)
    signals.worker_process_init.connect(process_init, weak=False)
    signals.worker_process_shutdown.connect(process_shutdown, weak=False)
    signals.worker_shutdown.connect(worker_shutdown, weak=False)

    from .listener import RelayWorkerStep

    app.steps["worker"].add(RelayWorkerStep)
