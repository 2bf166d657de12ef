"""``install(app)``: adopt the relay into an existing Celery app.

It registers the ``outbox_relay.*`` tasks, adds the beat entry that claims
every ``OUTBOX_CLAIM_INTERVAL_SECONDS``, makes workers consume the ``outbox``
queue, wires the per-process signal handlers, and adds the worker bootstep
(start-up validation and the NOTIFY listener). The app's own tasks, routes and
schedule are left as they were.
"""

from __future__ import annotations

from typing import Any

from celery import signals

from ..metrics import MetricsObserver
from .runtime import RelayRuntime
from .tasks import CLAIM, PURGE, register_tasks

__all__ = ["install"]

BEAT_ENTRY = "outbox-relay-claim"
PURGE_ENTRY = "outbox-relay-purge"
PURGE_EVERY_SECONDS = 3600.0


def install(
    app: Any,
    *,
    beat: bool = True,
    consume: bool = True,
    task_options: dict[str, Any] | None = None,
    **settings: Any,
) -> RelayRuntime:
    """Install the relay into ``app`` and return its runtime.

    ``settings`` override ``outbox_*`` Celery settings and ``OUTBOX_*``
    environment variables (``install(app, dsn=..., publisher="pkg.mod:send")``).
    ``task_options`` are Celery retry options (``max_retries``,
    ``retry_backoff``, ``retry_backoff_max``, ``retry_jitter``,
    ``autoretry_for``) read as the relay's retry policy; ``task_annotations``
    for ``outbox_relay.deliver`` override them.
    """
    existing = getattr(app, "outbox_relay", None)
    if isinstance(existing, RelayRuntime):
        return existing
    rt = RelayRuntime(app, settings, task_options)
    app.outbox_relay = rt
    register_tasks(app, rt)
    # Counters and histograms for Prometheus (see outbox_relay.metrics for
    # PROMETHEUS_MULTIPROC_DIR under the prefork pool).
    rt.observers.append(MetricsObserver())

    if beat:

        def add_beat_entry(sender: Any = None, **kwargs: Any) -> None:
            s = rt.settings
            schedule = dict(app.conf.beat_schedule or {})
            schedule.setdefault(
                BEAT_ENTRY,
                {
                    "task": CLAIM,
                    "schedule": s.claim_interval_seconds,
                    # A tick nobody picked up within one interval is replaced
                    # by the next one; don't let them pile up in the broker.
                    "options": {"queue": s.queue, "expires": s.claim_interval_seconds},
                },
            )
            schedule.setdefault(
                PURGE_ENTRY,
                {
                    "task": PURGE,
                    "schedule": PURGE_EVERY_SECONDS,
                    "options": {"queue": s.queue, "expires": PURGE_EVERY_SECONDS},
                },
            )
            app.conf.beat_schedule = schedule

        if app.configured:
            add_beat_entry()
        else:
            app.on_after_configure.connect(add_beat_entry, weak=False)

    def after_setup(sender: Any = None, instance: Any = None, **kwargs: Any) -> None:
        # Make every worker of this app consume the outbox queue too.
        if instance is not None and instance.app is app and consume:
            instance.app.amqp.queues.select_add(rt.settings.queue)

    def process_init(**kwargs: Any) -> None:
        rt.reset()  # a forked child must not reuse the parent's sockets

    def process_shutdown(**kwargs: Any) -> None:
        rt.close()

    signals.celeryd_after_setup.connect(after_setup, weak=False)
    signals.worker_process_init.connect(process_init, weak=False)
    signals.worker_process_shutdown.connect(process_shutdown, weak=False)

    from .listener import RelayWorkerStep

    app.steps["worker"].add(RelayWorkerStep)
    return rt
