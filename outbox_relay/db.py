"""How services reach PostgreSQL: a ``Database`` runs a function with a connection.

``DirectDatabase`` wraps one connection the caller owns (tests, the plain
loop, a user's own script). ``PoolDatabase`` is a per-process pool that
bounds every call in time and retries an idempotent call once on a broken
connection.

Every call has a bound, because a database host that vanishes or fails over
leaves half-open sockets: no FIN, no RST, and a client that waits for an
answer forever. Three layers: TCP keepalives and ``tcp_user_timeout`` (the
kernel gives up on a peer that stopped acknowledging), a server-side
``statement_timeout``, and a client-side watchdog that severs a connection
whose call outlived its deadline (the only bound when something between us
and the server still acknowledges bytes but forwards none, such as a proxy
or a load balancer whose backend went away).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool

from .store._base import configure_relay_session, relax_commit

__all__ = [
    "RECONNECT_SECONDS",
    "UNPREPARED",
    "Database",
    "DirectDatabase",
    "PoolDatabase",
    "Watchdog",
    "as_database",
    "bounded_connection_kwargs",
]

log = logging.getLogger("outbox_relay.db")
T = TypeVar("T")


class Database(Protocol):
    def run(self, fn: Callable[[psycopg.Connection[Any]], T], *, retry: bool = True) -> T:
        """Call ``fn`` with a connection. ``retry=False`` for a call that must not
        repeat after its commit may have happened (a claim)."""
        ...


class DirectDatabase:
    """A ``Database`` over one connection the caller owns; never retries."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def run(self, fn: Callable[[psycopg.Connection[Any]], T], *, retry: bool = True) -> T:
        return fn(self.conn)


def as_database(db: psycopg.Connection[Any] | Database) -> Database:
    return DirectDatabase(db) if isinstance(db, psycopg.Connection) else db


def bounded_connection_kwargs(timeout: float) -> dict[str, Any]:
    """libpq parameters that bound connecting and a silent peer by ``timeout``."""
    return {
        "connect_timeout": max(2, int(timeout)),
        "keepalives": 1,
        "keepalives_idle": max(1, int(timeout / 2)),
        "keepalives_interval": 1,
        "keepalives_count": 3,
        # Data sent and not acknowledged for this long: the peer is gone.
        "tcp_user_timeout": int(timeout * 1000),
    }


