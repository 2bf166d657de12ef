"""The relay's Celery tasks: glue between Celery and the services.

``outbox_relay.claim`` (claimer + fan-out), ``deliver`` / ``deliver_batch``
(deliverer), ``rescue`` (rescuer) and ``purge`` (purger). Rules they follow,
each one a way Celery loses or repeats work:

* Claim, commit, then fan out; never publish inside the claim transaction.
* Fan-out messages carry only ``(id, lease_version)`` and expire before the
  lease ends, so a backlogged task is dropped instead of publishing late.
* No ``Task.retry``, countdown or ETA: a failure is one fenced UPDATE that
  sets ``available_at``; the task itself returns normally. (Claims, which
  carry no message, may be sent with a short countdown: held back by the
  in-flight cap, or for when a retry falls due, see wake.py.)
* The broker message is a hint. If it is lost, the lease expires and the
  rescuer frees the row; if it arrives twice or late, the fence turns it away.
* No explicit ``queue=``: routing (the user's ``task_routes``, then the
  relay's own route to ``OUTBOX_QUEUE``) decides.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import psycopg

from .._redact import connect_error
from .._throttle import Throttle
from ..model import LeaseRef, Outcome
from ..services import DeliveryReport
from ..store.relay import Began, Rescued
from . import names
from .fanout import CHUNK_PAYLOAD_BYTES, chunk_size_for, fan_out
from .identity import origin_headers, send_back_if_foreign
from .options import annotations_for, time_limits

if TYPE_CHECKING:
    from ..config import Settings
    from .runtime import Installation

__all__ = [
    "FOLLOW_SECONDS",
    "HELD_BACK_SECONDS",
    "MAX_HELD_BACK_ROUNDS",
    "claim_when_due",
    "hint_args",
    "hint_room",
    "register_tasks",
]

log = logging.getLogger("outbox_relay.celery")

# Consecutive claim rounds that may find the in-flight cap reached before a
# drain stops and leaves the rest to beat (leases held by a dead worker, say,
# which the rescuer frees once they expire).
MAX_HELD_BACK_ROUNDS = 5
# The first held-back round looks again after this long, each next one after
# twice as long (0.1 + 0.2 + ... + 1.6 s in all).
HELD_BACK_SECONDS = 0.1
# Claims one claim task makes in a row while each only parks ordered rows
# (see claim_round): 40 rounds park 20,000 rows in about half a second.
PARKING_ROUNDS = 40

# How long a delivery task goes on delivering the next messages of the
# ordered aggregates it advanced (follow), before it leaves them to a claim:
# long enough for hundreds of one aggregate's messages, short enough that the
# tasks queued behind it in its process wait no longer than a beat tick.
FOLLOW_SECONDS = 0.5


def hint_room(settings: Settings) -> int:
    """The room a claim hint needs before it claims: a quarter of a batch (or
    of the cap). A hint that finds less is one count of the live leases.

    Hints are the claims sent as deliveries start or finish, after a NOTIFY,
    or by a finished durable task; each would otherwise take whatever room
    one finished chunk left (under a steady stream of new rows: claims of a
    chunk each, and hints that found the cap full, took half the pool).
    Beat's tick claims whatever the room.
    """
    cap = settings.max_in_flight or settings.batch_size
    return max(1, min(settings.batch_size, cap) // 4)


def hint_args(
    settings: Settings, *, last_round: bool = False, contend: bool = False
) -> tuple[int, int, bool]:
    """A claim hint's arguments, ``claim(held_back, min_room, contend)``: it
    needs ``hint_room`` and, unless ``contend``, leaves the rows to a claim in
    progress (a drain's hints, a finished durable task's). ``last_round``:
    sent as the last held-back round, so a hint that finds the cap reached
    stops there instead of starting a chain of claims that only count it (the
    listener's and a durable task's: the next NOTIFY or finished run hints
    again).
    """
    return (MAX_HELD_BACK_ROUNDS if last_round else 0, hint_room(settings), contend)


# Every relay task takes ``*later, **later_options`` and ignores them: the
# arguments a later release adds. In a rolling upgrade the workers of this
# release take the later release's tasks from the same queue, and a claim
# with one argument more failed with a TypeError in each of them (383 in 40 s
# in a walkthrough, docs/operations.md, Upgrading). A release that adds an
# argument keeps its old meaning as the default, so ignoring it is safe.
#
# shared=False: Celery would otherwise add a task to every app created in the
# process, and a second app's relay tasks would run with the first app's
# installation (its database, its publisher).
_TASK = {
    "bind": True,
    "ignore_result": True,
    "serializer": "json",
    "typing": False,
    "shared": False,
}


def register_tasks(app: Any, inst: Installation) -> dict[str, Any]:
    """Define the relay tasks on ``app``; return them by short name."""

    def send(task: Any, args: tuple[Any, ...] = (), **options: Any) -> None:
        _send(task, args, headers=origin_headers(inst.identity()), **options)

    def foreign(task: Any) -> bool:
        """Another relay's task, sent back to the queue (see celery/identity.py)."""
        # The queue's name only for the error line: routing it is not free.
        return send_back_if_foreign(task, inst.identity(), inst.queue_as_written)

    def after_delivery(report: DeliveryReport, refs: list[LeaseRef]) -> dict[str, int] | str:
        if report.ordered_finished > report.followed:
            # An ordered message is done and its aggregate's next one was not
            # taken by this task (_Follow): a claim takes it. Without this an
            # aggregate would advance one message per tick.
            send(claim)
        if report.took:
            # Rows this task claimed for itself (_Follow.take): its claims
            # held the claim lock, and a drain's next claim that met one gave
            # way to it (contend=False) as to a claim that drains on. This one
            # carries the drain on in its place.
            send(claim, hint_args(inst.settings, contend=True))
        if report.retried or report.released:
            # Rows given back wait for a claim: one when the first falls due.
            waits = [o.delay.total_seconds() for o in report.outcomes if o.status == "pending"]
            if report.released:
                waits.append(0.0)  # given back unpublished: due now
            claim_when_due(inst, min(waits, default=None))
        if len(refs) == 1:
            # One message: what became of it, as one word. Celery reprs every
            # result for its log and events; a dict's repr cost a twentieth
            # of a per-message delivery.
            return _one_outcome(report)
        result = {"done": report.done, "retried": report.retried, "dead": report.dead}
        if report.took:
            # Of those, the rows this task took itself (_Follow.take).
            result["took"] = report.took
        return result

    def drained(drain: bool | str, refs: list[LeaseRef]) -> dict[str, int] | str:
        # ``drain`` (see fan_out): this task is halfway through a round of a
        # drain; it sends the next claim as it starts ("start", or True), or
        # once its own rows are finished ("end": the round was cut short by
        # the in-flight cap, and only finished rows make room).
        follow = _Follow(inst)
        if drain and drain != "end":
            send(claim, hint_args(inst.settings))
        services = inst.services()
        try:
            return after_delivery(services.deliverer.deliver(refs, follow), refs)
        finally:
            if drain == "end":
                # The claim counts the room this task's row makes: its done
                # written now, not by the completer a moment later.
                services.deliverer.flush()
                send(claim, hint_args(inst.settings))

    @app.task(name=names.DELIVER, **_TASK)  # type: ignore[untyped-decorator]
    def deliver(
        self: Any,
        outbox_id: int,
        lease_version: int,
        drain: bool | str = False,
        *later: Any,
        **later_options: Any,
    ) -> dict[str, int] | str:
        """Deliver one leased message (the default, one task per message);
        returns what became of it: done, retried, dead, released, stale or lost
        (or foreign: another relay's task, sent back to the queue)."""
        if foreign(self):
            return "foreign"
        return drained(drain, [LeaseRef(int(outbox_id), int(lease_version))])

    @app.task(name=names.DELIVER_BATCH, **_TASK)  # type: ignore[untyped-decorator]
    def deliver_batch(
        self: Any,
        refs: list[list[int]],
        drain: bool | str = False,
        *later: Any,
        **later_options: Any,
    ) -> dict[str, int] | str:
        """Deliver a chunk: one begin, concurrent publishes, one batched finalize."""
        if foreign(self):
            return "foreign"
        return drained(drain, [LeaseRef(int(i), int(v)) for i, v in refs])

    @app.task(name=names.CLAIM, **_TASK)  # type: ignore[untyped-decorator]
    def claim(
        self: Any,
        held_back: int = 0,
        min_room: int = 0,
        contend: bool = True,
        *later: Any,
        **later_options: Any,
    ) -> dict[str, int]:
        """Claim due rows under the cap and fan them out; keep draining while
        batches come back full. ``held_back`` counts the rounds in a row that
        found the cap reached; ``min_room``: claim only if the cap leaves at
        least that many (a finished durable task's hint); ``contend=False``:
        not if another claim is in progress (a hint; see Claimer.run_once)."""
        if foreign(self):
            return {"claimed": 0}
        try:
            services = inst.services()
            if services.rescuer.due(inst.settings.rescue_interval):
                # What it frees, this claim takes (see services/rescuer.py).
                _report_rescued(self, services.rescuer.run_once(), inst.outbox.table.qualified)
            return claim_round(int(held_back), int(min_room), bool(contend))
        except psycopg.OperationalError as exc:
            _database_away(inst, exc)
            return {"claimed": 0}

    def claim_round(held_back: int, min_room: int, contend: bool) -> dict[str, int]:
        """One claim and its fan-out (the claim task's, and the rescue task's)."""
        services = inst.services()
        result = services.claimer.run_once(min_room=min_room, contend=contend)
        # A claim that only parked rows (ordered ones waiting behind their
        # aggregate's unfinished row) has nothing to fan out, and so no
        # delivery task to send the drain's next claim: claim again here,
        # past them (about 13 ms a round of 500), a bounded number of times.
        for _ in range(PARKING_ROUNDS):
            if not result.parked_only:
                break
            result = services.claimer.run_once(min_room=min_room, contend=contend)
        if result.parked_only:
            send(claim, hint_args(inst.settings))  # the drain goes on in a task of its own
        if result.claimed:
            s = inst.settings
            delivery = names.DELIVER_BATCH if s.chunk_size > 1 else names.DELIVER
            more = result.full or result.capped
            fan_out(
                app,
                s,
                services.db,
                result.claimed,
                deliver=deliver,
                deliver_batch=deliver_batch,
                annotated=annotations_for(app, delivery),
                follow_up=(
                    (lambda producer: send(claim, hint_args(s), producer=producer))
                    if more
                    else None
                ),
                prefetched=inst.prefetched,
                processes=inst.concurrency,
                capped=result.capped,
                headers=origin_headers(inst.identity()),
            )
        elif result.capped and held_back < MAX_HELD_BACK_ROUNDS:
            # Backpressure: look again once deliveries had time to finish. At
            # once, the claim would come straight back from an empty queue
            # (the worker holds the whole backlog in its prefetch) and use up
            # its rounds in milliseconds; the drain would then wait for
            # beat's tick. A short countdown is no retry of a message: a lost
            # claim hint costs one beat interval.
            # min_room 1: a round that still finds the cap full is one count.
            # Only after a claim that took nothing: a round the cap cut short
            # carries the drain's next claim in its marked delivery task
            # (fan_out). Sent beside it, a held-back claim gave every such
            # round two successors, and the claims multiplied until they held
            # the pool (2026-12-07: 3,212 empty claims beside 802 deliveries
            # once every first attempt failed). Nor while a claim this
            # process sent for later runs by then (a wake-up, another
            # held-back round): that one looks at the cap in its place.
            countdown = inst.wake.take(
                HELD_BACK_SECONDS * 2**held_back, within=inst.settings.claim_interval_seconds
            )
            if countdown is not None:
                send(claim, (held_back + 1, max(1, min_room), contend), countdown=countdown)
        if not (result.full or result.capped or result.busy):
            # The last claim of a drain, or an idle one: rows that wait for
            # their time are claimed when it comes (celery/wake.py).
            try:
                claim_when_due(inst, services.claimer.next_due())
            except Exception:  # a wake-up; beat's tick is the safety net
                log.debug("could not look up the next due row", exc_info=True)
        return {"claimed": len(result.claimed)}

    @app.task(name=names.RESCUE, **_TASK)  # type: ignore[untyped-decorator]
    def rescue(self: Any, *later: Any, **later_options: Any) -> dict[str, int]:
        """Free expired leases (lost or stuck delivery tasks), whatever the room."""
        try:
            result = inst.services().rescuer.run_once()
            _report_rescued(self, result, inst.outbox.table.qualified)
            # And a claim here, not only in a task of its own: the rescue task
            # can be the only one of a tick that reaches this relay's workers
            # (see services/rescuer.py). Not if another claim is under way.
            claim_round(0, 0, False)
        except psycopg.OperationalError as exc:
            _database_away(inst, exc)
            return {"released": 0, "dead": 0}
        return {"released": len(result.released), "dead": len(result.dead)}

    @app.task(name=names.PURGE, **_TASK)  # type: ignore[untyped-decorator]
    def purge(self: Any, *later: Any, **later_options: Any) -> dict[str, int]:
        """Delete done rows older than OUTBOX_PURGE_AFTER_SECONDS, in bounded
        batches; while more are due, another purge task follows this one."""
        result = inst.services().purger.run_once()
        if result.more_left:
            # One run stops at its bound (100 batches of OUTBOX_PURGE_BATCH_SIZE,
            # 500,000 rows by default): a relay finishing more than that an
            # hour saw its table grow run after run, and nothing said so.
            log.info(
                "purge deleted %d done message(s) in %d batch(es) and more finished before "
                "%s are due: another purge task follows",
                result.deleted,
                result.batches,
                result.cutoff.isoformat(timespec="seconds"),
            )
            send(purge)
        return {
            "deleted": result.deleted,
            "batches": result.batches,
            "more_left": int(result.more_left),
        }

    return {
        "claim": claim,
        "deliver": deliver,
        "deliver_batch": deliver_batch,
        "rescue": rescue,
        "purge": purge,
    }


