"""One driver for every fault scenario: a relay of real processes, a receiver,
a load, and the ledger check at the end.

A scenario builds a ``Run`` (the test's database, a broker, relay settings),
starts workers and a beat, enqueues its messages, injects its faults while
they flow, waits until every message is ``done`` or ``dead``, and calls
``ledger()``, which checks what the relay promises:

* **zero lost**: every message that is not meant to fail is ``done`` and
  has exactly one effect row at the receiver;
* messages meant to fail (rejected by the receiver, or poison that kills its
  worker) are ``dead`` with a reason, and had no effect;
* **every duplicate explained**: the receiver saw a message again only
  because the earlier delivery's response was lost (the call ended in an
  error although the receiver applied it), or because the earlier lease was
  lost after a successful call (a higher attempt came later). The second
  needs evidence of a cause: the earlier call is in the call log, and the
  process that made it died (killed, or poisoned) or was frozen, or it was
  made while a fault of the scenario was on (``Run.fault``: from a lease and
  a publish timeout before it to two seconds after it), when its finalize
  could not reach the database. A scenario names the explanations it
  allows; anything else fails the test.

Each fault is injected inside ``with run.fault(what):``, which first waits
until messages are waiting or in flight (``Run.producing`` keeps them
coming): a fault that strikes an idle relay proves nothing.

With ``OUTBOX_TEST_FAULTS_REPORT`` set to a file, each ledger is appended to it as
a JSON line (``python -m tests.faults.report`` prints the table that
docs/reliability.md shows).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

import outbox_relay

from ..celery_procs import CeleryProcs, Proc, pool_pids
from . import publisher
from .receiver import Receiver

LOST_RESPONSE = "lost response"
# The test's own sessions (producers, samplers): faults that terminate the
# relay's database sessions spare these.
TEST_SESSION = "fault-test"
LEASE_LOST = "lease lost after publish"
# An earlier attempt's request, held up in the network, reaching the receiver
# after a later attempt (under a newer lease) was applied.
LATE_REQUEST = "stale request arrived late"

# Relay settings for the scenarios: short leases and ticks so a fault costs
# seconds, not minutes; the rest are the defaults a user gets.
RELAY_ENV = {
    "OUTBOX_PUBLISHER": "tests.faults.publisher:publish",
    "OUTBOX_LEASE_SECONDS": "8",
    "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "4",
    "OUTBOX_CLAIM_INTERVAL_SECONDS": "0.5",
    "OUTBOX_MAX_ATTEMPTS": "5",
    "OUTBOX_BACKOFF_BASE_SECONDS": "0.5",
    "OUTBOX_BACKOFF_CAP_SECONDS": "4",
    "OUTBOX_BATCH_SIZE": "100",
    "OUTBOX_MAX_IN_FLIGHT": "200",
    "OUTBOX_CHUNK_SIZE": "10",
}
# Chunked delivery (one task publishes up to this many rows); a scenario
# passes OUTBOX_CHUNK_SIZE=1 for per-message delivery tasks, the default mode.
CHUNKED = {"OUTBOX_CHUNK_SIZE": "10"}
PER_MESSAGE = {"OUTBOX_CHUNK_SIZE": "1"}


@dataclass
class Ledger:
    scenario: str
    mode: str
    faults: str
    messages: int
    done: int
    dead: int
    lost: int
    effects: int
    duplicates: int
    explained: dict[str, int]
    unexplained: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Run:
    def __init__(
        self,
        name: str,
        dsn: str,
        receiver_dsn: str,
        tmp_path: Path,
        *,
        broker: str,
        env: Mapping[str, str] | None = None,
        relay_dsn: str | None = None,
        receiver_bind: str = "127.0.0.1",
    ) -> None:
        """``dsn``: the outbox's database (migrated); ``receiver_dsn``: another
        database, for the receiver's inbox and effects and the call log, so a
        fault injected into the outbox's database leaves the evidence intact.
        ``relay_dsn``: how the relay reaches the outbox (through a proxy, say)."""
        self.name = name
        self.dsn = dsn
        self.receiver_dsn = receiver_dsn
        self.receiver = Receiver(receiver_dsn, bind=receiver_bind)
        with psycopg.connect(receiver_dsn, autocommit=True) as conn:
            conn.execute(publisher.DDL)
        self.env = {
            **RELAY_ENV,
            "OUTBOX_DSN": relay_dsn or dsn,
            "CELERY_BROKER_URL": broker,
            "OUTBOX_QUEUE": f"outbox-{name}",
            "FAULT_WEBHOOK_URL": self.receiver.url,
            "FAULT_DSN": receiver_dsn,
            **(env or {}),
        }
        self.procs = CeleryProcs(self.env, tmp_path)
        self.ids: list[int] = []
        self.poison: set[int] = set()
        self.started = time.monotonic()
        self.faults: list[str] = []
        # Evidence for "lease lost after publish": when faults were on
        # (epoch seconds), and the processes killed or frozen.
        self.windows: list[tuple[float, float]] = []
        self.victims: set[int] = set()

    # ----------------------------------------------------------- processes
    def workers(self, n: int, *, concurrency: int = 2, pool: str = "prefork") -> list[Proc]:
        return [self.procs.worker(concurrency=concurrency, pool=pool) for _ in range(n)]

    def live_workers(self) -> list[Proc]:
        return [p for p in self.procs.procs if p.name.startswith("w") and p.alive()]

    def beat(self) -> Proc:
        return self.procs.beat()

    def kill(self, proc: Proc) -> None:
        self.victims |= pool_pids(proc)
        proc.kill(signal.SIGKILL)
        proc.popen.wait(10)

    def freeze_mid_publish(self, proc: Proc, *, timeout: float = 30.0) -> None:
        """SIGSTOP ``proc``'s group at a moment one of its processes is inside a
        publish (a call with no outcome yet), so it wakes holding a stale lease."""
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.receiver_dsn, autocommit=True) as conn:
            while time.monotonic() < deadline:
                if self._open_call(conn, proc):
                    os.killpg(proc.popen.pid, signal.SIGSTOP)
                    if self._open_call(conn, proc):
                        self.victims |= pool_pids(proc)
                        return
                    os.killpg(proc.popen.pid, signal.SIGCONT)
                time.sleep(0.01)
        raise AssertionError(f"{proc.name} was never caught inside a publish")

    @staticmethod
    def _open_call(conn: psycopg.Connection[Any], proc: Proc) -> bool:
        pids = [r[0] for r in conn.execute("SELECT pid FROM calls WHERE outcome IS NULL")]
        for pid in pids:
            try:
                if os.getpgid(pid) == proc.popen.pid:
                    return True
            except ProcessLookupError:
                continue
        return False

    # ------------------------------------------------------------- the load
    def enqueue(
        self,
        n: int,
        *,
        poison_every: int = 0,
        per_transaction: int = 20,
        threads: int = 2,
    ) -> list[int]:
        """``n`` business transactions' worth of rows from ``threads`` producers."""
        made: list[int] = []
        poison: set[int] = set()
        lock = threading.Lock()
        errors: list[BaseException] = []
        base = len(self.ids)

        def produce(start: int) -> None:
            try:
                with psycopg.connect(self.dsn, application_name=TEST_SESSION) as conn:
                    mine = list(range(start, n, threads))
                    for at in range(0, len(mine), per_transaction):
                        with conn.transaction():
                            for i in mine[at : at + per_transaction]:
                                bad = (
                                    poison_every > 0
                                    and (base + i) % poison_every == poison_every - 1
                                )
                                row = outbox_relay.enqueue(
                                    conn,
                                    aggregate_type="order",
                                    aggregate_id=str(base + i),
                                    event_type="order.created",
                                    payload={"n": base + i, "poison": bad},
                                )
                                with lock:
                                    made.append(row)
                                    if bad:
                                        poison.add(row)
            except BaseException as exc:
                errors.append(exc)

        producers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
        for t in producers:
            t.start()
        for t in producers:
            t.join()
        if errors:
            raise errors[0]
        self.ids.extend(sorted(made))
        self.poison |= poison
        return sorted(made)

    @contextmanager
    def fault(self, what: str, *, lasting: float = 0.0, window: bool = True) -> Iterator[None]:
        """Inject a fault in the block (``what`` names it in errors): first
        wait, up to 5 s, until messages are waiting or in flight (a fault on
        an idle relay proves nothing), then keep the time it was on, plus
        ``lasting`` seconds after the block, as evidence for the ledger.
        ``window=False`` for a kill: the killed processes are its evidence,
        not the time (a finalize lost elsewhere meanwhile is not its doing)."""
        deadline = time.monotonic() + 5.0
        counts = self.counts()
        while counts.get("pending", 0) + counts.get("processing", 0) == 0:
            assert time.monotonic() < deadline, (
                f"{self.name}: {what!r} would strike an idle relay ({counts}): "
                "inject it while messages flow"
            )
            time.sleep(0.02)
            counts = self.counts()
        started = time.time()
        try:
            yield
        finally:
            if window:
                self.windows.append((started, time.time() + lasting))

    @contextmanager
    def producing(self, rows: int = 20, every: float = 0.1) -> Iterator[None]:
        """Business transactions of ``rows`` messages every ``every`` seconds
        for the duration of the block, so that faults strike a relay at
        work. A transaction the fault makes fail is not counted (it rolled
        back), as for any application."""

        def produce(stop: threading.Event) -> None:
            while not stop.wait(every):
                try:
                    self.enqueue(rows, threads=1, per_transaction=rows)
                except psycopg.Error:
                    continue

        with self.background(produce):
            yield

    # ------------------------------------------------------------- watching
    def counts(self) -> dict[str, int]:
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute("SELECT status, count(*) FROM outbox GROUP BY status").fetchall()
        return {s: int(n) for s, n in rows}

    def finished(self) -> bool:
        c = self.counts()
        return c.get("done", 0) + c.get("dead", 0) == len(self.ids)

    def wait_finished(self, timeout: float) -> float:
        started = time.monotonic()
        deadline = started + timeout
        last: dict[str, int] = {}
        while time.monotonic() < deadline:
            try:
                if self.finished():
                    return time.monotonic() - started
                last = self.counts()
            except psycopg.OperationalError:
                pass  # the database may be the fault
            time.sleep(0.5)
        raise AssertionError(
            f"{self.name}: not finished after {timeout:.0f}s: {last} of {len(self.ids)}\n"
            + self.procs.logs()[-8000:]
        )

    def every(
        self, seconds: float, action: Callable[[], None], *, until: Callable[[], bool]
    ) -> None:
        """Run ``action`` every ``seconds`` (jittered) until ``until()``."""
        rng = random.Random(self.name)
        while not until():
            time.sleep(seconds * (0.5 + rng.random()))
            if until():
                return
            action()

    @contextmanager
    def background(self, action: Callable[[threading.Event], None]) -> Iterator[None]:
        """Run ``action(stop)`` in a thread for the duration of the block."""
        stop = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                action(stop)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(60)
        if errors:
            raise errors[0]

    # --------------------------------------------------------------- ledger
    def ledger(
        self, *, allow: set[str] = frozenset(), dead_expected: set[int] | None = None
    ) -> Ledger:  # type: ignore[assignment]
        """Check the promise (see the module docstring); return the figures."""
        reject_every = self.receiver.behaviour.reject_every
        rejected = {i for i in self.ids if reject_every and i % reject_every == 0}
        expect_dead = (dead_expected or set()) | rejected | self.poison
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            status = dict(
                conn.execute(
                    "SELECT id, status FROM outbox WHERE id = ANY(%s)", (self.ids,)
                ).fetchall()
            )
            reasons = dict(
                conn.execute(
                    "SELECT id, last_error FROM outbox WHERE status = 'dead' AND id = ANY(%s)",
                    (self.ids,),
                ).fetchall()
            )
        with psycopg.connect(self.receiver_dsn, autocommit=True) as conn:
            effects = Counter(
                dict(
                    conn.execute(
                        "SELECT message_id, count(*) FROM effects GROUP BY message_id"
                    ).fetchall()
                )
            )
            deliveries = conn.execute(
                "SELECT message_id, attempt, verdict FROM deliveries ORDER BY seq"
            ).fetchall()
            calls = conn.execute(
                "SELECT message_id, attempt, lease_version, outcome, pid,"
                " extract(epoch FROM at)::float8 FROM calls ORDER BY seq"
            ).fetchall()
        problems: list[str] = []
        lost = [
            i
            for i in self.ids
            if i not in expect_dead and (status.get(i) != "done" or effects[i] != 1)
        ]
        for i in lost[:10]:
            problems.append(f"message {i}: status {status.get(i)}, {effects[i]} effect rows")
        twice = [i for i in self.ids if effects[i] > 1]
        for i in twice[:10]:
            problems.append(f"message {i}: {effects[i]} effect rows (the inbox failed)")
        for i in sorted(expect_dead):
            if status.get(i) != "dead" or effects[i] != 0 or not reasons.get(i):
                problems.append(
                    f"message {i} should be dead with a reason and no effect: "
                    f"status {status.get(i)}, reason {reasons.get(i)!r}, {effects[i]} effects"
                )
        unexpected_dead = [i for i, s in status.items() if s == "dead" and i not in expect_dead]
        for i in unexpected_dead[:10]:
            problems.append(f"message {i} is dead unexpectedly: {reasons.get(i)!r}")

        explained: Counter[str] = Counter()
        unexplained: list[str] = []
        outcome_of = {(m, a): o for m, a, _, o, _, _ in calls}
        version_of = {(m, a): v for m, a, v, _, _, _ in calls}
        caused = self._causes(calls)
        applied_at: dict[int, tuple[int, str]] = {}
        duplicates = 0
        for message_id, attempt, verdict in deliveries:
            if verdict.endswith("applied"):
                applied_at[message_id] = (attempt, verdict)
            elif verdict.endswith("duplicate"):
                duplicates += 1
                if message_id not in applied_at:
                    unexplained.append(
                        f"message {message_id}: a duplicate with no applied delivery"
                    )
                    continue
                first_attempt, first_verdict = applied_at[message_id]
                why = self._explain(
                    message_id, first_attempt, first_verdict, attempt, outcome_of, version_of
                )
                if why == LEASE_LOST and (message_id, first_attempt) not in caused:
                    why = f"{LEASE_LOST}, with no fault, killed or frozen process behind it"
                if why is not None and why in allow:
                    explained[why] += 1
                else:
                    unexplained.append(
                        f"message {message_id}: attempt {attempt} after applied attempt "
                        f"{first_attempt} ({first_verdict}, call outcome "
                        f"{outcome_of.get((message_id, first_attempt))!r}): "
                        f"{why or 'no explanation'}"
                    )
        result = Ledger(
            scenario=self.name,
            mode="per-message" if self.env["OUTBOX_CHUNK_SIZE"] == "1" else "chunked",
            faults="; ".join(self.faults),
            messages=len(self.ids),
            done=sum(1 for s in status.values() if s == "done"),
            dead=sum(1 for s in status.values() if s == "dead"),
            lost=len(lost),
            effects=sum(effects[i] for i in self.ids),
            duplicates=duplicates,
            explained=dict(explained),
            unexplained=unexplained,
            seconds=round(time.monotonic() - self.started, 1),
        )
        report = os.environ.get("OUTBOX_TEST_FAULTS_REPORT")
        if report:
            with open(report, "a", encoding="utf-8") as out:
                out.write(json.dumps(asdict(result)) + "\n")
        problems.extend(unexplained[:10])
        assert not problems, f"{self.name}: ledger check failed ({result}):\n" + "\n".join(problems)
        return result

    @staticmethod
    def _explain(
        message_id: int,
        first_attempt: int,
        first_verdict: str,
        attempt: int,
        outcome_of: Mapping[tuple[int, int], Any],
        version_of: Mapping[tuple[int, int], Any],
    ) -> str | None:
        if attempt == first_attempt:
            return None  # the same delivery attempt twice: nothing explains that
        if attempt < first_attempt:
            # An attempt is counted once per lease (began_version), so a lower
            # attempt is an older lease's request; the call log, when it got
            # through (it travels the same cut link), must agree.
            earlier = version_of.get((message_id, attempt))
            later = version_of.get((message_id, first_attempt))
            if earlier is not None and later is not None and earlier >= later:
                return None
            return LATE_REQUEST
        if first_verdict.startswith("lost"):
            return LOST_RESPONSE
        outcome = outcome_of.get((message_id, first_attempt), "missing")
        if outcome not in ("ok", None, "missing"):
            return LOST_RESPONSE  # the call failed on the way back although it was applied
        first_version = version_of.get((message_id, first_attempt))
        later_version = version_of.get((message_id, attempt))
        if (
            first_version is not None
            and later_version is not None
            and later_version <= first_version
        ):
            return None
        # The call returned (or its process died in it) and a later attempt
        # came under a new lease: the first lease was lost before its finalize.
        return LEASE_LOST

    def _causes(self, calls: list[Any]) -> set[tuple[int, int]]:
        """The (message, attempt) calls whose lease could have been lost by a
        fault of this run: made by a process that died or was a victim, or
        while a fault was on (from a lease and a publish timeout before it:
        a delivery under way when it struck, to 2 s after it)."""
        before = float(self.env["OUTBOX_LEASE_SECONDS"]) + float(
            self.env["OUTBOX_PUBLISH_TIMEOUT_SECONDS"]
        )
        found = set()
        # Looked up once per process, not per call (an hour's soak logs 144,000).
        dead = {pid for pid in {c[4] for c in calls} if pid in self.victims or not _alive(pid)}
        for message_id, attempt, _, _, pid, at in calls:
            died = pid in dead
            during = any(start - before <= at <= end + 2.0 for start, end in self.windows)
            if died or during:
                found.add((message_id, attempt))
        return found

    def close(self) -> None:
        self.procs.stop_all()
        self.receiver.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
