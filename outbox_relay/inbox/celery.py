"""Celery consumer tasks whose body runs once per message: ``InboxTask``, ``inbox_task``."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import psycopg
from celery import Task

from .._redact import reveal
from ..errors import ConfigError
from .core import (
    ConnectionFactory,
    InboxError,
    TableLike,
    connection_from_pool,
    current_connection,
    receive,
    running,
)

__all__ = ["InboxTask", "inbox_task", "message_id_from_request"]

_ID_HEADERS = ("idempotency-key", "Idempotency-Key", "idempotency_key")


def message_id_from_request(request: Any) -> str | None:
    """The message id of a Celery task request.

    In order: an ``Idempotency-Key`` header (set by outbox-relay's task
    publisher, or by any producer that has one); the task id (outbox-relay
    sends its tasks with ``task_id`` = idempotency key, and a broker
    redelivery keeps the task id); the ``outbox-id`` header.
    """
    headers = getattr(request, "headers", None) or {}
    for name in _ID_HEADERS:
        value = headers.get(name) if isinstance(headers, dict) else None
        if value is None:
            value = getattr(request, name, None)
        if value:
            return str(value)
    task_id = getattr(request, "id", None)
    if task_id:
        return str(task_id)
    outbox_id = headers.get("outbox-id") if isinstance(headers, dict) else None
    outbox_id = outbox_id or getattr(request, "outbox-id", None)
    return str(outbox_id) if outbox_id else None


class InboxTask(Task):  # type: ignore[misc]  # celery is untyped
    """A Celery task base whose body runs once per message, in one transaction with the inbox row.

    Use ``@app.task(base=InboxTask)`` or ``@inbox_task(app, ...)``. The body
    writes its effect through ``self.inbox_conn`` (or
    ``inbox.current_connection()``); a duplicate delivery returns
    ``on_duplicate(...)`` (None) without running the body. The message id
    is the ``Idempotency-Key`` header, else the task id, so a fresh send
    that reuses a task id is skipped too (Celery itself only recognizes a
    broker redelivery of the same message).

    Acknowledgement defaults that lose no work (a task's own ``acks_late``,
    ``reject_on_worker_lost`` or ``acks_on_failure_or_timeout`` wins; the
    app's ``task_*`` settings do not, they are Celery's lossy defaults):
    the message is acked after the body (``acks_late=True``); a worker
    process that dies mid-body gives it back to the broker
    (``reject_on_worker_lost=True``) and the inbox absorbs any repeat; a
    body that raises is *rejected*, not acked (``acks_on_failure_or_timeout
    =False``): RabbitMQ dead-letters it when the queue has a dead-letter
    exchange, Redis drops it. Either way its effect and inbox row rolled
    back, so a re-send with the same id runs it. See docs/publishers.md.

    Settings (task attributes, e.g. ``@app.task(base=InboxTask,
    inbox_consumer="billing")``): ``inbox_consumer`` (default: the task
    name), ``inbox_dsn`` (default: Celery setting ``outbox_inbox_dsn``, then
    ``OUTBOX_INBOX_DSN``, then the DSN of ``outbox_relay.install(app, ...)``,
    then ``outbox_dsn``, ``OUTBOX_DSN``),
    ``inbox_conn_factory``, ``inbox_table``, ``inbox_pool_size``.
    """

    # Class attributes, so Celery's Task.bind leaves them alone (it copies
    # the app's task_* settings only onto attributes that are None) and a
    # task's own options (@app.task(base=InboxTask, acks_late=False)) win.
    acks_late = True
    reject_on_worker_lost = True
    acks_on_failure_or_timeout = False

    inbox_consumer: str | None = None
    inbox_dsn: str | None = None
    inbox_conn_factory: ConnectionFactory | None = None
    inbox_table: TableLike = None
    inbox_pool_size: int = 4

    @property
    def inbox_conn(self) -> psycopg.Connection[Any]:
        return current_connection()

    def inbox_message_id(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """Override to take the id from the arguments instead of the request."""
        message_id = message_id_from_request(self.request)
        if not message_id:
            raise InboxError(
                f"task {self.name}: no message id (no Idempotency-Key header and no task id); "
                "call it through a broker, or override inbox_message_id()"
            )
        return message_id

    def inbox_connection(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A connection for one inbox transaction (from the per-process pool)."""
        if self.inbox_conn_factory is not None:
            return self.inbox_conn_factory()
        return connection_from_pool(self._inbox_dsn(), self.inbox_pool_size)

    def _inbox_dsn(self) -> str:
        if self.inbox_dsn:
            return self.inbox_dsn
        conf = self.app.conf
        # An app set up with outbox_relay.install(app, dsn=...) carries its
        # DSN on app.outbox_relay (given to install(), or its outbox_dsn
        # setting, or OUTBOX_DSN). It comes after the inbox-specific settings,
        # which exist to put the inbox in another database, and before the
        # bare environment, which install(dsn=...) overrides for the relay too.
        relay = getattr(self.app, "outbox_relay", None)
        for found in (
            conf.get("outbox_inbox_dsn"),
            os.environ.get("OUTBOX_INBOX_DSN"),
            getattr(relay, "dsn", None),
            conf.get("outbox_dsn"),
            os.environ.get("OUTBOX_DSN"),
        ):
            if found:
                # Celery settings hold DSNs as masked Secrets (config.hide_secrets).
                return str(reveal(found))
        raise ConfigError(
            f"task {self.name} has no inbox database: set inbox_dsn on the task, the Celery "
            "setting outbox_inbox_dsn, or OUTBOX_INBOX_DSN, or install(app, dsn=...)"
        )

    def on_duplicate(self, message_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What a duplicate delivery returns (the body did not run)."""
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        message_id = self.inbox_message_id(args, kwargs)
        consumer = self.inbox_consumer or self.name
        with (
            self.inbox_connection() as conn,
            receive(
                conn, consumer=consumer, message_id=message_id, table=self.inbox_table
            ) as fresh,
        ):
            if not fresh:
                return self.on_duplicate(message_id, args, kwargs)
            with running(conn):
                return super().__call__(*args, **kwargs)


def inbox_task(
    app: Any,
    *,
    consumer: str | None = None,
    dsn: str | None = None,
    conn_factory: ConnectionFactory | None = None,
    table: TableLike = None,
    base: type[InboxTask] = InboxTask,
    **options: Any,
) -> Callable[[Callable[..., Any]], Any]:
    """``@inbox_task(app, consumer="billing")``: ``app.task`` with the ``InboxTask`` base.

    Other keyword arguments go to ``app.task`` (``name``, ``queue``,
    ``acks_late`` ...). The acknowledgement defaults are ``InboxTask``'s: a
    worker that dies mid-task gets the message again, and the inbox absorbs it.
    """
    attrs: dict[str, Any] = {
        "inbox_consumer": consumer,
        "inbox_dsn": dsn,
        "inbox_table": table,
    }
    attrs = {k: v for k, v in attrs.items() if v is not None}
    if conn_factory is not None:
        # A plain function stored on the class would become a method.
        attrs["inbox_conn_factory"] = staticmethod(conn_factory)
    decorator: Callable[[Callable[..., Any]], Any] = app.task(base=base, **attrs, **options)
    return decorator
