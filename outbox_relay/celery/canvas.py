"""``apply_async`` through the outbox: a Celery canvas written in the business transaction.

``task.delay()`` inside a transaction can run before the commit, or for a
transaction that rolls back; called after the commit (``on_commit``) it is
lost when the process dies or the broker is down at that moment, and there
is no task id until then. Here the whole signature or canvas (chain, group,
chord, callbacks, options) becomes **one outbox row** in the caller's
transaction, with every task id fixed now, and the relay sends it after the
commit, as many times as it takes, always with those ids.

Two halves:

* producer: ``prepare_canvas(sig, options)`` is pure (no I/O): it checks the
  canvas, freezes its ids and returns the row to write and the result to
  hand back; ``apply_async(conn, outbox, sig, options)`` writes that row
  through the ordinary enqueue path (same savepoint, validation, NOTIFY).
  An asyncio producer reuses ``prepare_canvas`` and writes the row itself.
* relay: ``CanvasPublisher`` rebuilds the canvas from the row with
  ``Signature.from_dict`` and sends it, through an app of its own made from
  the relay app's configuration, with publisher confirms and every broker
  call bounded by ``OUTBOX_PUBLISH_TIMEOUT_SECONDS``.

Row format: ``event_type`` ``celery.apply_async``, ``aggregate_type``
``celery``, ``aggregate_id`` the root task id, ``payload`` the canvas as
Celery's own dict form (JSON), ids and options included.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

from ..errors import InvalidMessage, PermanentError, RetryableError
from ..model import LeaseRef, Message
from ..outbox import Outbox
from ..producer import CANVAS_EVENT_TYPE, NewMessage, enqueue_many
from ..publishers._process import PerProcess
from ..publishers.celery_task import did_you_mean, sending
from .sender import argsrepr, kwargsrepr

__all__ = [
    "CANVAS_AGGREGATE_TYPE",
    "CANVAS_EVENT_TYPE",
    "CanvasPublisher",
    "apply_async",
    "is_durable",
    "prepare_canvas",
    "walk",
]

CANVAS_AGGREGATE_TYPE = "celery"

# Options that are objects of the calling process (a producer, a
# connection ...): the relay sends with its own.
_PROCESS_OPTIONS = ("producer", "connection", "publisher", "router", "result_cls", "add_to_parent")
# The relay retries a failed send from the database, with its backoff; a
# retry inside the send would wait inside the publish timeout.
_RELAY_OPTIONS = ("retry", "retry_policy")
# Parts of a node's options that are other nodes, walked (and checked) on their own.
_NODE_OPTIONS = ("link", "link_error", "chord", "chain")


# ------------------------------------------------------------------ the tree
def _signature(value: Any, app: Any) -> Any:
    from celery.canvas import maybe_signature

    return maybe_signature(value, app=app)


def _children(node: Any, app: Any) -> list[Any]:
    from celery.canvas import _chain, _chord, group

    if isinstance(node, (_chain, group)):
        return [_signature(t, app) for t in node.tasks]
    if isinstance(node, _chord):
        header = node.tasks
        tasks = header.tasks if isinstance(header, group) else header
        body = [node.body] if node.body is not None else []
        return [_signature(t, app) for t in [*tasks, *body]]
    return []


def _callbacks(node: Any, app: Any, *, convert: bool) -> list[Any]:
    found: list[Any] = []
    for key in ("link", "link_error"):
        value = node.options.get(key)
        if not value:
            continue
        listed = value if isinstance(value, (list, tuple)) else [value]
        items = [_signature(v, app) for v in listed]
        if convert:
            # Signatures in place of dicts, so that freezing one sticks.
            node.options[key] = items
        found.extend(items)
    return found


def walk(sig: Any, app: Any = None, *, convert: bool = False) -> Iterator[Any]:
    """Every signature of a canvas, depth first: containers, tasks, callbacks.

    ``convert`` replaces callback dicts by signatures in the tree (so that
    what is done to them is kept); without it the tree is left as it is.
    """
    stack = [sig]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(_callbacks(node, app, convert=convert)))
        stack.extend(reversed(_children(node, app)))


def _is_task(node: Any) -> bool:
    """A signature of one task, not a chain, group or chord."""
    return not node.get("subtask_type")


def _app_of(sig: Any) -> Any:
    return sig.app


# ------------------------------------------------------------------ checking
def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def _check_json(sig: Any, app: Any) -> None:
    """Refuse what JSON cannot carry, naming the task and the part."""
    try:
        _dumps(sig)
        return
    except (TypeError, ValueError) as exc:
        whole = exc
    for node in walk(sig, app):
        name = node.get("task")
        parts: list[tuple[str, Any]] = []
        if _is_task(node):  # a container's arguments are its nodes, walked on their own
            parts += [
                ("its arguments are", node.get("args")),
                ("its keyword arguments are", node.get("kwargs")),
            ]
        parts += [
            (f"its option {key!r} is", value)
            for key, value in dict(node.get("options") or {}).items()
            if key not in _NODE_OPTIONS
        ]
        for what, value in parts:
            try:
                _dumps(value)
            except (TypeError, ValueError) as exc:
                raise InvalidMessage(
                    f"apply_async: task {name!r}: {what} not JSON-serializable ({exc}); "
                    "the outbox stores canvases as JSON only"
                ) from None
    raise InvalidMessage(f"apply_async: the canvas is not JSON-serializable: {whole}")


def _check_registered(sig: Any, app: Any) -> None:
    """Refuse a task name the app does not register, for every task of the canvas.

    A worker drops a message for a task it does not know: the row would be
    done and the work gone. Celery's own apply_async sends such names; here
    the mistake is caught while the transaction can still roll back.
    """
    known = {str(name) for name in app.tasks}  # finalizes the app (autodiscovery)
    for node in walk(sig, app):
        if _is_task(node) and str(node.get("task")) not in known:
            name = str(node.get("task"))
            raise InvalidMessage(
                f"apply_async: no task named {name!r} is registered in the Celery app "
                f"{app.main!r}{did_you_mean(name, known)}; a worker drops a message for an "
                "unregistered task. Import the module that defines it before calling apply_async"
            )


def _check_chords_have_a_backend(sig: Any, app: Any) -> None:
    """A chord (also a group chained to a task, which Celery makes one) is
    started in the result backend; without one Celery refuses it in the
    caller (NotImplementedError). Through the outbox the refusal came at every
    send, from the relay, after the commit."""
    from celery.backends.base import DisabledBackend
    from celery.canvas import _chain, _chord, group

    if not isinstance(app.backend, DisabledBackend):
        return
    for node in walk(sig, app):
        chained_group = isinstance(node, _chain) and any(
            isinstance(step, group) for step in _children(node, app)[:-1]
        )
        if isinstance(node, _chord) or chained_group:
            raise InvalidMessage(
                f"apply_async: a chord (or a group chained to a task, which Celery makes one) "
                f"needs a result backend, and Celery app {app.main!r} has none: set its "
                "result_backend (Redis, a database ...), in the relay's workers too"
            )


def _check_not_durable(sig: Any, app: Any) -> None:
    """Refuse a DurableTask anywhere in a canvas row: sent as part of a plain
    canvas it would run untracked, and fail on its first use of outbox_conn.

    A durable task alone, or a chain that begins with durable steps, is
    written by ``celery.durable`` instead (``apply_async`` sends it there)."""
    from celery.canvas import Signature, _chain

    if isinstance(sig, _chain) and sig.tasks:
        first = _signature(sig.tasks[0], app)
        if _is_task(first) and getattr(app.tasks.get(first.task), "__outbox_durable__", False):
            # It begins with its durable step, as the refusal below asks, but
            # goes on with a group, a chord or a nested chain.
            steps = [_signature(t, app) for t in sig.tasks[1:]]
            other = next(t for t in steps if type(t) is not Signature)
            kind = type(other).__name__.lstrip("_")
            raise InvalidMessage(
                f"apply_async: the chain begins with the DurableTask {first.task} and goes on "
                f"with a {kind}; a durable chain is a chain of single tasks. Write the {kind} "
                "from the last durable step's body with outbox_relay.apply_async("
                "self.outbox_conn, ...): it is then sent once that step's effect and done "
                "commit, with them (docs/durable.md, Chains)"
            )
    for node in walk(sig, app):
        if _is_task(node) and getattr(app.tasks.get(node.task), "__outbox_durable__", False):
            raise InvalidMessage(
                f"apply_async: {node.task} is a DurableTask inside a group, a chord, a "
                "callback or after a plain chain step, where it would run untracked and fail; "
                "write it alone, or as a chain that begins with its durable steps "
                "(docs/durable.md)"
            )


def _aware(value: datetime, app: Any) -> datetime:
    if value.tzinfo is None:
        # As Celery reads a naive eta or expires: in the app's timezone.
        from celery.utils.time import maybe_make_aware

        return maybe_make_aware(value, app.timezone)  # type: ignore[no-any-return]
    return value


def _when(name: str, value: Any, app: Any) -> datetime:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidMessage(f"apply_async: {name}={value!r} is not an ISO 8601 time") from None
    if not isinstance(value, datetime):
        raise InvalidMessage(
            f"apply_async: {name} must be a datetime or an ISO 8601 string, "
            f"not {type(value).__name__}"
        )
    return _aware(value, app)


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidMessage(
            f"apply_async: {name} must be a finite number of seconds, not {value!r}"
        )
    return float(value)


def _delay(countdown: Any, eta: Any, now: datetime, app: Any) -> timedelta | None:
    """countdown/eta as the row's delay: the relay sends when it is due, with no
    broker ETA (Redis would re-deliver a long ETA after its visibility timeout)."""
    if countdown is not None:  # Celery, too, takes countdown over eta
        return timedelta(seconds=max(_seconds("countdown", countdown), 0.0))
    if eta is not None:
        return max(_when("eta", eta, app) - now, timedelta(0))
    return None


def _expires(value: Any, now: datetime, app: Any) -> str:
    """An absolute expiry: ``expires=60`` counts from this call, not from the
    (possibly much later) send."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (now + timedelta(seconds=_seconds("expires", value))).isoformat()
    return _when("expires", value, app).isoformat()


