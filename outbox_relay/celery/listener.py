"""Wake the relay when rows arrive: LISTEN on the outbox channel, debounced.

``enqueue`` sends a NOTIFY that PostgreSQL delivers at commit. A thread in
the worker's main process listens and, on a notification, sends one
``outbox_relay.claim`` task; notifications that arrive within the debounce
window are folded into one more claim at its end. Beat's polling stays the
safety net: a lost notification, a dropped LISTEN connection or a relay that
was down only delays delivery until the next tick. The claim runs in a pool
process; this thread never touches the outbox itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from celery import bootsteps

from .. import store
from .._redact import connect_error, mask_dsn
from .._throttle import Throttle
from ..config import Settings
from ..db import bounded_connection_kwargs
from ..errors import ConfigError
from ..table import OutboxTable
from . import names
from .compat import harden_redis_transport, ignore_stale_soft_time_limits, reuse_redis_clients
from .fanout import chunk_size_for
from .identity import origin_headers
from .tasks import hint_args

__all__ = ["NotifyListener", "RelayWorkerStep", "chunk_cut", "relays_here"]

log = logging.getLogger("outbox_relay.celery")
# While claim tasks cannot be sent (the broker is away), at most one line this often.
UNSENT_LOG_SECONDS = 60.0


class NotifyListener:
    """A daemon thread that turns NOTIFYs into claim tasks."""

    def __init__(
        self,
        dsn: str,
        table: OutboxTable,
        trigger: Callable[[], None],
        *,
        debounce: float = 0.05,
        timeout: float = 10.0,
    ) -> None:
        self.connect_kwargs = bounded_connection_kwargs(timeout)
        self.dsn = dsn
        self.table = table
        self.trigger = trigger
        self.debounce = debounce
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.triggered = 0
        # Failed sends: a broker outage logged one traceback per committed
        # row (a new user's walkthrough).
        self._unsent = Throttle(UNSENT_LOG_SECONDS)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="outbox-listen", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _fire(self, after: str = "NOTIFY") -> None:
        """Send a claim; ``after``: what prompted it, for the log."""
        try:
            self.trigger()
            self.triggered += 1
        except Exception:
            due = self._unsent.hit()
            if due is not None:
                log.warning(
                    "could not send a claim task after %s (%d since the last such line; "
                    "beat's tick claims meanwhile)",
                    after,
                    due.count,
                    exc_info=due.first,
                )
            return
        if self._unsent.clear():
            log.info("claim tasks after NOTIFY are sent again")

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                # Keepalives: a LISTEN connection is idle by nature, and a
                # dead peer must not leave it waiting forever (beat's polling
                # covers the gap until it reconnects).
                with psycopg.connect(self.dsn, autocommit=True, **self.connect_kwargs) as conn:
                    store.listen(conn, table=self.table)
                    backoff = 0.5
                    # Rows may have arrived while we were not listening.
                    self._fire("LISTEN began (rows may have come before it)")
                    self._listen(conn)
            except Exception as exc:
                if self._stop.is_set():
                    return
                # Why, and to where (a wrong OUTBOX_LISTEN_DSN said nothing
                # more than this line, every 30 s for good): as the start-up
                # check says it, password masked and libpq's message scrubbed.
                log.warning(
                    "LISTEN connection to %s failed (%s); reconnecting in %.1fs",
                    mask_dsn(self.dsn),
                    connect_error(exc, self.dsn),
                    backoff,
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _listen(self, conn: psycopg.Connection[Any]) -> None:
        last = 0.0
        while not self._stop.is_set():
            got = False
            for _ in conn.notifies(timeout=1.0, stop_after=1):
                got = True
            if not got:
                continue
            wait = last + self.debounce - time.monotonic()
            if wait > 0:
                # A claim went out moments ago; fold this burst into one more.
                self._stop.wait(wait)
            # Swallow what queued up meanwhile: one claim drains all of it.
            for _ in conn.notifies(timeout=0.0):
                pass
            last = time.monotonic()
            self._fire()


def relays_here(worker: Any, inst: Any) -> bool:
    """Whether this worker consumes the relay's queue (so it must check and listen).

    Without -Q it does (install added the queue). With -Q, only when the
    operator listed the queue the relay's tasks are routed to. A relay
    configuration that cannot be read stops a worker that consumes the queue
    it names as written (``-Q outbox`` with ``OUTBOX_LEASE_SECONDS=abc``
    would take every claim and fail it), and the standalone app's workers,
    which run nothing else; a worker started for other queues only warns.
    """
    queues = worker.app.amqp.queues
    selected = queues.consume_from
    consumed = set(selected) if selected is not None else set(queues)
    try:
        queue = inst.relay_queue()
    except ConfigError as exc:
        standalone = worker.app.main == names.STANDALONE_APP
        if inst.explicit_queues and not standalone and inst.queue_as_written() not in consumed:
            log.warning("outbox relay settings are invalid (%s); this worker ignores them", exc)
            return False
        raise
    if queue in consumed:
        return True
    # A worker for the team's own queues is a normal deployment, but one
    # started so by mistake delivered nothing and said nothing: rows waited
    # while beat's ticks piled up in the queue.
    log.info(
        "outbox-relay: this worker does not consume the relay's queue %r (it consumes %s), "
        "so it delivers no outbox messages; another worker must (-Q %s, or no -Q)",
        queue,
        ", ".join(sorted(consumed)) or "nothing",
        queue,
    )
    return False


def chunk_cut(settings: Settings, processes: int) -> str | None:
    """What a worker says at start when its delivery tasks will carry fewer
    rows than OUTBOX_CHUNK_SIZE (fanout.chunk_size_for): documented, but a
    user tuning chunk sizes saw tasks of 300 and 200 rows and no word why."""
    chunk = chunk_size_for(settings.chunk_size, settings.max_in_flight, processes)
    if chunk >= settings.chunk_size:
        return None
    return (
        f"delivery tasks carry at most {chunk} rows here, not OUTBOX_CHUNK_SIZE "
        f"{settings.chunk_size}: OUTBOX_MAX_IN_FLIGHT {settings.max_in_flight} shared by "
        f"{processes} pool processes (raise it to keep whole chunks)"
    )


class RelayWorkerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Checks the relay at worker start and runs the NOTIFY listener.

    Only on workers that consume the relay's queue: a worker started with
    ``-Q billing`` opens no connection for the relay and checks nothing.
    """

    label = "outbox-relay"
    # Start after the pool has forked its children.
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.listener: NotifyListener | None = None
        self.connection: Any = None
        self.inst = getattr(worker.app, "outbox_relay", None)
        # Before the consumer connects: a Redis outage must not end this
        # worker (see compat.harden_redis_transport).
        harden_redis_transport()
        # And one Redis client per channel, not one per acknowledgement.
        reuse_redis_clients()
        # Before the pool forks: a late soft time limit must not break a pool
        # process between tasks (see compat.ignore_stale_soft_time_limits).
        ignore_stale_soft_time_limits()

    def start(self, worker: Any) -> None:
        inst = self.inst
        if inst is None:
            return
        # Fail at start, with a message naming the setting, not at the first
        # task; one line, not Celery's "Unrecoverable error" traceback (the
        # worker's own start() turns SystemExit into its exit code).
        try:
            if not relays_here(worker, inst):
                return
            inst.check_start()
        except ConfigError as exc:
            log.critical("outbox-relay cannot start: %s", exc)
            raise SystemExit(1) from None
        s = inst.settings
        cut = chunk_cut(s, inst.concurrency)
        if cut:
            log.info("outbox-relay: %s", cut)
        if not s.listen:
            return
        app = worker.app
        claim = app.tasks[names.CLAIM]
        # A broker connection of the listener's own. Sharing the app's pool
        # with a thread of the main process is unsafe under prefork: a child
        # forked while the thread holds that pool's lock deadlocks when it
        # resets the pool after fork.
        self.connection = app.connection_for_write()
        producer = app.amqp.Producer(self.connection)

        # It waits for a claim in progress (contend): a NOTIFY may announce
        # rows newer than that claim's snapshot.
        args = hint_args(s, last_round=True, contend=True)

        def trigger() -> None:
            # "Claim if the cap leaves room (tasks.hint_args), else stop": a
            # full cap belongs to a drain that claims again as its deliveries
            # finish. Without this, a steady stream of NOTIFYs sent a claim
            # every debounce window into a full cap, each one a held-back
            # chain of its own.
            claim.apply_async(
                args, serializer="json", producer=producer, headers=origin_headers(inst.identity())
            )

        self.listener = NotifyListener(
            s.listen_connection_dsn(), s.outbox_table, trigger, timeout=s.database_timeout
        )
        self.listener.start()

    def stop(self, worker: Any) -> None:
        if self.listener is not None:
            self.listener.stop()
            self.listener = None
        if self.connection is not None:
            self.connection.release()
            self.connection = None
