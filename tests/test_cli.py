"""``outbox-relay`` against real PostgreSQL: every command through click's
CliRunner, and the installed scripts (``outbox-relay``, ``celery ... outbox``)
as real subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox_relay
from outbox_relay import OutboxTable, operations, store
from outbox_relay.cli import celery_command, main, mask_dsn, parse_duration
from outbox_relay.sql.queries import migrations_for

from .opsdata import EXPECTED, add, backdate, claim_all, make_dead, scenario

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# Every migration this package ships, 1..n.
VERSIONS = [m.version for m in migrations_for(OutboxTable())]


def cli(*args: str, dsn: str | None = None, input: str | None = None, **env: str | None) -> Result:
    """Run ``outbox-relay`` in-process; nothing leaks in from the environment.
    ``input`` is what stdin holds (not a terminal, as for a cron job)."""
    argv = (["--dsn", dsn] if dsn else []) + list(args)
    clean: dict[str, str | None] = {
        "OUTBOX_DSN": None,
        "OUTBOX_TABLE": None,
        "OUTBOX_MAX_IN_FLIGHT": None,
        **env,
    }
    return CliRunner().invoke(main, argv, env=clean, input=input)


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def row(conn: psycopg.Connection[Any], message_id: int) -> dict[str, Any]:
    found = store.get_row(conn, message_id)
    assert found is not None
    return found


# What `status` shows of scenario() beyond the gauges: its one processing row's
# lease has expired (nothing in flight), its done row finished hours ago, and
# no cap is configured here (the default is shown).
STATUS_ONLY = {"in_flight": 0, "done_last_minute": 0, "max_in_flight": 1000, "parked": 0}


def past(**delta: float) -> datetime:
    return datetime.now(timezone.utc) - timedelta(**delta)


# ---------------------------------------------------------------- migrate
def test_migrate_applies_then_reports_nothing_to_do(fresh_database: str) -> None:
    first = ok(cli("migrate", dsn=fresh_database))
    assert f"applied migrations {', '.join(map(str, VERSIONS))} to public.outbox" in first
    assert "up to date" in ok(cli("migrate", dsn=fresh_database))


def test_migrate_sql_prints_a_script_that_migrates(fresh_database: str) -> None:
    # Without a database: every migration, nothing applied anywhere.
    offline = ok(cli("--table", "app.events", "migrate", "--sql"))
    assert 'CREATE TABLE "app"."events"' in offline
    assert 'CREATE INDEX "events_done"' in offline
    # With one: what that database lacks (everything, here), still not applied.
    script = ok(cli("migrate", "--sql", dsn=fresh_database))
    assert script.startswith("-- outbox-relay migrations for public.outbox: 0001_outbox")
    with psycopg.connect(fresh_database, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('public.outbox')").fetchone() == (None,)
        conn.execute(script)  # what a DBA would run after review
        applied = conn.execute("SELECT version FROM outbox_migrations ORDER BY 1").fetchall()
        assert applied == [(v,) for v in VERSIONS]
    assert "up to date" in ok(cli("migrate", dsn=fresh_database))
    assert "no migration to apply" in ok(cli("migrate", "--sql", dsn=fresh_database))


# ---------------------------------------------------------------- status
def test_status_json_matches_rows(dsn: str, conn: psycopg.Connection[Any]) -> None:
    scenario(conn)
    snapshot = json.loads(ok(cli("status", "--json", dsn=dsn)))
    assert set(snapshot) == {*EXPECTED, *STATUS_ONLY, "oldest_pending_age_seconds"}
    age = snapshot.pop("oldest_pending_age_seconds")
    assert snapshot == {**EXPECTED, **STATUS_ONLY}
    assert 10800 <= age < 10860


def test_status_table_and_watch(dsn: str, conn: psycopg.Connection[Any]) -> None:
    scenario(conn)
    text = ok(cli("status", dsn=dsn))
    assert "dead messages" in text and "expired leases" in text
    assert "0: 2, 1: 2" in text  # attempts distribution
    assert "3h 00m" in text  # the backdated message's age
    lines = ok(cli("status", "--json", "--watch", "0.1", "--count", "3", dsn=dsn)).splitlines()
    assert len(lines) == 3
    assert all(json.loads(line)["dead"] == 1 for line in lines)


def test_status_max_age_is_a_probe(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """For an orchestrator or a cron check: status 1 (and why, on stderr)
    once the oldest waiting message is older than --max-age; status always
    exited 0, whatever the age."""
    assert cli("status", "--max-age", "1", dsn=dsn).exit_code == 0  # nothing waits
    scenario(conn)  # a message backdated three hours
    late = cli("status", "--json", "--max-age", "3600", dsn=dsn)
    assert late.exit_code == 1
    assert "waited 108" in late.stderr and "more than --max-age 3600s" in late.stderr
    assert json.loads(late.stdout)["dead"] == 1  # the status is printed all the same
    assert cli("status", "--max-age", "86400", dsn=dsn).exit_code == 0


def test_status_json_says_null_where_the_table_says_none(dsn: str) -> None:
    # Nothing awaits delivery: no age at all, not a message that is 0.0 s old.
    assert json.loads(ok(cli("status", "--json", dsn=dsn)))["oldest_pending_age_seconds"] is None
    # The Python API says so too (it said 0.0 where the JSON said null).
    with psycopg.connect(dsn) as conn:
        assert operations.status(conn)["oldest_pending_age_seconds"] is None
    text = ok(cli("status", dsn=dsn))
    assert "oldest awaiting delivery" in text and "none" in text


def test_status_never_prints_the_password(dsn: str) -> None:
    secret = "s3cret-Pa55"
    # The test server trusts local connections, so any password gets in.
    with_password = make_conninfo(dsn, password=secret)
    text = ok(cli("status", dsn=with_password))
    assert "password=****" in text and secret not in text
    unreachable = make_conninfo(dsn, port=1, password=secret)
    failed = cli("status", dsn=unreachable)
    assert failed.exit_code == 1
    assert "cannot connect to" in failed.output and secret not in failed.output


def test_a_dsn_libpq_cannot_parse_shows_its_message_unless_it_may_hold_the_password(
    dsn: str,
) -> None:
    p = conninfo_to_dict(dsn)
    server = f"{p.get('host', '127.0.0.1')}:{p.get('port', 5432)}/{p['dbname']}"

    def refused(bad: str) -> str:
        result = cli("status", dsn=bad)
        assert result.exit_code == 1 and "cannot connect to" in result.output, result.output
        return result.output

    # No password, or one libpq's message does not quote: its message is the help.
    for bad in (
        f"postgresql://postgres@{server}?application_nam=x",
        f"postgresql://postgres:plainpw@{server}?application_nam=x",
    ):
        out = refused(bad)
        assert 'invalid URI query parameter: "application_nam"' in out, out
        assert "withheld" not in out and "plainpw" not in out
    out = refused("postgres//127.0.0.1")
    assert 'missing "=" after "postgres//127.0.0.1" in connection info string' in out, out
    # A message that may quote the password: withheld, with what to check;
    # also where the password's extent cannot be told (an "=" in a mistyped
    # URL, a space in an unquoted value, a raw "&name=" in a query's).
    for bad in (
        "postgres//postgres:Zq7secretpw@127.0.0.1",
        "postgres//postgres:Zq7sec=ret@127.0.0.1",
        "host=127.0.0.1 password=plain Zq7secret application_nam=x",
    ):
        out = refused(bad)
        assert "withheld: libpq cannot parse the DSN" in out and "Zq7" not in out, out
    # (The masked DSN shows "&Zq7secret=1" as a parameter of its own, as
    # libpq reads it; the driver's message is what is judged here.)
    reason = refused(f"postgresql://{server}?password=plain&Zq7secret=1").partition(": Prog")[2]
    assert "withheld: libpq cannot parse the DSN" in reason and "Zq7" not in reason, reason
    # What the percent-encoding hint was made for: libpq takes "se" for the
    # password and "cret99@..." for the host, and its message would say so.
    out = refused(f"postgresql://postgres:se@cret99@{server}")
    assert "percent-encode @ : / ? # &" in out and "cret99" not in out, out


def test_mask_dsn_forms() -> None:
    assert mask_dsn("postgresql://app:pw@db:5432/x?sslmode=require") == (
        "postgresql://app:****@db:5432/x?sslmode=require"
    )
    assert mask_dsn("postgresql://db/x?password=pw&user=app") == (
        "postgresql://db/x?password=****&user=app"
    )
    assert conninfo_to_dict(mask_dsn("host=db password=pw dbname=x"))["password"] == "****"
    assert mask_dsn("postgresql://app@db/x") == "postgresql://app@db/x"


def test_missing_table_suggests_migrate(fresh_database: str) -> None:
    result = cli("status", dsn=fresh_database)
    assert result.exit_code == 1
    assert "outbox-relay migrate" in result.output
    # A table an earlier release migrated: a column of this one is missing.
    ok(cli("migrate", dsn=fresh_database))
    with psycopg.connect(fresh_database, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox DROP COLUMN waiting_since")
        conn.execute("DELETE FROM outbox_migrations WHERE version = 8")
    result = cli("status", dsn=fresh_database)
    assert result.exit_code == 1
    assert (
        'column "waiting_since" does not exist: is the outbox public.outbox migrated to this '
        "version? Run `outbox-relay migrate` first"
    ) in result.output, result.output
    assert "outbox tables in this database" not in result.output  # it exists
    assert "applied migration 8" in ok(cli("migrate", dsn=fresh_database))
    assert ok(cli("status", dsn=fresh_database))


def test_a_missing_table_of_another_name_suggests_migrate_with_its_table(
    fresh_database: str,
) -> None:
    # Run without --table, the suggested command would migrate public.outbox.
    result = cli("--table", "app.outbox", "status", dsn=fresh_database)
    assert result.exit_code == 1
    assert "Run `outbox-relay migrate --table app.outbox` first" in result.output, result.output


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["status", "--json"],
        ["dead", "list"],
        ["dead", "retry", "--all"],
        ["dead", "skip", "1"],
        ["dead", "skip", "--all", "--yes"],
        ["purge", "--older-than", "7d"],
    ],
)
def test_a_mistyped_table_names_the_outbox_tables_there_are(
    fresh_database: str, command: list[str]
) -> None:
    # Not only "migrate billing.event_outbox", which would make a second,
    # empty outbox beside the one the operator meant.
    result = cli(*command, "--table", "billing.event_outbox", dsn=fresh_database)
    assert result.exit_code == 1
    assert "(no outbox table in this database yet)" in result.output, result.output
    ok(cli("migrate", dsn=fresh_database))
    ok(cli("--table", "billing.events_outbox", "migrate", dsn=fresh_database))
    with psycopg.connect(fresh_database, autocommit=True) as conn:
        conn.execute("CREATE TABLE billing.invoices (id int)")  # not an outbox
    result = cli(*command, "--table", "billing.event_outbox", dsn=fresh_database)
    assert result.exit_code == 1
    assert (
        "Run `outbox-relay migrate --table billing.event_outbox` first "
        "(outbox tables in this database: billing.events_outbox, public.outbox)"
    ) in result.output, result.output


def test_migrate_as_a_role_that_may_not_create_says_who_can(fresh_database: str) -> None:
    # The relay's or an operator's role: it may read the table, not create in
    # its schema. Nothing pending: up to date, as for the owner. Something
    # pending: who must run it, instead of "permission denied for database".
    role = f"mig_{uuid.uuid4().hex[:8]}"
    as_role = make_conninfo(fresh_database, user=role)
    with psycopg.connect(fresh_database, autocommit=True) as conn:
        outbox_relay.migrate(conn)
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(
            sql.SQL("GRANT SELECT ON outbox_migrations TO {}").format(sql.Identifier(role))
        )
        try:
            assert "public.outbox is up to date" in ok(cli("migrate", dsn=as_role))
            conn.execute("ALTER TABLE outbox DROP COLUMN waiting_since")
            conn.execute("DELETE FROM outbox_migrations WHERE version = 8")
            result = cli("migrate", dsn=as_role)
            assert result.exit_code == 1
            assert "permission denied" in result.output
            assert "migration(s) 8 of public.outbox need the role that owns it" in result.output, (
                result.output
            )
            assert "applied migration 8" in ok(cli("migrate", dsn=fresh_database))
        finally:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_role_without_grants_is_told_which_to_ask_for(dsn: str) -> None:
    role = f"ops_{uuid.uuid4().hex[:8]}"
    as_role = make_conninfo(dsn, user=role)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        try:
            ok(cli("--table", "app.events", "migrate", dsn=dsn))
            hint = f"`outbox-relay grant --role {role} --kind operator` prints the GRANT"
            for command in (["status"], ["dead", "list"], ["purge", "--older-than", "7d"]):
                result = cli(*command, dsn=as_role)
                assert result.exit_code == 1
                assert "permission denied for table outbox" in result.output, result.output
                assert hint in result.output, result.output
            result = cli("--table", "app.events", "dead", "retry", "--all", dsn=as_role)
            assert "--kind operator --table app.events` prints" in result.output, result.output
            # Migrating needs the owner, not a grant, even where it may not
            # read which migrations were applied.
            result = cli("migrate", dsn=as_role)
            assert result.exit_code == 1
            assert "migrating public.outbox needs the role that owns it" in result.output, (
                result.output
            )
            assert "outbox-relay grant" not in result.output
            # The statements the hint names are the ones that were missing.
            conn.execute(ok(cli("grant", "--role", role, "--kind", "operator")))
            assert json.loads(ok(cli("status", "--json", dsn=as_role)))["dead"] == 0
            assert "no dead messages" in ok(cli("dead", "list", dsn=as_role))
        finally:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_missing_dsn_is_a_usage_error() -> None:
    result = cli("status")
    assert result.exit_code == 2
    assert "--dsn" in result.output and "OUTBOX_DSN" in result.output


@pytest.mark.parametrize("command", [["status", "--json"], ["dead", "list"], ["migrate"]])
def test_a_misspelled_setting_is_refused_by_every_command(
    dsn: str, conn: psycopg.Connection[Any], command: list[str]
) -> None:
    # The worker refuses OUTBOX_CHUNK_SIZ; a command that never reads the
    # chunk size must not pass it over either (the operator would think the
    # environment it shares with the worker is right).
    before = conn.execute("SELECT count(*), max(id) FROM outbox").fetchone()
    result = cli(*command, dsn=dsn, OUTBOX_CHUNK_SIZ="1")
    assert result.exit_code == 2, result.output
    assert "OUTBOX_CHUNK_SIZ (did you mean OUTBOX_CHUNK_SIZE?)" in result.output
    assert conn.execute("SELECT count(*), max(id) FROM outbox").fetchone() == before
    # A real relay setting the command has no use for is no error.
    status = json.loads(ok(cli("status", "--json", dsn=dsn, OUTBOX_CHUNK_SIZE="50")))
    assert status["pending"] >= 0


# ---------------------------------------------------------------- durations
def test_parse_duration() -> None:
    assert parse_duration("7d") == timedelta(days=7)
    assert parse_duration("12h") == timedelta(hours=12)
    assert parse_duration("30m") == timedelta(minutes=30)
    assert parse_duration("45s") == timedelta(seconds=45)
    assert parse_duration("1h30m") == timedelta(minutes=90)
    assert parse_duration("1.5h") == timedelta(minutes=90)
    for bad in ("", "7", "7x", "d7", "-1h", "1h 30m"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)
    # Past timedelta's range it was an OverflowError's traceback.
    for huge in ("99999999999d", "5300w"):
        with pytest.raises(ValueError, match="longer than 100 years"):
            parse_duration(huge)
    assert parse_duration("36500d") == timedelta(days=36500)


def test_out_of_range_arguments_are_named(dsn: str) -> None:
    for command in (("purge", "--older-than"), ("dead", "list", "--older-than")):
        result = cli(*command, "99999999999d", dsn=dsn)
        assert result.exit_code == 2, result.output
        assert "'99999999999d' is longer than 100 years" in result.output
    for command, bad in [
        *((("dead", "retry"), b) for b in ("0", "99999999999999999999", "-5")),
        (("dead", "skip"), "-5"),
    ]:
        # -5 is an ID out of range too, not an unknown option "-5".
        result = cli(*command, "3", bad, dsn=dsn)
        assert result.exit_code == 2, result.output
        assert f"{bad} is not in the range 1<=x<=9223372036854775807" in result.output
    # An option's value that looks like one is left to the option.
    result = cli("dead", "retry", "--all", "--older-than", "-5", dsn=dsn)
    assert result.exit_code == 2 and "--older-than" in result.output, result.output


@pytest.mark.parametrize("command", [["purge"], ["dead", "list"]])
def test_bad_duration_names_the_option(dsn: str, command: list[str]) -> None:
    result = cli(*command, "--older-than", "7x", dsn=dsn)
    assert result.exit_code == 2
    assert "--older-than" in result.output and "'7x' is not a duration" in result.output


# ---------------------------------------------------------------- dead letters
def test_dead_list_filters(dsn: str, conn: psycopg.Connection[Any]) -> None:
    t0 = past(hours=2)
    a = add(conn, at=t0, event_type="order.paid", aggregate_id="o1")[0]
    b = add(conn, at=t0, event_type="order.paid", aggregate_id="o2")[0]
    c = add(conn, at=t0, event_type="invoice.sent", aggregate_type="invoice", aggregate_id="i1")[0]
    alive = add(conn, at=t0, event_type="order.paid", aggregate_id="o3")[0]
    make_dead(conn, [a, b, c], t0, "permanent: HTTP 422 unprocessable")
    backdate(conn, a, timedelta(days=2))

    def listed(*args: str) -> list[int]:
        return [r["id"] for r in json.loads(ok(cli("dead", "list", "--json", *args, dsn=dsn)))]

    assert listed() == [a, b, c]
    assert alive not in listed()
    assert listed("--event-type", "order.paid") == [a, b]
    assert listed("--aggregate-type", "invoice") == [c]
    assert listed("--aggregate-id", "o2") == [b]
    assert listed("--older-than", "1d") == [a]
    assert listed("--limit", "2") == [a, b]
    first = json.loads(ok(cli("dead", "list", "--json", dsn=dsn)))[0]
    assert first["last_error"] == "permanent: HTTP 422 unprocessable"
    assert first["attempts"] == 1 and first["event_type"] == "order.paid"
    assert "payload" not in first
    text = ok(cli("dead", "list", dsn=dsn))
    assert "HTTP 422" in text and "invoice/i1" in text
    assert "--json shows them whole" not in text
    # A long reason (a receiver's whole body) is cut in the table, and says so.
    long = "permanent: HTTP 400 " + "x" * 300
    make_dead(conn, [alive], t0, long)
    text = ok(cli("dead", "list", dsn=dsn))
    assert "…" in text and "(last errors cut to 160 characters; --json shows them whole)" in text
    assert json.loads(ok(cli("dead", "list", "--json", dsn=dsn)))[-1]["last_error"] == long
    assert "no dead messages in public.outbox match" in ok(
        cli("dead", "list", "--aggregate-id", "zz", dsn=dsn)
    )


def ordered_aggregate(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """An ordered aggregate whose head is dead: nothing of it is claimable."""
    t0 = past(hours=1)
    head, successor = add(conn, at=t0, aggregate_type="cart", aggregate_id="c1", n=2)
    claimed = claim_all(conn, t0, ordered=True)
    assert list(claimed) == [head]  # the successor waits behind the head
    assert store.mark_dead(conn, claimed[head], error="permanent: bad address", now=t0)
    assert claim_all(conn, t0, ordered=True) == {}  # a dead head blocks its aggregate
    return head, successor


def test_dead_retry_unblocks_an_ordered_aggregate(dsn: str, conn: psycopg.Connection[Any]) -> None:
    head, successor = ordered_aggregate(conn)
    before = row(conn, head)
    out = ok(cli("dead", "retry", str(head), dsn=dsn))
    assert f"retried 1 dead message(s) in public.outbox: {head}" in out
    after = row(conn, head)
    assert after["status"] == "pending" and after["attempts"] == 0
    assert after["available_at"] <= datetime.now(timezone.utc)
    assert after["last_error"] == "permanent: bad address"  # kept for history
    assert after["lease_version"] == before["lease_version"]  # the fence never goes back
    # The head is claimable again, and still first: its successor waits.
    claimed = claim_all(conn, datetime.now(timezone.utc), ordered=True)
    assert list(claimed) == [head]
    assert claimed[head].attempts == 1
    assert store.mark_done(conn, claimed[head])
    assert list(claim_all(conn, datetime.now(timezone.utc), ordered=True)) == [successor]


def test_dead_skip_unblocks_an_ordered_aggregate(dsn: str, conn: psycopg.Connection[Any]) -> None:
    head, successor = ordered_aggregate(conn)
    out = ok(cli("dead", "skip", str(head), dsn=dsn))
    assert f"skipped 1 dead message(s) in public.outbox: {head}" in out
    skipped = row(conn, head)
    assert skipped["status"] == "done" and skipped["done_at"] is not None
    assert skipped["last_error"].startswith("skipped by an operator, not delivered")
    assert "permanent: bad address" in skipped["last_error"]
    assert list(claim_all(conn, datetime.now(timezone.utc), ordered=True)) == [successor]


def test_dead_commands_touch_only_dead_rows(dsn: str, conn: psycopg.Connection[Any]) -> None:
    t0 = past(hours=1)
    dead = add(conn, at=t0, event_type="order.paid", n=2)
    other = add(conn, at=t0, event_type="invoice.sent")[0]
    alive = add(conn, at=t0)[0]
    make_dead(conn, [*dead, other], t0, "boom")
    # An id that is not dead is reported and fails the command; the dead one changes.
    mixed = cli("dead", "retry", str(dead[0]), str(alive), "999999", dsn=dsn)
    assert mixed.exit_code == 1
    assert f"retried 1 dead message(s) in public.outbox: {dead[0]}" in mixed.output
    assert f"not dead (or missing) in public.outbox, left unchanged: {alive}, 999999" in (
        mixed.output
    )
    assert row(conn, alive)["status"] == "pending" and row(conn, alive)["attempts"] == 0
    assert cli("dead", "skip", str(alive), dsn=dsn).exit_code == 1
    assert row(conn, alive)["status"] == "pending"
    # --all with a filter retries just what matches.
    out = ok(cli("dead", "retry", "--all", "--event-type", "order.paid", "--yes", dsn=dsn))
    assert f"retried 1 dead message(s) in public.outbox: {dead[1]}" in out
    assert row(conn, other)["status"] == "dead"
    assert f"retried 1 dead message(s) in public.outbox: {other}" in ok(
        cli("dead", "retry", "--all", "-y", dsn=dsn)
    )
    assert "retried 0 dead message(s) in public.outbox" in ok(
        cli("dead", "retry", "--all", "-y", dsn=dsn)
    )
    # Argument mistakes are usage errors.
    assert cli("dead", "retry", dsn=dsn).exit_code == 2
    assert cli("dead", "retry", "--all", str(other), dsn=dsn).exit_code == 2
    assert cli("dead", "retry", str(other), "--event-type", "x", dsn=dsn).exit_code == 2
    assert cli("dead", "skip", dsn=dsn).exit_code == 2


def test_dead_all_asks_first_and_needs_yes_without_a_terminal(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--all changes every match at once: it says how many and asks. A cron
    job (no terminal on stdin) must never hang on that question: it is told
    to pass --yes, exit status 2, and nothing changes."""
    t0 = past(hours=1)
    paid = add(conn, at=t0, event_type="order.paid", n=3)
    sent = add(conn, at=t0, event_type="invoice.sent")
    make_dead(conn, [*paid, *sent], t0, "boom")
    for verb in ("retry", "skip"):
        result = cli("dead", verb, "--all", "--event-type", "order.paid", dsn=dsn)
        assert result.exit_code == 2, result.output
        assert (
            f"confirmation needed to {verb} 3 dead message(s) in public.outbox "
            "(event type order.paid), "
        ) in result.output
        assert "stdin is not a terminal, so nothing was asked or changed: pass --yes" in (
            result.output
        )
    assert operations.dead_count(conn) == 4
    # A person at a terminal is asked; anything but yes changes nothing.
    monkeypatch.setattr("outbox_relay.cli.common._interactive", lambda: True)
    result = cli("dead", "retry", "--all", "--limit", "2", dsn=dsn, input="n\n")
    assert result.exit_code == 1 and "not confirmed: nothing changed" in result.output
    assert "Retry 2 dead message(s) in public.outbox, all due at once (--spread" in result.output
    assert operations.dead_count(conn) == 4
    result = cli("dead", "retry", "--all", "--limit", "2", dsn=dsn, input="y\n")
    assert f"retried 2 dead message(s) in public.outbox: {paid[0]}, {paid[1]}" in ok(result)
    # Nothing matches: nothing to ask.
    out = ok(cli("dead", "skip", "--all", "--aggregate-id", "nope", dsn=dsn))
    assert "skipped 0 dead message(s)" in out
    # IDs are explicit: no question.
    monkeypatch.setattr("outbox_relay.cli.common._interactive", lambda: False)
    assert f"skipped 1 dead message(s) in public.outbox: {sent[0]}" in ok(
        cli("dead", "skip", str(sent[0]), dsn=dsn)
    )
    # skip takes --all and the filters as retry does.
    out = ok(cli("dead", "skip", "--all", "--event-type", "order.paid", "--yes", dsn=dsn))
    assert f"skipped 1 dead message(s) in public.outbox: {paid[2]}" in out
    assert row(conn, paid[2])["last_error"].startswith("skipped by an operator")
    # --limit selects among --all's matches only.
    assert cli("dead", "skip", str(paid[0]), "--limit", "1", dsn=dsn).exit_code == 2