def _check_expires_after_due(work: Any, delay: timedelta | None, now: datetime) -> None:
    """A canvas that expires by the time it is due is sent, and then every
    worker discards it as revoked: its row ends ``done`` and nothing ever runs.
    Celery takes such a call silently; through the outbox it is refused."""
    expires = work.options.get("expires")
    if expires is None:
        return
    due = now + (delay or timedelta(0))
    if datetime.fromisoformat(expires) <= due:
        raise InvalidMessage(
            f"apply_async: expires ({expires}) is not after the time the canvas is due "
            f"({due.isoformat()}): the relay would send it and every worker would discard "
            "it as expired; give an expires later than the countdown or eta"
        )


def _exec_options(task: Any) -> dict[str, Any]:
    """What ``Task.apply_async`` adds from the task itself (its queue, priority...)."""
    get = getattr(task, "_get_exec_options", None)
    options = {k: v for k, v in (get() if get else {}).items() if v is not None}
    options["ignore_result"] = bool(getattr(task, "ignore_result", False))
    return options


def _route(app: Any, node: Any) -> dict[str, str]:
    """The queue ``app`` routes ``node`` to, by name.

    Only the name: the relay's app finds the queue's exchange and routing key
    in its own ``task_queues`` (your app's, with ``install(app)``), and an
    option given to a whole group or chord (``queue=``) still overrides it,
    as it would a task's own queue.
    """
    from celery.exceptions import QueueNotFound

    if any(node.options.get(k) for k in ("queue", "exchange", "routing_key")):
        return {}  # given: Celery's send uses it as it is (_check_queues)
    try:
        route = app.amqp.router.route({}, node.task, tuple(node.args), dict(node.kwargs))
    except QueueNotFound as exc:
        raise InvalidMessage(
            f"apply_async: task {node.task!r}: {_missing_queue(exc, app)}"
        ) from None
    queue = route.get("queue")
    return {} if queue is None else {"queue": str(getattr(queue, "name", queue))}


