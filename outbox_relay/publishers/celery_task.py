"""Deliver messages by sending a task of the user's own Celery pipeline.

The task id is the message's idempotency key, so every retry of one outbox
message sends the same task id, and a consumer task built on
``outbox_relay.inbox.InboxTask`` runs its body once per message however
many times it arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import kombu.exceptions

from ..errors import ConfigError, PermanentError, RetryableError
from ..model import Message
from ._options import as_callable_or, constructor_kwargs
from ._process import PerProcess
from .protocol import import_object

__all__ = ["CeleryTaskPublisher", "message_kwargs"]

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
    """Send the task ``task_name`` for each message (``task_id`` = idempotency key).

    ``app`` is a Celery app, ``"module:app"``, or None: then an app of our
    own on ``broker_url`` when given, else Celery's current app at publish
    time (inside the relay worker, the relay's app and broker). ``args_from``
    is ``"payload"`` (``args=[payload]``), ``"message"`` (the whole message
    as keyword arguments, see ``message_kwargs``) or a callable returning
    ``(args, kwargs)``.
    """

    def __init__(
        self,
        task_name: str,
        *,
        app: Any = None,
        broker_url: str | None = None,
        queue: str | None = None,
        link: Any = None,
        args_from: ArgsFrom = "payload",
        publish_timeout: float = 6.0,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(task_name, str) or not task_name:
            raise ConfigError("a Celery task publisher needs a task name")
        if args_from not in ("payload", "message") and not callable(args_from):
            raise ConfigError(
                f"args_from must be 'payload', 'message' or a callable, not {args_from!r}"
            )
        if app is not None and broker_url is not None:
            raise ConfigError("give a Celery task publisher an app or a broker_url, not both")
        self.task_name = task_name
        self.queue = queue
        self.link = link
        self.args_from = args_from
        self.publish_timeout = float(publish_timeout)
        self._options = dict(options or {})
        self._app_spec = app
        self._broker_url = broker_url
        # An app built here is per process: its producer pool holds sockets.
        self._own_app: PerProcess[Any] = PerProcess(self._build_app)

    def __repr__(self) -> str:
        return f"CeleryTaskPublisher({self.task_name!r}, queue={self.queue!r})"

    @classmethod
    def from_options(
        cls, task_name: str, options: Mapping[str, Any], overrides: Mapping[str, Any] | None = None
    ) -> CeleryTaskPublisher:
        defaults: dict[str, Any] = {}
        budget = options.get("publish_timeout_seconds")
        if budget is not None:
            # Connect (broker_connection_timeout) + write + confirm must fit.
            defaults["publish_timeout"] = float(budget) / 3.0
        names = {
            "celery_app": "app",
            "celery_broker_url": "broker_url",
            "celery_queue": "queue",
            "celery_args_from": "args_from",
        }
        kwargs = constructor_kwargs(options, overrides, names, defaults)
        if "args_from" in kwargs:
            kwargs["args_from"] = as_callable_or(
                "celery_args_from", kwargs["args_from"], ("payload", "message")
            )
        return cls(task_name, **kwargs)

    # ------------------------------------------------------------------ app
    def _build_app(self) -> Any:
        from celery import Celery

        app = Celery("outbox_relay.task_publisher", broker=self._broker_url, set_as_current=False)
        app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            # Publisher confirms on RabbitMQ: a send counts once the broker has it.
            # One connection attempt: kombu would otherwise retry (and sleep)
            # until broker_connection_timeout ran out, inside our publish.
            broker_transport_options={"confirm_publish": True, "max_retries": 0},
            broker_connection_timeout=self.publish_timeout,
        )
        return app

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

    @property
    def timeout_seconds(self) -> float:
        """Connect (the app's ``broker_connection_timeout``) + write + confirm."""
        connect = float(self.app.conf.broker_connection_timeout or 4.0)
        return connect + 2 * self.publish_timeout

    # ------------------------------------------------------------ publishing
    def arguments(self, message: Message) -> tuple[list[Any], dict[str, Any]]:
        if self.args_from == "payload":
            return [message.payload], {}
        if self.args_from == "message":
            return [], message_kwargs(message)
        args, kwargs = self.args_from(message)
        return list(args), dict(kwargs)

    def __call__(self, message: Message) -> None:
        args, kwargs = self.arguments(message)
        # Celery turns custom headers into attributes of the consumer's
        # task.request, so a user header named "id" or "task" would clobber
        # the protocol's: the row's own headers travel nested, under one key.
        headers = {
            "idempotency-key": message.idempotency_key,
            "outbox-id": message.id,
            "outbox-event-type": message.event_type,
            "outbox-aggregate-type": message.aggregate_type,
            "outbox-aggregate-id": message.aggregate_id,
            "outbox-headers": dict(message.headers or {}),
        }
        app = self.app
        try:
            app.send_task(
                self.task_name,
                args=args,
                kwargs=kwargs,
                task_id=message.idempotency_key,
                queue=self.queue,
                headers=headers,
                link=self.link,
                serializer="json",
                # The relay's backoff is the retry loop: Celery's own publish
                # retries would sleep inside our publish timeout.
                retry=False,
                timeout=self.publish_timeout,
                confirm_timeout=self.publish_timeout,
                **self._options,
            )
        except kombu.exceptions.EncodeError as exc:
            raise PermanentError(
                f"task {self.task_name}: arguments cannot be serialized: {exc}"
            ) from exc
        except (kombu.exceptions.KombuError, OSError) as exc:
            raise RetryableError(f"task {self.task_name}: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            errors = _broker_errors(app)
            if isinstance(exc, errors):
                raise RetryableError(f"task {self.task_name}: {type(exc).__name__}: {exc}") from exc
            raise


def _broker_errors(app: Any) -> tuple[type[BaseException], ...]:
    """The connection and channel error classes of the app's broker transport."""
    try:
        with app.connection_for_write() as connection:
            return tuple(connection.connection_errors + connection.channel_errors)
    except Exception:  # the transport cannot even be loaded
        return ()
