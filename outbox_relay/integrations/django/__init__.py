"""Django, the Django way: an app for ``INSTALLED_APPS``.

    INSTALLED_APPS = [..., "outbox_relay.integrations.django"]
    OUTBOX_PUBLISHER = "https://hooks.example.com/orders"    # any OUTBOX_* setting

* ``manage.py migrate`` creates the outbox table: the app's Django migration
  runs ``outbox_relay.migrate`` on the database ``OUTBOX_DATABASE``
  (default ``"default"``).
* ``enqueue`` / ``enqueue_many`` write on Django's connection, inside
  ``transaction.atomic()``: the message commits with your models or not at all.
* The relay reads ``OUTBOX_*`` from ``settings.py``: in your Celery module,
  ``outbox_relay.integrations.django.install(app)``. Without ``OUTBOX_DSN``
  the relay connects to the ``OUTBOX_DATABASE`` database of ``DATABASES``.
* A dead-letter page for staff in the admin (list, retry, skip): include
  ``outbox_relay.integrations.django.urls`` (see docs/integrations.md).

Needs Django 4.2+ with the psycopg 3 driver.
"""

from __future__ import annotations

from ._producer import enqueue, enqueue_many, psycopg_connection
from .conf import database_alias, install, outbox, relay_settings

__all__ = [
    "database_alias",
    "enqueue",
    "enqueue_many",
    "install",
    "outbox",
    "psycopg_connection",
    "relay_settings",
]
