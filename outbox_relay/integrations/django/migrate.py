"""The hook the app's Django migrations run: ``outbox_relay.migrate`` on Django's connection."""

from __future__ import annotations

from typing import Any

from ...store import migrate
from ._producer import psycopg_connection
from .conf import database_alias, outbox

__all__ = ["run"]


def run(connection: Any) -> list[int]:
    """Apply the outbox migrations on ``connection`` if it is the outbox's database.

    Inside Django's migration transaction (a savepoint of it); other
    databases of a multi-database project are left alone.
    """
    if connection.alias != database_alias():
        return []
    return migrate(psycopg_connection(connection.alias), table=outbox().table)
