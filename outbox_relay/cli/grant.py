"""``outbox-relay grant --role R --kind producer|relay``: print least-privilege GRANTs."""

from __future__ import annotations

import click

from .. import operations
from .common import CliState, command_options, pass_state

__all__ = ["grant_command"]


@click.command("grant")
@click.option("--role", required=True, help="The PostgreSQL role to grant to.")
@click.option(
    "--kind",
    type=click.Choice(["producer", "relay"]),
    required=True,
    help="producer: application code that enqueues; relay: workers, beat, operators.",
)
@command_options(dsn=False)
@pass_state
def grant_command(state: CliState, role: str, kind: str) -> None:
    """Print least-privilege GRANT statements (nothing is executed)."""
    role_kind: operations.RoleKind = "producer" if kind == "producer" else "relay"
    click.echo(operations.grants(role, role_kind, table=state.table), nl=False)
