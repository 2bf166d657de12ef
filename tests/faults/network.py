"""Network namespaces for the fault suite: relay hosts with a link that can be cut.

``Host`` is a network namespace joined to this one by a veth pair
(``10.77.N.1`` on our side, ``10.77.N.2`` inside). Processes started in it
(``ip netns exec``) reach the machine's services only through proxies that
listen on ``10.77.N.1``. ``cut()`` takes our end of the link down: packets
to and from the host vanish, with no FIN and no RST, as when a switch port
or a cable fails; ``restore()`` brings it back. Needs root and ``ip``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid


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


class Host:
    def __init__(self, number: int) -> None:
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
