"""Operator actions on the outbox: status, dead letters, retention, gauges, grants.

The Python side of ``outbox-relay status``, ``dead list|retry|skip``,
``purge`` and ``grant``, for scripts and admin views. The functions are the
store's (``outbox_relay/store/ops.py``, SQL in ``sql/operations.sql``): like
every store call, each runs in its own short transaction (a savepoint inside
a caller's), takes an optional ``table`` (default ``public.outbox``) and,
where time matters, an optional ``now``.

Also here: ``status_table``, how a person sees ``status()``, shared by
``outbox-relay status`` and the demo's closing report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .store.ops import (
    DeadFilter,
    DeadRow,
    PurgeResult,
    QueueGauges,
    RetryingRow,
    RoleKind,
    attempts_distribution,
    dead_count,
    dead_list,
    dead_retry,
    dead_skip,
    done_recently,
    gauges,
    get_row,
    grants,
    purge,
    retrying_list,
    stats,
    status,
)

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "DeadFilter",
    "DeadRow",
    "PurgeResult",
    "QueueGauges",
    "RetryingRow",
    "RoleKind",
    "attempts_distribution",
    "dead_count",
    "dead_list",
    "dead_retry",
    "dead_skip",
    "done_recently",
    "gauges",
    "get_row",
    "grants",
    "human_duration",
    "purge",
    "retrying_list",
    "stats",
    "status",
    "status_table",
]


def human_duration(seconds: float) -> str:
    """``2d 03h 04m``, ``1h 00m 05s``, ``4m 09s`` or ``3.2s``."""
    whole = int(seconds)
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{seconds:.1f}s"


def status_table(snapshot: dict[str, Any]) -> Table:
    """``status()`` as a table for a terminal. With a ``max_in_flight`` key
    (the in-flight cap, which only the relay's settings know) the live
    leases are shown against it."""
    # Imported here: scripts and workers that import this module for purge()
    # or dead_retry() never render anything.
    from rich.table import Table

    table = Table(show_header=True)
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key in ("pending", "processing", "done", "dead"):
        table.add_row(f"{key} messages", str(snapshot[key]))
        if key == "pending" and snapshot.get("parked"):
            # Ordered messages behind a dead or in-flight one of their
            # aggregate: `dead list` shows the dead ones that block.
            table.add_row(
                "  of which behind an earlier one of their aggregate", str(snapshot["parked"])
            )
    age = snapshot["oldest_pending_age_seconds"]
    # Under a minute human_duration is already in seconds: say it once.
    shown = "none" if not age else human_duration(age) + (f" ({age:.1f}s)" if age >= 60 else "")
    table.add_row("oldest awaiting delivery", shown)
    table.add_row("expired leases", str(snapshot["expired_leases"]))
    in_flight, cap = snapshot.get("in_flight"), snapshot.get("max_in_flight")
    if in_flight is not None:
        label = "in flight (live leases)" + (" / cap" if cap else "")
        table.add_row(label, f"{in_flight} / {cap}" if cap else str(in_flight))
    if snapshot.get("done_last_minute") is not None:
        table.add_row("done in the last minute", str(snapshot["done_last_minute"]))
    attempts = snapshot["attempts"]
    spread = ", ".join(f"{k}: {v}" for k, v in attempts.items()) or "none waiting"
    table.add_row("attempts (pending+processing)", spread)
    return table
