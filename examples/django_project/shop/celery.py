"""The shop's Celery app, with the outbox relay installed from settings.py.

celery -A shop worker        # delivers the outbox (and runs the shop's tasks)
celery -A shop beat          # the relay's claim / rescue / purge ticks
"""

import os

import django
from celery import Celery

from outbox_relay.integrations.django import install

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
django.setup()

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
install(app)  # OUTBOX_* from settings.py; the database from DATABASES
