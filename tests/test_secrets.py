"""Secrets never leave the process in anything a person reads: each path an
operator found, tried for real.

* ``celery report``, ``celery inspect conf`` and Flower itself (its API and pages)
  and the example ``celeryconfig.py``: real ``celery`` subprocesses and a
  running worker;
* ``repr(Settings)``, a mistyped publisher URL, libpq's connection errors;
* the worker's log at DEBUG, ``last_error`` after failed publishes, and the
  CLI (``outbox-relay status``, ``--dsn`` on the command line,
  ``--dsn-file``).

PostgreSQL here trusts local connections, so a DSN with a password is
accepted and the password ignored: a test can run a whole relay on one.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import string
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from celery import Celery
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict

import outbox_relay
from outbox_relay import ConfigError
from outbox_relay.config import Secret, Settings, hide_secrets
from outbox_relay.publishers import resolve_publisher

from . import services
from .apps import kit
from .apps.recording import DDL
from .celery_procs import CeleryProcs, wait_for

pytestmark = pytest.mark.security

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# Each secret is a word found nowhere else, so "not in the text" means it.
DB_PASSWORD = "Pg/S3cr3tDb#77"  # percent-encoded "/" in the DSN, raw "#"
DB_PASSWORD_IN_URL = "Pg%2FS3cr3tDb#77"
BROKER_PASSWORD = "Br0kerPw9"
HOOK_PASSWORD = "Wh00kPw9"
HOOK_TOKEN = "T0kenVal9"
HEADER_VALUE = "Bearer H3aderPw9"
WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"W3bhookSigningKey-0123456789").decode()
# What must never be printed, as fragments a message could quote.
SECRETS = (
    "S3cr3tDb",
    BROKER_PASSWORD,
    HOOK_PASSWORD,
    HOOK_TOKEN,
    "H3aderPw9",
    WEBHOOK_SECRET[len("whsec_") :],
)


def assert_hidden(text: str, where: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{where} shows {leaked}:\n{text[-4000:]}"


def with_password(dsn: str, password_in_url: str = DB_PASSWORD_IN_URL) -> str:
    """``dsn`` (key=value) as a URL carrying a password the server ignores.

    A unix-socket host (the embedded server's, a directory) is percent-encoded,
    as libpq reads it in a URL's host part."""
    p = conninfo_to_dict(dsn)
    host = quote(str(p.get("host", "127.0.0.1")), safe="")
    return (
        f"postgresql://{p.get('user', 'postgres')}:{password_in_url}@"
        f"{host}:{p.get('port', 5432)}/{p['dbname']}"
    )


def closed_port() -> int:
    """A local port nobody listens on: every connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def celery_run(
    args: list[str], env: dict[str, str], cwd: Path, *, app: str = "outbox_relay.app"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(cwd),
        timeout=120,
        check=False,
    )


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any OUTBOX_* setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return {**env, **extra}


def secret_config_module(folder: Path, name: str, dsn: str, port: int) -> None:
    """A celeryconfig that puts every kind of secret into Celery settings."""
    (folder / f"{name}.py").write_text(
        textwrap.dedent(
            f"""
            outbox_dsn = {dsn!r}
            outbox_publisher = {{
                "order.*": "amqp://relay:{BROKER_PASSWORD}@127.0.0.1:{port}//",
                "hook.*": "http://relay:{HOOK_PASSWORD}@127.0.0.1:{port}/in?token={HOOK_TOKEN}",
            }}
            outbox_webhook_secret = {WEBHOOK_SECRET!r}
            outbox_webhook_headers = {{"Authorization": {HEADER_VALUE!r}}}
            """
        )
    )


# ------------------------------------------------------------ celery report
def test_celery_report_masks_secrets_held_in_celery_settings(dsn: str, tmp_path: Path) -> None:
    secret_config_module(tmp_path, "secret_conf", with_password(dsn), closed_port())
    env = clean_env(
        CELERY_CONFIG_MODULE="secret_conf",
        CELERY_BROKER_URL=services.redis_url(),
        PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]),
    )
    done = celery_run(["report"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert_hidden(done.stdout + done.stderr, "celery report")
    # Masked, not dropped: the reader still sees which database and broker.
    assert "outbox_dsn: 'postgresql://postgres:****@" in done.stdout
    assert "'amqp://relay:****@127.0.0.1:" in done.stdout
    assert "'http://relay:****@127.0.0.1:" in done.stdout
    assert "{'Authorization': '****'}" in done.stdout


def test_celery_report_of_an_app_that_sets_secrets_after_install(dsn: str, tmp_path: Path) -> None:
    # Assignments after install() and after the configuration was read: the
    # app module runs before report imports the app's modules.
    (tmp_path / "shop_secrets.py").write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            import outbox_relay

            app = Celery("shop_secrets", broker={services.redis_url()!r})
            app.conf.outbox_publisher = "amqp://relay:{BROKER_PASSWORD}@127.0.0.1//"
            outbox_relay.install(app, dsn={with_password(dsn)!r})
            app.conf.broker_connection_retry_on_startup = True  # reads the configuration
            app.conf.outbox_webhook_headers = {{"Authorization": {HEADER_VALUE!r}}}
            app.conf.outbox_kombu_transport_options = {{"password": {HOOK_PASSWORD!r}}}
            """
        )
    )
    env = clean_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    done = celery_run(["report"], env, tmp_path, app="shop_secrets")
    assert done.returncode == 0, done.stderr
    assert_hidden(done.stdout + done.stderr, "celery report")
    assert "outbox_publisher: 'amqp://relay:****@127.0.0.1//'" in done.stdout
    # install(dsn=...) never enters the Celery configuration at all.
    assert "outbox_dsn" not in done.stdout


