"""A Celery app whose outbox settings live in its configuration, not the
environment: ``celery -A tests.apps.cli_app outbox ...`` must find the DSN here.
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery("cli_app")
app.conf.outbox_dsn = os.environ["CLI_APP_DSN"]
if os.environ.get("CLI_APP_TABLE"):
    app.conf.outbox_table = os.environ["CLI_APP_TABLE"]
