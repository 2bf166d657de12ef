"""Write outbox messages from an ORM's transaction.

* ``outbox_relay.integrations.sqlalchemy``: ``enqueue(session_or_connection, ...)``
  for SQLAlchemy 2 with the ``postgresql+psycopg`` dialect.
* ``outbox_relay.integrations.django``: ``enqueue(..., using="default")`` for
  Django 4.2+ with the psycopg 3 backend.

Both hand the ORM's own psycopg 3 connection to ``outbox_relay.enqueue``, so
the message commits, or rolls back, with the business change. Neither module
is imported here: each needs its framework installed, and only its users
should pay for importing it. See docs/integrations.md.
"""

from __future__ import annotations

__all__: list[str] = []