def test_dead_retry_spread_paces_the_backlog(dsn: str, conn: psycopg.Connection[Any]) -> None:
    t0 = past(hours=1)
    ids = add(conn, at=t0, n=4)
    make_dead(conn, ids, t0, "retryable: HTTP 503")
    out = ok(cli("dead", "retry", "--all", "--spread", "10m", "--yes", dsn=dsn))
    assert "retried 4 dead message(s)" in out
    assert "(due from now until 10m 00s from now, oldest first)" in out
    due = [row(conn, i)["available_at"] for i in ids]
    assert due == sorted(due)
    assert [round((d - due[0]).total_seconds()) for d in due] == [0, 150, 300, 450]
    assert abs((due[0] - datetime.now(timezone.utc)).total_seconds()) < 60


def test_dead_list_says_how_many_match(dsn: str, conn: psycopg.Connection[Any]) -> None:
    t0 = past(hours=1)
    ids = add(conn, at=t0, n=3)
    make_dead(conn, ids, t0, "boom")
    text = ok(cli("dead", "list", "--limit", "2", dsn=dsn))
    assert "(the first 2 of 3 that match; raise --limit or narrow the filters for more)" in text
    assert "that match" not in ok(cli("dead", "list", "--limit", "3", dsn=dsn))
    # --json stays an array of the page, as scripts read it.
    assert len(json.loads(ok(cli("dead", "list", "--limit", "2", "--json", dsn=dsn)))) == 2


