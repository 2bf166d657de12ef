"""Network namespaces for the fault suite: relay hosts with a link that can be cut.

``Host`` is a network namespace joined to this one by a veth pair
(``10.77.N.1`` on our side, ``10.77.N.2`` inside, N free on this machine). Processes started in it
(``ip netns exec``) reach the machine's services only through proxies that
listen on ``10.77.N.1``. ``cut()`` takes our end of the link down: packets
to and from the host vanish, with no FIN and no RST, as when a switch port
or a cable fails; ``restore()`` brings it back. Needs root and ``ip``.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"orp{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _free_subnet() -> tuple[int, int]:
    """A ``10.77.N.0/24`` no other suite on this machine uses, and a file
    descriptor holding it: a lock per N (two suites at once would otherwise
    both route 10.77.1.0/24, each to its own namespace), freed when the
    descriptor closes or its process dies. A subnet a crashed run left on an
    interface is skipped too."""
    folder = Path(tempfile.gettempdir())
    start = random.randrange(1, 255)
    for number in [*range(start, 255), *range(1, start)]:
        fd = os.open(folder / f"outbox-relay-netns-{number}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        used = subprocess.run(
            ["ip", "-o", "addr", "show", "to", f"10.77.{number}.0/24"],
            capture_output=True,
            text=True,
            check=True,
        )
        if not used.stdout.strip():
            return number, fd
        os.close(fd)
    raise RuntimeError("no free 10.77.N.0/24 subnet for a test host")


class Host:
    def __init__(self) -> None:
        number, self._lock = _free_subnet()
        tag = uuid.uuid4().hex[:5]
        self.name = f"or{tag}{number}"
        self.outer = f"vo{tag}{number}"  # our end
        inner = f"vi{tag}{number}"
        self.gateway = f"10.77.{number}.1"  # this machine, as the host sees it
        self.address = f"10.77.{number}.2"
        _ip("netns", "add", self.name)
        _ip("link", "add", self.outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", self.name)
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.outer)
        _ip("link", "set", self.outer, "up")
        _ip("-n", self.name, "addr", "add", f"{self.address}/24", "dev", inner)
        _ip("-n", self.name, "link", "set", inner, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")
        _ip("-n", self.name, "route", "add", "default", "via", self.gateway)

    def cut(self) -> None:
        _ip("link", "set", self.outer, "down")

    def restore(self) -> None:
        _ip("link", "set", self.outer, "up")

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.outer], check=False, capture_output=True)
        os.close(self._lock)
