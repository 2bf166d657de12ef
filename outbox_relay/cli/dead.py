"""``outbox-relay dead list|retry|skip``: inspect dead messages, send them back or past."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import click
import psycopg

from .. import operations
from ..table import OutboxTable
from .common import (
    CliState,
    Duration,
    command_options,
    confirm,
    console,
    pass_state,
    print_messages,
    yes_option,
)

__all__ = ["dead_group"]

F = TypeVar("F", bound=Callable[..., Any])
# A message id is a bigint identity: positive, at most 2**63 - 1.
MESSAGE_ID = click.IntRange(1, 2**63 - 1)


class _IdsCommand(click.Command):
    """A command whose arguments are message IDs: ``-5`` is an ID out of range
    (as ``0`` is), not an unknown option ``-5``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        valued = {
            name
            for p in self.params
            if isinstance(p, click.Option) and not p.is_flag
            for name in p.opts
        }
        ids = next(p for p in self.params if p.name == "ids")
        after_option = False
        for arg in args:
            if arg == "--":
                break
            if not after_option and arg[:1] == "-" and arg[1:].isdigit():
                # The same words click uses for 0.
                MESSAGE_ID.convert(int(arg), ids, ctx)
            after_option = arg in valued
        return super().parse_args(ctx, args)


def _filter_options(fn: F) -> F:
    """The filters of dead messages, given to ``fn`` as one ``where``
    (an ``operations.DeadFilter``)."""

    @functools.wraps(fn)
    def packed(
        *args: Any,
        event_type: str | None,
        aggregate_type: str | None,
        aggregate_id: str | None,
        older_than: timedelta | None,
        **kwargs: Any,
    ) -> Any:
        where = operations.DeadFilter(event_type, aggregate_type, aggregate_id, older_than)
        return fn(*args, where=where, **kwargs)

    wrapped: Any = packed
    for option in reversed(
        [
            click.option("--event-type", default=None, help="Only this event type."),
            click.option("--aggregate-type", default=None, help="Only this aggregate type."),
            click.option("--aggregate-id", default=None, help="Only this aggregate id."),
            click.option(
                "--older-than",
                type=Duration(),
                default=None,
                help="Only messages written longer ago than this (7d, 12h, 30m, 45s): "
                "created_at, as the table records no time of death.",
            ),
        ]
    ):
        wrapped = option(wrapped)
    return cast(F, wrapped)


@click.group("dead")
def dead_group() -> None:
    """Inspect dead messages and send them back (retry) or past (skip)."""


@dead_group.command("list")
@_filter_options
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="A JSON array, for scripts.")
@command_options()
@pass_state
def dead_list_command(
    state: CliState, where: operations.DeadFilter, limit: int, as_json: bool
) -> None:
    """List dead messages, oldest first (payloads are not shown)."""
    with state.connect() as conn:
        rows = operations.dead_list(conn, where=where, limit=limit, table=state.table)
        # A full page: how many match in all, beyond it (--json stays an array).
        total = (
            operations.dead_count(conn, where=where, table=state.table)
            if len(rows) == limit and not as_json
            else len(rows)
        )
    if as_json:
        click.echo(json.dumps([r.as_json() for r in rows], indent=2))
        return
    out = console()
    if not rows:
        out.print(f"no dead messages in {state.table.qualified} match")
        return
    print_messages(
        f"dead messages in {state.table.qualified}",
        ("id", "event type", "aggregate", "attempts", "created"),
        [
            (
                str(r.id),
                r.event_type,
                f"{r.aggregate_type}/{r.aggregate_id}",
                str(r.attempts),
                r.created_at.isoformat(sep=" ", timespec="seconds"),
                r.last_error or "",
            )
            for r in rows
        ],
    )
    if total > len(rows):
        out.print(
            f"(the first {len(rows)} of {total} that match; raise --limit or narrow "
            "the filters for more)"
        )


def _report(verb: str, changed: list[int], asked: tuple[int, ...], table: OutboxTable) -> None:
    # The table is named: with two outbox tables, ids alone do not say
    # which one was changed (or lacks them).
    where = table.qualified
    click.echo(
        f"{verb} {len(changed)} dead message(s) in {where}"
        + (f": {_ids(changed)}" if changed else "")
    )
    missing = sorted(set(asked) - set(changed))
    if missing:
        # A script must notice that an id it named was not dead: exit 1.
        raise click.ClickException(
            f"not dead (or missing) in {where}, left unchanged: {_ids(missing)}"
        )


def _ids(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:50]))
    return shown + (f" ... ({len(ids)} in all)" if len(ids) > 50 else "")