def _missing_queue(exc: BaseException, app: Any) -> str:
    return (
        f"{exc.args[0] if exc.args else exc}: Celery app {app.main!r} sends only to the "
        "queues of its task_queues (task_create_missing_queues is off); Celery's own "
        "apply_async would refuse it too (QueueNotFound)"
    )


def _check_queues(sig: Any, app: Any) -> None:
    """A queue given by name that Celery would refuse in the caller: through
    the outbox it was refused at every send, from the relay, until the row
    went dead."""
    if app.conf.task_create_missing_queues:
        return
    known = app.amqp.queues
    for node in walk(sig, app):
        queue = node.options.get("queue")
        name = getattr(queue, "name", queue)
        if isinstance(name, str) and name and name not in known:
            what = f"task {node.task!r}" if _is_task(node) else "the canvas"
            raise InvalidMessage(
                f"apply_async: {what}: "
                + _missing_queue(KeyError(f"Queue {name!r} missing from task_queues"), app)
            )


def _root_id(result: Any) -> str:
    node = result
    while getattr(node, "parent", None) is not None:
        node = node.parent
    return str(node.id)


# ------------------------------------------------------------------ producer
def prepare_canvas(
    sig: Any,
    options: Mapping[str, Any] | None = None,
    *,
    app: Any = None,
    now: datetime | None = None,
) -> tuple[NewMessage, Any]:
    """A signature or canvas and ``apply_async`` options -> (the row, the result).

    Pure: nothing is written or sent. The result is what ``sig.apply_async()``
    would return (``AsyncResult``, ``GroupResult`` for a group, the body's
    result with the header's ``GroupResult`` as parent for a chord) and every
    task of the canvas, callbacks included, has its id fixed in the row.
    ``sig`` itself is left as it was (a copy is frozen). ``app`` is the app
    that must register every task (default: the signature's).
    """
    from celery.canvas import Signature

    if not isinstance(sig, Signature):
        raise InvalidMessage(
            "apply_async needs a Celery signature or canvas (task.s(...), chain, group, "
            f"chord), not {type(sig).__name__}"
        )
    if sig.get("subtask_type") == "chain" and not sig.tasks:
        raise InvalidMessage("apply_async: the chain is empty; there is no task to send")
    app = app if app is not None else _app_of(sig)
    now = now if now is not None else datetime.now(timezone.utc)
    options = dict(options or {})
    for key in _PROCESS_OPTIONS:
        if key in options:
            raise InvalidMessage(
                f"apply_async: option {key!r} belongs to the sending process; through the "
                "outbox the relay sends with its own"
            )
    for key in _RELAY_OPTIONS:
        if key in options:
            raise InvalidMessage(
                f"apply_async: option {key!r} is not taken: the relay retries a failed send "
                "from the database, with its own backoff"
            )
    # The canvas's own countdown, eta and expires become the row's times
    # (below); a copy without them, so that a datetime there is no JSON error.
    timing = {k: sig.options[k] for k in ("countdown", "eta", "expires") if k in sig.options}
    if timing:
        sig = sig.clone()
        for key in timing:
            sig.options.pop(key)
    _check_json(sig, app)  # before the copy through JSON below, to name the part
    args, kwargs = options.pop("args", None), options.pop("kwargs", None)
    task_id = options.pop("task_id", None)
    if task_id is not None and (not isinstance(task_id, str) or not task_id):
        raise InvalidMessage(f"apply_async: task_id must be a non-empty string, not {task_id!r}")
    try:
        _dumps([args, kwargs])
    except (TypeError, ValueError) as exc:
        raise InvalidMessage(
            f"apply_async: task {sig.get('task')!r}: the arguments given to apply_async are "
            f"not JSON-serializable ({exc}); the outbox stores canvases as JSON only"
        ) from None

    # A copy through JSON: what the relay will read back, and the caller's
    # signature stays unfrozen (freezing works in place).
    work = Signature.from_dict(json.loads(_dumps(sig)), app=app)
    if args or kwargs:
        work = _partial(work, tuple(args or ()), dict(kwargs or {}), app)
    timing.update((k, options.pop(k)) for k in ("countdown", "eta", "expires") if k in options)
    delay = _delay(timing.get("countdown"), timing.get("eta"), now, app)
    _set_options(work, options, timing.get("expires"), now, app)
    _check_expires_after_due(work, delay, now)
    # The whole canvas, this call's link and link_error options included.
    _check_registered(work, app)
    _check_json(work, app)
    _check_not_durable(work, app)
    _check_chords_have_a_backend(work, app)
    _check_queues(work, app)
    for node in walk(work, app, convert=True):
        if _is_task(node):
            # As Task.apply_async would at this call: the task's own routing
            # and result options, under the signature's; then the route your
            # app's task_routes and queues give it. Routing is the caller's
            # app's decision, as with sig.apply_async(): a relay running
            # another app (the standalone outbox_relay.app) would otherwise
            # send your tasks to its own default queue, where nothing runs them.
            node.options = {**_exec_options(app.tasks[node.task]), **node.options}
            node.options.update(_route(app, node))
    result, root_id = _freeze(work, task_id, app)

    message = NewMessage(
        aggregate_type=CANVAS_AGGREGATE_TYPE,
        aggregate_id=root_id,
        event_type=CANVAS_EVENT_TYPE,
        payload=json.loads(_dumps(work)),
        delay=delay,
    )
    return message, result


