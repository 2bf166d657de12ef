"""One run of a durable task in a worker: fence, attempt, body, fenced finalize.

    begin (fence check, attempt counted) -> body (lease renewed meanwhile)
      -> done + next chain step, in the body's own transaction (fenced)
      -> or: reschedule / dead from the task's Celery retry options (fenced)

A run whose fence fails before the body (the row was finished, rescued or
re-claimed since the message was sent) skips the body. A run whose fence
fails at the end (its lease lapsed meanwhile and another run holds the row)
rolls its effect back: only the holder of the current lease commits one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
import psycopg.errors
from celery.exceptions import Retry

from .. import store
from ..db import PoolDatabase
from ..errors import ConfigError, OutboxError, PermanentError
from ..model import Claimed, LeaseRef, Outcome
from ..services.keeper import renewal_period
from ..services.policy import RetryPolicy, classify_task
from . import names
from .durable import (
    HEADER_ID,
    HEADER_LEASE_VERSION,
    follows,
    plain_options,
    row_lease,
    write_step,
)
from .events import Observers
from .identity import origin_headers
from .options import annotations_for, retry_policy
from .sender import argsrepr, kwargsrepr

if TYPE_CHECKING:
    from ..config import Settings
    from .runtime import Installation, Services

__all__ = [
    "begin_margin",
    "current_connection",
    "follow_hold",
    "lease_from_request",
    "run",
    "running",
]

log = logging.getLogger("outbox_relay.durable")
T = TypeVar("T")
_RUNS_LOCK = threading.Lock()

_local = threading.local()

# A run that ends well takes the next due row of its task in the transaction
# of its done, and its process runs that row at once, as the worker would
# have run its message: for up to FOLLOW_SECONDS from the start of the
# message that began it ("following", docs/durable.md). Each row so run
# saves its send, its trip through the broker and the worker's main
# process, its claim and its own begin.
FOLLOW_SECONDS = 0.5
# A message that waited in the queue this share of its lease or more runs
# alone: the queue behind it is long, and rows run after it would make the
# messages behind it wait longer still, past their expiry (each message's
# run would hold its pool process for FOLLOW_SECONDS).
FOLLOW_WAITED_SHARE = 0.25


def follow_hold(settings: Settings) -> timedelta:
    """How long a claim may leave a following task's due row in the table
    for its runs to take while its queue is long (store.claim_batch,
    ``hold``): the share of the relay's lease a message may wait in the
    queue and still be followed. It bounds what a queue the broker lost, or
    a worker that does not follow, costs the rows held behind it."""
    return timedelta(seconds=FOLLOW_WAITED_SHARE * settings.lease_seconds)


@dataclass
class _Following:
    """The rows one message's pool slot runs after its own (thread-local)."""

    until: float
    # What every row's request takes from the message's (the worker's host
    # name, the queue it came from).
    request: dict[str, Any]
    # The next row, taken with the last done; the row running now.
    taken: store.Began | None = None
    running: store.Began | None = None


# The task attributes Celery's autoretry reads; here they become the policy.
_RETRY_OPTIONS = (
    "autoretry_for",
    "max_retries",
    "retry_backoff",
    "retry_backoff_max",
    "retry_jitter",
    "default_retry_delay",
)


# A finished run frees a lease; at most this often per process it asks for a
# claim (which claims only when enough leases are free, see tasks.hint_room). The
# relay's own resumption after its in-flight cap (a claim queued behind the
# deliveries) does not work for tasks on queues of their own, and beat's tick
# alone would pace a capped relay at one batch per interval.
CLAIM_HINT_SECONDS = 0.5
_hint_lock = threading.Lock()
_last_hint = [0.0]


def _hint_claim(task: Any) -> None:
    now = time.monotonic()
    with _hint_lock:
        if now - _last_hint[0] < CLAIM_HINT_SECONDS:
            return
        _last_hint[0] = now
    from .tasks import hint_args

    claim = task.app.tasks.get(names.CLAIM)
    if claim is None:
        return
    try:
        inst = _installation(task)
        claim.apply_async(
            hint_args(inst.settings, last_round=True),
            serializer="json",
            headers=origin_headers(inst.identity()),
        )
    except Exception:  # a hint; beat's tick is the safety net
        log.debug("could not send a claim hint", exc_info=True)


