"""The standalone relay app: ``celery -A outbox_relay.app worker`` / ``beat``.

Configured from the environment (``CELERY_BROKER_URL``, ``OUTBOX_DSN``,
``OUTBOX_PUBLISHER`` and the other ``OUTBOX_*`` settings), and from a
``celeryconfig`` module when one is importable (set ``CELERY_CONFIG_MODULE`` to
use another name).
"""

from __future__ import annotations

import os

from celery import Celery

from .celery import install, names

__all__ = ["app"]

app = Celery(names.STANDALONE_APP)
app.conf.update(
    # JSON only: task arguments are ids and versions, never pickled objects.
    task_serializer="json",
    accept_content=["json"],
    result_serializer="json",
    task_ignore_result=True,
    task_default_queue=os.environ.get("OUTBOX_QUEUE", "outbox"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)
app.config_from_object(os.environ.get("CELERY_CONFIG_MODULE", "celeryconfig"), silent=True)
# The broker: CELERY_BROKER_URL (Celery reads it before any setting), else a
# celeryconfig's broker_url, else a local Redis. Set only when neither gave
# one: a value set with conf.update() above would win over the celeryconfig,
# whose broker_url was then ignored without a word (the worker went to
# redis://127.0.0.1:6379/0, perhaps another relay's broker).
if not app.conf.broker_url:
    app.conf.broker_url = "redis://127.0.0.1:6379/0"

# A broker that vanishes or fails over leaves half-open sockets: without a
# bound on every socket operation, a worker (or the claim task's fan-out)
# waits on one forever. Bounds for Redis; AMQP has heartbeats (Celery's
# broker_heartbeat, on by default). A celeryconfig's own values win.
#
# ack_emulation off: this app runs only the relay's tasks, and those are
# hints (the outbox table is the truth). kombu's emulated acks keep every
# task message in an ``unacked`` hash until it is acknowledged, two Redis
# transactions per task in the worker's main process (a third of its time
# per message); they would bring back the prefetched tasks of a SIGKILLed
# worker only after visibility_timeout (an hour), long after the rows'
# leases lapsed and the rescuer freed them. A warm shutdown still puts
# prefetched tasks back. Not for an app that runs the user's own tasks
# (outbox_relay.install(app) leaves the transport alone).
if str(app.conf.broker_url).startswith(("redis", "rediss")):
    app.conf.broker_transport_options = {
        "socket_timeout": 10,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "health_check_interval": 10,
        "ack_emulation": False,
        **(app.conf.broker_transport_options or {}),
    }
# Celery looks up the time zone for every task message that carries an
# expiry, as every relay task does (the worker's main process, per message).
# With none configured, that lookup walks every configuration source for
# ``timezone`` and then Django's ``TIME_ZONE``: 31 us a message here against
# 5 with one set, about a twentieth of the main process's time per message
# in per-message delivery. UTC is what Celery uses then anyway; a
# celeryconfig's own ``timezone`` (or ``enable_utc = False``) wins.
if app.conf.timezone is None and app.conf.enable_utc:
    app.conf.timezone = "UTC"

install(app)
