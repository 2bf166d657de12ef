"""Publishers used by the benchmarks: a no-op, and one that waits like a network call."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from outbox_relay import Message, RetryableError


def noop(message: Message) -> None:
    """Publish nowhere: measures the relay's own cost."""


def wait20ms(message: Message) -> None:
    """Stand-in for a receiver that answers in 20 ms."""
    time.sleep(0.02)


def wait1ms(message: Message) -> None:
    """Stand-in for a receiver that answers in 1 ms (a broker with publisher confirms)."""
    time.sleep(0.001)


def fail_first(message: Message) -> None:
    """A receiver that was down for every message's first attempt (an outage
    the relay rode out): the retries are what is measured."""
    if message.attempts <= 1:
        raise RetryableError("receiver down (benchmark)")


async def wait20ms_async(message: Message) -> None:
    """The same receiver awaited (an ``httpx.AsyncClient``, say), as pgqueuer's jobs wait."""
    await asyncio.sleep(0.02)


class _Recorder:
    """Latencies of one process, written to ``bench_latency`` by a thread of
    its own every 0.2 s: the measurement must not slow what it measures (a
    statement, let alone a WAL flush, per published message would cost the
    relay more than its own work)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.pending: list[tuple[int, float]] = []
        threading.Thread(target=self._run, name="bench-latency", daemon=True).start()

    def add(self, message_id: int, seconds: float) -> None:
        with self.lock:
            self.pending.append((message_id, seconds))

    def _run(self) -> None:
        import psycopg

        with psycopg.connect(os.environ["BENCH_DSN"], autocommit=True) as conn:
            conn.execute("SET synchronous_commit = off")
            while True:
                time.sleep(0.2)
                with self.lock:
                    batch, self.pending = self.pending, []
                if batch:
                    ids, seconds = zip(*batch, strict=True)
                    conn.execute(
                        "INSERT INTO bench_latency (id, seconds)"
                        " SELECT * FROM unnest(%s::bigint[], %s::float8[]) ON CONFLICT DO NOTHING",
                        (list(ids), list(seconds)),
                    )


_recorder: _Recorder | None = None
_recorder_lock = threading.Lock()


def record_latency(message: Message) -> None:
    """Record commit-to-publish latency (row created_at is the producer's transaction time)."""
    global _recorder
    assert message.created_at is not None
    latency = time.time() - message.created_at.timestamp()
    with _recorder_lock:
        if _recorder is None or _recorder.pid != os.getpid():
            _recorder = _Recorder()
        recorder = _recorder
    recorder.add(message.id, latency)