def _set_options(work: Any, options: dict[str, Any], expires: Any, now: datetime, app: Any) -> None:
    """The options of this apply_async call on the canvas's outermost signature,
    where Celery's own apply_async puts them (a link replaces the existing ones)."""
    from celery.canvas import group

    if isinstance(work, group) and (options.get("link") or options.get("link_error")):
        raise InvalidMessage(
            "apply_async: a group takes no link or link_error (Celery refuses them too); "
            "use a chord (group | callback), or link each task"
        )
    root = work.options
    for key in ("link", "link_error"):
        if options.get(key) is not None:
            value = options.pop(key)
            root[key] = list(value) if isinstance(value, (list, tuple)) else [value]
    root.update(options)
    if expires is not None:
        root["expires"] = _expires(expires, now, app)
    for key, value in root.items():
        if key not in _NODE_OPTIONS:
            try:
                _dumps(value)
            except (TypeError, ValueError) as exc:
                raise InvalidMessage(
                    f"apply_async: option {key!r} is not JSON-serializable ({exc})"
                ) from None


def _freeze(work: Any, task_id: str | None, app: Any) -> tuple[Any, str]:
    """Fix every id of the canvas in place; return its result and root id."""
    from celery.canvas import group

    if task_id is not None and (isinstance(work, group) or _is_task(work)):
        # A group's id, or the task's; a chain's or chord's goes to its last
        # task or body, as with Celery's apply_async(task_id=).
        work.options["task_id"] = task_id
    result = work.freeze(_id=task_id)
    root_id = _root_id(result)
    for node in walk(work, app, convert=True):
        if _is_task(node) and not node.options.get("task_id"):
            node.freeze()  # a callback: fixed now, as the tasks are
        # Stable across re-sends: the relay's own task would otherwise
        # become the root of every task it sends.
        node.options.setdefault("root_id", root_id)
    return result, root_id


