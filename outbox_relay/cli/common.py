"""What every ``outbox-relay`` command shares: the resolved group options
(``CliState``), the ``--dsn`` / ``--dsn-file`` / ``--table`` options, durations
and output.

A password given in ``--dsn`` can be read by every user of the machine in
``ps`` and stays in shell history: the CLI warns (on stderr, without the
password) and offers ``--dsn-file`` / ``OUTBOX_DSN_FILE``, a file holding the
DSN (a Docker or Kubernetes secret), besides ``OUTBOX_DSN``, ``PGPASSWORD``
and ``~/.pgpass``."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import click
import psycopg
from psycopg import errors as pg_errors
from rich.console import Console
from rich.table import Table

from .._redact import connect_error, mask_dsn, scrub
from ..config import Settings, read_secret_file, refuse_unknown_environment
from ..db import UNPREPARED
from ..errors import ConfigError
from ..store.ops import outbox_tables
from ..store.schema import table_exists
from ..table import OutboxTable

__all__ = [
    "ERROR_SHOWN",
    "CliState",
    "Duration",
    "command_options",
    "confirm",
    "console",
    "group_options",
    "parse_duration",
    "pass_state",
    "print_messages",
    "setup",
    "yes_option",
]

F = TypeVar("F", bound=Callable[..., Any])
# A missing table's error names at most this many of the outbox tables there are.
OUTBOX_TABLES_SHOWN = 10


# ---------------------------------------------------------------- durations
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_UNIT_SECONDS = {"w": 604_800, "d": 86_400, "h": 3_600, "m": 60, "s": 1}
# Longer would be no filter at all, and past timedelta's range a traceback.
_LONGEST = timedelta(days=100 * 366)


def parse_duration(text: str) -> timedelta:
    """``7d``, ``12h``, ``30m``, ``45s``, ``1w``, or combined as ``1h30m``."""
    value = text.strip().lower()
    if not value or _DURATION_PART.sub("", value):
        raise ValueError(f"{text!r} is not a duration; use a number and a unit: 7d, 12h, 30m, 45s")
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))
    if seconds > _LONGEST.total_seconds():
        raise ValueError(f"{text!r} is longer than 100 years")
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


def _interactive() -> bool:
    """Whether a person can answer a prompt: stdin is a terminal."""
    return sys.stdin.isatty()


def confirm(action: str, yes: bool) -> None:
    """Ask before ``action`` (a phrase: "retry 40 dead message(s) in ...") changes
    many rows; ``--yes`` answers. The question goes to stderr.

    Without a terminal on stdin (cron, a pipe, CI) nobody can answer, and a
    prompt would hang or read end-of-file: the command stops instead, exit
    status 2, naming ``--yes``. A "no" changes nothing, exit status 1.
    """
    if yes:
        return
    if not _interactive():
        raise click.UsageError(
            f"confirmation needed to {action}; stdin is not a terminal, so nothing was "
            "asked or changed: pass --yes to do it from a script"
        )
    if not click.confirm(f"{action[:1].upper()}{action[1:]}?", default=False, err=True):
        raise click.ClickException("not confirmed: nothing changed")


def yes_option(fn: F) -> F:
    """``--yes`` / ``-y``: confirm without a prompt (required without a terminal)."""
    return click.option(
        "--yes",
        "-y",
        is_flag=True,
        help="Do it without asking (needed when stdin is not a terminal: cron, scripts).",
    )(fn)


def console(stderr: bool = False) -> Console:
    # Made per call: click's CliRunner swaps sys.stdout between invocations.
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


# Characters of last_error a table shows (--json shows the whole text).
ERROR_SHOWN = 160


def print_messages(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A page of messages as a table (``dead list``, ``retrying``): each row's
    last cell is its ``last_error``, cut to ``ERROR_SHOWN`` characters, and a
    line says so when one was."""
    table = Table(title=title, title_justify="left")
    for column in (*columns, "last error"):
        table.add_column(column, overflow="fold")
    cut = False
    for *cells, error in rows:
        if len(error) > ERROR_SHOWN:
            error, cut = error[: ERROR_SHOWN - 1] + "…", True
        table.add_row(*cells, error)
    out = console()
    out.print(table)
    if cut:
        out.print(f"(last errors cut to {ERROR_SHOWN} characters; --json shows them whole)")


