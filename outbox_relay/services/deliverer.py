"""The deliverer: one delivery step, shared by the Celery tasks and the plain loop.

    begin (fence check) -> publish -> classify -> fenced finalize

* ``begin`` re-reads the chunk under the lease versions the task was given,
  skips rows no longer ours, and starts (counting the attempt) only rows with
  lease enough for the chunk's whole worst case: ``ceil(n / concurrency)``
  waves of one publish timeout each. Rows with less are given back at once.
* Publishing happens outside any transaction, concurrently (bounded) for a
  chunk. Before each publish the row's lease is checked again; once a lease
  is lost or runs short, the rest of that row's chunk is not published.
* ``classify`` maps each result onto an ``Outcome``; one fenced statement
  writes the whole chunk. An id the database did not change is a lost lease:
  someone else holds the row now, and the receiver absorbs the duplicate
  through the idempotency key.
* A soft time limit (or any interruption) while a chunk publishes still
  finalizes what was published and gives back what never started, then
  re-raises. A row whose publish is still running in another thread keeps
  its lease until it lapses: handed out again at once, it would be published
  a second time beside the first, under the same attempt number. One whose
  publish the interruption unwound in the task's own thread is a failed
  attempt, retried after the backoff.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Protocol, TypeVar

import psycopg

from .. import store
from ..db import Database
from ..errors import PermanentError, RetryableError
from ..model import Claimed, LeaseRef, Message, Outcome
from ..producer import DURABLE_EVENT_TYPE
from ..publishers.protocol import is_async_publisher
from ..store.relay import Began
from ..table import OutboxTable
from ..tracing import PublishTracer, default_tracer
from .completer import FULL_ROWS, Completer
from .keeper import Hold, LeaseKeeper
from .observer import Observer, lost_after_publish
from .policy import RetryPolicy, classify

__all__ = [
    "BUSY_SHARE",
    "IDLE_CPU_SHARE",
    "RAMP_SECONDS",
    "SLOW_PUBLISH_SECONDS",
    "Deliverer",
    "DeliveryReport",
    "Follow",
    "Observer",
    "Publisher",
    "publish_loop",
    "threads_at_once",
]

log = logging.getLogger("outbox_relay.deliverer")
T = TypeVar("T")

Publisher = Callable[[Message], Any]

# The longest a chunk's rows wait for their publishing threads to start when
# the publisher has been fast (see Deliverer._publish_all).
RAMP_SECONDS = 0.02

# A publisher that takes at least this long a message (on average, lately)
# leaves the delivery task waiting for most of a chunk's time: with a
# ``Follow``, the task then leases and publishes the next chunk while the
# one under way waits (Deliverer._pipeline).
SLOW_PUBLISH_SECONDS = 0.005
# ... unless its publishes keep the interpreter busy: a chunk whose publishing
# threads (or event loop) used at least this share of its wave in CPU (an
# HTTP client's parsing, TLS) would only queue a second chunk behind the
# first for the GIL. Seen with httpx to a 20 ms receiver: about 0.8 ms of
# CPU a request, and two chunks in flight delivered a fifth less.
BUSY_SHARE = 0.5
# ... and while the machine's CPUs were idle at least this share of the time
# since the delivery before: where they are all taken (the relay's
# processes, the database, a receiver on the same host), a second chunk's
# threads and the task's own database work only queue for the CPU and the
# GIL. httpx to a 20 ms receiver on 2 CPUs so taken delivered a fifth less
# with two chunks in flight, although each publish took 60 to 250 ms and
# the interpreter looked idle most of the time.
IDLE_CPU_SHARE = 0.2


def threads_at_once(publish_seconds: float | None, rows: int, threads: int) -> int:
    """How many of a chunk's ``threads`` start with it: enough to have every
    row under way within half of RAMP_SECONDS (or of one publish, for a
    publisher slower than that) at the pace the publisher has kept, the other
    half left for jitter before the rest start; all of them while that pace
    is unknown.

    Each thread costs a hand-off, and for a connection-holding publisher a
    connection: a publisher of 1 ms a message publishes a chunk of 200 about
    as soon from 20 threads as from 200. One slower than RAMP_SECONDS gets
    every thread, a wave per ``threads`` rows; one that has been fast, one.
    """
    if publish_seconds is None:
        return threads
    window = max(publish_seconds, RAMP_SECONDS) / 2
    return max(1, min(threads, math.ceil(rows * publish_seconds / window)))


class _NoObserver:
    def published(self, msg: Claimed, outcome: Outcome, seconds: float) -> None:
        pass

    def finalized(self, msg: Claimed, outcome: Outcome, age_seconds: float) -> None:
        pass

    def lost_lease(self, ref: LeaseRef, where: str) -> None:
        pass

    def stale(self, ref: LeaseRef, reason: str) -> None:
        pass


@dataclass
class DeliveryReport:
    """What became of a chunk's messages, counted (and each ``Outcome``)."""

    done: int = 0
    retried: int = 0
    dead: int = 0
    stale: int = 0
    released: int = 0
    lost: int = 0
    # Still publishing when the task was interrupted: left to their leases.
    left_leased: int = 0
    # Ordered messages done (ids): their aggregates' next messages are due now.
    ordered_done: list[int] = field(default_factory=list)
    # Of those next messages, how many this delivery took and delivered too
    # (``Deliverer.deliver``'s ``follow``): the rest are a claim's.
    followed: int = 0
    # Rows this delivery leased for itself while its publishes waited on a
    # slow publisher (``Follow.take``), a chunk at a time.
    took: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def ordered_finished(self) -> int:
        return len(self.ordered_done)

    def add(self, other: DeliveryReport) -> None:
        names = (
            "done",
            "retried",
            "dead",
            "stale",
            "released",
            "lost",
            "left_leased",
            "followed",
            "took",
        )
        for name in names:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ordered_done.extend(other.ordered_done)
        self.outcomes.extend(other.outcomes)


