"""Load the named queries and migrations in ``sql/`` and render them for a table.

The SQL text lives in ``sql/queries.sql`` and ``sql/migrations/NNNN_name.sql``;
this module only parses those files and fills in identifiers, so reading the
SQL never means reading Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from psycopg import sql

from ..table import OutboxTable

__all__ = ["Migration", "Queries", "migrations_for", "queries_for", "raw_migration", "raw_queries"]

_NAME_LINE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
# A line that is only a comment (no statement here puts one after code).
_COMMENT_LINE = re.compile(r"^[ \t]*--.*(?:\n|$)", re.MULTILINE)
_INDENT = re.compile(r"^[ \t]+", re.MULTILINE)
_MIGRATION_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")


def _identifiers(table: OutboxTable) -> dict[str, sql.Composable]:
    return {
        "table": table.identifier,
        # The table's name as a string literal, for a migration's DO block
        # ('"public"."outbox"'::regclass): quoted twice, as identifier and text.
        "table_literal": sql.Literal(table.identifier.as_string()),
        "schema": sql.Identifier(table.schema),
        "migrations": table.related("migrations"),
        "inbox": table.related("inbox"),
        "ix_ready": table.index("ready"),
        "ix_leased": table.index("leased"),
        "ix_unfinished_agg": table.index("unfinished_agg"),
        "ix_operation_key": table.index("operation_key"),
        "ix_done": table.index("done"),
        "ix_inbox_received": table.index("inbox_received"),
        "leased_iff_processing": sql.Identifier(f"{table.name}_leased_iff_processing"),
        "channel": sql.Identifier(table.channel),
    }


def _render(text: str, table: OutboxTable) -> str:
    # Rendered once per table and cached: the hot path then sends a constant
    # string, which psycopg can prepare server-side. A query named frag_*
    # is a piece of others, written into them where they name it; it may
    # name identifiers and the fragments defined before it.
    names: dict[str, sql.Composable] = dict(_identifiers(table))
    for name, body in raw_queries().items():
        if name.startswith("frag_"):
            names[name] = sql.SQL(sql.SQL(body).format(**names).as_string())
    return sql.SQL(text).format(**names).as_string()


@cache
def raw_queries() -> dict[str, str]:
    """Every named query's text, identifiers not yet filled in."""
    # Every sql/*.sql file (not the migrations) holds named queries, one
    # file per concern: queries.sql for the hot path, others beside it.
    found: dict[str, str] = {}
    folder = resources.files("outbox_relay.sql")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        parts = _NAME_LINE.split(entry.read_text("utf-8"))
        # parts = [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2]):
            if name in found:
                raise RuntimeError(f"query {name!r} is defined twice ({entry.name})")
            found[name] = _without_comments(body).strip().rstrip(";")
    return found


def _without_comments(body: str) -> str:
    """A query as sent: its comment lines and indentation stay in the .sql
    file. The longest query (the claim) was 4.5 KB with its comments, past
    the 4 KB up to which psycopg caches a query's conversion to PostgreSQL's
    placeholders: 65 us of the client's CPU per claim to split it again.
    (No query has a string literal that spans lines, whose indentation
    would be part of its value.)"""
    return _INDENT.sub("", _COMMENT_LINE.sub("", body))


class Queries:
    """Every named query, rendered for one table (attribute access by name)."""

    def __init__(self, table: OutboxTable) -> None:
        self.table = table
        self._rendered = {name: _render(body, table) for name, body in raw_queries().items()}

    def __getattr__(self, name: str) -> str:
        try:
            return self._rendered[name]
        except KeyError:
            raise AttributeError(f"no query named {name!r} in queries.sql") from None


@cache
def queries_for(table: OutboxTable) -> Queries:
    return Queries(table)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


@cache
def _raw_migrations() -> tuple[tuple[int, str, str], ...]:
    folder = resources.files("outbox_relay.sql").joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = _MIGRATION_FILE.match(entry.name)
        if match:
            found.append((int(match.group(1)), match.group(2), entry.read_text("utf-8")))
    found.sort()
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..n without gaps, found {versions}")
    return tuple(found)


def raw_migration(version: int) -> str:
    """One migration's text, identifiers not yet filled in."""
    for number, _, text in _raw_migrations():
        if number == version:
            return text
    raise KeyError(f"no migration {version}")


@cache
def migrations_for(table: OutboxTable) -> tuple[Migration, ...]:
    return tuple(Migration(v, n, _render(text, table)) for v, n, text in _raw_migrations())
