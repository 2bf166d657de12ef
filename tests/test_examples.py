"""The examples in examples/ run as written.

* examples/fastapi_app: its app takes orders over HTTP (httpx's ASGI
  transport, in this process, under a span of this test), and a real relay
  (``celery worker`` + ``celery beat``, with OpenTelemetry's SDK writing its
  spans to a file) delivers each event to a webhook receiver on loopback.
  One trace runs from the test's span (the producer) through the relay's
  publish span into the webhook's ``traceparent`` header.
* examples/django_project: its own test suite (``manage.py test``): Django's
  migrate creates the outbox, enqueue in ``atomic()`` commits and rolls back
  with the order, the relay reads settings.py, and the admin's dead-letter
  page lists, retries and skips for staff.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import subprocess
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlencode

import httpx
import psycopg
import pytest
from opentelemetry import propagate
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from . import services
from .celery_procs import CeleryProcs, counts, wait_for
from .otel import exporter, hex_ids, tracer
from .test_publisher_webhook import Server

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def sqlalchemy_url(dsn: str, dialect: str) -> str:
    p = conninfo_to_dict(dsn)
    auth = p.get("user", "") + (f":{p['password']}" if p.get("password") else "")
    host, port = str(p.get("host", "")), p.get("port", 5432)
    if host.startswith("/"):
        # A unix socket (the embedded server's directory): SQLAlchemy takes it
        # as a query parameter, for both drivers.
        return f"postgresql+{dialect}://{auth}@/{p['dbname']}?" + urlencode(
            {"host": host, "port": port}
        )
    return f"postgresql+{dialect}://{auth}@{host}:{port}/{p['dbname']}"


def load_fastapi_example(database_url: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """examples/fastapi_app/app.py, imported afresh with SHOP_DATABASE_URL set."""
    monkeypatch.setenv("SHOP_DATABASE_URL", database_url)
    path = EXAMPLES / "fastapi_app" / "app.py"
    spec = importlib.util.spec_from_file_location(f"fastapi_example_{uuid.uuid4().hex}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # In sys.modules while it runs, as an import would: SQLAlchemy resolves
    # the models' annotations through it.
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def finished_span_ids(trace_id: str) -> set[str]:
    """Span ids of this trace that this process finished."""
    return {hex_ids(s)[1] for s in exporter().get_finished_spans() if hex_ids(s)[0] == trace_id}


def spans_in(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.celery
@pytest.mark.parametrize("dialect", ["asyncpg", "psycopg"])
def test_fastapi_example_order_is_delivered_by_a_real_relay_in_one_trace(
    dialect: str, dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = Server()
    trace_file = tmp_path / "relay-spans.jsonl"
    procs = CeleryProcs(
        {
            "OUTBOX_DSN": dsn,
            "CELERY_BROKER_URL": services.redis_url(),
            "OUTBOX_PUBLISHER": f"{receiver.url}/hooks/orders",
            "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
            "OUTBOX_LEASE_SECONDS": "20",
            "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "5",
            "TRACE_FILE": str(trace_file),
        },
        tmp_path,
        app="tests.apps.traced",
    )
    example = load_fastapi_example(sqlalchemy_url(dsn, dialect), monkeypatch)

    async def place_orders() -> tuple[int, str, str]:
        transport = httpx.ASGITransport(app=example.app)
        async with (
            example.app.router.lifespan_context(example.app),
            httpx.AsyncClient(transport=transport, base_url="http://shop") as client,
        ):
            # Refused by the app's validation: neither an order nor an event.
            bad = await client.post("/orders", json={"customer": "", "total_cents": 5})
            assert bad.status_code == 422
            with tracer().start_as_current_span("checkout") as span:
                # As an instrumented HTTP client would: the trace travels in
                # the request (FastAPI continues it in its endpoint span).
                headers: dict[str, str] = {}
                propagate.inject(headers)
                response = await client.post(
                    "/orders", json={"customer": "ada", "total_cents": 1250}, headers=headers
                )
            assert response.status_code == 201, response.text
            trace_id, span_id, _ = hex_ids(span)  # type: ignore[arg-type]
            return int(response.json()["id"]), trace_id, span_id

    try:
        order_id, trace_id, checkout_span = asyncio.run(place_orders())
        procs.worker(concurrency=2)
        procs.beat()
        [request] = wait_for(
            lambda: receiver.received(str(order_id)), timeout=60, what="the webhook call"
        )
        publish = wait_for(
            lambda: [s for s in spans_in(trace_file) if s["name"].startswith("outbox publish")],
            timeout=30,
            what="the relay's publish span",
        )
        wait_for(lambda: counts(dsn) == {"done": 1}, timeout=30, what="the row finalized done")
    except BaseException:
        print(procs.logs())
        raise
    finally:
        procs.stop_all()
        receiver.close()

    assert json.loads(request.body) == {"id": order_id, "customer": "ada", "total_cents": 1250}
    assert request.headers["Idempotency-Key"] == f"order-created-{order_id}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        [(stored,)] = conn.execute("SELECT headers FROM outbox").fetchall()
    # enqueue recorded the producer's span: one in this trace, under the
    # client's "checkout" span (directly, or through the framework's own spans).
    _, stored_trace, producer_span, _ = stored["traceparent"].split("-")
    assert stored_trace == trace_id
    assert producer_span in finished_span_ids(trace_id)
    assert checkout_span in finished_span_ids(trace_id)
    # One trace: the producer's span -> the relay's publish span -> the webhook.
    [span] = publish
    assert span["trace_id"] == trace_id
    assert span["parent_id"] == producer_span
    assert span["attributes"]["outbox.outcome"] == "done"
    assert span["attributes"]["outbox.attempt"] == 1
    version, header_trace, header_parent, _flags = request.headers["traceparent"].split("-")
    assert (version, header_trace, header_parent) == ("00", trace_id, span["span_id"])
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT status, aggregate_id FROM outbox").fetchall()
        orders = conn.execute("SELECT id FROM orders").fetchall()
    assert orders == [(order_id,)]
    assert rows == [("done", str(order_id))]


def test_django_example_runs_its_own_tests(pg_admin_dsn: str) -> None:
    # Django's test runner makes test_<NAME> on the server and drops it after.
    name = f"shop_{uuid.uuid4().hex[:10]}"
    result = subprocess.run(
        [sys.executable, "manage.py", "test", "--noinput", "-v", "2"],
        cwd=EXAMPLES / "django_project",
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "SHOP_DATABASE": make_conninfo(pg_admin_dsn, dbname=name),
        },
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Applying outbox_relay.0001_outbox... OK" in output
    ran = re.search(r"^Ran (\d+) tests", output, re.MULTILINE)
    assert ran is not None and int(ran.group(1)) >= 12 and "\nOK" in output, output