def test_status_shows_the_rate_and_the_in_flight_cap(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    now = datetime.now(timezone.utc)
    ids = add(conn, at=now, n=3)
    claimed = claim_all(conn, now)
    assert store.mark_done(conn, claimed[ids[0]])
    snapshot = json.loads(ok(cli("status", "--json", dsn=dsn)))
    assert snapshot["done_last_minute"] == 1
    assert snapshot["in_flight"] == 2 and snapshot["max_in_flight"] == 1000
    text = ok(cli("status", dsn=dsn))
    assert "in flight (live leases) / cap" in text and "2 / 1000" in text
    assert "done in the last minute" in text
    assert "(cap: the default 1000; give --max-in-flight or OUTBOX_MAX_IN_FLIGHT" in text
    # The workers' cap, from the environment they share or the command line.
    text = ok(cli("status", dsn=dsn, OUTBOX_MAX_IN_FLIGHT="200"))
    assert "2 / 200" in text and "(cap: the default" not in text
    snapshot = json.loads(ok(cli("status", "--json", "--max-in-flight", "50", dsn=dsn)))
    assert snapshot["max_in_flight"] == 50


def test_metrics_once_fails_without_the_database_and_hides_the_password(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # libpq's message for a DSN it cannot parse quotes the part it choked on:
    # here the password's tail. The scrape still prints (outbox_database_up 0),
    # and exits 1 so a script notices.
    bad = make_conninfo(dsn, password="x") + " hunter2tail dbname=nope"
    result = cli("metrics", "--once", dsn=bad)
    assert result.exit_code == 1, result.output
    assert "outbox_database_up 0.0" in result.stdout
    assert "could not read public.outbox (outbox_database_up 0)" in result.stderr
    assert "hunter2tail" not in result.output + caplog.text
    assert "metrics scrape could not read public.outbox: ProgrammingError" in caplog.text


def test_dead_and_purge_name_the_table_they_acted_on(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    t0 = past(hours=1)
    [dead] = add(conn, at=t0)
    make_dead(conn, [dead], t0, "boom")
    ok(cli("--table", "app.events", "migrate", dsn=dsn))
    # The id is dead in public.outbox, not in app.events: the output says where it looked.
    result = cli("--table", "app.events", "dead", "retry", str(dead), dsn=dsn)
    assert result.exit_code == 1
    assert "retried 0 dead message(s) in app.events" in result.output, result.output
    assert f"not dead (or missing) in app.events, left unchanged: {dead}" in result.output
    result = cli("dead", "skip", str(dead), "--table", "app.events", dsn=dsn)
    assert "skipped 0 dead message(s) in app.events" in result.output, result.output
    assert row(conn, dead)["status"] == "dead"
    out = ok(cli("--table", "app.events", "purge", "--older-than", "1d", dsn=dsn))
    assert "purged 0 done message(s) from app.events finished before" in out
    assert f"retried 1 dead message(s) in public.outbox: {dead}" in ok(
        cli("dead", "retry", str(dead), dsn=dsn)
    )


# ---------------------------------------------------------------- purge
def test_purge_deletes_old_done_rows_in_batches(dsn: str, conn: psycopg.Connection[Any]) -> None:
    old, recent = past(days=10), past(days=1)
    old_ids = add(conn, at=old, n=7)
    for c in claim_all(conn, old).values():
        assert store.mark_done(conn, c, now=old)
    recent_ids = add(conn, at=recent, n=2)
    for c in claim_all(conn, recent).values():
        assert store.mark_done(conn, c, now=recent)
    dead = add(conn, at=old)[0]
    make_dead(conn, [dead], old, "boom")
    backdate(conn, dead, timedelta(days=30))
    pending = add(conn, at=old)[0]
    backdate(conn, pending, timedelta(days=30))

    # One batch only: three rows go, the rest waits for the next run.
    first = ok(
        cli("purge", "--older-than", "7d", "--batch-size", "3", "--max-batches", "1", dsn=dsn)
    )
    assert "purged 3 done message(s) from public.outbox" in first
    assert "in 1 batch(es) of at most 3" in first
    assert "stopped at --max-batches, more are left (run it again)" in first
    rest = ok(cli("purge", "--older-than", "7d", "--batch-size", "3", dsn=dsn))
    assert "purged 4 done message(s)" in rest and "in 2 batch(es)" in rest  # 3 + 1
    assert re.search(r"in 2 batch\(es\) of at most 3, \d+\.\d\ds$", rest.strip()), rest
    assert "more are left" not in rest
    left = {r[0]: r[1] for r in conn.execute("SELECT id, status FROM outbox")}
    assert set(left) == {*recent_ids, dead, pending}
    assert not set(old_ids) & set(left)
    assert left[dead] == "dead" and left[pending] == "pending"
    assert "purged 0 done message(s)" in ok(cli("purge", "--older-than", "7d", dsn=dsn))
    assert "purged 2 done message(s)" in ok(cli("purge", "--older-than", "12h", dsn=dsn))


# ---------------------------------------------------------------- grant, metrics
def test_grant_prints_quoted_statements() -> None:
    producer = ok(cli("--table", "app.events", "grant", "--role", 'web"app', "--kind", "producer"))
    assert 'GRANT USAGE ON SCHEMA "app" TO "web""app";' in producer
    assert 'ON TABLE "app"."events" TO "web""app";' in producer
    assert "UPDATE" not in producer and "DELETE" not in producer
    relay = ok(cli("grant", "--role", "relay", "--kind", "relay"))
    # The relay changes only the dispatcher's columns (tests/test_security.py).
    assert 'GRANT SELECT, DELETE ON TABLE "public"."outbox" TO "relay";' in relay
    assert "GRANT UPDATE (status, available_at, waiting_since, attempts, lease_owner," in relay
    assert "UPDATE ON TABLE" not in relay
    assert 'GRANT SELECT ON TABLE "public"."outbox_migrations" TO "relay";' in relay
    operator = ok(cli("grant", "--role", "ops", "--kind", "operator"))
    assert 'TO "ops"' in operator and "GRANT INSERT" not in operator, operator
    assert cli("grant", "--role", "x", "--kind", "admin").exit_code == 2
    assert cli("--table", "bad-name", "grant", "--role", "x", "--kind", "relay").exit_code == 2


def test_metrics_once_prints_the_gauges(dsn: str, conn: psycopg.Connection[Any]) -> None:
    scenario(conn)
    text = ok(cli("metrics", "--once", dsn=dsn))
    assert 'outbox_messages{status="pending"} 3.0' in text
    assert 'outbox_messages{status="dead"} 1.0' in text
    assert "outbox_expired_leases 1.0" in text
    assert "outbox_database_up 1.0" in text


# ---------------------------------------------------------------- real processes
def test_installed_script_status_json(dsn: str, conn: psycopg.Connection[Any]) -> None:
    scenario(conn)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    done = subprocess.run(
        [str(BIN / "outbox-relay"), "status", "--json", "--dsn", dsn],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    snapshot = json.loads(done.stdout)
    assert 10800 <= snapshot.pop("oldest_pending_age_seconds") < 10860
    assert snapshot == {**EXPECTED, **STATUS_ONLY}


def celery_outbox(args: tuple[str, ...], **app_env: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.apps.cli_app outbox ARGS`` in a fresh process, with no
    OUTBOX_* of this environment; ``app_env``: CLI_APP_* for the app."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({**app_env, "PYTHONPATH": str(ROOT)})
    return subprocess.run(
        [str(BIN / "celery"), "-A", "tests.apps.cli_app", "outbox", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
        timeout=60,
        check=False,
    )


def test_celery_outbox_command_uses_the_app_settings(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """``celery -A APP outbox``: the DSN comes from the app's outbox_dsn setting."""
    t0 = past(hours=1)
    [dead] = add(conn, at=t0)
    make_dead(conn, [dead], t0, "boom")

    def celery(*args: str) -> str:
        done = celery_outbox(args, CLI_APP_DSN=dsn)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert json.loads(celery("status", "--json"))["dead"] == 1
    assert f"retried 1 dead message(s) in public.outbox: {dead}" in celery(
        "dead", "retry", str(dead)
    )
    assert row(conn, dead)["status"] == "pending"


def test_celery_outbox_help_shows_the_apps_table(dsn: str) -> None:

    def celery(*args: str) -> subprocess.CompletedProcess[str]:
        return celery_outbox(args, CLI_APP_DSN=dsn, CLI_APP_TABLE="billing.x")

    shown = celery("--help")
    assert shown.returncode == 0, shown.stderr
    # Not "default: outbox": the table the commands will use.
    assert "default: billing.x]" in " ".join(shown.stdout.split()), shown.stdout
    failed = celery("status")
    assert failed.returncode == 1
    assert "migrate --table billing.x` first (outbox tables in this database: public.outbox)" in (
        failed.stderr
    ), failed.stderr


def test_celery_command_is_the_same_cli() -> None:
    assert celery_command.name == "outbox"
    assert set(celery_command.commands) == set(main.commands)


def test_inbox_purge_deletes_old_inbox_rows(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A receiving service's retention: nothing else deletes inbox rows."""
    from outbox_relay.inbox import record

    with conn.transaction():
        for consumer, message in (("billing", "m1"), ("billing", "m2"), ("shipping", "m1")):
            assert record(conn, consumer=consumer, message_id=message)
        assert record(conn, consumer="billing", message_id="m3")
    conn.execute(
        "UPDATE outbox_inbox SET received_at = now() - interval '40 days' WHERE message_id <> 'm3'"
    )
    only = ok(cli("inbox", "purge", "--older-than", "30d", "--consumer", "billing", dsn=dsn))
    assert "purged 2 inbox row(s) of consumer 'billing' from public.outbox_inbox" in only
    assert "received over 30d 00h 00m ago" in only
    every = ok(cli("inbox", "purge", "--older-than", "30d", dsn=dsn))
    assert "purged 1 inbox row(s) from public.outbox_inbox" in every
    left = conn.execute("SELECT consumer, message_id FROM outbox_inbox").fetchall()
    assert left == [("billing", "m3")]
    missing = cli("inbox", "purge", "--older-than", "30d", "--inbox-table", "app.inbox", dsn=dsn)
    assert missing.exit_code == 1
    assert "there is no inbox table app.inbox in this database" in missing.output
    bad = cli("inbox", "purge", "--older-than", "30d", "--inbox-table", "in box", dsn=dsn)
    assert bad.exit_code == 2 and "--inbox-table" in bad.output


def test_retrying_lists_the_messages_waiting_for_a_retry_and_why(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """An operator asks why messages are late: which failed, what the receiver
    said, when each is tried again. Untried and dead ones are not listed."""
    now = past(seconds=0)
    soon, later, untried, dead = add(conn, at=now, n=4)
    claimed = claim_all(conn, now)
    store.reschedule(
        conn, claimed[soon], delay=timedelta(0), error="HTTP 503", refund_attempt=False, now=now
    )
    store.reschedule(
        conn,
        claimed[later],
        delay=timedelta(minutes=5),
        error="x" * 300 + " timeout",
        refund_attempt=False,
        now=now,
    )
    store.reschedule(conn, claimed[untried], delay=timedelta(0), error=None, refund_attempt=True)
    assert store.mark_dead(conn, claimed[dead], error="HTTP 400", now=now)
    shown = ok(cli("retrying", dsn=dsn, COLUMNS="200"))
    assert "messages waiting for a retry in public.outbox" in shown
    # The table's rows (a long error folds onto more lines, with no id).
    lines = [x for x in shown.splitlines() if x.startswith("│") and x.split("│")[1].strip()]
    assert [line.split("│")[1].strip() for line in lines] == [str(soon), str(later)]
    assert "due now" in lines[0] and "HTTP 503" in lines[0]
    assert re.search(r"in 4m 5\d ?s", lines[1]), lines[1]
    assert "last errors cut to 160 characters" in shown
    rows = json.loads(ok(cli("retrying", "--json", "--limit", "1", dsn=dsn)))
    assert [(r["id"], r["attempts"], r["last_error"]) for r in rows] == [(soon, 1, "HTTP 503")]
    conn.execute(
        "UPDATE outbox SET status = 'done', done_at = now(), last_error = NULL"
        " WHERE status = 'pending' AND attempts > 0"
    )
    assert "no message in public.outbox waits for a retry" in ok(cli("retrying", dsn=dsn))
