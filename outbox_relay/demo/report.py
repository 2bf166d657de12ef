"""What the demo prints at the end: the outcome, the CLI's status table, and where to look next."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psycopg
from rich.console import Console
from rich.table import Table

from .. import operations
from .._redact import mask_dsn
from . import DemoConfig
from .display import Sample, format_statuses
from .processes import CeleryProcess
from .receiver import Receiver

__all__ = ["Running", "print_next_steps", "print_report", "published_totals"]


@dataclass
class Running:
    """What the demo started, for the report and the hints."""

    folder: Path
    dsn: str
    broker: str
    queue: str
    receiver: Receiver
    worker: CeleryProcess
    beat: CeleryProcess
    metrics_dir: Path
    embedded_db: bool

    def shown_dsn(self) -> str:
        return mask_dsn(self.dsn)

    def shown_broker(self) -> str:
        return mask_dsn(self.broker)


def print_report(
    console: Console, config: DemoConfig, running: Running, sample: Sample, settled: bool
) -> None:
    """The outcome, the status table, the webhook's and workers' view, dead messages."""
    cfg = config
    console.print()
    if settled:
        why = " (rejected with HTTP 400 on purpose)" if sample.dead else ""
        console.print(
            f"[bold green]All {cfg.orders} orders settled in {sample.elapsed:.1f}s[/]: "
            f"{sample.delivered} delivered, {sample.dead} dead{why}, none lost"
        )
    else:
        console.print(
            f"[bold red]Not settled after {cfg.timeout:g}s[/]: {sample.delivered} "
            f"delivered, {sample.dead} dead; the worker's last lines:"
        )
        console.print(running.worker.tail(20), markup=False, soft_wrap=True)
    with psycopg.connect(running.dsn, autocommit=True) as conn:
        snapshot = operations.status(conn, table=cfg.table)
        dead = operations.dead_list(conn, where=operations.DeadFilter(), limit=10, table=cfg.table)
    console.print()
    console.print(f"outbox {cfg.table.qualified} at {running.shown_dsn()}", soft_wrap=True)
    console.print(operations.status_table(snapshot))

    statuses, accepted, duplicates = running.receiver.stats.snapshot()
    console.print(
        f"webhook: {sum(statuses.values())} requests (HTTP {format_statuses(statuses)}); "
        f"{accepted} orders accepted once each, "
        f"{duplicates} duplicate(s) recognised by their Idempotency-Key",
        soft_wrap=True,
    )
    published = published_totals(running.metrics_dir)
    if published:
        shown = ", ".join(f"{k}={v:g}" for k, v in sorted(published.items()))
        console.print(f"metrics: outbox_published_total by outcome: {shown}")
    if dead:
        table = Table(title="dead messages (outbox-relay dead list)", title_justify="left")
        for column in ("id", "order", "attempts", "last error"):
            table.add_column(column, overflow="fold")
        for row in dead:
            table.add_row(str(row.id), row.aggregate_id, str(row.attempts), row.last_error)
        console.print(table)
    print_next_steps(console, config, running)


def print_next_steps(console: Console, config: DemoConfig, running: Running) -> None:
    """Where to read and what to run next."""
    table = config.table.qualified
    gone = running.embedded_db and not config.keep_running
    console.print()
    console.print("[bold]Where to look next[/]")
    lines = [
        ("README", '"Quick start" and "Guarantees"; docs/state-machine.md (the statuses),'),
        ("", "docs/operations.md (alerts, dead letters, purge, scaling), "
             "docs/configuration.md, docs/publishers.md, docs/integrations.md"),
        ("status", f"outbox-relay --table {table} status   (queue depth, oldest, leases)"),
        ("dead letters", f"outbox-relay --table {table} dead list   then dead retry / skip"),
        ("Flower", "celery -A outbox_relay.app flower   (the workers send task events, -E)"),
        ("metrics", f"outbox-relay --table {table} metrics --port 9808   "
                    "(alerts: deploy/prometheus/alerts.yml)"),
    ]  # fmt: skip
    for label, text in lines:
        console.print(f"  [cyan]{label:<13}[/]{text}", soft_wrap=True)
    if gone:
        console.print(
            "  The embedded servers are gone now; `outbox-relay demo --keep-running` "
            "leaves them up for these commands.",
            soft_wrap=True,
        )
    elif not config.keep_running:
        console.print(
            f"  The demo's rows stay in {running.shown_dsn()}: "
            f"DROP SCHEMA {config.table.schema} CASCADE removes them.",
            soft_wrap=True,
        )


def published_totals(folder: Path) -> dict[str, float]:
    """``outbox_published_total`` summed by outcome over the workers' metric files."""
    from ..metrics import build_registry

    registry, _ = build_registry(dsn=None, multiprocess_dir=str(folder))
    totals: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "outbox_published_total":
                outcome = sample.labels.get("outcome", "?")
                totals[outcome] = totals.get(outcome, 0.0) + sample.value
    return totals
