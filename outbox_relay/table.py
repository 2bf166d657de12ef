"""Where the outbox and the inbox live: validated schema and table names.

Names are checked against a conservative pattern *and* always quoted with
``psycopg.sql.Identifier`` when they reach SQL, so a configuration value can
never smuggle SQL in. Both tables go through the one checker below.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
from dataclasses import dataclass

from psycopg import sql

from .errors import InvalidIdentifier

__all__ = ["InboxTable", "OutboxTable", "check_identifier"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Index names are the table name plus a suffix of up to 16 characters and must
# fit PostgreSQL's 63-byte identifier limit.
_MAX_TABLE_NAME = 40
_MAX_SCHEMA_NAME = 63
# The inbox's retention index is its name plus "_received".
_MAX_INBOX_NAME = 63 - len("_received")


def check_identifier(what: str, kind: str, value: str, limit: int) -> str:
    """``value`` if it is a safe ``what`` (outbox, inbox) ``kind`` (table, schema) name.

    Errors quote the name with ``repr`` so that a blank or odd name is visible.
    """
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidIdentifier(
            f"invalid {what} {kind} name {value!r}: use letters, digits and underscores, "
            "not starting with a digit"
        )
    if len(value) > limit:
        raise InvalidIdentifier(f"{what} {kind} name {value!r} is longer than {limit} characters")
    return value


@dataclass(frozen=True)
class OutboxTable:
    """A schema-qualified outbox table, e.g. ``OutboxTable.parse("app.outbox")``."""

    name: str = "outbox"
    schema: str = "public"

    def __post_init__(self) -> None:
        check_identifier("outbox", "table", self.name, _MAX_TABLE_NAME)
        check_identifier("outbox", "schema", self.schema, _MAX_SCHEMA_NAME)

    @classmethod
    def parse(cls, value: str | OutboxTable | None) -> OutboxTable:
        """Accept ``"outbox"``, ``"schema.outbox"`` or an ``OutboxTable``.

        None: the table ``outbox_relay.enqueue`` writes to (``configure()``,
        the first ``install()``, ``OUTBOX_TABLE``, else ``public.outbox``), so
        that every call taking ``table=`` agrees with it when given none
        (``claim``, ``stats`` and ``dispatch_once`` read public.outbox while
        ``enqueue`` wrote to OUTBOX_TABLE's table).
        """
        if value is None:
            from ._defaults import producer_settings

            return producer_settings().outbox_table
        if isinstance(value, OutboxTable):
            return value
        if not isinstance(value, str):
            raise InvalidIdentifier(f"outbox table must be a string, not {type(value).__name__}")
        parts = value.split(".")
        if len(parts) == 1:
            return cls(name=parts[0])
        if len(parts) == 2:
            return cls(schema=parts[0], name=parts[1])
        raise InvalidIdentifier(
            f"invalid outbox table {value!r}: expected 'table' or 'schema.table'"
        )

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def identifier(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)

    def related(self, suffix: str) -> sql.Identifier:
        """A relation beside the table (the migrations table, the inbox ...)."""
        return sql.Identifier(self.schema, f"{self.name}_{suffix}")

    def index(self, suffix: str) -> sql.Identifier:
        """An index name; indexes live in their table's schema, so unqualified."""
        return sql.Identifier(f"{self.name}_{suffix}")

    @property
    def channel(self) -> str:
        """The LISTEN/NOTIFY channel that announces new rows in this table."""
        channel = f"outbox_relay.{self.schema}.{self.name}"
        if len(channel) > 63:
            digest = hashlib.sha1(channel.encode(), usedforsecurity=False).hexdigest()[:20]
            channel = f"outbox_relay.{digest}"
        return channel

    @property
    def lock_key(self) -> str:
        """Text hashed into advisory-lock keys that belong to this table."""
        return f"outbox_relay:{self.schema}.{self.name}"

    @property
    def migrate_command(self) -> str:
        """The command that migrates this table, for error messages: with its
        ``--table`` unless it is the default one (run without, the command
        would migrate ``public.outbox`` and the error would stay)."""
        return self.command("migrate")

    def command(self, args: str) -> str:
        """``outbox-relay ARGS`` on this table, for messages: with ``--table``
        unless it is the default one."""
        if self == OutboxTable():
            return f"outbox-relay {args}"
        return f"outbox-relay {args} --table {shlex.quote(self.qualified)}"

    def grant_command(self, role: str | None, kind: str) -> str:
        """The command that prints ``role``'s grants of ``kind`` on this table
        (``ROLE`` when the role is not known)."""
        return self.command(f"grant --role {shlex.quote(role or 'ROLE')} --kind {kind}")

    @property
    def migrate_call(self) -> str:
        """The Python call that migrates this table, for error messages."""
        if self == OutboxTable():
            return "outbox_relay.migrate(conn)"
        return f"outbox_relay.migrate(conn, table={self.qualified!r})"


@dataclass(frozen=True)
class InboxTable:
    """Where a consumer's inbox lives. By default beside the outbox: ``public.outbox_inbox``."""

    name: str = "outbox_inbox"
    schema: str = "public"

    def __post_init__(self) -> None:
        check_identifier("inbox", "table", self.name, _MAX_INBOX_NAME)
        check_identifier("inbox", "schema", self.schema, _MAX_SCHEMA_NAME)

    @classmethod
    def beside(cls, outbox: OutboxTable | str | None = None) -> InboxTable:
        """The inbox of an outbox table (``schema.<outbox>_inbox``)."""
        table = OutboxTable.parse(outbox)
        return cls(name=f"{table.name}_inbox", schema=table.schema)

    @classmethod
    def parse(cls, value: InboxTable | str | None) -> InboxTable:
        """None: beside ``OUTBOX_TABLE`` (default ``outbox``); ``"[schema.]table"``: that table."""
        if value is None:
            # A consumer process often has no outbox settings of its own; the
            # environment it shares with the producer names the outbox.
            return cls.beside(os.environ.get("OUTBOX_TABLE") or None)
        if isinstance(value, InboxTable):
            return value
        if not isinstance(value, str):
            raise InvalidIdentifier(f"inbox table must be a string, not {type(value).__name__}")
        schema, dot, name = value.rpartition(".")
        return cls(name=name, schema=schema) if dot else cls(name=name)

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def identifier(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)

    @property
    def lock_key(self) -> str:
        """Text hashed into the advisory lock that serializes creating this inbox."""
        return f"outbox_relay:inbox:{self.qualified}"
