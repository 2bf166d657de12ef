"""What every ``outbox-relay`` command shares: the resolved group options
(``CliState``), the ``--dsn`` / ``--table`` options, durations and output."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import click
import psycopg
from psycopg import errors as pg_errors
from rich.console import Console

from .._redact import mask_dsn, scrub
from ..config import Settings
from ..errors import ConfigError
from ..table import OutboxTable

__all__ = [
    "CliState",
    "Duration",
    "command_options",
    "console",
    "group_options",
    "parse_duration",
    "pass_state",
    "setup",
]

F = TypeVar("F", bound=Callable[..., Any])


# ---------------------------------------------------------------- durations
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


def console(stderr: bool = False) -> Console:
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
            # An app that ran outbox_relay.install() already holds validated
            # settings; any other app's configuration is read the same way.
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
                f"cannot connect to {mask_dsn(dsn)}: {scrub(str(exc), dsn).strip()}"
            ) from None
        try:
            with conn:
                yield conn
        except pg_errors.UndefinedTable as exc:
            raise click.ClickException(
                f"{scrub(str(exc), dsn).strip()}: is the outbox {self.table.qualified} "
                "migrated? Run `outbox-relay migrate` first"
            ) from None
        except psycopg.Error as exc:
            raise click.ClickException(scrub(str(exc), dsn).strip()) from None


pass_state = click.make_pass_decorator(CliState)


# ---------------------------------------------------------------- options
def _check_table(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        OutboxTable.parse(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


def group_options(fn: F) -> F:
    """``--dsn`` and ``--table`` before the command name."""
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


def setup(ctx: click.Context, dsn: str | None, table: str) -> None:
    """The group callback: resolve the group options into ``ctx.obj``."""
    source = click.core.ParameterSource.COMMANDLINE
    ctx.obj = CliState(
        dsn_option=dsn,
        dsn_on_command_line=ctx.get_parameter_source("dsn") == source,
        table_option=table,
        table_on_command_line=ctx.get_parameter_source("table") == source,
        # Celery's own group put a CLIContext here, holding the app.
        app=getattr(ctx.obj, "app", None),
    )


def _set_dsn(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    state = ctx.find_object(CliState)
    if value is not None and state is not None:
        state.dsn_option, state.dsn_on_command_line = value, True


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
                "--dsn",
                default=None,
                expose_value=False,
                callback=_set_dsn,
                help="PostgreSQL connection string (as before the command).",
            )(fn)
        return fn

    return decorate
