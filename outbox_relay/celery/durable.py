"""Durable Celery tasks: a task whose *execution* its outbox row tracks.

    @app.task(base=DurableTask, autoretry_for=(TimeoutError,), max_retries=3,
              retry_backoff=True)
    def charge(self, order_id): ...

    with conn.transaction():            # the business transaction
        conn.execute("INSERT INTO orders ...")
        charge.enqueue(conn, order_id)  # one outbox row, same transaction

The row (``event_type = "celery.durable"``) holds the task's name, arguments,
routing options, its fixed task id and the rest of its chain. The relay sends
the task itself (no ``outbox_relay.deliver`` hop) with ``(outbox id,
lease_version)`` in its headers; the worker checks that fence before the
body, counts the attempt, renews the lease while the body runs, and
finalizes ``done`` fenced at the end, in one transaction with whatever the
body wrote through ``self.outbox_conn``. Failures are rescheduled in the
database from the task's own Celery retry options, never with
``Task.retry``. See docs/durable.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import psycopg
from celery import Task, signals
from kombu.utils.uuid import uuid

from ..errors import ConfigError, InvalidMessage, RetryableError
from ..producer import DURABLE_EVENT_TYPE, NewMessage, enqueue_many

if TYPE_CHECKING:
    from celery.result import AsyncResult

    from ..outbox import Outbox

__all__ = [
    "DURABLE_EVENT",
    "HEADER_ID",
    "HEADER_LEASE_VERSION",
    "DurableTask",
    "is_durable",
    "prepare_durable",
    "step_message",
    "write_durable",
    "write_step",
]

DURABLE_EVENT = DURABLE_EVENT_TYPE
# Not the celery: publisher's outbox-id / outbox-lease-version: a task that
# publisher sends is not tracked by its row, and must never be taken for one.
HEADER_ID = "outbox-durable-id"
HEADER_LEASE_VERSION = "outbox-durable-lease-version"

# Options a durable row keeps for the relay's send: routing and time limits.
_SEND_OPTIONS = ("queue", "routing_key", "exchange", "priority", "time_limit", "soft_time_limit")
# Options that mean something else here, and what to do instead.
_REFUSED = {
    "link": "write a chain instead (chain(a.s(), b.s())): each step becomes a row",
    "link_error": "a dead durable row is the failure signal (task-outbox-dead event)",
    "expires": "the relay sets expires from the row's lease (outbox_lease_seconds)",
    "retry": "the relay decides how a send is retried",
    "retry_policy": "the relay decides how a send is retried",
}


def is_durable(task: Any) -> bool:
    """Whether ``task`` (a Task instance or class) is a durable task."""
    return bool(getattr(task, "__outbox_durable__", False))


def _positive(task: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"task {task}: {name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"task {task}: {name} must be a positive number of seconds, got {value}")
    return float(value)


class DurableTask(Task):  # type: ignore[misc]  # celery is untyped
    """A task base whose execution its outbox row tracks (see the module docstring).

    Settings (task options: ``@app.task(base=DurableTask,
    outbox_lease_seconds=120)``):

    * ``outbox_lease_seconds``: the row's lease, the longest a sent task may
      wait in the queue plus how long its body runs between lease renewals
      (default: the relay's ``OUTBOX_LEASE_SECONDS``). The task begins only
      with part of it left (see ``durable_run.begin_margin``); its message
      expires when that part is gone.
    * ``outbox_max_run_seconds``: how long the lease is renewed while the body
      runs, when the task has no ``time_limit`` (which then bounds it).
    * ``outbox_follow`` (default True): a run that ends well takes the next
      due row of its task with its done, and its pool process runs it at
      once, as the worker runs a message (until half a second after the
      message's run began; docs/durable.md, "Following"). Never for a task with a
      rate limit or a time limit, or one that overrides ``after_return``.

    Acknowledgement: early (``acks_late = False``), on purpose. The row's
    lease is the truth: a worker killed mid-body lets the lease lapse, the
    rescuer frees the row and the relay sends the task again with the same
    id, counting the attempt, so a body that kills its worker ends dead
    after ``max_retries`` + 1 attempts. A late ack would let the
    broker redeliver it under the same lease, uncounted, as often as it
    kills a worker.
    """

    __outbox_durable__ = True
    acks_late = False
    reject_on_worker_lost = False
    outbox_lease_seconds: float | None = None
    outbox_max_run_seconds: float = 3600.0
    outbox_follow: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Celery makes one subclass per task (type(name, (base,), options)):
        # a bad setting fails when the task is defined, naming it.
        super().__init_subclass__(**kwargs)
        name = getattr(cls, "name", None) or cls.__name__
        if cls.outbox_lease_seconds is not None:
            cls.outbox_lease_seconds = _positive(
                name, "outbox_lease_seconds", cls.outbox_lease_seconds
            )
        cls.outbox_max_run_seconds = _positive(
            name, "outbox_max_run_seconds", cls.outbox_max_run_seconds
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .durable_run import run, running

        request = self.request
        # The worker's tracer pushes this run's request before calling us; a
        # direct call (task(...), also inside another task's body) finds
        # someone else's request, or none: it runs as Celery runs one.
        traced = not request.called_directly and request.task == self.name and not running()
        if not traced:
            return super().__call__(*args, **kwargs)
        return run(self, args, kwargs)

    def after_return(
        self,
        status: str,
        retval: Any,
        task_id: str,
        args: Any,
        kwargs: Any,
        einfo: Any,
    ) -> None:
        """Runs the rows this run took to run after it (``outbox_follow``)."""
        super().after_return(status, retval, task_id, args, kwargs, einfo)
        from .durable_run import follow_after

        follow_after(self)

    @property
    def outbox_conn(self) -> psycopg.Connection[Any]:
        """The connection whose transaction commits with this run's ``done``.

        Write the body's database effect here: it commits together with the
        fenced finalize, and rolls back when the run turns out to be stale
        (its lease was lost), when the body raises, or the worker dies. Do
        not commit it yourself (psycopg refuses inside the transaction).
        """
        from .durable_run import current_connection

        return current_connection()

    def enqueue(self, conn: psycopg.Connection[Any], *args: Any, **kwargs: Any) -> AsyncResult:
        """Write a call of this task to the outbox in ``conn``'s transaction.

        The table is the one this task's app relays (its installed
        ``Outbox``), else the process's default outbox's; for options (queue,
        countdown, task_id) or another ``Outbox`` use ``write_durable``.
        """
        from .runtime import outbox_for

        return write_durable(conn, outbox_for(self.app), self.s(*args, **kwargs), {})

    def retry(self, *args: Any, exc: BaseException | None = None, **kwargs: Any) -> Any:
        """Never a broker retry: ask for a reschedule in the database instead.

        ``countdown`` is the least delay (the backoff may give more); the
        attempt counts against ``max_retries`` like any failure.
        """
        countdown = kwargs.get("countdown")
        reason = f"{type(exc).__name__}: {exc}" if exc is not None else "the task asked to retry"
        delay = float(countdown) if isinstance(countdown, (int, float)) else None
        raise RetryableError(reason, retry_after=delay) from exc


def _forget_expired(
    sender: Any = None, request: Any = None, expired: bool = False, **kwargs: Any
) -> None:
    """Let a durable task's id run again after one of its messages expired.

    Celery adds the id of an expired message to the worker's revoked set
    (kept for hours, and copied to workers that start meanwhile), and would
    drop every later message with that id. A durable task is re-sent with
    the same id under a new lease once the expired one's lease lapses: that
    one must run.
    """
    task_id = getattr(request, "id", None)
    if expired and task_id and is_durable(sender):
        from celery.worker import state

        state.revoked.discard(task_id)


signals.task_revoked.connect(_forget_expired, weak=False)


# ------------------------------------------------------------------ writing
def _steps(sig: Any) -> list[Any]:
    from celery.canvas import Signature, _chain

    if isinstance(sig, Task):
        return [sig.s()]
    if isinstance(sig, _chain):
        steps = [s for s in sig.tasks]
        if not steps:
            raise InvalidMessage("write_durable: the chain is empty")
        for step in steps:
            if type(step) is not Signature:
                raise InvalidMessage(
                    f"write_durable: a chain step that is a {type(step).__name__.lstrip('_')} "
                    "is not supported; durable chains are chains of single tasks"
                )
        return steps
    if type(sig) is Signature:
        return [sig]
    raise InvalidMessage(
        f"write_durable: expected a signature of a durable task or a chain of them, not {sig!r}"
    )


def _registered(app: Any, name: str) -> Any:
    task = app.tasks.get(name)
    if task is None:
        import difflib

        known = sorted(n for n in app.tasks if not n.startswith("celery."))
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidMessage(
            f"no task named {name!r} is registered in app {app.main!r}{hint}: a worker would "
            "drop its message"
        )
    return task


def _json(what: str, value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidMessage(f"{what} must be JSON-serializable: {exc}") from None
    return value


def _delay(name: str, options: Mapping[str, Any]) -> timedelta | None:
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown is not None and eta is not None:
        raise InvalidMessage(f"task {name}: give countdown or eta, not both")
    if countdown is not None:
        if isinstance(countdown, bool) or not isinstance(countdown, (int, float)):
            raise InvalidMessage(f"task {name}: countdown must be seconds, got {countdown!r}")
        return timedelta(seconds=max(0.0, float(countdown)))
    if eta is not None:
        if isinstance(eta, str):
            eta = datetime.fromisoformat(eta)
        if not isinstance(eta, datetime):
            raise InvalidMessage(f"task {name}: eta must be a datetime, got {eta!r}")
        if eta.tzinfo is None:
            eta = eta.replace(tzinfo=timezone.utc)
        # The row's available_at: the database waits, never the broker.
        return max(timedelta(0), eta - datetime.now(timezone.utc))
    return None


def _send_options(task: Any, name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    refused = sorted(set(options) & set(_REFUSED))
    if refused:
        raise InvalidMessage(
            f"task {name}: option {refused[0]!r} is not supported for durable tasks: "
            f"{_REFUSED[refused[0]]}"
        )
    serializer = options.get("serializer")
    if serializer not in (None, "json"):
        raise InvalidMessage(f"task {name}: durable tasks are sent as JSON, not {serializer!r}")
    get = getattr(task, "_get_exec_options", None)
    merged = {k: v for k, v in (get() if get else {}).items() if v is not None}
    merged.update({k: v for k, v in options.items() if v is not None})
    kept: dict[str, Any] = {}
    for key in _SEND_OPTIONS:
        value = merged.get(key)
        if value is None:
            continue
        # A kombu Queue or Exchange travels by name (the worker's app
        # declares it); anything else must already be JSON.
        kept[key] = getattr(value, "name", value)
    _json(f"task {name}: options", kept)
    return kept


def plain_options(task: Any) -> str:
    """The send options stored on a row of a plain call of ``task`` (its
    class's own: queue, priority, time limits), as JSON; worked out once
    per task."""
    cached = task.__dict__.get("_outbox_plain_options")
    if cached is None:
        cached = json.dumps(_send_options(task, task.name, {}))
        task.__dict__["_outbox_plain_options"] = cached
    return cached  # type: ignore[no-any-return]


def follows(task: Any) -> bool:
    """Whether ``task``'s runs take its next rows as they end ("following",
    durable_run): what of it the task's class and app decide, worked out once
    per task. Not for a task the worker meters (``rate_limit``) or times (a
    time limit counts from the message, and a row run after it would have
    less), nor one whose own ``after_return`` might not hand over."""
    cached = task.__dict__.get("_outbox_follows")
    if cached is None:
        conf = task.app.conf
        cached = not (
            not getattr(task, "outbox_follow", True)
            or task.rate_limit
            or type(task).after_return is not DurableTask.after_return
            or task.time_limit
            or task.soft_time_limit
            or conf.get("task_time_limit")
            or conf.get("task_soft_time_limit")
        )
        task.__dict__["_outbox_follows"] = cached
    return bool(cached)


def row_lease(headers: Mapping[str, Any] | None, default: float) -> float:
    """The lease a durable row is given, from its ``headers``: its own (its
    task's ``outbox_lease_seconds``, written by its producer) or ``default``,
    the relay's, as the claim gives it (queries.sql, frag_row_lease)."""
    value = (headers or {}).get("lease_seconds")
    return float(value) if isinstance(value, (int, float)) else default


def _row_headers(task: Any, send_options: Mapping[str, Any]) -> dict[str, Any]:
    """What the relay reads from a durable row: its lease, its attempt limit,
    and whether a run of its task would take it (``follows``).

    The claim and the rescuer apply the task's own ``max_retries`` + 1 (a
    worker killed mid-body counts an attempt too), not the relay's limit. A
    row marked ``follows`` (its task follows, and ``send_options`` are a
    plain call's: the rows done_and_take_durable takes) may
    wait in the table for its task's runs (queries.sql, frag_held).
    """
    from .options import annotations_for

    headers: dict[str, Any] = {}
    lease = getattr(task, "outbox_lease_seconds", None)
    if lease is not None:
        headers["lease_seconds"] = float(lease)
    options = {"max_retries": getattr(task, "max_retries", 3)}
    options.update(annotations_for(task.app, task.name))
    retries = options.get("max_retries")
    headers["max_attempts"] = 2**31 - 1 if retries is None else int(retries) + 1
    if follows(task) and dict(send_options) == json.loads(plain_options(task)):
        headers["follows"] = True
    return headers


def step_message(
    app: Any, step: Mapping[str, Any], rest: Sequence[Mapping[str, Any]]
) -> NewMessage:
    """The row of one step (a signature dict with its task id fixed).

    A durable task becomes a tracked row; any other task a hand-off row that
    the relay sends and marks done (the rest of its chain then continues as
    Celery's own chain, see docs/durable.md). Pure: writes nothing.
    """
    name = str(step["task"])
    task = _registered(app, name)
    options = dict(step.get("options") or {})
    task_id = str(options["task_id"])
    payload = {
        "task": name,
        "id": task_id,
        "args": _json(f"task {name}: args", list(step.get("args") or ())),
        "kwargs": _json(f"task {name}: kwargs", dict(step.get("kwargs") or {})),
        "options": _send_options(task, name, options),
        "chain": _json(f"task {name}: chain", [dict(s) for s in rest]),
        "track": is_durable(task),
    }
    return NewMessage(
        aggregate_type="celery.task",
        aggregate_id=name,
        event_type=DURABLE_EVENT,
        payload=payload,
        delay=_delay(name, options),
        headers=_row_headers(task, payload["options"]) if is_durable(task) else {},
    )


def write_step(
    conn: psycopg.Connection[Any],
    outbox: Outbox | None,
    app: Any,
    step: Mapping[str, Any],
    rest: Sequence[Mapping[str, Any]],
) -> int:
    """Write one step's row (``step_message``) in ``conn``'s transaction.
    Used by ``write_durable`` and by a finished step writing its successor."""
    from .._defaults import producer_settings

    settings = outbox.settings if outbox is not None else producer_settings()
    [row_id] = enqueue_many(
        conn,
        [step_message(app, step, rest)],
        settings=settings,
        # A chain orders its own steps; aggregate ordering does not apply.
        ordered=False,
        allow_reserved=True,
    )
    return row_id


def write_durable(
    conn: psycopg.Connection[Any], outbox: Outbox | None, sig: Any, options: dict[str, Any]
) -> AsyncResult:
    """Write a durable task call (or a chain whose steps are durable) as one
    outbox row in ``conn``'s transaction; return its ``AsyncResult``.

    ``options`` are ``apply_async`` options for the first step: ``queue``,
    ``routing_key``, ``exchange``, ``priority``, ``time_limit``,
    ``soft_time_limit``, ``task_id``, ``countdown`` / ``eta`` (the row's
    ``available_at``: the database waits, not the broker). Every task id is
    fixed now and kept on every re-send. For a chain the result is the last
    step's, with ``.parent`` links to the others, as ``chain.apply_async``
    returns. ``outbox`` None: the process's default outbox.
    """
    message, result = prepare_durable(sig, options)
    from .._defaults import producer_settings

    settings = outbox.settings if outbox is not None else producer_settings()
    # A chain orders its own steps; aggregate ordering does not apply.
    enqueue_many(conn, [message], settings=settings, ordered=False, allow_reserved=True)
    return result


def prepare_durable(sig: Any, options: Mapping[str, Any]) -> tuple[NewMessage, AsyncResult]:
    """``write_durable`` without the write: (the row, the result), every task
    id fixed. Pure, so that the asyncio producer writes the same row."""
    from celery.result import AsyncResult

    steps = _steps(sig)
    app = steps[0].app
    first = _registered(app, str(steps[0].task))
    if not is_durable(first):
        raise InvalidMessage(
            f"task {first.name} is not a DurableTask; send it with outbox_relay.apply_async()"
        )
    seen_plain = False
    fixed: list[dict[str, Any]] = []
    for number, step in enumerate(steps):
        task = _registered(app, str(step.task))
        if seen_plain and is_durable(task):
            raise InvalidMessage(
                f"chain step {task.name} is durable but follows a non-durable step: after a "
                "plain task the chain continues as Celery's own chain, untracked"
            )
        seen_plain = seen_plain or not is_durable(task)
        step_options = dict(step.options)
        if number == 0:
            step_options.update(options)
        step_options["task_id"] = str(step_options.get("task_id") or uuid())
        # Checked now, not when the previous step finishes in a worker.
        _send_options(task, task.name, step_options)
        _delay(task.name, step_options)
        fixed.append(
            {
                "task": str(step.task),
                "args": list(step.args),
                "kwargs": dict(step.kwargs),
                "options": step_options,
                "immutable": bool(step.immutable),
            }
        )
    result: AsyncResult | None = None
    for step_dict in fixed:
        result = AsyncResult(step_dict["options"]["task_id"], app=app, parent=result)
    assert result is not None
    return step_message(app, fixed[0], fixed[1:]), result