def test_the_example_celeryconfig_keeps_secrets_out_of_celery_report(
    dsn: str, tmp_path: Path
) -> None:
    # It used to copy OUTBOX_DSN and OUTBOX_PUBLISHER into Celery settings.
    env = clean_env(
        CELERY_CONFIG_MODULE="celeryconfig",
        CELERY_BROKER_URL=services.redis_url(),
        OUTBOX_DSN=with_password(dsn),
        OUTBOX_PUBLISHER=f"amqp://relay:{BROKER_PASSWORD}@127.0.0.1//",
        PYTHONPATH=str(ROOT),
    )
    done = celery_run(["report"], env, ROOT)
    assert done.returncode == 0, done.stderr
    assert_hidden(done.stdout + done.stderr, "celery report")
    assert "task_default_queue: 'outbox'" in done.stdout  # it is the example's report


def test_a_django_projects_outbox_settings_are_masked_in_celery_report(
    dsn: str, tmp_path: Path
) -> None:
    # A Celery app configured from Django's settings shows every setting of
    # settings.py; the example project's, with OUTBOX_DSN added as the docs
    # allow and OUTBOX_PUBLISHER from the environment as its settings.py reads it.
    (tmp_path / "shop_secret_settings.py").write_text(
        f"from shop.settings import *  # noqa\nOUTBOX_DSN = {with_password(dsn)!r}\n"
    )
    env = clean_env(
        DJANGO_SETTINGS_MODULE="shop_secret_settings",
        CELERY_BROKER_URL=services.redis_url(),
        OUTBOX_PUBLISHER=f"amqp://relay:{BROKER_PASSWORD}@127.0.0.1//",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]),
    )
    project = ROOT / "examples" / "django_project"
    done = celery_run(["report"], env, project, app="shop")
    assert done.returncode == 0, done.stderr
    assert_hidden(done.stdout + done.stderr, "celery report of a Django project")
    # Masked, not dropped.
    assert "OUTBOX_DSN: 'postgresql://postgres:****@" in done.stdout
    assert "OUTBOX_PUBLISHER: 'amqp://relay:****@127.0.0.1//'" in done.stdout
    assert "OUTBOX_LEASE_SECONDS: 30" in done.stdout  # it is the project's report