def _describe(where: operations.DeadFilter) -> str:
    """The filters, as the confirmation question names them."""
    named = [
        f"{label} {value}"
        for label, value in (
            ("event type", where.event_type),
            ("aggregate type", where.aggregate_type),
            ("aggregate id", where.aggregate_id),
        )
        if value is not None
    ]
    if where.older_than is not None:
        named.append(
            f"written over {operations.human_duration(where.older_than.total_seconds())} ago"
        )
    return f" ({', '.join(named)})" if named else ""


def _check_selection(
    verb: str, ids: tuple[int, ...], all_dead: bool, filtered: bool, limit: int | None
) -> None:
    if ids and all_dead:
        raise click.UsageError("give message IDs or --all, not both")
    if not ids and not all_dead:
        raise click.UsageError(f"give the IDs of dead messages to {verb}, or --all")
    if (filtered or limit is not None) and not all_dead:
        raise click.UsageError(
            "the filters and --limit select messages for --all; with IDs, drop them"
        )


def _limit_option(fn: F) -> F:
    return click.option(
        "--limit",
        type=click.IntRange(min=1),
        default=None,
        help="With --all: only the oldest this many matches (by id); run again for the next.",
    )(fn)


@dead_group.command("retry", cls=_IdsCommand)
@click.argument("ids", nargs=-1, type=MESSAGE_ID)
@click.option("--all", "all_dead", is_flag=True, help="Every dead message the filters match.")
@_filter_options
@_limit_option
@click.option(
    "--spread",
    type=Duration(),
    default="0s",
    show_default=True,
    help="Make them due evenly over this long, oldest first, instead of all at once "
    "(e.g. 10m): a receiver that just recovered gets the backlog at a pace.",
)
@yes_option
@command_options()
@pass_state
def dead_retry_command(
    state: CliState,
    ids: tuple[int, ...],
    all_dead: bool,
    where: operations.DeadFilter,
    limit: int | None,
    spread: timedelta,
    yes: bool,
) -> None:
    """Send dead messages back to pending, attempts reset to 0.

    They are due now, or spread over --spread. last_error is kept so the
    reason stays visible until the next attempt records its own. The
    filters and --limit apply with --all, which asks first (--yes answers).
    """
    _check_selection("retry", ids, all_dead, where != operations.DeadFilter(), limit)
    with state.connect() as conn:
        if all_dead:
            pace = (
                f"due evenly over {operations.human_duration(spread.total_seconds())}"
                if spread
                else "all due at once (--spread paces them)"
            )
            _confirm_all(conn, state, "retry", where, limit, pace, yes)
        changed = operations.dead_retry(
            conn,
            None if all_dead else ids,
            all_dead=all_dead,
            where=where,
            limit=limit,
            spread=spread,
            table=state.table,
        )
    _report("retried", changed, ids, state.table)
    if changed and spread:
        click.echo(
            f"(due from now until {operations.human_duration(spread.total_seconds())} "
            "from now, oldest first)"
        )


def _confirm_all(
    conn: psycopg.Connection[Any],
    state: CliState,
    verb: str,
    where: operations.DeadFilter,
    limit: int | None,
    how: str,
    yes: bool,
) -> None:
    """--all changes every match at once: say how many and ask (nothing to ask for none)."""
    matching = operations.dead_count(conn, where=where, table=state.table)
    count = matching if limit is None else min(matching, limit)
    if count:
        confirm(
            f"{verb} {count} dead message(s) in {state.table.qualified}{_describe(where)}, {how}",
            yes,
        )


@dead_group.command("skip", cls=_IdsCommand)
@click.argument("ids", nargs=-1, type=MESSAGE_ID)
@click.option("--all", "all_dead", is_flag=True, help="Every dead message the filters match.")
@_filter_options
@_limit_option
@yes_option
@command_options()
@pass_state
def dead_skip_command(
    state: CliState,
    ids: tuple[int, ...],
    all_dead: bool,
    where: operations.DeadFilter,
    limit: int | None,
    yes: bool,
) -> None:
    """Mark dead messages done without delivering them.

    For an ordered aggregate blocked by a dead head that can never be sent:
    its next message becomes claimable. last_error records the skip. The
    filters and --limit apply with --all, which asks first (--yes answers).
    """
    _check_selection("skip", ids, all_dead, where != operations.DeadFilter(), limit)
    with state.connect() as conn:
        if all_dead:
            how = "marking them done unsent"
            _confirm_all(conn, state, "skip", where, limit, how, yes)
        changed = operations.dead_skip(
            conn,
            None if all_dead else ids,
            all_dead=all_dead,
            where=where,
            limit=limit,
            table=state.table,
        )
    _report("skipped", changed, ids, state.table)