class Follow(Protocol):
    """How a delivery goes on with the next messages of the ordered
    aggregates it advanced (the Celery relay's, celery/tasks.py)."""

    def wants(self, rows: int) -> bool:
        """Whether to take the next messages of ``rows`` aggregates now."""
        ...

    def finish(
        self, conn: psycopg.Connection[Any], writes: list[Outcome]
    ) -> tuple[set[int], list[Began]]:
        """Finalize ``writes`` and lease and begin those next messages in one
        transaction (store.finalize_and_take): the ids changed, the rows taken."""
        ...

    def take(self, limit: int) -> list[Began]:
        """Lease and begin a chunk of due rows, at most ``limit``, for this
        delivery to publish beside the one under way (``Deliverer.deliver``
        with a slow publisher); none when nothing is due or the in-flight
        cap leaves no room."""
        ...


class _NotPublished:
    """A publish that never began; the row is given back unpublished."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Unfinished:
    """A publish the interruption caught under way: it may have reached the
    receiver. ``running``: still under way in a publishing thread."""

    def __init__(self, running: bool) -> None:
        self.running = running


_Result = tuple["BaseException | _NotPublished | _Unfinished | None", float]


@dataclass
class _Run:
    """One chunk's publishing state (a Deliverer serves many threads at once)."""

    stop: threading.Event = field(default_factory=threading.Event)
    futures: list[Future[None]] = field(default_factory=list)
    # Filled by the publishing threads, one slot per row, in row order.
    slots: list[_Result | None] = field(default_factory=list)
    # Rows a publishing thread has taken (under ``lock``, never after ``stop``).
    taken: list[bool] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    results: list[_Result] = field(default_factory=list)
    # The wave's start (perf_counter) and the CPU its publishing threads used
    # (thread_time, summed under ``lock``): the interpreter's share (_learn).
    started: float = 0.0
    cpu: float = 0.0


@dataclass
class _Lane:
    """A chunk publishing while the task does something else (_pipeline)."""

    rows: list[Began]
    released: list[Outcome]
    run: _Run
    hold: Hold | None
    # A coroutine publisher's chunk, under way on the publish loop.
    pending: Future[None] | None = None

    def close(self) -> None:
        if self.hold is not None:
            self.hold.release()
            self.hold = None


class _Attempt:
    """One publish under way: its message, span and clock (sync or async alike)."""

    def __init__(self, deliverer: Deliverer, row: Began) -> None:
        self.deliverer = deliverer
        self.row = row
        self.started = time.perf_counter()
        message = row.claimed.to_message(deliverer.prefix)
        tracer = deliverer.tracer
        self.span = tracer.start(message) if tracer is not None else None
        self.message = self.span.message if self.span is not None else message
        # For the span: the row's next status ("interrupted" if the publish
        # never returned, e.g. the worker is shutting down).
        self.outcome = "interrupted"
        self.error: BaseException | None = None

    def failed(self, exc: Exception) -> _Result:
        d, msg = self.deliverer, self.row.claimed
        self.error = exc
        if self.span is not None:
            self.outcome = classify(exc, msg, d.policy, age_seconds=self.row.age_seconds).status
        if not d.policy.is_classified(exc):
            log.error(
                "publisher raised an unclassified error for outbox message %s; %s",
                msg.id,
                "retrying it as transient"
                if msg.attempts < d.policy.max_attempts
                else "it was the last attempt",
                exc_info=exc,
            )
        return exc, time.perf_counter() - self.started

    def succeeded(self) -> _Result:
        return None, time.perf_counter() - self.started

    def close(self) -> None:
        if self.span is not None:
            self.span.end(self.outcome, self.error)


