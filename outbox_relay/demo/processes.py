"""Real ``celery worker``/``beat`` (and Flower) processes for the demo.

Each runs in a session of its own: a Ctrl-C in the terminal reaches only the
demo, which then stops them in order (beat, then workers, then the servers
they use) instead of every process dying at once and the survivors logging
connection errors. Stopping signals the whole process group, so the prefork
pool's children go too. Output goes to log files in the demo's folder; the
tail is shown when a process fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .services import DemoError

__all__ = ["CeleryProcess", "delete_queue", "start_celery"]

APP = "outbox_relay.app"


class CeleryProcess:
    """One started process and its log file."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def wait_for(self, marker: str, *, timeout: float) -> None:
        """Wait until ``marker`` appears in the log; fail with the log if it exits first."""
        deadline = time.monotonic() + timeout
        while marker not in self.text():
            if not self.alive():
                raise DemoError(
                    f"celery {self.name} exited with code {self.popen.returncode}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise DemoError(f"celery {self.name} not ready after {timeout:g}s:\n{self.tail()}")
            time.sleep(0.1)

    def _signal_group(self, sig: int) -> bool:
        """Signal the process group; False when no process of it is left."""
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:  # pragma: no cover - the group id was reused
            return False
        return True

    def stop(self, *, timeout: float = 10.0, hurry: Callable[[], bool] = lambda: False) -> bool:
        """SIGTERM (a worker's warm shutdown finishes its running tasks), then SIGKILL.

        Returns once no process of the group is left, pool children included:
        True when the process exited on SIGTERM, False when it had to be killed.
        """
        graceful = True
        if self._signal_group(signal.SIGTERM):
            deadline = time.monotonic() + timeout
            while self.alive() and time.monotonic() < deadline and not hurry():
                time.sleep(0.05)
            graceful = not self.alive()
        # Whatever is left of the group (the main process, or pool children
        # orphaned by it) is killed; then wait until the group is empty.
        deadline = time.monotonic() + 5.0
        while self._signal_group(signal.SIGKILL) and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(0.05)
            time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        return graceful


def start_celery(
    name: str, args: list[str], *, env: Mapping[str, str], folder: Path
) -> CeleryProcess:
    """``python -m celery -A outbox_relay.app ARGS`` with ``env``, run in ``folder``.

    The interpreter running the demo runs Celery too, so the worker imports
    the same outbox_relay. The working directory is the demo's own folder,
    so a ``celeryconfig.py`` where the demo was started is not picked up.
    """
    log = folder / f"{name}.log"
    with log.open("wb") as handle:
        try:
            popen = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
                [sys.executable, "-m", "celery", "-A", APP, *args],
                cwd=str(folder),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise DemoError(f"cannot start celery {name}: {exc}") from exc
    return CeleryProcess(name, popen, log)


def delete_queue(broker: str, queue: str) -> None:
    """Delete the demo's queue, the tasks left in it, and its exchange.

    Declared first so that kombu knows the binding (a fresh Redis channel
    deletes only bindings it has seen); Celery names the exchange like the queue.
    """
    import kombu.connection
    import kombu.entity

    # kombu's annotations are partial; handled as Any here.
    connection: Any = kombu.connection.Connection
    exchange_class: Any = kombu.entity.Exchange
    queue_class: Any = kombu.entity.Queue
    declared = queue_class(queue, exchange_class(queue, type="direct"), routing_key=queue)
    try:
        with connection(broker, connect_timeout=5) as conn:
            bound = declared(conn.default_channel)
            bound.declare()
            bound.delete()
            bound.exchange.delete()
    except Exception:  # noqa: S110 - leftovers on a broker are untidy, not harmful
        pass