# ---------------------------------------------------------------- state
def app_settings(app: Any) -> Settings:
    """A Celery app's outbox settings; raises ``ConfigError``."""
    # An app that ran outbox_relay.install() already holds validated
    # settings; any other app's configuration is read the same way.
    runtime = getattr(app, "outbox_relay", None)
    settings = getattr(runtime, "settings", None)
    return settings if isinstance(settings, Settings) else Settings.load(app.conf)


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
    # --dsn-file / OUTBOX_DSN_FILE: a file holding the DSN.
    dsn_file_option: str | None = None
    dsn_file_on_command_line: bool = False

    def _app_settings(self) -> Settings:
        if self._settings is None:
            try:
                self._settings = app_settings(self.app)
            except ConfigError as exc:
                raise click.ClickException(f"the Celery app's outbox settings: {exc}") from None
        return self._settings

    def relay_max_in_flight(self) -> int | None:
        """The Celery app's ``OUTBOX_MAX_IN_FLIGHT`` under ``celery -A APP outbox``, else None."""
        return self._app_settings().max_in_flight if self.app is not None else None

    def maybe_dsn(self) -> str | None:
        on_command_line = self.dsn_on_command_line or self.dsn_file_on_command_line
        if on_command_line or self.app is None:
            return self._given_dsn()
        # The app's settings read outbox_dsn(_file), then OUTBOX_DSN(_FILE).
        return self._app_settings().dsn or None

    def _given_dsn(self) -> str | None:
        """``--dsn`` or ``--dsn-file``: the command line first, then the environment."""
        if self.dsn_on_command_line and self.dsn_file_on_command_line:
            raise click.UsageError("give --dsn or --dsn-file, not both")
        if self.dsn_on_command_line:
            return self.dsn_option or None
        if self.dsn_file_on_command_line:
            return self._read_dsn_file("--dsn-file")
        if self.dsn_file_option:
            if self.dsn_option:
                raise click.UsageError(
                    "OUTBOX_DSN and OUTBOX_DSN_FILE are both set; give one of them"
                )
            return self._read_dsn_file("OUTBOX_DSN_FILE")
        return self.dsn_option or None

    def _read_dsn_file(self, label: str) -> str:
        try:
            return read_secret_file(label, self.dsn_file_option)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None

    @property
    def dsn(self) -> str:
        found = self.maybe_dsn()
        if found:
            return found
        where = " or set outbox_dsn in the Celery app" if self.app is not None else ""
        raise click.UsageError(
            f"no database given: pass --dsn or --dsn-file, or set OUTBOX_DSN{where}"
        )

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
                dsn,
                autocommit=True,
                connect_timeout=10,
                application_name="outbox-relay-cli",
                **UNPREPARED,  # safe through a pooler in transaction mode (db.UNPREPARED)
            )
        except (psycopg.Error, ValueError, OSError) as exc:
            # ValueError: psycopg resolves host names itself, and a bad one
            # (a password's tail read as a host) fails with a UnicodeError.
            raise click.ClickException(
                f"cannot connect to {mask_dsn(dsn)}: {connect_error(exc, dsn)}"
            ) from None
        try:
            with conn:
                try:
                    yield conn
                # Handled while the connection is open: the hints ask it more.
                except (pg_errors.UndefinedTable, pg_errors.UndefinedColumn) as exc:
                    # A missing column: a table migrated by an earlier release.
                    raise click.ClickException(self._not_migrated(conn, exc, dsn)) from None
                except pg_errors.InsufficientPrivilege as exc:
                    raise click.ClickException(self._not_granted(conn, exc, dsn)) from None
        except psycopg.Error as exc:
            raise click.ClickException(scrub(str(exc), dsn).strip()) from None

    def _not_migrated(self, conn: psycopg.Connection[Any], exc: psycopg.Error, dsn: str) -> str:
        table = self.table
        message = (
            f"{_first_line(exc, dsn)}: is the outbox {table.qualified} migrated to this "
            f"version? Run `{table.migrate_command}` first"
        )
        try:
            if table_exists(conn, table=table):
                return message
            found = outbox_tables(conn)
        except psycopg.Error:
            return message  # the hint is a courtesy; the error above stands
        # A mistyped --table must not read as "create this table": name the
        # outbox tables there are.
        if not found:
            return f"{message} (no outbox table in this database yet)"
        shown = ", ".join(found[:OUTBOX_TABLES_SHOWN])
        more = len(found) - OUTBOX_TABLES_SHOWN
        return f"{message} (outbox tables in this database: {shown}" + (
            f" and {more} more)" if more > 0 else ")"
        )

    def _not_granted(self, conn: psycopg.Connection[Any], exc: psycopg.Error, dsn: str) -> str:
        # Every command that reaches here (status, dead, purge, migrate --sql)
        # needs what `grant --kind operator` gives; migrate itself needs the
        # table's owner and says so (migrate.py).
        command = self.table.grant_command(conn.info.user, "operator")
        return (
            f"{_first_line(exc, dsn)}: the role {conn.info.user} lacks an operator's "
            f"privileges on {self.table.qualified}; `{command}` prints the GRANT statements "
            "for the table's owner to run"
        )


