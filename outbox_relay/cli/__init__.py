"""``outbox-relay``: the operator's command line.

    outbox-relay [--dsn DSN | --dsn-file PATH] [--table [SCHEMA.]TABLE] COMMAND

    migrate [--sql]             apply migrations, or print the pending DDL to review
    status [--json] [--watch S] queue depth, oldest waiting message, leases, attempts
    dead list|retry|skip        inspect and release dead messages
    retrying                    messages waiting for a retry, with their last error
    purge --older-than 7d       delete old done rows in bounded batches
    inbox purge --older-than 30d  delete old inbox rows (a receiving service's retention)
    grant --role R --kind K     print least-privilege GRANT statements
    metrics [--port 9808]       serve Prometheus metrics
    demo [--orders N]           the whole relay end to end on this machine

The same commands run as ``celery -A APP outbox ...`` (entry point group
``celery.commands``); there the DSN and table default to the app's
``outbox_dsn`` / ``outbox_table`` settings. The DSN's password is never
printed: wherever a DSN is shown it is masked. ``--dsn-file`` /
``OUTBOX_DSN_FILE`` read the DSN from a file, which keeps the password out of
``ps``; a password given in ``--dsn`` draws a warning on stderr.

One module per command (group) beside this one; ``common.py`` holds the
options and state they share.
"""

from __future__ import annotations

import click

from .._redact import mask_dsn
from .common import Duration, group_options, parse_duration, setup
from .dead import dead_group
from .demo import demo_command
from .grant import grant_command
from .inbox import inbox_group
from .metrics import metrics_command
from .migrate import migrate_command
from .purge import purge_command
from .retrying import retrying_command
from .status import status_command

__all__ = ["Duration", "celery_command", "main", "mask_dsn", "parse_duration"]

_COMMANDS: tuple[click.Command, ...] = (
    migrate_command,
    status_command,
    dead_group,
    retrying_command,
    purge_command,
    inbox_group,
    grant_command,
    metrics_command,
    demo_command,
)


def _make_group(name: str, help_text: str) -> click.Group:
    # Two groups with the same commands: the script's, and the one Celery's
    # command line mounts (where ctx.obj arrives holding the app).
    @click.group(name, help=help_text)
    @group_options
    @click.pass_context
    def group(ctx: click.Context, dsn: str | None, dsn_file: str | None, table: str) -> None:
        setup(ctx, dsn, table, dsn_file)

    for command in _COMMANDS:
        group.add_command(command)
    return group


main = _make_group("outbox-relay", "Operate an outbox-relay outbox table.")
celery_command = _make_group(
    "outbox",
    "Operate this app's outbox (outbox-relay). The DSN and table default to the "
    "app's outbox_dsn and outbox_table settings.",
)
