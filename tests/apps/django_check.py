"""Django scenarios for tests/test_integrations.py, run in a subprocess of their own.

``settings.configure`` is once per process and global, so the Django half of
the integration tests runs here: ``python -m tests.apps.django_check DSN``
prints one JSON object with what each scenario left in the database.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import django
from django.conf import settings
from psycopg.conninfo import conninfo_to_dict


class Boom(Exception):
    pass


def configure(dsn: str) -> None:
    params = conninfo_to_dict(dsn)
    database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.get("dbname", "postgres"),
        "USER": params.get("user", ""),
        "PASSWORD": params.get("password", ""),
        "HOST": params.get("host", ""),
        "PORT": params.get("port", ""),
    }
    # A second alias on the same database shows that ``using`` picks the
    # connection; it holds the outbox (OUTBOX_DATABASE), and its OPTIONS mix
    # libpq parameters with Django's own.
    other = {
        **database,
        "OPTIONS": {"sslmode": "prefer", "application_name": "shop-other", "isolation_level": 1},
    }
    settings.configure(
        DATABASES={"default": database, "other": other},
        USE_TZ=True,
        INSTALLED_APPS=[],
    )
    django.setup()


def main(dsn: str) -> dict[str, Any]:
    configure(dsn)
    from django.db import connection, connections, transaction

    from outbox_relay import NewMessage
    from outbox_relay.integrations.django import enqueue, enqueue_many

    with connection.cursor() as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, total int)")

    def event(order: int) -> dict[str, Any]:
        return {
            "aggregate_type": "order",
            "aggregate_id": order,
            "event_type": "order.created",
            "payload": {"id": order},
        }

    # 1. Committed with the order.
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("INSERT INTO orders VALUES (1, 10)")
        committed = enqueue(**event(1))

    # 2. Rolled back with the order: neither exists.
    try:
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute("INSERT INTO orders VALUES (2, 20)")
            rolled_back = enqueue(**event(2))
            raise Boom
    except Boom:
        pass

    # 3. Outside any atomic block (autocommit): commits on its own.
    alone = enqueue(**event(3))

    # 4. Another alias, and enqueue_many, in that alias's transaction.
    with transaction.atomic(using="other"):
        many = enqueue_many([NewMessage(**event(4)), NewMessage(**event(5))], using="other")

    from celery import Celery
    from django.test import override_settings
    from psycopg.conninfo import conninfo_to_dict

    from outbox_relay.integrations.django import conf

    with override_settings(OUTBOX_DATABASE="other"):
        # 5. Without ``using``: OUTBOX_DATABASE's connection, the database the
        # relay reads (it went to "default", in a transaction of its own, and
        # outlived this rollback).
        try:
            with transaction.atomic(using="other"):
                unnamed = enqueue(**event(6))
                raise Boom
        except Boom:
            pass
        # 6. The relay's own connections: OUTBOX_DATABASE's, with its libpq OPTIONS.
        relay_dsn = conninfo_to_dict(conf.relay_settings()["dsn"])
        # 7. install() takes outbox_relay.install's own keywords.
        app = Celery("django-check", broker="memory://", set_as_current=False)
        inst = conf.install(app, beat=False, consume=False, task_options={"max_retries": 3})
        app.conf.timezone  # noqa: B018 (reading a setting configures the app)

    with connection.cursor() as cur:
        cur.execute("SELECT id FROM orders ORDER BY id")
        orders = [r[0] for r in cur.fetchall()]
        cur.execute("SELECT id, aggregate_id FROM outbox ORDER BY id")
        outbox = {str(r[0]): r[1] for r in cur.fetchall()}
    for alias in connections:
        connections[alias].close()
    return {
        "committed": committed,
        "rolled_back": rolled_back,
        "alone": alone,
        "many": many,
        "orders": orders,
        "outbox": outbox,
        "in_atomic_after": connection.in_atomic_block,
        "unnamed": unnamed,
        "relay_dsn": {k: v for k, v in relay_dsn.items() if k != "password"},
        "task_options": inst.task_options,
        "beat_entries": sorted(app.conf.beat_schedule or {}),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