def _partial(node: Any, args: tuple[Any, ...], kwargs: dict[str, Any], app: Any) -> Any:
    """``apply_async(args=, kwargs=)`` as Celery applies them: to the task, a
    chain's first task, every task of a group or of a chord's header."""
    from celery.canvas import _chain, _chord, group

    if isinstance(node, _chain):
        first = _signature(node.tasks[0], app)
        node.tasks[0] = _partial(first, args, kwargs, app)
    elif isinstance(node, (group, _chord)):
        tasks = node.tasks.tasks if isinstance(node.tasks, group) else node.tasks
        tasks[:] = [_partial(_signature(t, app), args, kwargs, app) for t in tasks]
    else:
        return node.clone(args, kwargs)
    return node


def is_durable(sig: Any) -> bool:
    """A task, or a chain of single tasks beginning with one, whose registered
    class is an outbox DurableTask (written by celery.durable instead)."""
    from celery.canvas import Signature, _chain

    first = sig
    if isinstance(sig, _chain):
        if not sig.tasks or any(type(t) is not Signature for t in sig.tasks):
            return False
        first = sig.tasks[0]
    if type(first) is not Signature or not _is_task(first):
        return False
    task = _app_of(first).tasks.get(first.task)
    return bool(getattr(task, "__outbox_durable__", False))


