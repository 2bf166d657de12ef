"""The publishers' pool of idle connections (publishers/_process.IdlePool),
with real sockets: what a quiet relay keeps open, and for how long."""

from __future__ import annotations

import os
import socket
import time

from outbox_relay.publishers import _process
from outbox_relay.publishers._process import IdlePool


def _closed(sock: socket.socket) -> bool:
    return sock.fileno() == -1


def _pair() -> socket.socket:
    ours, theirs = socket.socketpair()
    theirs.close()
    return ours


def test_a_connection_left_idle_is_closed_though_nothing_is_given_back_after_it() -> None:
    # A relay that goes quiet after a burst: the burst's connections are given
    # back once, and then nothing happens in that process for a long time.
    pool: IdlePool[socket.socket] = IdlePool(socket.socket.close, idle_seconds=0.3)
    burst = [_pair() for _ in range(5)]
    for sock in burst:
        pool.give_back(sock)
    assert not any(_closed(s) for s in burst)
    deadline = time.monotonic() + 0.3 + _process.SWEEP_SECONDS
    while not all(_closed(s) for s in burst) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_closed(s) for s in burst), "idle connections still open after their idle time"
    assert pool.take() is None


def test_a_connection_in_use_again_is_kept_and_the_last_given_back_is_taken_first() -> None:
    pool: IdlePool[socket.socket] = IdlePool(socket.socket.close, idle_seconds=0.5)
    old, new = _pair(), _pair()
    pool.give_back(old)
    pool.give_back(new)
    assert pool.take() is new
    pool.give_back(new)
    # Taken and given back every 0.1 s, "new" is never idle for 0.5 s; "old" is.
    for _ in range(12):
        time.sleep(0.1)
        taken = pool.take()
        assert taken is new
        pool.give_back(taken)
    assert _closed(old)
    assert not _closed(new)
    pool.close()
    assert _closed(new)


def test_an_unusable_connection_is_closed_instead_of_handed_out() -> None:
    broken, good = _pair(), _pair()
    pool: IdlePool[socket.socket] = IdlePool(socket.socket.close, usable=lambda s: s is good)
    pool.give_back(good)
    pool.give_back(broken)
    assert pool.take() is good
    assert _closed(broken)
    assert not _closed(good)
    good.close()


def test_a_forked_child_sweeps_its_own_connections_and_never_its_parents() -> None:
    # A prefork worker: the parent's pool (and its sweeper) exist before the
    # fork; closing the parent's connections in a child would close sockets
    # the parent still uses (an AMQP close or TLS close_notify on them).
    parents: IdlePool[socket.socket] = IdlePool(socket.socket.close, idle_seconds=0.2)
    inherited, peer = socket.socketpair()
    parents.give_back(inherited)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            childs: IdlePool[socket.socket] = IdlePool(socket.socket.close, idle_seconds=0.2)
            own = _pair()
            childs.give_back(own)
            deadline = time.monotonic() + 0.2 + _process.SWEEP_SECONDS
            while not _closed(own) and time.monotonic() < deadline:
                time.sleep(0.05)
            code = 0 if _closed(own) and not _closed(inherited) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's own sweeper closes the parent's idle connection as usual.
    deadline = time.monotonic() + 0.2 + _process.SWEEP_SECONDS
    while not _closed(inherited) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _closed(inherited)
    peer.close()
