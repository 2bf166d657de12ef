"""Deliver messages by sending a task of the user's own Celery pipeline.

The task id is the message's idempotency key, so every retry of one outbox
message sends the same task id, and a consumer task built on
``outbox_relay.inbox.InboxTask`` runs its body once per message however
many times it arrives.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import kombu.exceptions

from .._parse import as_number
from ..config import PUBLISHER_OPTIONS
from ..errors import ConfigError, PermanentError, RetryableError
from ..model import Message
from ..tracing import TRACE_HEADERS
from ._options import as_callable_or, constructor_kwargs
from ._process import PerProcess
from .protocol import import_object

__all__ = [
    "CeleryTaskPublisher",
    "did_you_mean",
    "is_celery_target",
    "message_kwargs",
    "sending",
]

# The least a write or confirm may be given when the app's own connect
# timeout leaves less of the budget (the start-up check then refuses).
_MIN_PUBLISH_TIMEOUT = 0.5

ArgsFrom = (
    Literal["payload", "message"] | Callable[[Message], tuple[Sequence[Any], Mapping[str, Any]]]
)


def message_kwargs(message: Message) -> dict[str, Any]:
    """The whole message as JSON-friendly keyword arguments (``args_from="message"``)."""
    return {
        "id": message.id,
        "idempotency_key": message.idempotency_key,
        "aggregate_type": message.aggregate_type,
        "aggregate_id": message.aggregate_id,
        "event_type": message.event_type,
        "payload": message.payload,
        "headers": dict(message.headers or {}),
        "created_at": message.created_at.isoformat() if message.created_at else None,
    }


class CeleryTaskPublisher:
    """Send the task ``task`` for each message (``task_id`` = idempotency key).

    ``task`` is a task name, a Celery ``Task`` or a ``Signature`` (its own
    partial arguments and options are kept; Celery's rules for partials
    apply: the message's arguments come first). The task is always *sent*
    through the broker, never run in the relay's process.

    ``app`` is a Celery app, ``"module:app"``, or None: then an app of our
    own on ``broker_url`` when given, else the app of a ``Task`` or
    ``Signature``, else Celery's current app at publish time (inside the relay
    worker, the relay's app and broker). ``args_from`` is ``"payload"``
    (``args=[payload]``), ``"message"`` (the whole message as keyword
    arguments, see ``message_kwargs``) or a callable returning
    ``(args, kwargs)``.

    Timeouts: a publish is connect + write + confirm. ``publish_timeout``
    bounds the write and the confirm each; the connect is bounded by
    ``connect_timeout`` on the publisher's own app (``broker_url``), else by
    the app's ``broker_connection_timeout``. Those not given are carved out
    of ``budget`` (the relay's ``OUTBOX_PUBLISH_TIMEOUT_SECONDS``) so that the
    whole publish fits in it.
    """

    def __init__(
        self,
        task: Any,
        *,
        app: Any = None,
        broker_url: str | None = None,
        queue: str | None = None,
        link: Any = None,
        args_from: ArgsFrom = "payload",
        publish_timeout: float | None = None,
        connect_timeout: float | None = None,
        budget: float | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        name, task_app, base = _target(task)
        if args_from not in ("payload", "message") and not callable(args_from):
            raise ConfigError(
                f"args_from must be 'payload', 'message' or a callable, not {args_from!r}"
            )
        if app is not None and broker_url is not None:
            raise ConfigError("give a Celery task publisher an app or a broker_url, not both")
        if connect_timeout is not None and broker_url is None:
            # The connect of someone else's app is bounded by that app's own
            # broker_connection_timeout; we cannot change it from here.
            raise ConfigError(
                "celery_connect_timeout applies only to the publisher's own app "
                "(celery_broker_url); set broker_connection_timeout on your Celery app instead"
            )
        for label, value in (
            ("celery_publish_timeout", publish_timeout),
            ("celery_connect_timeout", connect_timeout),
            ("publish_timeout_seconds", budget),
        ):
            if value is not None and not float(value) > 0:
                raise ConfigError(f"{label} must be greater than 0, got {value!r}")
        self.task_name = name
        self.queue = queue
        self.link = link
        self.args_from = args_from
        self._publish_timeout = None if publish_timeout is None else float(publish_timeout)
        self._connect_timeout = None if connect_timeout is None else float(connect_timeout)
        self._budget = None if budget is None else float(budget)
        self._options = dict(options or {})
        self._app_spec = app if app is not None or broker_url is not None else task_app
        self._broker_url = broker_url
        # A Task's own execution options (its queue, priority ...) and a
        # Signature's partial arguments and options.
        self._base = base
        # An app built here is per process: its producer pool holds sockets.
        self._own_app: PerProcess[Any] = PerProcess(self._build_app)

    def __repr__(self) -> str:
        return f"CeleryTaskPublisher({self.task_name!r}, queue={self.queue!r})"

    @classmethod
    def from_options(
        cls, task: Any, options: Mapping[str, Any], overrides: Mapping[str, Any] | None = None
    ) -> CeleryTaskPublisher:
        defaults: dict[str, Any] = {}
        budget = options.get("publish_timeout_seconds")
        if budget is not None:
            defaults["budget"] = float(budget)
        names = PUBLISHER_OPTIONS["celery"]
        kwargs = constructor_kwargs(options, overrides, names, defaults)
        if "args_from" in kwargs:
            kwargs["args_from"] = as_callable_or(
                "celery_args_from", kwargs["args_from"], ("payload", "message")
            )
        for key in ("publish_timeout", "connect_timeout"):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = as_number(float, f"OUTBOX_CELERY_{key.upper()}", kwargs[key])
        publisher = cls(task, **kwargs)
        if (
            budget is not None
            and publisher._broker_url is not None
            and publisher.timeout_seconds > float(budget) + 1e-9
        ):
            # Our own app's parts are all known now: fail here, naming them.
            # (Another app's connect timeout is read when the relay checks.)
            raise ConfigError(
                f"Celery task publisher timeouts add up to {publisher.timeout_seconds:g}s "
                f"({publisher.describe_timeouts()}), more than OUTBOX_PUBLISH_TIMEOUT_SECONDS "
                f"({float(budget):g})"
            )
        return publisher

    # ------------------------------------------------------------------ app
    def _build_app(self) -> Any:
        from celery import current_app

        assert self._broker_url is not None
        app = _broker_app_class()(self._broker_url)
        app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            # Publisher confirms on RabbitMQ: a send counts once the broker has it.
            # One connection attempt: kombu would otherwise retry (and sleep)
            # until broker_connection_timeout ran out, inside our publish.
            broker_transport_options={"confirm_publish": True, "max_retries": 0},
            broker_connection_timeout=self.connect_timeout,
            # kombu keeps one pool limit per process and every app's first
            # use of its pool resets it: the same limit as the process's app
            # (a worker's own), or one of them would shrink the other's pool
            # while it is in use, which raises.
            broker_pool_limit=current_app.conf.broker_pool_limit,
            broker_pool_acquire_timeout=self.connect_timeout,
        )
        return app

    @property
    def owns_app(self) -> bool:
        """Whether the task goes out through an app of our own (``broker_url``)."""
        return self._broker_url is not None

    @property
    def app(self) -> Any:
        if self._broker_url is not None:
            return self._own_app.get()
        if isinstance(self._app_spec, str):
            self._app_spec = import_object(
                self._app_spec, setting="celery_app", what="app", dotted=True
            )
        if self._app_spec is not None:
            return self._app_spec
        from celery import current_app

        return current_app

    # -------------------------------------------------------------- timeouts
    @property
    def connect_timeout(self) -> float:
        """The bound on connecting to the broker: ours, or the app's own."""
        if self._broker_url is None:
            return float(self.app.conf.broker_connection_timeout or 4.0)
        if self._connect_timeout is not None:
            return self._connect_timeout
        if self._budget is not None:
            return self._budget / 3.0
        return self._publish_timeout if self._publish_timeout is not None else 6.0

    @property
    def publish_timeout(self) -> float:
        """The bound on the write, and again on the broker's confirm."""
        if self._publish_timeout is not None:
            return self._publish_timeout
        if self._budget is None:
            return 6.0
        # What the connect leaves of the budget, halved. When the app's own
        # connect timeout leaves (almost) nothing, keep a usable minimum: the
        # relay's start-up check then says which setting to change.
        return max((self._budget - self.connect_timeout) / 2.0, _MIN_PUBLISH_TIMEOUT)

    @property
    def timeout_seconds(self) -> float:
        """Connect + write + confirm: the worst case of one publish."""
        return self.connect_timeout + 2 * self.publish_timeout

    @property
    def timeout_parts(self) -> list[tuple[str, float, int]]:
        """``(setting, seconds, times counted)`` adding up to ``timeout_seconds``,
        so an error can say which setting to lower, and to what."""
        connect = (
            "OUTBOX_CELERY_CONNECT_TIMEOUT"
            if self._broker_url is not None
            else "the Celery app's broker_connection_timeout"
        )
        return [
            (connect, self.connect_timeout, 1),
            ("OUTBOX_CELERY_PUBLISH_TIMEOUT", self.publish_timeout, 2),
        ]

    def describe_timeouts(self) -> str:
        return " + ".join(
            f"{n} x {name} {seconds:g}" if n > 1 else f"{name} {seconds:g}"
            for name, seconds, n in self.timeout_parts
        )

    # ---------------------------------------------------------- registration
    def check_registered(self, relay_app: Any, *, setting: str = "OUTBOX_PUBLISHER") -> str | None:
        """Refuse a task name nobody registers; return a warning when we cannot know.

        Sent through the relay's own app (the default), the task must be
        registered there: the relay's app is the user's app, and a worker of
        it drops a message of a name it does not know, after the row was
        marked done. Sent through another app (``celery_app`` or
        ``celery_broker_url``), that app's workers may know names this
        process does not, so an unknown name is only a warning.
        """
        target = self.app
        strict = self._broker_url is None and (self._app_spec is None or target is relay_app)
        known: set[str] = set()
        for app in (relay_app, None if self._broker_url is not None else target):
            if app is not None:
                # Reading app.tasks finalizes the app (autodiscovery included).
                known.update(str(name) for name in app.tasks)
        if self.task_name in known:
            return None
        hint = did_you_mean(self.task_name, known)
        if strict:
            raise ConfigError(
                f"{setting}: no task named {self.task_name!r} is registered in the relay's "
                f"Celery app{hint}; a worker drops a message for an unregistered task, so the "
                "outbox row would be done and the message gone. If another service's "
                "workers run it, send through their broker with OUTBOX_CELERY_BROKER_URL"
            )
        return (
            f"{setting}: task {self.task_name!r} is not registered in this process{hint}; "
            "the workers of the app it is sent through must know it, or they drop the message"
        )

    # ------------------------------------------------------------ publishing
    def arguments(self, message: Message) -> tuple[list[Any], dict[str, Any]]:
        if self.args_from == "payload":
            args: list[Any] = [message.payload]
            kwargs: dict[str, Any] = {}
        elif self.args_from == "message":
            args, kwargs = [], message_kwargs(message)
        else:
            built_args, built_kwargs = self.args_from(message)
            args, kwargs = list(built_args), dict(built_kwargs)
        if self._base is None:
            return args, kwargs
        if self._base.immutable:
            # An immutable signature (task.si(...)) takes no arguments from
            # outside, as in a Celery chain; the message travels in headers.
            return list(self._base.args), dict(self._base.kwargs)
        # Celery's rule for partial signatures: new arguments come first,
        # new keyword arguments win.
        return [*args, *self._base.args], {**self._base.kwargs, **kwargs}

    def send_options(
        self, message: Message, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Everything ``send_task`` is given besides the name and arguments."""
        options: dict[str, Any] = {}
        if self._base is not None:
            options.update(self._base.exec_options)
            options.update(self._base.options)
        options.update(self._options)
        if self.queue is not None:
            options["queue"] = self.queue
        if self.link is not None:
            options["link"] = self.link
        # Celery turns custom headers into attributes of the consumer's
        # task.request, so a user header named "id" or "task" would clobber
        # the protocol's: the row's own headers travel nested, under one key.
        headers = {
            **dict(options.pop("headers", None) or {}),
            "idempotency-key": message.idempotency_key,
            "outbox-id": message.id,
            "outbox-lease-version": message.lease_version,
            "outbox-event-type": message.event_type,
            "outbox-aggregate-type": message.aggregate_type,
            "outbox-aggregate-id": message.aggregate_id,
            "outbox-headers": dict(message.headers or {}),
            # The trace context also at the top, where Celery's OpenTelemetry
            # instrumentation reads it (outbox_relay.tracing).
            **{k: v for k, v in (message.headers or {}).items() if k in TRACE_HEADERS},
        }
        # What Flower, events and worker logs show instead of the arguments:
        # the row they came from, never the payload (it may hold personal data).
        row = f"outbox #{message.id} v{message.lease_version}"
        options.update(
            # The same id on every re-send of this message: a consumer on
            # InboxTask de-duplicates by it.
            task_id=message.idempotency_key,
            headers=headers,
            argsrepr=f"({row})",
            kwargsrepr="{" + ", ".join(f"{k!r}: ..." for k in kwargs) + "}" if kwargs else "{}",
            serializer="json",
            # The relay's backoff is the retry loop: Celery's own publish
            # retries would sleep inside our publish timeout.
            retry=False,
            timeout=self.publish_timeout,
            confirm_timeout=self.publish_timeout,
        )
        return options

    def __call__(self, message: Message) -> None:
        args, kwargs = self.arguments(message)
        options = self.send_options(message, args, kwargs)
        app = self.app
        with sending(app, f"task {self.task_name}"):
            # send_task, not Task.apply_async: it never runs the task inline
            # (task_always_eager applies only to apply_async), and it needs
            # no local registration of the task.
            app.send_task(self.task_name, args=args, kwargs=kwargs, **options)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` with the closest of ``known`` task names, or ``""``."""
    candidates = sorted(n for n in known if not n.startswith("celery."))
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@contextlib.contextmanager
def sending(app: Any, what: str) -> Iterator[None]:
    """Translate what a send through ``app`` raises into the relay's failure classes.

    Broker errors (connection, channel, timeout) are retryable, so the row is
    rescheduled in the database; arguments that cannot be encoded never will
    be, so they are permanent.
    """
    from celery.exceptions import QueueNotFound

    try:
        yield
    except kombu.exceptions.EncodeError as exc:
        raise PermanentError(f"{what}: arguments cannot be serialized: {exc}") from exc
    except QueueNotFound as exc:
        # A KeyError, which kombu's Redis transport counts among its
        # connection errors: it was retried as if the broker were away.
        raise PermanentError(
            f"{what}: {exc.args[0] if exc.args else exc}: add the queue to task_queues (or "
            "set task_create_missing_queues), then send it again with `outbox-relay dead retry`"
        ) from exc
    except (kombu.exceptions.KombuError, OSError) as exc:
        raise RetryableError(f"{what}: {type(exc).__name__}: {exc}{_hint(exc)}") from exc
    except Exception as exc:
        if isinstance(exc, _broker_errors(app)):
            raise RetryableError(f"{what}: {type(exc).__name__}: {exc}{_hint(exc)}") from exc
        raise


_INEQUIVALENT_QUEUE = re.compile(
    r"Queue\.declare: .*inequivalent arg '([^']+)' for queue '([^']*)'"
)


def _hint(exc: BaseException) -> str:
    """What to do about a broker refusal an operator must fix, for last_error."""
    found = _INEQUIVALENT_QUEUE.search(str(exc))
    if found is None:
        return ""
    # Retried, not permanent: the message goes through once the declarations
    # agree. Seen with a consumer queue given a dead-letter exchange through
    # queue_arguments (docs/publishers.md, Celery consumer tasks): the send
    # declares the queue by its name alone, and RabbitMQ refuses either
    # declaration, whichever came second.
    argument, queue = found.groups()
    return (
        f"; queue {queue!r} exists with another {argument} than this send declares it "
        "with: give the queue that argument by a RabbitMQ policy rather than queue "
        "arguments (rabbitmqctl set_policy ... --apply-to queues), or send through an app "
        "whose task_queues declare the queue as its consumer does (celery_app)"
    )


@dataclass(frozen=True)
class _Base:
    """What a Task or Signature given as the target adds to each send."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    exec_options: dict[str, Any]
    immutable: bool


# Options of a signature that the publisher decides itself, per message.
_OWN_OPTIONS = ("task_id", "serializer", "retry", "argsrepr", "kwargsrepr")


def is_celery_target(value: Any) -> bool:
    """Whether ``value`` is a Celery ``Task`` or ``Signature`` (to send, not to call)."""
    from celery import Task
    from celery.canvas import Signature

    return isinstance(value, (Task, Signature))


def _target(task: Any) -> tuple[str, Any, _Base | None]:
    """``(name, app or None, base)`` from a task name, a Task or a Signature."""
    from celery import Task
    from celery.canvas import Signature

    if isinstance(task, str):
        if not task:
            raise ConfigError("a Celery task publisher needs a task name")
        return task, None, None
    if isinstance(task, Signature):
        if type(task) is not Signature:
            raise ConfigError(
                f"a Celery canvas ({type(task).__name__.lstrip('_')}) cannot be a publisher: "
                "give one task, its name, or a signature of one task"
            )
        options = {k: v for k, v in dict(task.options).items() if k not in _OWN_OPTIONS}
        base = _Base(tuple(task.args), dict(task.kwargs), options, {}, bool(task.immutable))
        return str(task.task), task._app, base
    if isinstance(task, Task):
        # The task's own routing and priority options, as Task.apply_async
        # would use them; None values leave the choice to the app's routes.
        get = getattr(task, "_get_exec_options", None)
        exec_options = {k: v for k, v in (get() if get else {}).items() if v is not None}
        for key in _OWN_OPTIONS:
            exec_options.pop(key, None)
        return str(task.name), task.app, _Base((), {}, {}, exec_options, False)
    raise ConfigError(
        f"a Celery task publisher needs a task name, a Task or a Signature, not {task!r}"
    )


def _broker_errors(app: Any) -> tuple[type[BaseException], ...]:
    """The connection and channel error classes of the app's broker transport."""
    try:
        with app.connection_for_write() as connection:
            return tuple(connection.connection_errors + connection.channel_errors)
    except Exception:  # the transport cannot even be loaded
        return ()


@functools.cache
def _broker_app_class() -> type[Any]:
    # Made on first use: importing the publishers does not import Celery.
    from celery import Celery

    class BrokerApp(Celery):  # type: ignore[misc]
        """A Celery app that sends to its own broker whatever the environment says.

        Celery reads ``CELERY_BROKER_URL`` (and ``CELERY_BROKER_WRITE_URL``)
        from the environment before an app's own broker setting, for every
        app in the process, and the relay's worker is usually started with
        the first: a task meant for another service's broker would quietly
        go to the relay's own. Every connection this app writes through, its
        producer pool's included, is made here, to ``broker_url``.
        """

        def __init__(self, broker_url: str) -> None:
            super().__init__("outbox_relay.task_publisher", broker=broker_url, set_as_current=False)
            self.outbox_broker_url = broker_url

        def connection_for_write(self, url: Any = None, **kwargs: Any) -> Any:
            return super().connection_for_write(url or self.outbox_broker_url, **kwargs)

    return BrokerApp
