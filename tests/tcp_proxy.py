"""A TCP proxy that can go silent: what a client sees when a host vanishes.

``silence()`` makes every connection open at that moment swallow bytes in
both directions, with no FIN and no RST (the kernel still acknowledges them,
so only a client-side deadline notices), while new connections pass. The
target is a TCP address or a Unix socket (the embedded PostgreSQL's).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class SilencingProxy:
    def __init__(self, dsn: str | None = None, *, target: tuple[str, int] | None = None) -> None:
        """In front of a PostgreSQL ``dsn`` (``.dsn`` is the proxied one) or a TCP ``target``."""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.dsn = ""
        if dsn is not None:
            params = conninfo_to_dict(dsn)
            host = str(params.get("host") or "127.0.0.1")
            port = int(params.get("port") or 5432)
            unix = host.startswith("/")
            self._target: Any = os.path.join(host, f".s.PGSQL.{port}") if unix else (host, port)
            self.dsn = make_conninfo(dsn, host="127.0.0.1", port=self.port)
        else:
            assert target is not None
            self._target = target
        self._lock = threading.Lock()
        self._silenced: set[int] = set()
        self._generation = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

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
            upstream = self._connect()
            with self._lock:
                generation = self._generation
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