# While the database is away, at most one line this often per process.
AWAY_REPORT_SECONDS = 60.0
_away = Throttle(AWAY_REPORT_SECONDS)


def _database_away(inst: Installation, exc: psycopg.OperationalError) -> None:
    """A claim or rescue that could not reach the database (a failover, a
    restart, a cut link; a pool that found no connection in time): one
    warning a minute, not an ERROR and a traceback from Celery per tick (8
    in 20 s of an outage). The next tick tries again; nothing is lost."""
    due = _away.hit()
    if due is None:
        return
    # A statement timeout is a database that answers, but too late: a lock
    # held on the table (a migration, VACUUM FULL, a LOCK TABLE), not an outage.
    what = (
        "did not answer within OUTBOX_DATABASE_TIMEOUT_SECONDS (a lock held on the outbox table?)"
        if isinstance(exc, psycopg.errors.QueryCanceled)
        else "is not reachable"
    )
    log.warning(
        "outbox-relay: the database %s (%s): claims and rescues wait for it, each tick tries "
        "again (%d such tick(s) since the last such line)",
        what,
        connect_error(exc, inst.settings.dsn or ""),
        due.count,
    )


def _one_outcome(report: DeliveryReport) -> str:
    """One message's delivery report as one word."""
    for name in ("done", "retried", "dead", "released", "stale", "lost"):
        if getattr(report, name):
            return name
    return "nothing"


