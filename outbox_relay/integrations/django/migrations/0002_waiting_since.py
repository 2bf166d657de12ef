"""Outbox schema migration 0008 (waiting_since) for ``manage.py migrate`` after an upgrade.

Runs the same hook as 0001 (see its docstring): every outbox migration the
table lacks, so a project that migrated with an earlier release catches up.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

OUTBOX_SCHEMA = 8


def apply_outbox_migrations(apps: Any, schema_editor: Any) -> None:
    from outbox_relay.integrations.django.migrate import run

    run(schema_editor.connection)


class Migration(migrations.Migration):  # type: ignore[misc]  # django ships no types
    dependencies = [("outbox_relay", "0001_outbox")]  # noqa: RUF012 - Django reads class attributes
    operations = [  # noqa: RUF012
        # Reversing leaves the column: dropping it would lose nothing but the
        # wait ages, and a reverse should never touch undelivered messages.
        migrations.RunPython(apply_outbox_migrations, migrations.RunPython.noop),
    ]