def _write(conn: Any, outbox: Outbox, message: NewMessage, *, durable: bool = False) -> int:
    """Write on a psycopg connection, a SQLAlchemy Session/Connection or a
    Django connection (``django.db.connection``), in its current transaction.
    ``durable``: a durable task's row (a reserved event type; its chain orders
    its own steps, so no aggregate ordering)."""
    # Both are reserved event types; a durable chain orders its own steps.
    extra: dict[str, Any] = {"allow_reserved": True}
    if durable:
        extra["ordered"] = False

    def write(pg: Any) -> int:
        return enqueue_many(pg, [message], settings=outbox.settings, **extra)[0]

    if isinstance(conn, psycopg.Connection):
        return write(conn)
    module = type(conn).__module__
    if module.startswith("sqlalchemy."):
        from ..integrations.sqlalchemy import psycopg_connection

        return write(psycopg_connection(conn))
    if module.startswith("django."):
        from django.db import transaction

        from ..integrations import django as on_django

        alias = str(conn.alias)
        # A savepoint of the caller's atomic block (or, outside one, a
        # transaction of its own, as a lone Model.save() would be).
        with transaction.atomic(using=alias):
            return write(on_django.psycopg_connection(alias))
    hint = (
        "; for an AsyncConnection, await outbox_relay.aio.apply_async(...)"
        if isinstance(conn, psycopg.AsyncConnection)
        else ""
    )
    raise InvalidMessage(
        "apply_async needs a psycopg 3 connection, a SQLAlchemy Session or Connection, or a "
        f"Django connection, not {type(conn).__name__}{hint}"
    )


def apply_async(conn: Any, outbox: Outbox, sig: Any, options: Mapping[str, Any]) -> Any:
    """Write ``sig`` as one outbox row in ``conn``'s transaction; return its result now."""
    if is_durable(sig):
        # A DurableTask is tracked by its row while it runs: its own module
        # builds that row.
        from .durable import prepare_durable

        message, result = prepare_durable(sig, options)
        _write(conn, outbox, message, durable=True)
        return result
    message, result = prepare_canvas(sig, options)
    _write(conn, outbox, message)
    return result


