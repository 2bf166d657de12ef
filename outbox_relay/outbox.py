"""``Outbox``: one configured outbox, shared by producers and relays.

As one ``Celery(...)`` app is shared by web processes and workers, one
``Outbox`` holds what both sides must agree on (the table, which event types
are ordered, the payload limit, NOTIFY) and is what ``install(app, ...)``
gives the relay::

    # shop/outbox.py
    outbox = outbox_relay.Outbox(table="shop.outbox", ordered_event_types=["order.*"])

    # shop/celery.py
    outbox.install(app, dsn=..., publisher="shop.events:publish")

    # shop/views.py
    with conn.transaction():
        outbox.enqueue(conn, aggregate_type="order", ...)
        outbox.apply_async(conn, send_receipt.s(order_id))

Producers validate only these settings. Ordering is decided here and
written on each row, so the relay can never order rows differently from how
they were written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg

from . import _defaults, producer, store
from .config import ProducerSettings
from .errors import ConfigError
from .producer import NewMessage
from .table import OutboxTable

if TYPE_CHECKING:
    from .aio import AsyncOutbox
    from .celery.runtime import Installation

__all__ = ["Outbox", "configure", "default_outbox", "migrate"]

_PRODUCER_FIELDS = frozenset(ProducerSettings.field_names())


class Outbox:
    """Producer settings, validated once, plus ``enqueue`` and ``install``.

    Keywords left out are read from ``conf`` (a Celery app's configuration,
    ``outbox_*`` names) when given, then from ``OUTBOX_*`` environment
    variables, then the defaults. Reading is deferred to first use, so an
    ``Outbox`` made before the Celery app is configured sees its settings.
    """

    def __init__(
        self,
        *,
        table: str | OutboxTable | None = None,
        ordered_event_types: Iterable[str] | str | None = None,
        max_payload_bytes: int | None = None,
        notify: bool | None = None,
        conf: Any = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        given: dict[str, Any] = {
            "table": table.qualified if isinstance(table, OutboxTable) else table,
            "ordered_event_types": ordered_event_types,
            "max_payload_bytes": max_payload_bytes,
            "notify": notify,
        }
        self._given = {k: v for k, v in given.items() if v is not None}
        self._conf = conf
        self._environ = environ
        self._settings: ProducerSettings | None = None
        if conf is None:
            self._settings = self._load()  # nothing to wait for: fail now

    @classmethod
    def from_settings(cls, values: Mapping[str, Any], *, conf: Any = None) -> Outbox:
        """An Outbox from the producer part of a settings mapping (``install`` keywords)."""
        return cls(**{k: v for k, v in values.items() if k in _PRODUCER_FIELDS}, conf=conf)

    def _load(self) -> ProducerSettings:
        return ProducerSettings.load(self._conf, self._environ, **self._given)

    @property
    def settings(self) -> ProducerSettings:
        if self._settings is None:
            self._settings = self._load()
        return self._settings

    @property
    def table(self) -> OutboxTable:
        return self.settings.outbox_table

    def __repr__(self) -> str:
        return f"Outbox({self.settings!r})"

    # ------------------------------------------------------------ producing
    def enqueue(
        self,
        conn: psycopg.Connection[Any],
        *,
        aggregate_type: str,
        aggregate_id: str | int,
        event_type: str,
        payload: Any,
        operation_key: str | None = None,
        delay: timedelta | float | None = None,
        headers: Mapping[str, Any] | None = None,
        now: datetime | None = None,
    ) -> int:
        """Record one message in the caller's transaction; see ``outbox_relay.enqueue``."""
        return producer.enqueue(
            conn,
            aggregate_type=aggregate_type,
            aggregate_id=aggregate_id,
            event_type=event_type,
            payload=payload,
            operation_key=operation_key,
            delay=delay,
            headers=headers,
            settings=self.settings,
            now=now,
        )

    def enqueue_many(
        self,
        conn: psycopg.Connection[Any],
        messages: Iterable[NewMessage],
        *,
        now: datetime | None = None,
    ) -> list[int]:
        """Insert many messages in the caller's transaction; ids in order."""
        return producer.enqueue_many(conn, messages, settings=self.settings, now=now)

    def migrate(self, conn: psycopg.Connection[Any]) -> list[int]:
        """Apply the migrations this outbox's table lacks; the versions applied."""
        producer.require_psycopg(conn, "migrate")
        return store.migrate(conn, table=self.table)

    @property
    def aio(self) -> AsyncOutbox:
        """The same producer API as coroutines: ``await outbox.aio.enqueue(async_conn, ...)``."""
        from .aio import AsyncOutbox

        return AsyncOutbox(self)

    def apply_async(self, conn: Any, sig: Any, **options: Any) -> Any:
        """Write a Celery signature or canvas as one row in ``conn``'s transaction.

        Returns at once what ``sig.apply_async(**options)`` would (an
        ``AsyncResult``, a ``GroupResult`` for a group), with every task id
        of the canvas fixed now; the relay sends it after the commit, with
        those ids, however many times it takes. Nothing is sent if the
        transaction rolls back. ``conn``: a psycopg connection, a SQLAlchemy
        Session or Connection, or a Django connection. See docs/celery.md.
        """
        from .celery.canvas import apply_async

        return apply_async(conn, self, sig, options)

    # --------------------------------------------------------------- relaying
    def install(self, app: Any, **settings: Any) -> Installation:
        """Adopt the relay into ``app`` with this outbox; ``settings`` are relay settings."""
        clash = sorted(_PRODUCER_FIELDS.intersection(settings))
        if clash:
            raise ConfigError(
                f"install(): {', '.join(clash)} belong(s) to the Outbox; give them to "
                "Outbox(...) so that producers and the relay share them"
            )
        from .celery.install import install

        return install(app, outbox=self, **settings)


def configure(**settings: Any) -> Outbox:
    """Make an ``Outbox`` with these producer settings the process default.

    The module-level ``outbox_relay.enqueue`` then uses it. Without this, the
    first ``install(app, ...)`` in the process provides the default, else
    the environment.
    """
    unknown = sorted(set(settings) - _PRODUCER_FIELDS)
    if unknown:
        raise ConfigError(
            f"configure() takes producer settings ({', '.join(sorted(_PRODUCER_FIELDS))}); "
            f"not {', '.join(unknown)}"
        )
    outbox = Outbox(**settings)
    _defaults.register(lambda: outbox.settings, explicit=True)
    return outbox


def default_outbox() -> Outbox:
    """An Outbox with the process's default producer settings."""
    settings = _defaults.producer_settings()
    return Outbox(
        table=settings.table,
        ordered_event_types=settings.ordered_event_types,
        max_payload_bytes=settings.max_payload_bytes,
        notify=settings.notify,
    )


def migrate(conn: psycopg.Connection[Any], *, table: OutboxTable | str | None = None) -> list[int]:
    """Apply the migrations the outbox table lacks; return the versions applied.

    ``table`` None: the table ``outbox_relay.enqueue`` writes to (the default
    outbox's: ``configure()``, else the first ``install()``, else
    ``OUTBOX_TABLE``, else ``outbox``), so that the two never disagree.
    Idempotent, and safe when several processes run it at once.
    """
    producer.require_psycopg(conn, "migrate")
    chosen = _defaults.producer_settings().outbox_table if table is None else table
    return store.migrate(conn, table=chosen)