def _report_rescued(task: Any, result: Rescued, table: str) -> None:
    if result.dead:
        log.warning(
            "%d outbox message(s) in %s went dead: their lease expired on the last attempt "
            "(ids %s)",
            len(result.dead),
            table,
            _ids(result.dead),
        )
        for outbox_id in result.dead:
            # The same event a dead letter from a delivery sends, so one
            # monitor counts both.
            _event(
                task,
                "task-outbox-dead",
                outbox_id=int(outbox_id),
                reason="its lease expired on the last attempt",
            )
    if result.released:
        log.warning(
            "rescued %d expired lease(s): their deliveries did not finish within the lease "
            "(a task lost, stuck or still queued behind a backlog, or a done the database "
            "did not take in time); they are due again (ids %s). If this repeats while "
            "workers are busy, they are handed more rows than they deliver before a delivery "
            "task expires (OUTBOX_LEASE_SECONDS less a delivery's worst case): lower "
            "OUTBOX_MAX_IN_FLIGHT, or lengthen OUTBOX_LEASE_SECONDS",
            len(result.released),
            _ids(result.released),
        )
    if result.unparked:
        # Expected only while workers of an earlier release (which do not
        # promote) finish ordered rows, or after a change by hand.
        log.warning(
            "%d ordered message(s) in %s were parked behind a message that had finished "
            "and are due again (ids %s): something finished it without promoting the next "
            "(a worker of an earlier release, an UPDATE by hand)",
            len(result.unparked),
            table,
            _ids(result.unparked),
        )