class _CpuIdle:
    """The share of the machine's CPU time that was idle since the last
    look (Linux's /proc/stat; None where there is none): a second chunk in
    flight only pays while the CPUs have time to spare for it."""

    PATH = "/proc/stat"
    # The counters move in ticks of 10 ms a CPU: a shorter look is noise.
    LOOK_SECONDS = 0.2

    def __init__(self) -> None:
        self.last: tuple[int, int] | None = None
        self.looked = 0.0
        self.value: float | None = None

    def share(self) -> float | None:
        now = time.monotonic()
        if now - self.looked < self.LOOK_SECONDS:
            return self.value
        self.looked = now
        self.value = self._read()
        return self.value

    def _read(self) -> float | None:
        try:
            with open(self.PATH, encoding="ascii") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal (guest is in user).
        idle, total = fields[3] + fields[4], sum(fields[:8])
        last, self.last = self.last, (idle, total)
        if last is None or total <= last[1]:
            return None
        return (idle - last[0]) / (total - last[1])


class Deliverer:
    """Delivers leased messages: the step every delivery path shares.

    ``count_attempt``: whether ``begin`` counts the attempt. False pairs with
    ``store.claim``'s default (the claim counted it); the Celery relay claims
    with ``count_attempt=False`` and counts here, so that a delivery task
    that never ran costs its row nothing.
    """

    def __init__(
        self,
        publisher: Publisher,
        *,
        db: Database,
        table: OutboxTable | str | None = None,
        policy: RetryPolicy | None = None,
        publish_timeout: float = 10.0,
        idempotency_key_prefix: str = "outbox-",
        concurrency: int = 8,
        observer: Observer | None = None,
        keeper: LeaseKeeper | None = None,
        count_attempt: bool = False,
        tracer: PublishTracer | Literal["default"] | None = "default",
        interruptions: tuple[type[BaseException], ...] = (),
        completer: Completer | None = None,
    ) -> None:
        self.publisher = publisher
        self.db = db
        self.table = OutboxTable.parse(table)
        self.policy = policy or RetryPolicy()
        self.publish_timeout = publish_timeout
        self.prefix = idempotency_key_prefix
        self.concurrency = max(1, concurrency)
        self.observer: Observer = observer or _NoObserver()
        self.keeper = keeper
        self.count_attempt = count_attempt
        # A span per publish when OpenTelemetry is installed (outbox_relay.tracing).
        self.tracer = default_tracer() if tracer == "default" else tracer
        # Exceptions that interrupt the delivery rather than fail a publish
        # (Celery's soft time limit, raised in whatever the task's thread is
        # running, the publisher included): never classified as the row's error.
        self.interruptions = interruptions
        # Writes a published single message's done in a batch with the
        # process's others, after the task returns (services/completer.py).
        self.completer = completer
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        # A coroutine publisher runs on the process's publish loop.
        self.is_async = is_async_publisher(publisher)
        # How long a publish has taken lately (None: not known yet); see _publish_all.
        self._publish_seconds: float | None = None
        # The share of a chunk's wave its publishes kept the interpreter busy
        # (a moving average; None: not known yet).
        self._busy_share: float | None = None
        # The machine's idle CPU between deliveries (_waits_on_publisher).
        self._cpu_idle = _CpuIdle()

    @property
    def publish_seconds(self) -> float | None:
        """How long a publish has taken lately (a moving average over chunks
        published with threads; None until one was): how many threads the
        next chunk starts with follows it (``threads_at_once``)."""
        return self._publish_seconds

    @property
    def busy_share(self) -> float | None:
        """The share of a chunk's wave its publishes kept this process's
        interpreter busy, lately (None until a chunk was published by
        threads or coroutines): at BUSY_SHARE or more a second chunk in
        flight would only wait for the GIL behind the first."""
        return self._busy_share

    def worst_seconds(self, size: int) -> float:
        """The longest a chunk of ``size`` may publish: its waves x the publish timeout."""
        return -(-max(size, 1) // self.concurrency) * self.publish_timeout

    # -------------------------------------------------------------- delivery
    def deliver(self, refs: Sequence[LeaseRef], follow: Follow | None = None) -> DeliveryReport:
        """Begin, publish, classify and finalize one chunk of leased messages.

        ``follow``: as the chunk's ordered rows become done, lease and begin
        the next message of their aggregates in the same transaction and
        deliver those too, round after round, while ``follow.wants`` it.
        """
        report = DeliveryReport()
        worst = self.worst_seconds(len(refs))
        began = self.db.run(
            lambda conn: store.begin(
                conn,
                refs,
                needed=timedelta(seconds=worst),
                count_attempt=self.count_attempt,
                table=self.table,
            )
        )
        ready, released = self._sort(refs, began, worst, report)
        if follow is not None and self._waits_on_publisher(ready):
            self._pipeline(ready, released, worst, report, follow)
            return report
        while True:
            # The first round also writes ``released``, even with nothing ready.
            ready = self._round(ready, released, worst, report, follow)
            if not ready:
                return report
            report.followed += len(ready)
            released, worst = [], self.worst_seconds(len(ready))

    def _waits_on_publisher(self, ready: list[Began]) -> bool:
        """Whether a chunk spends most of its time waiting for the publisher
        (slower than SLOW_PUBLISH_SECONDS, the interpreter idle for more than
        BUSY_SHARE of the wave) and a second one as large fits beside it:
        several unordered rows, at most half of ``concurrency``.
        (An ordered chunk keeps its own follow: the next message of each
        aggregate, taken as the chunk's done commits.)"""
        if not 1 < len(ready) <= self.concurrency // 2:
            return False
        pace = self._publish_seconds
        if pace is None or pace < SLOW_PUBLISH_SECONDS:
            return False
        if self._busy_share is None or self._busy_share >= BUSY_SHARE:
            return False
        if any(row.claimed.ordered for row in ready):
            return False
        # Last: the only look outside the process (/proc/stat, at most every
        # LOOK_SECONDS).
        idle = self._cpu_idle.share()
        return idle is None or idle >= IDLE_CPU_SHARE

    def _pipeline(
        self,
        ready: list[Began],
        released: list[Outcome],
        worst: float,
        report: DeliveryReport,
        follow: Follow,
    ) -> None:
        """Deliver the chunk and, while ``follow.wants`` it, one more at a
        time, taken (``follow.take``) and begun while the one before is
        still publishing: two chunks in flight, each begun, published and
        finalized as a chunk is by itself. Only while a second chunk as
        large as the one under way fits beside it within ``concurrency``,
        and at most what that one leaves: the task's publishes at once stay
        within OUTBOX_PUBLISH_CONCURRENCY, as with one chunk (a receiver
        that should see fewer requests at once is served by lowering it),
        and no take is made for a sliver.

        With a publisher that waits (20 ms for an HTTP call, say), a chunk's
        task otherwise spends that wait idle and its own work (the begin, the
        claim and hand-over of the next task) after it: with chunks of 50 the
        pool was busy a third of the time. Here that work overlaps the wait.
        """
        lanes: list[_Lane] = []
        taking = True
        try:
            self._launch(lanes, ready, released, worst)
            while lanes:
                under_way = len(lanes[0].rows)
                room = self.concurrency - under_way
                if taking and len(lanes) == 1 and room >= under_way and follow.wants(under_way):
                    taken = self._take(follow, room)
                    report.took += len(taken)
                    taking = bool(taken)
                    if taken:
                        self._launch(lanes, taken, [], self.worst_seconds(len(taken)))
                self._wait(lanes[0])
                self._land(lanes.pop(0), report)
        except Exception as exc:  # a soft time limit: finalize what each lane published
            for lane in lanes:
                self._collect_after(exc, lane.run)
                self._land(lane, report)
            raise

    def _land(self, lane: _Lane, report: DeliveryReport) -> None:
        """Finalize a lane whose publishes ended (or were collected)."""
        lane.close()
        self._finish(lane.rows, lane.run.results, lane.released, report)

    def _take(self, follow: Follow, limit: int) -> list[Began]:
        """The next chunk, or none if the database would not give one: the
        chunk under way is finalized all the same (a take whose commit the
        connection lost leaves its rows to their leases, as a begin would)."""
        try:
            return follow.take(limit)
        except psycopg.Error:
            log.warning("could not take the next chunk; finishing the one under way", exc_info=True)
            return []

    def _launch(
        self, lanes: list[_Lane], rows: list[Began], released: list[Outcome], worst: float
    ) -> None:
        """Start publishing a begun chunk as the last of ``lanes``, without
        waiting for it (``_wait`` does). In ``lanes`` before any publish
        starts: an interruption from here on finalizes it with the others."""
        self._flush_before_retries(rows)
        run = _Run(slots=[None] * len(rows), taken=[False] * len(rows))
        lane = _Lane(rows, released, run, self._hold(rows, worst))
        lanes.append(lane)
        if not rows:
            return
        if self.is_async:
            lane.pending = self._start_async(rows, lane.hold, run)
        else:
            self._start_threads(rows, lane.hold, run, ramp=False)

    def _wait(self, lane: _Lane) -> None:
        """Wait for a lane's publishes (an interruption is raised here)."""
        if lane.pending is not None:
            self._wait_async(lane.pending, lane.run)
        elif lane.rows:
            self._wait_threads(lane.run)

    def _round(
        self,
        ready: list[Began],
        released: list[Outcome],
        worst: float,
        report: DeliveryReport,
        follow: Follow | None,
    ) -> list[Began]:
        """Publish and finalize begun rows; the next ones taken (``follow``)."""
        self._flush_before_retries(ready)
        hold = self._hold(ready, worst)
        interrupted: BaseException | None = None
        run = _Run()
        with hold if hold is not None else nullcontext():
            try:
                self._publish_all(ready, hold, run)
            except Exception as exc:  # a soft time limit: finalize, then re-raise
                interrupted = exc
                self._collect_after(exc, run)
        taken = self._finish(
            ready, run.results, released, report, follow if interrupted is None else None
        )
        if interrupted is not None:
            raise interrupted
        return taken

    def _flush_before_retries(self, rows: list[Began]) -> None:
        if self.completer is not None and any(row.claimed.attempts > 1 for row in rows):
            # A row tried before may be one that kills its process (a poison
            # message): the done this process gathered is written first, so
            # such a crash never costs other messages an attempt.
            self.completer.flush()

    def _hold(self, rows: list[Began], worst: float) -> Hold | None:
        if self.keeper is None or not rows:
            return None
        # Renewed only while the chunk is within its worst case; after that a
        # hung publisher lets the lease lapse (the rescuer frees it).
        pairs = [(row.claimed.ref, row.lease_left_seconds) for row in rows]
        return self.keeper.hold(pairs, max_hold=worst)

    def _sort(
        self,
        refs: Sequence[LeaseRef],
        began: dict[int, Began],
        worst: float,
        report: DeliveryReport,
    ) -> tuple[list[Began], list[Outcome]]:
        ready: list[Began] = []
        released: list[Outcome] = []
        seen: set[int] = set()
        for ref in refs:
            row = began.get(ref.id)
            if row is None or row.claimed.lease_version != ref.lease_version or ref.id in seen:
                report.stale += 1
                self.observer.stale(ref, "not held under this lease version")
                log.info("skipping outbox message %s v%s: lease no longer ours", *_pair(ref))
                continue
            seen.add(ref.id)
            if row.started:
                ready.append(row)
                continue
            # Not enough lease left for the whole chunk: give the row back now
            # rather than publish into a lease that may end midway.
            released.append(
                Outcome.release(
                    ref,
                    reason=f"too little lease left ({row.lease_left_seconds:.1f}s; "
                    f"a delivery may take {worst:g}s)",
                    # Counted by the claim (count_attempt=False) but never used.
                    refund_attempt=not self.count_attempt,
                    # Not begun by this task: if a copy of it began the row
                    # under this lease, that copy is publishing; leave it.
                    unless_begun=True,
                )
            )
            self.observer.stale(ref, "too little lease left")
        return ready, released

    # ------------------------------------------------------------ publishing
    def _refusal(
        self, msg: Claimed, hold: Hold | None, stop: threading.Event
    ) -> BaseException | _NotPublished | None:
        """Why this row must not be published now, if it must not."""
        if msg.event_type == DURABLE_EVENT_TYPE:
            # A durable Celery task's row: the Celery relay sends it as the
            # task itself; published as a message, it would never run.
            return PermanentError(
                f"outbox message {msg.id} is a durable Celery task ({msg.event_type}): only "
                "the Celery relay (outbox_relay.install) runs it, not a publisher"
            )
        if stop.is_set():
            return _NotPublished("the delivery task was interrupted")
        if hold is not None and not hold.alive(msg.ref, self.publish_timeout):
            # Lost, or too little left for one more publish: a later wave of
            # the chunk is not published past its lease.
            return _NotPublished("the chunk's lease was lost or ran short")
        return None

    def _publish(self, row: Began, hold: Hold | None, stop: threading.Event) -> _Result:
        refused = self._refusal(row.claimed, hold, stop)
        if refused is not None:
            return refused, 0.0
        attempt = _Attempt(self, row)
        try:
            returned = self.publisher(attempt.message)
            if inspect.isawaitable(returned):
                # A publisher not declared ``async def`` that returned an
                # awaitable anyway (a wrapper, a partial): awaited on the
                # deliverer's loop, never dropped unawaited as if published.
                self._wait_on_loop(_awaited(returned))
            attempt.outcome = "done"
        except self.interruptions:
            raise
        except Exception as exc:
            return attempt.failed(exc)
        finally:
            attempt.close()
        return attempt.succeeded()

    async def _publish_async(self, row: Began, hold: Hold | None, stop: threading.Event) -> _Result:
        """``_publish`` for a coroutine publisher, on the deliverer's event loop."""
        refused = self._refusal(row.claimed, hold, stop)
        if refused is not None:
            return refused, 0.0
        attempt = _Attempt(self, row)
        try:
            await self.publisher(attempt.message)
            attempt.outcome = "done"
        except Exception as exc:
            return attempt.failed(exc)
        finally:
            attempt.close()
        return attempt.succeeded()

    def publish_one(self, row: Began) -> tuple[BaseException | None, float]:
        """Publish one begun row, waiting for it here (the plain loop's step)."""
        if self.is_async:
            result, seconds = self._wait_on_loop(self._publish_async(row, None, threading.Event()))
        else:
            result, seconds = self._publish(row, None, threading.Event())
        assert not isinstance(result, (_NotPublished, _Unfinished))
        return result, seconds

    def _pool(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.concurrency, thread_name_prefix="outbox-publish"
                )
            return self._executor

    def _wait_on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the process's publish loop; wait for it in this
        thread (where an interruption such as a soft time limit is raised)."""
        return asyncio.run_coroutine_threadsafe(coroutine, publish_loop()).result()

    def _start_async(self, rows: Sequence[Began], hold: Hold | None, run: _Run) -> Future[None]:
        """A chunk's publishes as coroutines, up to ``concurrency`` at once, in
        row order: the waves of the threaded path, without a thread hand-off
        per publish; the future to wait on. An interruption (raised in the
        task's thread while it waits) leaves the publishes under way running,
        as threads would."""
        run.slots = [None] * len(rows)
        run.taken = [False] * len(rows)

        async def publish(index: int, gate: asyncio.Semaphore) -> None:
            async with gate:
                with run.lock:
                    if run.stop.is_set():
                        return  # never taken: given back unpublished
                    run.taken[index] = True
                run.slots[index] = await self._publish_async(rows[index], hold, run.stop)

        async def publish_all() -> None:
            gate = asyncio.Semaphore(self.concurrency)
            run.started, cpu = time.perf_counter(), time.thread_time()
            await asyncio.gather(*(publish(i, gate) for i in range(len(rows))))
            # The loop's thread runs every publish of the wave (and whatever
            # else it runs meanwhile, counted as busy too).
            run.cpu = time.thread_time() - cpu
            self._learn([slot[1] for slot in run.slots if slot is not None], run)

        return asyncio.run_coroutine_threadsafe(publish_all(), publish_loop())

    def _publish_all_async(self, rows: Sequence[Began], hold: Hold | None, run: _Run) -> None:
        self._wait_async(self._start_async(rows, hold, run), run)

    def _wait_async(self, pending: Future[None], run: _Run) -> None:
        pending.result()
        run.results = [slot for slot in run.slots if slot is not None]

    def _publish_all(self, rows: Sequence[Began], hold: Hold | None, run: _Run) -> None:
        if self.is_async and rows:
            self._publish_all_async(rows, hold, run)
            return
        if len(rows) <= 1 or self.concurrency == 1:
            for row in rows:
                run.results.append(self._publish(row, hold, run.stop))
            return
        self._start_threads(rows, hold, run, ramp=True)
        self._wait_threads(run)

    def _start_threads(
        self, rows: Sequence[Began], hold: Hold | None, run: _Run, *, ramp: bool
    ) -> None:
        """Start a chunk's publishing threads (``_wait_threads`` waits for
        them). ``ramp``: start only as many as the publisher's pace needs
        (``threads_at_once``); otherwise all of them."""
        # Up to ``concurrency`` threads take the rows one at a time, in order,
        # from one shared position: the schedule a future per row would give
        # (the same waves, and a hung publish holds up only its own thread),
        # at the cost of one future per thread. A future per row cost more
        # than a fast publish itself (a third of a chunk's time, by py-spy,
        # with a no-op publisher).
        run.slots = [None] * len(rows)
        run.taken = [False] * len(rows)
        position = iter(range(len(rows)))
        all_taken = threading.Event()

        def take_rows() -> None:
            cpu = time.thread_time()
            while True:
                with run.lock:
                    # Nothing is taken once the task was interrupted: what
                    # _collect_after saw untaken is never published.
                    index = None if run.stop.is_set() else next(position, None)
                    if index is None or index == len(rows) - 1:
                        all_taken.set()
                    if index is not None:
                        run.taken[index] = True
                    else:
                        run.cpu += time.thread_time() - cpu
                if index is None:
                    return
                run.slots[index] = self._publish(rows[index], hold, run.stop)

        pool = self._pool()
        run.started = time.perf_counter()
        threads = min(self.concurrency, len(rows))
        first = threads_at_once(self._publish_seconds, len(rows), threads) if ramp else threads
        run.futures = [pool.submit(take_rows) for _ in range(first)]
        # The rest start as soon as the chunk is not all taken within
        # RAMP_SECONDS (the publisher slowed down): no row starts later than
        # that beyond the usual waves, a sliver of the lease's spare fifth.
        if first < threads and not all_taken.wait(RAMP_SECONDS):
            run.futures += [pool.submit(take_rows) for _ in range(threads - first)]

    def _wait_threads(self, run: _Run) -> None:
        for future in run.futures:
            future.result()
        run.results = [slot for slot in run.slots if slot is not None]
        self._learn([seconds for _, seconds in run.results], run)

    def _learn(self, seconds: Sequence[float], run: _Run) -> None:
        """Follow how long a publish takes, and the share of a wave its
        publishes kept the interpreter busy (moving averages over chunks)."""
        if not seconds:
            return
        mean = sum(seconds) / len(seconds)
        last = self._publish_seconds
        self._publish_seconds = mean if last is None else 0.8 * last + 0.2 * mean
        wall = time.perf_counter() - run.started
        if wall > 0:
            share = min(1.0, run.cpu / wall)
            busy = self._busy_share
            self._busy_share = share if busy is None else 0.8 * busy + 0.2 * share

    def _collect_after(self, exc: BaseException, run: _Run) -> None:
        """After an interruption: keep what finished; what never started goes
        back unpublished; a publish still running keeps its row's lease."""
        with run.lock:
            run.stop.set()
            slots, taken = list(run.slots), list(run.taken)
        log.warning("delivery interrupted (%s); finalizing what was published", type(exc).__name__)
        if not taken:
            # Inline: an interruption inside the publisher is that publish's
            # error (_publish). One that lands around it may follow a publish
            # that reached the receiver before its result was kept: that row
            # goes back with its attempt counted, the rest refunded.
            run.results.append((_Unfinished(running=False), 0.0))
            return
        for future in run.futures:
            future.cancel()
        # Given back now, a row whose publish is still running would be
        # claimed and published again beside it, under the same attempt
        # (the fault suite's link-cut scenario caught that: a publisher stuck
        # on a connection the cut had left dead published its rows after the
        # soft time limit had given them back). Its lease lapses instead and
        # the rescuer frees it, with its attempt counted.
        run.results = [
            slot
            if slot is not None
            else (_Unfinished(running=True), 0.0)
            if was_taken
            else (_NotPublished("the delivery task was interrupted"), 0.0)
            for slot, was_taken in zip(slots, taken)
        ]

    # -------------------------------------------------------------- finishing
    def _finish(
        self,
        ready: Sequence[Began],
        results: Sequence[_Result],
        released: list[Outcome],
        report: DeliveryReport,
        follow: Follow | None = None,
    ) -> list[Began]:
        # Rows without a result (an inline chunk interrupted before reaching
        # them) are given back unpublished like the ones skipped on purpose.
        interrupted = _NotPublished("the delivery task was interrupted")
        padded = [*results, *[(interrupted, 0.0)] * (len(ready) - len(results))]
        running = [isinstance(r, _Unfinished) and r.running for r, _ in padded]
        # Added, not set: a report gathers every round of a delivery (follow).
        left_leased = sum(running)
        report.left_leased += left_leased
        if left_leased:
            log.warning(
                "%d publish(es) still running when the delivery was interrupted; their rows "
                "keep their leases until they lapse (the rescuer then frees them)",
                left_leased,
            )
        finished = [(row, p) for row, p, r in zip(ready, padded, running) if not r]
        outcomes = [self._outcome(row, result) for row, (result, _) in finished]
        finished, outcomes = self._hand_over(finished, outcomes, report)
        writes = outcomes + released
        if not writes:
            return []
        ordered = [
            outcome.id
            for (row, _), outcome in zip(finished, outcomes)
            if row.claimed.ordered and outcome.status == "done"
        ]
        changed, taken = self._write(writes, ordered, follow)
        report.released += sum(1 for o in released if o.id in changed)
        for (row, (result, seconds)), outcome in zip(finished, outcomes):
            # An inline publish the interruption unwound is a failed attempt
            # (counted as retried below); only a row never published is a release.
            if isinstance(result, _NotPublished):
                report.released += int(outcome.id in changed)
                continue
            self.observer.published(row.claimed, outcome, seconds)
            if outcome.id not in changed:
                report.lost += 1
                lost_after_publish(self.observer, row.claimed, outcome)
                continue
            self.observer.finalized(row.claimed, outcome, row.age_seconds + seconds)
            report.outcomes.append(outcome)
            if outcome.status == "done":
                report.done += 1
                if row.claimed.ordered:
                    report.ordered_done.append(row.claimed.id)
            elif outcome.status == "dead":
                report.dead += 1
            else:
                report.retried += 1
        return taken

    def _write(
        self, writes: list[Outcome], ordered: list[int], follow: Follow | None
    ) -> tuple[set[int], list[Began]]:
        """Finalize ``writes``, and with ``follow`` take, in the same
        transaction (one commit), the next messages of the aggregates of the
        ``ordered`` rows written done; the ids changed and the rows taken."""
        if follow is None or not ordered or not follow.wants(len(ordered)):
            return self.db.run(lambda conn: store.finalize(conn, writes, table=self.table)), []
        tries = 0

        def write(conn: Any) -> tuple[set[int], list[Began]]:
            nonlocal tries
            tries += 1
            if tries > 1:
                # Tried again after a broken connection: the first try may
                # have committed its take, whose rows then wait out their
                # lease (the rescuer frees them); taking again could not
                # tell them apart. The finalize alone.
                return store.finalize(conn, writes, table=self.table), []
            return follow.finish(conn, writes)

        return self.db.run(write)

    def _hand_over(
        self,
        finished: Sequence[tuple[Began, _Result]],
        outcomes: Sequence[Outcome],
        report: DeliveryReport,
    ) -> tuple[list[tuple[Began, _Result]], list[Outcome]]:
        """Leave the ``done`` of first attempts to the completer; the rows left
        for the task to write, with their outcomes.

        Only a row published on its first attempt with more to come and not
        ordered (its aggregate's next message waits for this done); a retry,
        a dead letter, a release and everything else is finalized by the
        task, now. A done the completer loses with its process costs its row
        one attempt, and the retry's done is written by its task: a lost done
        never makes a row dead.
        """
        # A chunk of FULL_ROWS is a statement of its own already: handing it
        # to the thread would only add the hand-off (chunks of 200 and 500
        # were 5 to 7% slower).
        if self.completer is None or self.policy.max_attempts <= 1 or len(finished) >= FULL_ROWS:
            return list(finished), list(outcomes)
        handed: list[tuple[Claimed, Outcome, float, float]] = []
        kept: list[tuple[Began, _Result]] = []
        kept_outcomes: list[Outcome] = []
        for (row, (result, seconds)), outcome in zip(finished, outcomes):
            if outcome.status != "done" or row.claimed.ordered or row.claimed.attempts != 1:
                kept.append((row, (result, seconds)))
                kept_outcomes.append(outcome)
                continue
            self.observer.published(row.claimed, outcome, seconds)
            # The lease left at begin, less the publish (a keeper may have
            # renewed it since: then it ends later, never sooner).
            lease_left = row.lease_left_seconds - seconds
            handed.append((row.claimed, outcome, row.age_seconds + seconds, lease_left))
            report.outcomes.append(outcome)
        self.completer.add(handed)
        report.done += len(handed)
        return kept, kept_outcomes

    def flush(self) -> None:
        """Write the ``done`` of deliveries handed to the completer, now."""
        if self.completer is not None:
            self.completer.flush()

    def _outcome(
        self, row: Began, result: BaseException | _NotPublished | _Unfinished | None
    ) -> Outcome:
        if isinstance(result, _NotPublished):
            # An attempt was counted (by begin or the claim) and never used.
            return Outcome.release(row.claimed, reason=result.reason, refund_attempt=True)
        if isinstance(result, _Unfinished):
            # Interrupted mid-publish in this thread: no longer running, but
            # it may have reached the receiver. A failed attempt: counted (a
            # second publish is the next attempt, not the same one) and
            # retried after the backoff, as a publish that timed out would be.
            error = RetryableError("the delivery task was interrupted while publishing it")
            return classify(error, row.claimed, self.policy, age_seconds=row.age_seconds)
        return classify(result, row.claimed, self.policy, age_seconds=row.age_seconds)

    def close(self) -> None:
        if self.completer is not None:
            self.completer.close()
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None


_publish_loop: tuple[int, asyncio.AbstractEventLoop] | None = None
_publish_loop_lock = threading.Lock()


def publish_loop() -> asyncio.AbstractEventLoop:
    """The event loop coroutine publishers run on: one per process, in a
    daemon thread of its own, made on first use (and again in a forked
    child, which has the parent's loop but not its thread).

    One per process, not per deliverer: a publisher's client made on first
    use (an ``httpx.AsyncClient``, docs/publishers.md) is bound to the loop
    it was made on, and ``dispatch_once`` makes a deliverer per call. With a
    loop each, the second call's publishes failed on the first call's client
    ("bound to a different event loop"), and every call left a thread and a
    loop behind."""
    global _publish_loop
    pid = os.getpid()
    with _publish_loop_lock:
        if _publish_loop is None or _publish_loop[0] != pid:
            loop = asyncio.new_event_loop()
            threading.Thread(
                target=loop.run_forever, name="outbox-publish-loop", daemon=True
            ).start()
            _publish_loop = (pid, loop)
        return _publish_loop[1]


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _pair(ref: LeaseRef) -> tuple[int, int]:
    return ref.id, ref.lease_version