def _first_line(exc: psycopg.Error, dsn: str) -> str:
    return scrub(str(exc), dsn).strip().splitlines()[0]


pass_state = click.make_pass_decorator(CliState)


# ---------------------------------------------------------------- options
def _check_table(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        OutboxTable.parse(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


class _TableOption(click.Option):
    """``--table``, whose default under ``celery -A APP outbox`` is the app's
    table, so that ``--help`` shows the one the commands will use."""

    def get_default(self, ctx: click.Context, call: bool = True) -> Any:
        # Celery's group put a CLIContext holding the app in ctx.obj.
        app = getattr(ctx.obj, "app", None)
        if app is not None:
            try:
                return app_settings(app).outbox_table.qualified
            except ConfigError:
                pass  # the command reports it, naming the setting (CliState.table)
        return super().get_default(ctx, call=call)


def _warn_password_on_command_line(dsn: str | None) -> None:
    """Say on stderr, without the password, that ``--dsn`` exposes it.

    Not an error: a throwaway database on a laptop is a fine place for it,
    and scripts that work today must keep working.
    """
    if dsn and mask_dsn(dsn) != dsn:
        click.echo(
            "outbox-relay: warning: the password in --dsn is visible to every user of this "
            "machine (ps, /proc) and stays in shell history; give the DSN with --dsn-file "
            "or OUTBOX_DSN_FILE, or OUTBOX_DSN, or keep the password in PGPASSWORD or "
            "~/.pgpass",
            err=True,
        )


def group_options(fn: F) -> F:
    """``--dsn``, ``--dsn-file`` and ``--table`` before the command name."""
    fn = click.option(
        "--dsn-file",
        envvar="OUTBOX_DSN_FILE",
        default=None,
        show_envvar=True,
        type=click.Path(dir_okay=False),
        help="A file holding the PostgreSQL connection string (a Docker or Kubernetes "
        "secret); keeps the password out of ps and shell history.",
    )(fn)
    fn = click.option(
        "--table",
        cls=_TableOption,
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


def setup(ctx: click.Context, dsn: str | None, table: str, dsn_file: str | None = None) -> None:
    """The group callback: resolve the group options into ``ctx.obj``."""
    try:
        # The worker refuses a misspelled OUTBOX_ setting; so does every
        # command here, though it reads only the DSN and the table.
        refuse_unknown_environment()
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    source = click.core.ParameterSource.COMMANDLINE
    ctx.obj = CliState(
        dsn_option=dsn,
        dsn_on_command_line=ctx.get_parameter_source("dsn") == source,
        table_option=table,
        table_on_command_line=ctx.get_parameter_source("table") == source,
        # Celery's own group put a CLIContext here, holding the app.
        app=getattr(ctx.obj, "app", None),
        dsn_file_option=dsn_file,
        dsn_file_on_command_line=ctx.get_parameter_source("dsn_file") == source,
    )
    if ctx.obj.dsn_on_command_line:
        _warn_password_on_command_line(dsn)


def _set_dsn(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    state = ctx.find_object(CliState)
    if value is not None and state is not None:
        # The command's --dsn replaces the group's (a --dsn-file included).
        state.dsn_option, state.dsn_on_command_line = value, True
        state.dsn_file_on_command_line = False
        _warn_password_on_command_line(value)


def _set_dsn_file(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    state = ctx.find_object(CliState)
    if value is not None and state is not None:
        state.dsn_file_option, state.dsn_file_on_command_line = value, True
        state.dsn_on_command_line = False


def _set_table(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    state = ctx.find_object(CliState)
    if value is not None and state is not None:
        state.table_option = _check_table(ctx, param, value)
        state.table_on_command_line = True


def command_options(*, dsn: bool = True) -> Callable[[F], F]:
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
                "--dsn-file",
                default=None,
                expose_value=False,
                callback=_set_dsn_file,
                type=click.Path(dir_okay=False),
                help="A file holding the connection string (as before the command).",
            )(fn)
            fn = click.option(
                "--dsn",
                default=None,
                expose_value=False,
                callback=_set_dsn,
                help="PostgreSQL connection string (as before the command).",
            )(fn)
        return fn

    return decorate
