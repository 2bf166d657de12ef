"""Work-arounds for defects in Celery's stack that stop a relay worker.

Each one is narrow (it changes behaviour only where the original would
crash), idempotent, and says which defect it answers and how it was found,
so that it can be dropped once upstream fixes the defect.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["harden_redis_transport", "ignore_stale_soft_time_limits", "reuse_redis_clients"]

log = logging.getLogger("outbox_relay.celery")

_MARK = "_outbox_relay_hardened"
_REUSE_MARK = "_outbox_relay_reuses_clients"
_CLIENT = "_outbox_relay_client"


def harden_redis_transport() -> bool:
    """Keep a Redis broker outage from killing the worker ("Unrecoverable error").

    Found by the fault suite (tests/faults/test_broker.py, Redis SIGKILLed
    while the worker is busy) and reproduced with a plain Celery app (Celery
    and kombu 5.7): when the broker connection drops while the consumer's
    channel waits in BRPOP, Celery's recovery first ``collect()``s the
    connection. The channel's ``close()`` there fails reading its BRPOP reply
    (a connection error, swallowed) *before* it marks itself closed, and
    ``collect()`` then detaches the transport from its connection. Celery next
    calls ``connection.close()``, which closes the channel again; this time it
    gets as far as restoring its unacknowledged messages, which needs a new
    Redis client, whose parameters it reads from the detached transport:
    ``AttributeError: 'NoneType' object has no attribute 'hostname'``. That is
    not a connection error, so it escapes Celery's ``ignore_errors`` and the
    worker exits; the only relay worker gone, the relay stops for good unless
    something restarts it.

    Here, asking a detached transport for connection parameters raises Redis's
    ``ConnectionError`` instead: Celery treats it as the connection error it
    is and reconnects as usual. The unacknowledged messages then stay in
    kombu's ``unacked`` hash (restored after ``visibility_timeout``) or, if the
    broker lost them, their outbox rows' leases lapse and the relay sends them
    again. Returns whether the transport was patched now.
    """
    try:
        import redis.exceptions
        from kombu.transport import redis as transport
    except ImportError:  # pragma: no cover - the redis extra is not installed
        return False
    original: Any = getattr(transport.Channel, "_connparams", None)
    if original is None or getattr(original, _MARK, False):
        return False

    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        if self.connection.client is None:
            # The class kombu counts among the Redis transport's connection errors.
            raise redis.exceptions.ConnectionError(
                "the broker connection was closed while this channel was in use"
            )
        return original(self, asynchronous=asynchronous)

    setattr(_connparams, _MARK, True)
    _connparams.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(transport.Channel, "_connparams", _connparams)  # noqa: B010 - a patch, on purpose
    log.debug("kombu's Redis transport hardened against close after collect")
    return True


def reuse_redis_clients() -> bool:
    """One ``redis.Redis`` per channel and pool instead of one per command.

    kombu's Redis channel builds a new ``redis.Redis`` over its connection
    pool every time it needs the synchronous client: to record each message
    a worker takes as unacknowledged, to acknowledge it, and to publish a
    message outside a batch. That client holds no connection of its own (it
    borrows one from the pool per command), but redis-py's constructor
    builds its response-callback tables each time: about 120 us here,
    measured as a sixth of a relay worker's main process per task
    (docs/benchmarks-changes.md item 7). Such a client is safe to share, so the channel
    keeps the one it built for as long as its pool is the same. A defect of
    speed only: behaviour does not change (tests/test_compat.py). Returns
    whether the transport was patched now.
    """
    try:
        from kombu.transport import redis as transport
    except ImportError:  # pragma: no cover - the redis extra is not installed
        return False
    original: Any = getattr(transport.Channel, "_create_client", None)
    if original is None or getattr(original, _REUSE_MARK, False):
        return False

    def _create_client(self: Any, asynchronous: bool = False) -> Any:
        if asynchronous:
            return original(self, asynchronous=True)
        pool = self.pool
        client = self.__dict__.get(_CLIENT)
        if client is None or client.connection_pool is not pool:
            client = original(self, asynchronous=False)
            self.__dict__[_CLIENT] = client
        return client

    setattr(_create_client, _REUSE_MARK, True)
    _create_client.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(transport.Channel, "_create_client", _create_client)  # noqa: B010 - a patch, on purpose
    return True


_STALE_MARK = "_outbox_relay_task_only"


def ignore_stale_soft_time_limits() -> bool:
    """A soft time limit raises in a pool process only while a task runs.

    Found by the fault suite (tests/faults/test_network.py, a relay host's
    link cut for 20 s, about 1 run in 10): the worker's main process schedules
    a task's soft time limit on its event loop and signals the pool process
    (SIGUSR1) when it fires. With the broker cut off, that loop was blocked
    for the whole cut, so the limit of a delivery that had ended (with an
    error) 16 s before, its result still unread in the pipe, fired after the
    link came back, at a pool process that was by then between tasks, in the
    pool's own pipe reads and writes (the ACK of its next task, most likely).
    billiard's handler raises ``SoftTimeLimitExceeded`` wherever it lands: a
    write stopped half way, the main process read ``UnpicklingError: invalid
    load key`` and exited ("Unrecoverable error"), and the host delivered
    nothing more. On an idle pool process the same signal ends the process
    (reproduced with a plain Celery app: SIGUSR1 to an idle child logs "Pool
    process ... error: SoftTimeLimitExceeded").

    Here billiard's handler (a module global it installs after each fork) is
    wrapped: while Celery traces a task (its task stack holds one, from
    before ``task_prerun`` to after ``task_postrun``) it raises as before;
    elsewhere, in the pool's own reads and writes, the signal is ignored (its
    task has ended). Looked up when a signal arrives, so tasks pay nothing.
    Returns whether billiard was patched now.
    """
    try:
        from billiard import pool  # type: ignore[import-untyped]
        from celery import current_task  # public: what task.request reads through
    except ImportError:  # pragma: no cover - Celery always brings billiard
        return False
    original: Any = getattr(pool, "soft_timeout_sighandler", None)
    if original is None or getattr(original, _STALE_MARK, False):
        return False

    def soft_timeout_sighandler(signum: int, frame: Any) -> None:
        # No logging here: a signal handler that takes the logging lock the
        # interrupted code holds would deadlock.
        # The proxy is false when Celery's task stack is empty (a Task is true).
        if current_task:
            original(signum, frame)

    setattr(soft_timeout_sighandler, _STALE_MARK, True)
    soft_timeout_sighandler.__wrapped__ = original  # type: ignore[attr-defined]
    pool.soft_timeout_sighandler = soft_timeout_sighandler
    return True