# ------------------------------------------------- a running worker, for real
@pytest.fixture
def secret_relay(dsn: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A worker and beat whose Celery settings hold every kind of secret.

    The publishers point at a closed local port, so every publish fails and
    its error lands in ``last_error``.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
    secret_config_module(tmp_path, "secret_conf", with_password(dsn), closed_port())
    node = f"secrets-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    env = {
        "CELERY_CONFIG_MODULE": "secret_conf",
        "CELERY_BROKER_URL": services.redis_url(),
        # A queue of our own on the shared Redis.
        "OUTBOX_QUEUE": kit.unique("secrets"),
        "OUTBOX_LEASE_SECONDS": "20",
        "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "5",
        "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
        "OUTBOX_BACKOFF_BASE_SECONDS": "0.05",
        "OUTBOX_BACKOFF_CAP_SECONDS": "0.5",
    }
    procs = CeleryProcs(env, tmp_path)
    procs.env = {k: v for k, v in procs.env.items() if not k.startswith("OUTBOX_") or k in env}
    procs.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    try:
        worker = procs.worker(args=("-n", node, "-l", "debug"), concurrency=1)
        beat = procs.beat()
        yield {"procs": procs, "worker": worker, "beat": beat, "node": node, "env": procs.env}
    finally:
        procs.stop_all()


def read_flower(procs: CeleryProcs, node: str, send: Any) -> dict[str, str]:
    """Start Flower against the test's broker and fetch the pages that show
    settings, tasks and the broker (JSON API and HTML alike); ``send()``
    makes the relay deliver once Flower watches."""
    import httpx

    port = closed_port()  # free until Flower binds it
    flower = procs.flower(port)
    base = f"http://127.0.0.1:{port}"

    def workers() -> str | None:
        if not flower.alive():
            raise AssertionError("Flower exited:\n" + flower.text()[-3000:])
        try:
            reply = httpx.get(f"{base}/api/workers?refresh=1", timeout=15)
        except httpx.HTTPError:
            return None
        # Flower knows the worker once its config has been fetched.
        return reply.text if reply.status_code == 200 and "outbox_dsn" in reply.text else None

    def deliveries() -> str | None:
        reply = httpx.get(f"{base}/api/tasks", timeout=15)
        return reply.text if "outbox_relay.deliver" in reply.text else None

    pages = {"/api/workers?refresh=1": wait_for(workers, timeout=60, what="Flower's workers")}
    send()  # Flower sees the tasks sent after it started
    pages["/api/tasks"] = wait_for(deliveries, timeout=60, what="a delivery in Flower")
    for path in ("/tasks", f"/worker/{node}", "/broker", "/workers"):
        reply = httpx.get(base + path, timeout=15)
        assert reply.status_code == 200, (path, reply.status_code)
        pages[path] = reply.text
    return pages


