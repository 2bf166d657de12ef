"""Write outbox messages from an ORM's transaction.

* ``outbox_relay.integrations.sqlalchemy``: ``enqueue(session_or_connection, ...)``
  for SQLAlchemy 2 with the ``postgresql+psycopg`` dialect.
* ``outbox_relay.integrations.sqlalchemy_asyncio``: the same as coroutines
  for ``AsyncSession`` / ``AsyncConnection``, on ``postgresql+psycopg`` or
  ``postgresql+asyncpg``.
* ``outbox_relay.integrations.django``: a Django app (``INSTALLED_APPS``):
  the table by ``manage.py migrate``, ``enqueue(..., using="default")`` in
  ``transaction.atomic()``, the relay configured from ``settings.py``, and a
  dead-letter page in the admin.

Each hands the ORM's own driver connection to the producer
(``outbox_relay.enqueue`` or ``outbox_relay.aio``), so the message commits,
or rolls back, with the business change. None is imported here: each needs
its framework installed, and only its users should pay for importing it.
See docs/integrations.md.
"""

from __future__ import annotations

__all__: list[str] = []