# --------------------------------------------------------------------- relay
class CanvasPublisher:
    """Sends ``celery.apply_async`` rows: the stored canvas, with its fixed ids.

    Through an app of its own per process, configured as the relay's app
    (broker, routes, queues, result backend), with publisher confirms on,
    no publish retries, and timeouts carved from ``budget`` (connect, then
    write and confirm) so that one send fits in the relay's publish timeout.
    Its registry is empty: every task goes out as ``send_task`` would send
    it, never run inline; the tasks' own options were added by the producer.
    """

    def __init__(self, app: Any, *, budget: float, concurrency: int = 1) -> None:
        if not budget > 0:
            raise ValueError(f"budget must be greater than 0, got {budget!r}")
        self.relay_app = app
        # Publishes of one chunk at once: each holds a pooled connection.
        self.concurrency = max(int(concurrency), 1)
        self.connect_timeout = budget / 3.0
        self.publish_timeout = (budget - self.connect_timeout) / 2.0
        self._app: PerProcess[Any] = PerProcess(self._build_app)

    def __repr__(self) -> str:
        return f"CanvasPublisher({self.relay_app.main!r})"

    @property
    def timeout_seconds(self) -> float:
        """Connect + write + confirm: the worst case of one send."""
        return self.connect_timeout + 2 * self.publish_timeout

    def _build_app(self) -> Any:
        from celery import Celery

        conf = self.relay_app.conf
        app = Celery(self.relay_app.main, set_as_current=False)
        app.conf.update(_configuration(conf))
        transport = dict(conf.get("broker_transport_options") or {})
        transport.update(
            # RabbitMQ acknowledges each publish: a send counts once the broker has it.
            confirm_publish=True,
            # One connection attempt: kombu would otherwise retry inside our timeout.
            max_retries=0,
            read_timeout=self.publish_timeout,
            write_timeout=self.publish_timeout,
            socket_timeout=self.publish_timeout,
            socket_connect_timeout=self.connect_timeout,
        )
        app.conf.update(
            broker_transport_options=transport,
            broker_connection_timeout=self.connect_timeout,
            broker_connection_retry=False,
            # The relay app's own limit: kombu keeps one pool limit per
            # process, each app's first use of its pool sets it and resizes
            # every pool, and shrinking a pool in use raises ("Can't shrink
            # pool when in use"; with a larger limit here, the relay app's
            # first send did that to a chunk being published). A chunk's
            # sends beyond the limit wait for a pooled connection instead,
            # for at most the connect timeout (then a retryable broker error).
            broker_pool_limit=conf.broker_pool_limit,
            broker_pool_acquire_timeout=self.connect_timeout,
            task_publish_retry=False,
            # Never run a canvas inside the relay.
            task_always_eager=False,
            # A chord's header is registered in the result backend (Redis) first.
            redis_socket_timeout=self.publish_timeout,
            redis_socket_connect_timeout=self.connect_timeout,
        )
        return app

    @property
    def app(self) -> Any:
        return self._app.get()

    def signature(self, message: Message) -> Any:
        """The stored canvas, marked with the row it came from."""
        from celery.canvas import Signature

        if message.event_type != CANVAS_EVENT_TYPE or not isinstance(message.payload, dict):
            raise PermanentError(
                f"outbox message {message.id} is not a stored canvas "
                f"(event type {message.event_type!r})"
            )
        app = self.app
        try:
            sig = Signature.from_dict(json.loads(_dumps(message.payload)), app=app)
            nodes = list(walk(sig, app, convert=True))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            # No retry reads it better: not written by apply_async (the
            # event type is reserved since), or edited by hand.
            raise PermanentError(
                f"outbox message {message.id} is not a canvas Celery can read "
                f"({type(exc).__name__}: {exc})"
            ) from None
        shown = argsrepr([LeaseRef(message.id, message.lease_version)])
        ours = {"outbox-id": message.id, "outbox-lease-version": message.lease_version}
        for node in nodes:
            if _is_task(node):
                kwargs = dict(node.get("kwargs") or {})
                # What Flower, events and worker logs show instead of the
                # arguments: the row, never the payload (it may hold personal data).
                node.options.update(
                    argsrepr=shown,
                    kwargsrepr=kwargsrepr(kwargs),
                    headers={**dict(node.options.get("headers") or {}), **ours},
                )
            elif node.options.get("headers"):
                # headers= given to a whole chain or group replace a task's own
                # when Celery sends it: they carry the row too.
                node.options["headers"] = {**dict(node.options["headers"]), **ours}
        return sig

    def __call__(self, message: Message) -> None:
        sig = self.signature(message)
        app = self.app
        what = f"canvas of outbox message {message.id} ({sig.get('task')})"
        try:
            with sending(app, what):
                sig.apply_async()
        except (RetryableError, PermanentError):
            raise
        except NotImplementedError as exc:
            # Celery's refusal of a chord without a result backend (the
            # relay's app has none): a setting to change, then `dead retry`.
            raise PermanentError(f"{what}: {exc}".strip()) from exc
        except Exception as exc:
            # The result backend (a chord's header is registered there
            # before its tasks are sent) failing to answer is a retry too.
            if _backend_unreachable(exc):
                raise RetryableError(f"{what}: {type(exc).__name__}: {exc}") from exc
            raise

    def close(self) -> None:
        app = self._app.reset()
        if app is not None:
            app.close()


def _configuration(conf: Any) -> dict[str, Any]:
    """Every setting of ``conf`` as the app reads it, not only Celery's
    defaults: what was assigned or updated (``conf.changes``), and what
    ``config_from_object`` loaded (a settings module, Django's settings
    under the ``CELERY`` namespace), which ``conf.changes`` leaves out. With
    ``changes`` alone the canvas app of most real apps had no broker (it
    fell back to amqp://localhost, and sent there), no result backend and
    none of their ``task_queues``."""
    from celery.app.defaults import DEFAULTS

    # Lower-case keys only: a user's own settings, never Celery's old
    # upper-case names, which Celery refuses to mix with the new ones.
    found = {k: v for k, v in dict(conf.changes).items() if k == k.lower()}
    for key, default in DEFAULTS.items():
        value = conf.get(key)
        if value is not None and value != default:
            found[key] = value
    return found


def _backend_unreachable(exc: BaseException) -> bool:
    try:
        import redis.exceptions
    except ImportError:  # pragma: no cover - celery[redis] brings it
        return False
    return isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError))
