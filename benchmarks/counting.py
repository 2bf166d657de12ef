"""Database statements (round trips), counted on the driver side.

``pg_stat_statements`` needs ``shared_preload_libraries`` and a server
restart, which a shared PostgreSQL cannot have; the server's per-database
transaction counter (``pg_stat_database.xact_commit``) is read beside these
counts by ``run.py``. Here every process that talks to the bench database
(Celery pool children, the worker's main process, the loop processes)
counts what its psycopg connections send:

* statements: ``Cursor.execute``/``executemany`` calls plus transaction
  commands (BEGIN, COMMIT, ROLLBACK, SAVEPOINT, RELEASE). The relay uses no
  pipeline mode, so each is one round trip to the server and back.
  (``Connection.wait`` calls would over-count: psycopg also calls it for a
  ``commit()`` with nothing to commit, which never reaches the network.)

Each process writes its totals to ``<BENCH_COUNT_DIR>/<pid>.json`` a few
times a second; ``totals()`` sums the folder. Patching psycopg's methods is
for measuring only: nothing in ``outbox_relay`` depends on it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import _connection_base

__all__ = ["install", "totals"]

_counts = {"statements": 0}
_lock = threading.Lock()
_installed_pid: int | None = None


def _bump(key: str) -> None:
    with _lock:
        _counts[key] += 1


def _patch() -> None:
    execute = psycopg.Cursor.execute
    executemany = psycopg.Cursor.executemany
    exec_command = _connection_base.BaseConnection._exec_command

    def counted_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        _bump("statements")
        return execute(self, *args, **kwargs)

    def counted_executemany(self: Any, *args: Any, **kwargs: Any) -> Any:
        _bump("statements")
        return executemany(self, *args, **kwargs)

    def counted_command(self: Any, *args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        _bump("statements")
        return (yield from exec_command(self, *args, **kwargs))

    psycopg.Cursor.execute = counted_execute  # type: ignore[method-assign]
    psycopg.Cursor.executemany = counted_executemany  # type: ignore[method-assign]
    _connection_base.BaseConnection._exec_command = counted_command  # type: ignore[method-assign]


def _writer(folder: Path, pid: int) -> Callable[[], None]:
    path = folder / f"{pid}.json"

    def run() -> None:
        while True:
            with _lock:
                text = json.dumps(_counts)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)
            time.sleep(0.2)

    return run


def install(folder: str | None = None) -> None:
    """Count in this process (again after a fork: the child starts from zero)."""
    global _installed_pid
    folder = folder or os.environ.get("BENCH_COUNT_DIR")
    if not folder:
        return
    pid = os.getpid()
    if _installed_pid is None:
        _patch()
    elif _installed_pid == pid:
        return
    with _lock:
        _counts.update(statements=0)
    _installed_pid = pid
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_writer(path, pid), name="bench-counter", daemon=True).start()


def totals(folder: Path) -> dict[str, int]:
    """The sums over every process that wrote into ``folder``."""
    found = {"statements": 0}
    for path in folder.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now: the next read has it
        for key in found:
            found[key] += int(data.get(key, 0))
    return found
