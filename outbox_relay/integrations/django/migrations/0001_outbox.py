"""Create (or bring up to date) the outbox table: runs ``outbox_relay.migrate``.

The outbox's schema has its own numbered migrations (outbox_relay/sql/migrations),
recorded in its own table; this Django migration only calls them, so
``manage.py migrate`` and ``outbox-relay migrate`` give the same schema and
either may run first. A release of outbox-relay that adds a schema migration
adds a Django migration here that runs the same hook (it is idempotent), so
that ``manage.py migrate`` after an upgrade applies it; ``OUTBOX_SCHEMA`` is
the last schema migration each one brings (tests/test_migrate.py checks that
the last Django migration brings the last schema migration).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations


def apply_outbox_migrations(apps: Any, schema_editor: Any) -> None:
    from outbox_relay.integrations.django.migrate import run

    run(schema_editor.connection)


OUTBOX_SCHEMA = 7


class Migration(migrations.Migration):  # type: ignore[misc]  # django ships no types
    initial = True
    dependencies: list[tuple[str, str]] = []  # noqa: RUF012 - Django reads class attributes
    operations = [  # noqa: RUF012
        # Reversing leaves the table: it may hold undelivered messages.
        migrations.RunPython(apply_outbox_migrations, migrations.RunPython.noop),
    ]