def begin_margin(lease_seconds: float) -> float:
    """The lease a run must have left to begin: two renewal periods (so the
    keeper renews it in time), at most half the lease. The relay's message
    expires once less than this is left."""
    return min(lease_seconds / 2.0, 2.0 * renewal_period(lease_seconds))


def lease_from_request(request: Any) -> LeaseRef | None:
    """``(outbox id, lease_version)`` from a task request's headers, if sent by the relay."""
    headers = getattr(request, "headers", None) or {}

    def read(name: str) -> Any:
        value = headers.get(name) if isinstance(headers, dict) else None
        return value if value is not None else getattr(request, name, None)

    outbox_id, version = read(HEADER_ID), read(HEADER_LEASE_VERSION)
    if outbox_id is None or version is None:
        return None
    try:
        return LeaseRef(int(outbox_id), int(version))
    except (TypeError, ValueError):
        return None


@dataclass
class _Run:
    """One tracked run (thread-local: the threads pool runs many at once).

    ``conn`` is held for the whole run: the fence check, the body's effect
    transaction (opened on first use of ``outbox_conn``) and the finalize.
    Outside that transaction it is in autocommit, so the fence check and the
    attempt it counts commit before the body starts.
    """

    conn: psycopg.Connection[Any]
    services: Services
    stack: ExitStack = field(default_factory=ExitStack)
    in_transaction: bool = False

    def connection(self) -> psycopg.Connection[Any]:
        if not self.in_transaction:
            self.stack.enter_context(self.conn.transaction())
            self.in_transaction = True
        return self.conn

    def commit(self) -> None:
        self.in_transaction = False
        self.stack.close()

    def rollback(self) -> None:
        if not self.in_transaction:
            return
        self.in_transaction = False
        try:
            # psycopg's transaction block rolls back on psycopg.Rollback, and swallows it.
            self.stack.__exit__(psycopg.Rollback, psycopg.Rollback(), None)
        except psycopg.Error:
            # The session is gone (the server ended it): so is the transaction.
            log.warning("could not roll back a durable task's transaction", exc_info=True)

    def write(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """A finalize outside the body's transaction: on the run's session, or
        on a relay connection when that session was lost."""
        if not self.conn.broken:
            try:
                return fn(self.conn)
            except psycopg.OperationalError:
                if not self.conn.broken:
                    raise
        return self.services.db.run(fn)


_BOUNDS: weakref.WeakKeyDictionary[psycopg.Connection[Any], float] = weakref.WeakKeyDictionary()


def _session(
    services: Services, inst: Installation
) -> AbstractContextManager[psycopg.Connection[Any]]:
    """A session of the per-process pool of durable runs (made on first use)."""
    with _RUNS_LOCK:
        if services.runs_db is None:
            s = inst.settings
            services.runs_db = PoolDatabase(
                s.require_dsn(),
                size=s.pool_size,
                # One session per concurrent run: a threads pool runs many.
                max_size=max(s.pool_size, 64),
                name=f"outbox-relay-runs-{os.getpid()}",
                timeout=s.database_timeout,
                session_timeouts=False,
                transaction_pooling=s.transaction_pooling,
            )
        return services.runs_db.connection()


def _bound(conn: psycopg.Connection[Any], seconds: float) -> None:
    # Session settings, set once per session and bound (one round trip saved per run).
    if _BOUNDS.get(conn) != seconds:
        store.bound_session(conn, seconds)
        _BOUNDS[conn] = seconds


def running() -> bool:
    """Whether a tracked durable run is under way in this thread."""
    return getattr(_local, "run", None) is not None


def current_connection() -> psycopg.Connection[Any]:
    """The running durable task's effect connection (see ``DurableTask.outbox_conn``)."""
    current: _Run | None = getattr(_local, "run", None)
    if current is None:
        raise OutboxError(
            "outbox_conn is available only while a durable task runs as sent by the relay "
            "(write it with task.enqueue(conn, ...) or write_durable(), not .delay())"
        )
    return current.connection()


def _installation(task: Any) -> Installation:
    inst = getattr(task.app, "outbox_relay", None)
    if inst is None:
        raise ConfigError(
            f"task {task.name}: a DurableTask runs in an app the relay is installed in "
            "(outbox_relay.install(app, ...)); this worker's app has none"
        )
    return inst  # type: ignore[no-any-return]


def _policy(task: Any, inst: Installation) -> RetryPolicy:
    cached = task.__dict__.get("_outbox_policy")
    if cached is None:
        options = {n: getattr(task, n) for n in _RETRY_OPTIONS if hasattr(task, n)}
        cached = retry_policy(inst.settings, options, annotations_for(task.app, task.name))
        # A database connection lost or a statement cancelled (the run's
        # transaction is bounded by its lease) is the infrastructure's
        # failure, not the body's: retried like autoretry_for's classes.
        retry_on = (
            *cached.retry_on,
            psycopg.OperationalError,
            psycopg.errors.IdleInTransactionSessionTimeout,
        )
        cached = dataclasses.replace(cached, retry_on=retry_on)
        task.__dict__["_outbox_policy"] = cached
    return cached  # type: ignore[no-any-return]


def _max_run(task: Any) -> float:
    cached = task.__dict__.get("_outbox_max_run")
    if cached is None:
        limit = task.time_limit or task.app.conf.get("task_time_limit")
        cached = float(limit) if limit else float(task.outbox_max_run_seconds)
        task.__dict__["_outbox_max_run"] = cached
    return float(cached)


def run(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``DurableTask.__call__``: a tracked run when the relay sent it, else the body."""
    # Celery wraps run() for autoretry_for; the original body never retries
    # through the broker (the row's reschedule is the retry).
    body = getattr(task, "_orig_run", None) or task.run
    ref = lease_from_request(task.request)
    if ref is None:
        # Called directly, or sent without the outbox (.delay()): untracked.
        return body(*args, **kwargs)
    inst = _installation(task)
    services = inst.services()
    settings = inst.settings
    lease = float(task.outbox_lease_seconds or settings.lease_seconds)
    max_run = _max_run(task)
    following: _Following | None = getattr(_local, "following", None)
    if following is not None and following.running is None:
        # Left by a run whose after_return never came (Celery's tracer skips
        # it for a run it retries): nothing of it runs any more.
        _local.following = None
        _give_back(inst, following)
        following = None
    if following is None:
        # This message's run; its after_return runs the rows it takes.
        following = _may_follow(task, inst)
        _local.following = following
    with _session(services, inst) as conn:
        if not settings.transaction_pooling:
            # Through a pooler in transaction mode a session setting would
            # outlive the run in a server session other clients use.
            _bound(conn, max_run + lease)
        current = _Run(conn, services)
        return _tracked(task, inst, current, ref, lease, max_run, body, args, kwargs, following)


def follow_after(task: Any) -> None:
    """``DurableTask.after_return``: run the rows this message's run took.

    After Celery's tracer has reported the run (its state, its result, its
    log line with its own runtime), before it lets the worker have the pool
    process back. A row run here comes back to this function too: only the
    message's own after_return goes on."""
    following: _Following | None = getattr(_local, "following", None)
    if following is None or following.running is not None:
        return
    try:
        _follow(task, following)
    finally:
        _local.following = None
        _give_back(_installation(task), following)


def _may_follow(task: Any, inst: Installation) -> _Following | None:
    """Whether this message's run may take and run its task's next rows.

    Not for a task the worker meters (``rate_limit``) or times (a time
    limit of the task, the call or the worker counts from the message, and a
    row run after it would have less), nor for a call that did not come from
    a worker's queue, nor for a task whose own ``after_return`` might not
    hand over to ours."""
    request = task.request
    if (
        not follows(task)
        or inst.time_limited
        or any(getattr(request, "timelimit", None) or ())
        or getattr(request, "is_eager", False)
        or not getattr(request, "delivery_info", None)
    ):
        return None
    template = {
        "hostname": request.hostname,
        "delivery_info": {**request.delivery_info, "redelivered": False},
        "is_eager": False,
    }
    return _Following(time.monotonic() + FOLLOW_SECONDS, template)


def _follow(task: Any, following: _Following) -> None:
    """Run the rows taken with each done, one after another, as the worker
    runs a message: through the task's tracer (its signals, its result and
    state in the result backend, its log lines), with the task events the
    worker's main process would have sent for it when it sends them (-E)."""
    inst = _installation(task)
    tracer = task.__trace__ or task.__dict__.get("_outbox_tracer")
    if tracer is None:
        from celery.app.trace import build_tracer

        hostname = following.request["hostname"]
        tracer = build_tracer(task.name, task, app=task.app, hostname=hostname)
        task.__dict__["_outbox_tracer"] = tracer
    with ExitStack() as stack:
        events: Any = None
        if inst.task_events:
            hostname = following.request["hostname"]
            try:
                events = stack.enter_context(task.app.events.default_dispatcher(hostname=hostname))
            except Exception:  # monitoring never stops a run
                log.debug("could not open a task event dispatcher", exc_info=True)
        while following.taken is not None:
            request = _request_for(task, following, following.taken)
            if request is None:  # written by hand, or by a release that knew another layout
                _give_back(inst, following)
                continue
            if not _routed_here(task, request):
                # The app's router sends this row's message elsewhere (by
                # its arguments): to the queue it routes to, by a claim.
                _give_back(inst, following)
                return
            began, following.taken = following.taken, None
            following.running = began
            try:
                _event(events, "task-received", request, name=task.name, retries=0)
                _event(events, "task-started", request)
                traced = tracer(request["id"], request["args"], request["kwargs"], request)
            except Exception:
                # Celery's tracer reports a body's failure itself; this is its
                # own (a result backend down). The row's lease decides.
                log.exception("running %s[%s] after another: stopped", task.name, request["id"])
                return
            finally:
                following.running = None
            _traced_event(events, request, traced)


def _request_for(task: Any, following: _Following, began: store.Began) -> dict[str, Any] | None:
    """The request a worker would have built for the row's message, as the
    relay sends it (durable_send: its task id, arguments and lease headers)."""
    payload = began.claimed.payload if isinstance(began.claimed.payload, dict) else {}
    try:
        task_id = str(payload["id"])
        args = list(payload.get("args") or [])
        kwargs = dict(payload.get("kwargs") or {})
    except (KeyError, TypeError, ValueError):
        return None
    ref = began.claimed.ref
    lease = {HEADER_ID: ref.id, HEADER_LEASE_VERSION: ref.lease_version}
    return {
        **following.request,
        **lease,
        "id": task_id,
        "task": task.name,
        "root_id": task_id,
        "parent_id": None,
        "correlation_id": task_id,
        "headers": lease,
        "timelimit": [None, None],
        "retries": 0,
        "argsrepr": argsrepr([ref]),
        "kwargsrepr": kwargsrepr(kwargs),
        "args": args,
        "kwargs": kwargs,
    }


def _routed_here(task: Any, request: dict[str, Any]) -> bool:
    """Whether the row's message would come where the message being run
    came from: the app's routes (``task_routes``) may route a task by its
    arguments. Without routes, every plain call of a task goes to one place."""
    if not task.app.conf.task_routes:
        return True
    own = {k: v for k, v in task._get_exec_options().items() if v is not None}
    route = task.app.amqp.router.route(own, task.name, request["args"], request["kwargs"], task)
    queue = route.get("queue")
    exchange = getattr(getattr(queue, "exchange", None), "name", None)
    info = request["delivery_info"] or {}
    return (exchange, getattr(queue, "routing_key", None)) == (
        info.get("exchange"),
        info.get("routing_key"),
    )


def _event(events: Any, kind: str, request: dict[str, Any], **fields: Any) -> None:
    if events is None:
        return
    if kind == "task-received":
        fields.update(
            args=request["argsrepr"],
            kwargs=request["kwargsrepr"],
            root_id=request["root_id"],
            parent_id=request["parent_id"],
        )
    try:
        events.send(kind, uuid=request["id"], **fields)
    except Exception:  # monitoring never fails a run
        log.debug("could not send task event %s", kind, exc_info=True)


def _traced_event(events: Any, request: dict[str, Any], traced: Any) -> None:
    """The worker's event for how a run ended, from the tracer's answer."""
    if events is None:
        return
    # For a retry or a failure the tracer's first value is the ExceptionInfo
    # it logged, whose formatted traceback the worker's events carry too.
    einfo, info, runtime, result_repr = traced
    if info is None:
        _event(events, "task-succeeded", request, result=result_repr, runtime=runtime)
        return
    tb = str(getattr(einfo, "traceback", None) or "")
    if info.state == "RETRY":  # rescheduled in the database; Retry wraps the cause
        exc = getattr(info.retval, "exc", None) or info.retval
        _event(events, "task-retried", request, exception=repr(exc), traceback=tb)
    else:
        _event(events, "task-failed", request, exception=repr(info.retval), traceback=tb)


def _give_back(inst: Installation, following: _Following) -> None:
    """A row taken to follow and not run: due again at once, its attempt refunded."""
    began, following.taken = following.taken, None
    if began is None:
        return
    outcome = Outcome.release(
        began.claimed, reason="taken to run after another, not run", refund_attempt=True
    )
    try:
        inst.services().db.run(
            lambda conn: store.finalize(conn, [outcome], table=inst.settings.outbox_table)
        )
    except Exception:  # its lease lapses; the rescuer frees it
        log.warning("could not give back outbox #%s", began.claimed.id, exc_info=True)


def _tracked(
    task: Any,
    inst: Installation,
    current: _Run,
    ref: LeaseRef,
    lease: float,
    max_run: float,
    body: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    following: _Following | None,
) -> Any:
    table = inst.settings.outbox_table
    needed = timedelta(seconds=begin_margin(lease))
    observers = Observers(list(inst.observers))
    began: store.Began | None
    if (
        following is not None
        and following.running is not None
        and (following.running.claimed.ref == ref)
    ):
        began = following.running  # taken and begun with the done before it
    else:
        began = current.write(
            lambda conn: store.begin(
                conn, [ref], needed=needed, count_attempt=True, chain_only=True, table=table
            )
        ).get(ref.id)
    if began is None:  # begin's statement is fenced on ref's lease version
        log.info(
            "skipping %s[%s]: outbox #%s v%s is no longer processing under this lease",
            task.name,
            task.request.id,
            ref.id,
            ref.lease_version,
        )
        observers.stale(ref, "not held under this lease version")
        return None
    if not began.started:
        # Too little lease left to renew it in time: give the row back now.
        reason = f"too little lease left ({began.lease_left_seconds:.1f}s) to begin"
        current.write(
            lambda conn: store.finalize(conn, [Outcome.release(ref, reason=reason)], table=table)
        )
        log.info("not running %s[%s]: outbox #%s %s", task.name, task.request.id, ref.id, reason)
        return None
    if (
        following is not None
        and following.running is None
        and began.lease_left_seconds
        < (1.0 - FOLLOW_WAITED_SHARE)
        * row_lease(began.claimed.headers, inst.settings.lease_seconds)
    ):
        following = None  # this message waited long: the queue goes first
    claimed = began.claimed
    if following is None and claimed.headers.get("follows"):
        _warn_not_following(task, inst)
    keeper = current.services.keeper_for(lease)
    _local.run = current
    try:
        with keeper.hold([(ref, began.lease_left_seconds)], max_hold=max_run):
            try:
                result = body(*args, **kwargs)
                return _succeeded(
                    task, inst, current, claimed, result, observers, began, lease, following
                )
            except Exception as exc:
                current.rollback()
                _failed(task, inst, current, claimed, exc, observers, began.age_seconds)
                raise
    finally:
        _local.run = None
        current.rollback()  # a no-op after a commit; else the effect goes


def _warn_not_following(task: Any, inst: Installation) -> None:
    """Once per task and process: its producer marked its rows as rows a run
    takes (durable.follows in the producer's app), and this worker's does
    not follow (a time limit or rate limit set for the worker alone). The
    claims then leave such rows in the table while the task's queue is long,
    up to ``follow_hold`` each, for runs that never take them."""
    if (follows(task) and not inst.time_limited) or task.__dict__.get("_outbox_warned_follow"):
        return
    task.__dict__["_outbox_warned_follow"] = True
    log.warning(
        "%s: its producer expects its runs to take its next rows as they end "
        "(outbox_follow), but this worker's runs do not (a time limit or rate limit set "
        "for the worker alone); while its queue is long, its rows wait up to %.0fs in the "
        "table before a claim sends them. Set the same limits where the producer "
        "imports the task, or outbox_follow = False on the task",
        task.name,
        follow_hold(inst.settings).total_seconds(),
    )


def _succeeded(
    task: Any,
    inst: Installation,
    current: _Run,
    claimed: Claimed,
    result: Any,
    observers: Observers,
    began: store.Began,
    lease: float,
    following: _Following | None,
) -> Any:
    table = inst.settings.outbox_table
    if following is not None and time.monotonic() >= following.until:
        following = None
    chain = list((claimed.payload or {}).get("chain") or [])
    outcome = Outcome.done(claimed)
    taken: store.Began | None = None

    def finish(conn: psycopg.Connection[Any], savepoint: bool) -> bool:
        nonlocal taken
        if following is not None:
            # The done and the take of the task's next row, in one statement.
            done, taken = store.done_and_take_durable(
                conn,
                claimed.ref,
                task=task.name,
                owner=current.services.claimer.owner(),
                lease=timedelta(seconds=lease),
                options=plain_options(task),
                max_attempts=inst.settings.max_attempts,
                table=table,
            )
        else:
            # The effect transaction commits or rolls back whole: no savepoint.
            done = claimed.id in store.finalize(conn, [outcome], table=table, savepoint=savepoint)
        if not done:
            return False
        if chain:
            step = dict(chain[0])
            if not step.get("immutable"):
                # Celery's chain rule: a step receives the previous result first.
                step["args"] = [result, *list(step.get("args") or ())]
            try:
                write_step(conn, inst.outbox, task.app, step, chain[1:])
            except psycopg.errors.InsufficientPrivilege as exc:
                # The relay's own grants have no INSERT; a chain's worker needs
                # it. Dead at once: no retry succeeds until a person grants it.
                raise PermanentError(
                    f"the chain's next step ({step.get('task')}) cannot be written: this "
                    f"worker's role {conn.info.user!r} may not insert into "
                    f"{table.qualified} ({exc.diag.message_primary}). Give it the producer's "
                    f"grants too (`{table.grant_command(conn.info.user, 'producer')}`), then "
                    f"`{table.command(f'dead retry {claimed.id}')}`"
                ) from None
        return True

    if chain or following is not None:
        # The successor (a chain's next step, the task's next row taken to
        # follow) commits with this row's done.
        current.connection()
    if current.in_transaction:
        done = finish(current.conn, False)
        if done:
            current.commit()
            if following is not None:
                following.taken = taken
        else:
            current.rollback()
    else:
        done = current.write(lambda conn: finish(conn, True))
    if not done:
        log.info(
            "%s[%s] finished but outbox #%s v%s was no longer its to finish (its lease lapsed "
            "and another run holds the row): its effect was rolled back",
            task.name,
            task.request.id,
            claimed.id,
            claimed.lease_version,
        )
        observers.lost_lease(claimed.ref, "finalize")
        return result
    observers.finalized(claimed, outcome, began.age_seconds)
    _hint_claim(task)
    return result


def _failed(
    task: Any,
    inst: Installation,
    current: _Run,
    claimed: Claimed,
    exc: Exception,
    observers: Observers,
    age_seconds: float,
) -> None:
    """Record a failed body; raise Retry when it is rescheduled (else the caller re-raises)."""
    table = inst.settings.outbox_table
    outcome = classify_task(exc, claimed, _policy(task, inst), age_seconds=age_seconds)
    changed = current.write(lambda conn: store.finalize(conn, [outcome], table=table))
    if claimed.id not in changed:
        log.info(
            "%s[%s] failed, but outbox #%s v%s is no longer its lease: the current holder decides",
            task.name,
            task.request.id,
            claimed.id,
            claimed.lease_version,
        )
        observers.lost_lease(claimed.ref, "finalize")
        return
    observers.finalized(claimed, outcome, age_seconds)
    _hint_claim(task)
    if outcome.status == "pending":
        seconds = outcome.delay.total_seconds()
        from .tasks import claim_when_due

        claim_when_due(inst, seconds)  # the retry runs when due, not at the next tick
        log.info(
            "%s[%s]: outbox #%s rescheduled in %.1fs (attempt %s): %s",
            task.name,
            task.request.id,
            claimed.id,
            seconds,
            claimed.attempts,
            outcome.error,
        )
        # Celery's RETRY state for monitoring; nothing is sent to the broker
        # (the row's available_at is the retry).
        raise Retry(
            f"rescheduled in the database, due in {seconds:.1f}s: {outcome.error}",
            exc=exc,
            when=seconds,
        ) from exc