class Watchdog:
    """Severs connections whose call outlived its deadline.

    One daemon thread per process; a call registers its connection for the
    call's duration (a dict entry, no thread per call). Severing shuts the
    socket down, so the waiting call fails at once with ``OperationalError``
    and the pool discards the broken connection.
    """

    def __init__(self, *, tick: float = 0.25) -> None:
        self._tick = tick
        self._lock = threading.Lock()
        self._deadlines: dict[int, tuple[float, psycopg.Connection[Any]]] = {}
        self._thread: threading.Thread | None = None
        self.severed = 0

    @contextlib.contextmanager
    def watch(self, conn: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
        key = id(conn)
        with self._lock:
            self._deadlines[key] = (time.monotonic() + seconds, conn)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="outbox-db-watchdog", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._deadlines.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(self._tick)
            now = time.monotonic()
            with self._lock:
                overdue = [c for d, c in self._deadlines.values() if d <= now]
                for conn in overdue:
                    self._deadlines.pop(id(conn), None)
            for conn in overdue:
                self._sever(conn)

    def _sever(self, conn: psycopg.Connection[Any]) -> None:
        try:
            fd = conn.pgconn.socket
            # A duplicate of the descriptor: shutdown() acts on the socket
            # itself, and closing our duplicate leaves psycopg's fd alone.
            with socket.socket(fileno=socket.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            self.severed += 1
            log.warning("a database call outlived its deadline; its connection was cut")
        except (OSError, psycopg.Error):
            pass  # already closed: the call is failing anyway


# psycopg's connection keyword that keeps every statement unprepared on the
# server. psycopg prepares a query it has run 5 times (prepare_threshold);
# through a pooler in transaction mode the next run may reach another server
# session, which does not have it ("prepared statement _pg3_1 does not
# exist"), already has one of that name ("already exists") or has another
# client's statement of that name ("bind message supplies 2 parameters, but
# prepared statement _pg3_8 requires 10"). Also for connections that run a
# few statements now and then (the CLI, the metrics exporter), whose
# statements prepared would save nothing worth that risk.
UNPREPARED: dict[str, Any] = {"prepare_threshold": None}


# How long the pool keeps one series of reconnection attempts going (above):
# after a database comes back, the relay's next claim finds a connection
# within a few seconds, whatever the length of the outage.
RECONNECT_SECONDS = 8.0


def _names_application(dsn: str) -> bool:
    """Whether ``dsn`` sets application_name (an unparsable one fails where it
    is connected, with the redacted message; not here, with libpq's)."""
    try:
        return "application_name" in conninfo_to_dict(dsn)
    except psycopg.Error:
        return True


class PoolDatabase:
    """A per-process connection pool: bounded calls, one retry when idempotent.

    A terminated backend, a restarted server or a failover surfaces as
    ``OperationalError`` on the next statement. Reads and fenced writes are
    safe to repeat, so one retry on a fresh connection turns most of those
    into a blip. A claim is not: if the connection broke after its COMMIT
    reached the server, a retry would lease a second batch while the first
    one's rows sit leased with no task to deliver them (until the rescuer
    frees them a lease later). Such calls pass ``retry=False``.

    ``timeout`` bounds every call: waiting for a pooled connection,
    connecting, each statement on the server, and the whole call on the
    client (see the module's docstring).
    """

    def __init__(
        self,
        dsn: str,
        *,
        size: int,
        name: str,
        synchronous_finalize: bool = True,
        timeout: float = 10.0,
        max_size: int | None = None,
        session_timeouts: bool = True,
        transaction_pooling: bool = False,
    ) -> None:
        self.timeout = timeout

        def configure(conn: psycopg.Connection[Any]) -> None:
            if not session_timeouts:
                return  # the user bounds each session (durable task runs)
            if transaction_pooling:
                # A session setting would stay with whichever server session
                # ran it, for the pooler's other clients (Settings.
                # transaction_pooling): the server's and the role's own
                # settings apply instead, and the watchdog bounds every call.
                return
            configure_relay_session(conn, timeout)
            if not synchronous_finalize:
                # Finalizes stop waiting for the WAL flush; claims still
                # commit durably (store.claim sets it back for its transaction).
                relax_commit(conn)

        self.watchdog = Watchdog()
        kwargs: dict[str, Any] = {"autocommit": True, **bounded_connection_kwargs(timeout)}
        if transaction_pooling:
            kwargs.update(UNPREPARED)
        if not _names_application(dsn):
            # Whose sessions these are in pg_stat_activity (the pool's name
            # holds the pid), unless the DSN names them itself.
            kwargs["application_name"] = name[:63]
        self.pool = ConnectionPool(
            dsn,
            min_size=1,
            max_size=max(1, size if max_size is None else max_size),
            kwargs=kwargs,
            configure=configure,
            name=name,
            timeout=timeout,
            # psycopg_pool retries a lost connection 1 s, 2 s, 4 s ... apart
            # for this long, then gives up and starts again, from 1 s, at the
            # next request. Its default of five minutes let the gaps grow
            # past the outage: 29.6 s without delivery for a 20 s outage (a
            # walkthrough), up to about as long again as any longer one.
            reconnect_timeout=RECONNECT_SECONDS,
            open=True,
        )

    def run(self, fn: Callable[[psycopg.Connection[Any]], T], *, retry: bool = True) -> T:
        attempts = 2 if retry else 1
        for attempt in range(1, attempts + 1):
            with self.pool.connection() as conn:
                try:
                    # A little past the server's statement_timeout, so a
                    # healthy but slow statement is cancelled by the server
                    # (connection kept) before the watchdog cuts it.
                    with self.watchdog.watch(conn, self.timeout * 1.5 + 1.0):
                        return fn(conn)
                except psycopg.OperationalError:
                    if attempt == attempts or not conn.broken:
                        raise
                    log.warning("database connection lost; retrying on a new connection")
        raise AssertionError("unreachable")  # pragma: no cover

    def connection(self) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
        """A pooled connection held across more than one call (a durable task's
        run, its body included). The watchdog does not watch it (a body may
        take long); the caller bounds the session on the server instead
        (``store.bound_session``), and TCP keepalives bound a silent peer."""
        return self.pool.connection(timeout=self.timeout)

    def close(self) -> None:
        self.pool.close()
