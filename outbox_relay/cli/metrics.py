"""``outbox-relay metrics [--port 9808]``: serve Prometheus metrics."""

from __future__ import annotations

import signal
import sys
import threading

import click

from .._redact import mask_dsn
from .common import CliState, command_options, pass_state

__all__ = ["metrics_command"]


@click.command("metrics")
@click.option("--port", type=click.IntRange(0, 65535), default=9808, show_default=True)
@click.option(
    "--addr",
    # metrics.DEFAULT_ADDR; not imported at the top (see prometheus_client below).
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on: loopback by default (nothing authenticates a scrape); "
    "0.0.0.0 or :: for a Prometheus on another host.",
)
@click.option(
    "--database/--no-database",
    default=True,
    show_default=True,
    help="Read the queue gauges from the database (use --no-database on all exporters but one).",
)
@click.option(
    "--once",
    is_flag=True,
    help="Print one scrape to stdout and exit (status 1 when the database could not be read).",
)
@command_options()
@pass_state
def metrics_command(state: CliState, port: int, addr: str, database: bool, once: bool) -> None:
    """Serve Prometheus metrics on /metrics.

    Worker counters are aggregated from $PROMETHEUS_MULTIPROC_DIR when set
    (see outbox_relay.metrics); queue gauges are read from the database.
    """
    # Imported here: prometheus_client reads PROMETHEUS_MULTIPROC_DIR at
    # import, and the other commands have no use for it.
    from prometheus_client import generate_latest

    from .. import metrics

    dsn = state.dsn if database else None
    table = state.table
    if once:
        registry, collector = metrics.build_registry(dsn=dsn, table=table)
        try:
            click.echo(generate_latest(registry).decode(), nl=False)
        finally:
            if collector is not None:
                collector.close()
        if collector is not None and not collector.up:
            # The scrape is printed all the same (outbox_database_up 0); a
            # script must still notice that the queue gauges are missing.
            raise click.ClickException(
                f"could not read {table.qualified} (outbox_database_up 0): "
                "the queue gauges are missing"
            )
        return
    stop = threading.Event()
    # SIGTERM (docker stop, Kubernetes) ends it like Ctrl-C. As a container's
    # PID 1 the kernel ignores a signal with no handler, and the runtime
    # would wait out its grace period and kill it. Installed before the
    # "serving" line: a supervisor that stops it as soon as it reads that
    # line must not meet the default action (a CI run did, under load).
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        server = metrics.serve(port, dsn=dsn, table=table, addr=addr)
    except OSError as exc:  # the port is taken, or the address is not ours
        raise click.ClickException(f"cannot listen on {addr}:{port}: {exc}") from None
    source = f"{table.qualified} at {mask_dsn(dsn)}" if dsn else "no database gauges"
    host = f"[{addr}]" if ":" in addr else addr  # an IPv6 address in a URL
    click.echo(f"serving http://{host}:{server.port}/metrics ({source})")
    sys.stdout.flush()
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