class _Follow:
    """A delivery task goes on delivering (Deliverer.deliver's ``follow``)
    for up to FOLLOW_SECONDS, never past its soft time limit:

    * the next message of each ordered aggregate it advanced, leased and
      begun in the transaction of the done before it. Each message of an
      aggregate otherwise waited for a claim task and a delivery task to
      cross the broker (about 25 ms: 40 a second for one aggregate);
    * with a publisher that waits (``take``), the next chunk of due rows,
      claimed while its own chunk publishes: a pool process then keeps two
      chunks in flight instead of idling through the wait.
    """

    def __init__(self, inst: Installation) -> None:
        self.inst = inst
        self.started = time.monotonic()
        self.soft, _ = time_limits(inst.settings)

    def wants(self, rows: int) -> bool:
        elapsed = time.monotonic() - self.started
        worst = self.inst.services().deliverer.worst_seconds(rows)
        return elapsed < FOLLOW_SECONDS and elapsed + worst < self.soft

    def finish(
        self, conn: psycopg.Connection[Any], writes: list[Outcome]
    ) -> tuple[set[int], list[Began]]:
        return self.inst.services().claimer.finish_and_take(conn, writes)

    def take(self, limit: int) -> list[Began]:
        s = self.inst.settings
        size = chunk_size_for(s.chunk_size, s.max_in_flight, self.inst.concurrency)
        return self.inst.services().claimer.take_chunk(min(size, limit), CHUNK_PAYLOAD_BYTES)


