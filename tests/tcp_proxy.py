"""A TCP proxy that can go silent or go down: what a client sees when a host
vanishes or a service stops.

``silence()`` makes every connection open at that moment swallow bytes in
both directions, with no FIN and no RST (the kernel still acknowledges them,
so only a client-side deadline notices), while new connections pass.
``cut()`` resets every open connection and refuses new ones (accepted and
reset at once) until ``restore()``: a service that is down. The target is a
TCP address or a Unix socket (the embedded PostgreSQL's).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class SilencingProxy:
    def __init__(
        self,
        dsn: str | None = None,
        *,
        target: tuple[str, int] | None = None,
        listen: str = "127.0.0.1",
    ) -> None:
        """In front of a PostgreSQL ``dsn`` (``.dsn`` is the proxied one) or a TCP
        ``target``, listening on ``listen`` (another address: for other network
        namespaces)."""
        self._listener = socket.create_server((listen, 0))
        self.port = self._listener.getsockname()[1]
        self.dsn = ""
        if dsn is not None:
            params = conninfo_to_dict(dsn)
            host = str(params.get("host") or "127.0.0.1")
            port = int(params.get("port") or 5432)
            unix = host.startswith("/")
            self._target: Any = os.path.join(host, f".s.PGSQL.{port}") if unix else (host, port)
            self.dsn = make_conninfo(dsn, host=listen, port=self.port)
        else:
            assert target is not None
            self._target = target
        self._lock = threading.Lock()
        self._silenced: set[int] = set()
        self._generation = 0
        self._stop = threading.Event()
        self._down = False
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """Reset every open connection; refuse new ones until ``restore()``."""
        with self._lock:
            self._down = True
            victims, self._open = list(self._open), set()
        for sock in victims:
            _reset(sock)

    def restore(self) -> None:
        with self._lock:
            self._down = False

    def silence(self) -> None:
        """From now on, connections open at this moment forward nothing."""
        with self._lock:
            self._silenced.add(self._generation)
            self._generation += 1

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _connect(self) -> socket.socket:
        if isinstance(self._target, str):
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self._target)
            return upstream
        return socket.create_connection(self._target)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                down = self._down
            if down:
                _reset(client)
                continue
            try:
                upstream = self._connect()
            except OSError:
                _reset(client)
                continue
            with self._lock:
                generation = self._generation
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b, generation), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, generation: int) -> None:
        while not self._stop.is_set():
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return
            with self._lock:
                silent = generation in self._silenced
            if silent:
                continue  # swallowed: read (and so acknowledged), never forwarded
            try:
                sink.sendall(data)
            except OSError:
                return


def _reset(sock: socket.socket) -> None:
    """Drop a connection as a stopping service does.

    Linger 0 makes the close an RST; the shutdown first wakes the pump
    thread blocked in ``recv`` on it (a bare close from another thread
    would not), so the socket is really released.
    """
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
