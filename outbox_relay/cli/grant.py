"""``outbox-relay grant --role R --kind producer|relay|operator``: print least-privilege GRANTs."""

from __future__ import annotations

from typing import cast

import click

from .. import operations
from .common import CliState, command_options, pass_state

__all__ = ["grant_command"]


@click.command("grant")
@click.option("--role", required=True, help="The PostgreSQL role to grant to.")
@click.option(
    "--kind",
    type=click.Choice(["producer", "relay", "operator"]),
    required=True,
    help=(
        "producer: application code that enqueues; relay: workers and beat; "
        "operator: status, dead letters and purge."
    ),
)
@command_options(dsn=False)
@pass_state
def grant_command(state: CliState, role: str, kind: str) -> None:
    """Print least-privilege GRANT statements (nothing is executed)."""
    role_kind = cast(operations.RoleKind, kind)  # click.Choice allows only the three
    click.echo(operations.grants(role, role_kind, table=state.table), nl=False)