def claim_when_due(inst: Installation, delay: float | None) -> None:
    """Send a claim for when a row due in ``delay`` seconds falls due, unless
    beat's tick or a claim already sent comes in time (celery/wake.py)."""
    if delay is None:
        return
    interval = inst.settings.claim_interval_seconds
    countdown = inst.wake.take(delay, within=interval)
    claim = inst.app.tasks.get(names.CLAIM)
    if countdown is None or claim is None:
        return
    # Expires with the tick that would have claimed the row anyway.
    headers = origin_headers(inst.identity())
    _send(claim, countdown=countdown, expires=countdown + interval, headers=headers)


def _send(task: Any, args: tuple[Any, ...] = (), **options: Any) -> None:
    """Send a claim hint; a failure is only logged (beat's tick is the safety net).

    No expiry unless given: the claim task's default (a tick's interval, see
    install._expire_ticks) would cut a drain's chain of claims short behind
    a deep queue."""
    options.setdefault("expires", None)
    try:
        task.apply_async(args, serializer="json", **options)
    except Exception:
        log.warning("could not send %s; the next beat tick will", task.name, exc_info=True)


def _event(task: Any, kind: str, **fields: Any) -> None:
    """A custom task event; best effort (monitoring never fails the relay)."""
    try:
        task.send_event(kind, **fields)
    except Exception:
        log.debug("could not send task event %s", kind, exc_info=True)


def _ids(ids: list[int], limit: int = 10) -> str:
    shown = ", ".join(map(str, ids[:limit]))
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")