@pytest.mark.celery
def test_a_running_relay_never_shows_its_secrets(
    secret_relay: dict[str, Any], dsn: str, tmp_path: Path
) -> None:
    env: dict[str, str] = secret_relay["env"]
    ids = []
    with psycopg.connect(dsn) as conn:
        for event_type in ("order.created", "hook.sent"):
            with conn.transaction():
                ids.append(
                    outbox_relay.enqueue(
                        conn,
                        aggregate_type="order",
                        aggregate_id="1",
                        event_type=event_type,
                        payload={"n": 1},
                    )
                )

    def errors() -> list[str] | None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT last_error FROM outbox WHERE id = ANY(%s) AND last_error IS NOT NULL",
                (ids,),
            ).fetchall()
        return [r[0] for r in rows] if len(rows) == len(ids) else None

    last_errors = wait_for(errors, timeout=60, what="both publishes to fail")
    assert_hidden("\n".join(last_errors), "last_error")

    # celery inspect conf: the worker's dump of its settings, which is what
    # Flower's worker page renders.
    node = secret_relay["node"]
    done = celery_run(["inspect", "conf", "--json", "-d", node, "--timeout", "10"], env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_hidden(done.stdout + done.stderr, "celery inspect conf")
    reply = next(json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
    conf = reply[node]
    assert "postgresql://postgres:****@" in conf["outbox_dsn"]
    assert "relay:****@127.0.0.1" in conf["outbox_publisher"]
    assert "'Authorization': '****'" in conf["outbox_webhook_headers"]

    # The CLI, through the app (the DSN from its settings) and on its own.
    done = celery_run(["outbox", "status"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert_hidden(done.stdout + done.stderr, "celery outbox status")
    assert "postgresql://postgres:****@" in done.stdout
    plain = subprocess.run(
        [str(BIN / "outbox-relay"), "status"],
        capture_output=True,
        text=True,
        env=clean_env(OUTBOX_DSN=with_password(dsn)),
        timeout=60,
        check=False,
    )
    assert plain.returncode == 0, plain.stderr
    assert_hidden(plain.stdout + plain.stderr, "outbox-relay status")

    # Flower, as an operator opens it: the workers' settings, tasks, broker.
    flower_pages = read_flower(secret_relay["procs"], node, send=lambda: kit.enqueue(dsn, 1))
    for page, text in flower_pages.items():
        assert_hidden(text, f"Flower's {page}")
    assert "postgresql://postgres:****@" in flower_pages["/api/workers?refresh=1"]

    secret_relay["procs"].stop_all()
    for proc in secret_relay["procs"].procs:
        text = proc.text()
        # The worker logs at DEBUG; beat and Flower at their defaults.
        assert "DEBUG" in text or proc.name != secret_relay["worker"].name, text[-2000:]
        assert_hidden(text, f"the log of {proc.name}")


@pytest.mark.celery
def test_a_worker_reads_its_dsn_and_publisher_from_files(dsn: str, tmp_path: Path) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
    secret_dsn = with_password(dsn)
    (tmp_path / "dsn").write_text(secret_dsn + "\n")  # as `echo ... > file` writes it
    (tmp_path / "publisher").write_text("tests.apps.recording:publish\n")
    procs = CeleryProcs(
        {
            "CELERY_BROKER_URL": services.redis_url(),
            "OUTBOX_QUEUE": kit.unique("secrets"),
            "OUTBOX_DSN_FILE": str(tmp_path / "dsn"),
            "OUTBOX_PUBLISHER_FILE": str(tmp_path / "publisher"),
            "RECORDING_DSN": dsn,
            "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
        },
        tmp_path,
    )
    for name in ("OUTBOX_DSN", "OUTBOX_PUBLISHER"):
        procs.env.pop(name, None)
    try:
        worker = procs.worker(concurrency=1, args=("-n", f"secrets-{uuid.uuid4().hex[:8]}@%h"))
        with psycopg.connect(dsn) as conn, conn.transaction():
            message_id = outbox_relay.enqueue(
                conn, aggregate_type="a", aggregate_id="1", event_type="e", payload={}
            )
        wait_for(
            lambda: kit.row(dsn, message_id)["status"] == "done",
            timeout=60,
            what="the message to be delivered",
        )
        procs.stop_all()
        assert_hidden(worker.text(), "the worker's log")
    finally:
        procs.stop_all()


# ------------------------------------------------------ start-up refusals
def _refused_start(tmp_path: Path, **env: str) -> str:
    """Start a worker that must refuse to start; return its log."""
    procs = CeleryProcs({"CELERY_BROKER_URL": services.redis_url(), **env}, tmp_path)
    try:
        worker = procs.worker(ready=False, args=("-n", f"secrets-{uuid.uuid4().hex[:8]}@%h"))
        worker.popen.wait(60)
        log = worker.text()
        assert " ready." not in log and worker.popen.returncode != 0, log[-3000:]
        return log
    finally:
        procs.stop_all()


@pytest.mark.celery
def test_a_mistyped_publisher_url_is_logged_masked(dsn: str, tmp_path: Path) -> None:
    log = _refused_start(
        tmp_path,
        OUTBOX_DSN=dsn,
        # "amqp//" for "amqp://": not a URL any more, so never masked as one.
        OUTBOX_PUBLISHER=f"amqp//relay:{BROKER_PASSWORD}@127.0.0.1//",
    )
    assert "OUTBOX_PUBLISHER" in log and "amqp//****@127.0.0.1//" in log, log[-3000:]
    assert_hidden(log, "the worker's log")


@pytest.mark.celery
def test_libpq_never_quotes_a_piece_of_the_password_into_the_log(dsn: str, tmp_path: Path) -> None:
    # A raw "@" in the password: libpq reads the password "Pg" and the host
    # "S3cr3tDb@127.0.0.1", and says it cannot resolve that host.
    p = conninfo_to_dict(dsn)
    ambiguous = f"postgresql://postgres:Pg@S3cr3tDb@127.0.0.1:{p.get('port', 5432)}/x"
    log = _refused_start(
        tmp_path, OUTBOX_DSN=ambiguous, OUTBOX_PUBLISHER="tests.apps.recording:publish"
    )
    assert "cannot connect to OUTBOX_DSN" in log and "percent-encode" in log, log[-3000:]
    assert_hidden(log, "the worker's log")


@pytest.mark.parametrize(
    "spec",
    [
        f"amqp//relay:{BROKER_PASSWORD}@rabbit//",
        f"amqp:/relay:{BROKER_PASSWORD}@rabbit//",
        f"relay:{BROKER_PASSWORD}@rabbit",
        f"htps://relay:{BROKER_PASSWORD}@rabbit//",
        {"order.*": f"amqps//relay:{BROKER_PASSWORD}@rabbit//"},
        {"url": f"ftp://relay:{BROKER_PASSWORD}@host/x"},
        # A raw "/" in the password: urllib, kombu and httpx read its head as
        # the port, and their ValueError quoted it ("Port could not be cast
        # to integer value as 'Br0k'"), from a worker dying with a traceback
        # and a beat that logged it and ran on.
        f"amqp://relay:{BROKER_PASSWORD[:4]}/{BROKER_PASSWORD[4:]}@rabbit//",
        f"https://relay:{BROKER_PASSWORD[:4]}/{BROKER_PASSWORD[4:]}@hooks.example/x",
        f"redis://relay:{BROKER_PASSWORD}@[rabbit/0",
    ],
)
def test_a_bad_publisher_setting_is_reported_masked(spec: Any, dsn: str) -> None:
    app = Celery(f"bad-publisher-{uuid.uuid4().hex[:6]}", broker="memory://")
    inst = outbox_relay.install(app, dsn=dsn, publisher=spec, beat=False)
    with pytest.raises(ConfigError) as caught:
        inst.validate()
    assert "OUTBOX_PUBLISHER" in str(caught.value)
    assert_hidden(str(caught.value), "the error")
    assert BROKER_PASSWORD[:4] not in str(caught.value)
    # The same setting resolved by hand (resolve_publisher, the public API).
    with pytest.raises(ConfigError) as caught:
        resolve_publisher(spec)
    assert_hidden(str(caught.value), "resolve_publisher's error")


# ------------------------------------------------- connection errors, libpq
CONNECT_CHARS = string.ascii_letters + string.digits + "@/:?#&=+%!$*' ;,.-_~"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(password=st.text(alphabet=CONNECT_CHARS, min_size=4, max_size=24))
@example(password="se@cret99")
@example(password="ab/cdef@ghij")
@example(password="%zzsecret")
@example(password="a?b#c:d@e/f")
@example(password="00@.")  # host ".@127.0.0.1": psycopg's own resolver raises UnicodeError
def test_check_database_never_repeats_a_piece_of_the_password(password: str) -> None:
    # A real libpq error for each password written raw into a URL whose
    # server refuses connections (or whose "host" is a piece of the password).
    port = closed_port()
    dsn = f"postgresql://relay:{password}@127.0.0.1:{port}/shop"
    innocent = _check_database_error(f"postgresql://relay:Qq@127.0.0.1:{port}/shop")
    pieces = {password[i : i + 4] for i in range(len(password) - 3)}
    # Pieces that the message would hold with any password are no leak.
    assume(not any(piece in innocent for piece in pieces))
    message = _check_database_error(dsn)
    assert message.startswith("cannot connect to OUTBOX_DSN")
    shown = [piece for piece in pieces if piece in message]
    assert not shown, f"{message!r} shows {shown} of {password!r}"


def _check_database_error(dsn: str) -> str:
    app = Celery(f"check-{uuid.uuid4().hex[:6]}", broker="memory://")
    inst = outbox_relay.install(app, dsn=dsn, publisher="tests.apps.recording:publish")
    with pytest.raises(ConfigError) as caught:
        inst.check_database()
    return str(caught.value)


def test_check_database_keeps_libpqs_message_when_it_is_safe(dsn: str) -> None:
    port = closed_port()
    message = _check_database_error(f"postgresql://relay:{BROKER_PASSWORD}@127.0.0.1:{port}/x")
    # The driver's reason stays: that is what the operator needs.
    assert "Connection refused" in message or "connection" in message.lower(), message
    assert f"postgresql://relay:****@127.0.0.1:{port}/x" in message
    assert BROKER_PASSWORD not in message


# ------------------------------------------------------------ Settings repr
def test_settings_repr_masks_every_secret() -> None:
    s = Settings(
        dsn=f"postgresql://app:{DB_PASSWORD_IN_URL}@db.example.com/shop",
        publisher=f"amqp://relay:{BROKER_PASSWORD}@rabbit.example.com//",
        publisher_options={
            "webhook_secret": WEBHOOK_SECRET,
            "webhook_headers": {"Authorization": HEADER_VALUE},
            "celery_broker_url": f"redis://:{HOOK_PASSWORD}@cache:6379/0",
            "kombu_transport_options": {"sentinel_kwargs": {"password": HOOK_TOKEN}},
            "webhook_envelope": "standard",
        },
    )
    text = repr(s)
    assert_hidden(text, "repr(Settings)")
    assert "db.example.com/shop" in text and "rabbit.example.com" in text
    assert "'webhook_envelope': 'standard'" in text  # options without secrets stay readable
    mapped = Settings(publisher={"order.*": f"https://h.example.com/in?token={HOOK_TOKEN}"})
    assert_hidden(repr(mapped), "repr(Settings)")


# ---------------------------------------------------------------- *_file
def test_every_setting_can_come_from_a_file(tmp_path: Path) -> None:
    def put(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    environ = {
        "OUTBOX_DSN_FILE": put("dsn", "postgresql://app:pw@db/x\n"),
        "OUTBOX_PUBLISHER_FILE": put("publisher", "https://hooks.example.com/in"),
        "OUTBOX_WEBHOOK_SECRET_FILE": put("secret", WEBHOOK_SECRET + "\r\n"),
        "OUTBOX_WEBHOOK_HEADERS_FILE": put("headers", json.dumps({"Authorization": "x"})),
        "OUTBOX_LEASE_SECONDS_FILE": put("lease", "90"),
    }
    s = Settings.load({}, environ)
    assert s.dsn == "postgresql://app:pw@db/x"
    assert s.publisher == "https://hooks.example.com/in"
    assert s.lease_seconds == 90.0
    assert s.publisher_options["webhook_secret"] == WEBHOOK_SECRET
    assert s.publisher_options["webhook_headers"] == json.dumps({"Authorization": "x"})
    # A Celery setting naming a file, and a keyword: the usual precedence.
    conf = {"outbox_dsn_file": put("dsn2", "postgresql://conf@db/x")}
    assert Settings.load(conf, environ).dsn == "postgresql://conf@db/x"
    assert Settings.load(conf, environ, dsn="postgresql://kw@db/x").dsn == "postgresql://kw@db/x"
    kw = Settings.load(conf, environ, dsn_file=put("dsn3", "postgresql://kwf@db/x"))
    assert kw.dsn == "postgresql://kwf@db/x"
    # An empty OUTBOX_DSN left in a .env beside the file is taken for unset.
    assert Settings.load({}, {**environ, "OUTBOX_DSN": ""}).dsn == "postgresql://app:pw@db/x"


def test_file_settings_fail_clearly_and_without_their_content(tmp_path: Path) -> None:
    secret_file = tmp_path / "dsn"
    secret_file.write_text(f"postgresql://app:{BROKER_PASSWORD}@db/x")
    with pytest.raises(ConfigError, match="OUTBOX_DSN and OUTBOX_DSN_FILE are both set"):
        Settings.load({}, {"OUTBOX_DSN": "postgresql://db/x", "OUTBOX_DSN_FILE": str(secret_file)})
    with pytest.raises(ConfigError, match=r"outbox_dsn and .*outbox_dsn_file are both set"):
        Settings.load({"outbox_dsn": "postgresql://db/x", "outbox_dsn_file": str(secret_file)}, {})
    missing = tmp_path / "absent"
    with pytest.raises(ConfigError, match=r"OUTBOX_DSN_FILE \(.*absent\): No such file"):
        Settings.load({}, {"OUTBOX_DSN_FILE": str(missing)})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        Settings.load({}, {"OUTBOX_DSN_FILE": str(tmp_path / "empty")})
    # Only the relay's own settings have a file form: the inbox reads its
    # DSN itself, so OUTBOX_INBOX_DSN_FILE would be silently ignored.
    with pytest.raises(ConfigError, match="OUTBOX_INBOX_DSN_FILE"):
        Settings.load({}, {"OUTBOX_INBOX_DSN_FILE": str(secret_file)})
    with pytest.raises(ConfigError, match="OUTBOX_LEASE_SECOND_FILE"):
        Settings.load({}, {"OUTBOX_LEASE_SECOND_FILE": str(secret_file)})
    # A misspelled publisher option's file form is refused with its closest name.
    with pytest.raises(ConfigError, match=r"did you mean OUTBOX_WEBHOOK_SECRET_FILE\?"):
        Settings.load({}, {"OUTBOX_WEBHOOK_SECERT_FILE": str(secret_file)})
    s = Settings.load({}, {"OUTBOX_WEBHOOK_SECRET_FILE": str(secret_file)})
    assert "webhook_secret" in s.publisher_options


# -------------------------------------------------- app.conf holds Secrets
def test_hide_secrets_keeps_the_values_readable_by_the_relay(dsn: str) -> None:
    app = Celery(f"hidden-{uuid.uuid4().hex[:6]}", broker="memory://")
    secret_dsn = with_password(dsn)
    app.conf.outbox_dsn = secret_dsn
    app.conf.outbox_publisher = "tests.apps.recording:publish"
    app.conf.outbox_webhook_headers = {"Authorization": HEADER_VALUE}
    inst = outbox_relay.install(app, beat=False)
    assert isinstance(app.conf.outbox_dsn, Secret)
    assert app.conf.outbox_dsn.get_secret_value() == secret_dsn
    # Nothing to hide: left as it was.
    assert app.conf.outbox_publisher == "tests.apps.recording:publish"
    assert inst.settings.dsn == secret_dsn
    assert inst.settings.publisher_options["webhook_headers"] == {"Authorization": HEADER_VALUE}
    # What Celery prints (report's humanize, inspect conf's table).
    assert_hidden(app.conf.humanize(), "app.conf.humanize()")
    assert_hidden(repr(app.conf.table()), "app.conf.table()")
    # Set after install and after the configuration was read: hidden again
    # when the relay reads its settings (a worker does at start).
    app.conf.outbox_webhook_secret = WEBHOOK_SECRET
    hide_secrets(app.conf)
    assert_hidden(app.conf.humanize(), "app.conf.humanize()")
    inst.check_database()  # the DSN inside the Secret still connects


# ------------------------------------------------------------------ the CLI
def _script(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "outbox-relay"), *args],
        capture_output=True,
        text=True,
        env=clean_env(**env),
        timeout=60,
        check=False,
    )


def test_a_password_in_dsn_on_the_command_line_draws_a_warning(dsn: str) -> None:
    secret_dsn = with_password(dsn)
    done = _script("--dsn", secret_dsn, "status", "--json")
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout)  # stdout stays clean for scripts
    assert "warning: the password in --dsn is visible" in done.stderr
    assert "--dsn-file" in done.stderr
    assert_hidden(done.stdout + done.stderr, "outbox-relay --dsn")
    # After the command too.
    done = _script("status", "--dsn", secret_dsn)
    assert done.returncode == 0 and "warning" in done.stderr, done.stderr
    assert_hidden(done.stdout + done.stderr, "outbox-relay status --dsn")
    # No password, no warning: behaviour as before.
    done = _script("--dsn", dsn, "status", "--json")
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_the_cli_reads_the_dsn_from_a_file(dsn: str, tmp_path: Path) -> None:
    secret_file = tmp_path / "dsn"
    secret_file.write_text(with_password(dsn) + "\n")
    for args, env in (
        (("--dsn-file", str(secret_file), "status", "--json"), {}),
        (("status", "--json", "--dsn-file", str(secret_file)), {}),
        (("status", "--json"), {"OUTBOX_DSN_FILE": str(secret_file)}),
    ):
        done = _script(*args, **env)
        assert done.returncode == 0, (args, done.stderr)
        assert done.stderr == "", done.stderr  # no warning: the password is not on the line
        assert json.loads(done.stdout)["dead"] == 0
    done = _script("--dsn", dsn, "--dsn-file", str(secret_file), "status")
    assert done.returncode != 0 and "not both" in done.stderr
    done = _script("status", OUTBOX_DSN=dsn, OUTBOX_DSN_FILE=str(secret_file))
    assert done.returncode != 0 and "both set" in done.stderr
    done = _script("--dsn-file", str(tmp_path / "absent"), "status")
    assert done.returncode != 0 and "absent" in done.stderr


def test_cli_connection_errors_hold_no_piece_of_the_password() -> None:
    port = closed_port()
    for url in (
        f"postgresql://relay:{BROKER_PASSWORD}@127.0.0.1:{port}/x",
        # libpq: password "Pg", host "S3cr3tDb@127.0.0.1".
        f"postgresql://relay:Pg@S3cr3tDb@127.0.0.1:{port}/x",
        f"host=127.0.0.1 port={port} password='{HOOK_PASSWORD} and more'",
    ):
        done = _script("status", OUTBOX_DSN=url)
        assert done.returncode != 0 and "cannot connect to" in done.stderr, done.stderr
        assert_hidden(done.stdout + done.stderr, "outbox-relay status")


def test_celery_outbox_command_reads_the_dsn_file(dsn: str, tmp_path: Path) -> None:
    secret_file = tmp_path / "dsn"
    secret_file.write_text(with_password(dsn))
    env = clean_env(
        OUTBOX_DSN_FILE=str(secret_file),
        CELERY_CONFIG_MODULE="tests.apps.no_celeryconfig",
        CELERY_BROKER_URL="memory://",
        PYTHONPATH=str(ROOT),
    )
    done = celery_run(["outbox", "status"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "postgresql://postgres:****@" in done.stdout
    assert_hidden(done.stdout + done.stderr, "celery outbox status")


def test_the_inbox_dsn_is_masked_in_celery_settings_and_used_whole() -> None:
    from outbox_relay.inbox import InboxTask

    app = Celery("inbox-secrets", set_as_current=False)
    dsn = f"postgresql://shop:{DB_PASSWORD_IN_URL}@db.internal/shop"
    app.conf.outbox_inbox_dsn = dsn
    hide_secrets(app.conf)
    assert_hidden(repr(app.conf.get("outbox_inbox_dsn")), "app.conf.outbox_inbox_dsn")

    @app.task(base=InboxTask, bind=True, shared=False)
    def apply(self: Any) -> None: ...

    # The task connects with the real password, not the mask.
    assert apply._inbox_dsn() == dsn


def test_an_app_that_accepts_pickle_is_warned_about(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """install(app) leaves the app's accept_content to the app, but a worker
    that accepts pickle runs the code of anyone who can write to its broker,
    through the relay's tasks too: said at start (checked by validate)."""
    import logging

    def warnings_of(accept: list[str] | None) -> list[str]:
        app = Celery(f"accepts-{uuid.uuid4().hex[:6]}", broker="memory://")
        if accept is not None:
            app.conf.accept_content = accept
        inst = outbox_relay.install(
            app, dsn=dsn, publisher="tests.apps.recording:publish", beat=False
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="outbox_relay"):
            inst.validate()
        return [r.getMessage() for r in caplog.records if "accept_content" in r.getMessage()]

    [said] = warnings_of(["json", "pickle"])
    assert "allows pickle" in said and "accept_content=['json']" in said
    assert warnings_of(["application/x-python-serialize"])
    assert warnings_of(None) == [] and warnings_of(["json", "msgpack"]) == []


def test_the_tests_dsns_hide_their_password_in_a_traceback() -> None:
    # pytest prints a failing test's arguments with repr(): the fixtures'
    # DSNs (conftest.MaskedDsn) must not carry the password into a CI log.
    from .conftest import MaskedDsn

    dsn = MaskedDsn("postgresql://app:Tr4ceback-pw@db.test:5432/x")
    assert "Tr4ceback-pw" not in repr(dsn) and "****" in repr(dsn)
    assert str(dsn) == "postgresql://app:Tr4ceback-pw@db.test:5432/x"  # still usable
