"""The store: the only code that runs SQL.

Every statement the package sends goes through one of these modules, each
a thin layer over the named queries in ``outbox_relay/sql/*.sql``:

* ``relay``: the hot path (claim, begin, finalize, renew, rescue);
* ``schema``: migrations and start-up checks;
* ``producer``: the producer's insert, ordering lock and NOTIFY;
* ``ops``: what operators run (status, dead letters, purge, gauges);
* ``inbox``: the consumer-side de-duplication table.

Each function takes a psycopg connection, an optional ``table`` (default
``public.outbox``) and, where time matters, an optional ``now`` so tests can
move the clock; production passes no ``now`` and the database's clock decides.
"""

from __future__ import annotations

from ._base import MAX_ERROR_LENGTH, statement_tx
from .durable import bound_session
from .ops import PurgeResult, get_row, purge, stats
from .relay import (
    Began,
    Rescued,
    begin,
    claim,
    claim_batch,
    done_and_take_durable,
    done_under,
    extend_lease,
    extend_leases,
    finalize,
    finalize_and_take,
    in_flight,
    mark_dead,
    mark_done,
    next_due,
    promote,
    reap,
    reprobe_parked,
    reschedule,
    rescue,
    take_chunk,
    take_next,
)
from .schema import (
    applied_migrations,
    listen,
    may_insert,
    migrate,
    missing_migrations,
    relay_identity,
    relay_lacks,
    session_defaults,
    table_exists,
)

__all__ = [
    "MAX_ERROR_LENGTH",
    "Began",
    "PurgeResult",
    "Rescued",
    "applied_migrations",
    "begin",
    "bound_session",
    "claim",
    "claim_batch",
    "done_and_take_durable",
    "done_under",
    "extend_lease",
    "extend_leases",
    "finalize",
    "finalize_and_take",
    "get_row",
    "in_flight",
    "listen",
    "mark_dead",
    "mark_done",
    "may_insert",
    "migrate",
    "missing_migrations",
    "next_due",
    "promote",
    "purge",
    "reap",
    "relay_identity",
    "relay_lacks",
    "reprobe_parked",
    "reschedule",
    "rescue",
    "session_defaults",
    "statement_tx",
    "stats",
    "table_exists",
    "take_chunk",
    "take_next",
]
