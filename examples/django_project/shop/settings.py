"""Settings of the example shop: a Django project whose orders publish events
through the outbox.

The database comes from ``SHOP_DATABASE`` (a libpq connection string or
``postgresql://`` URL); the outbox lives in the same database.
"""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(os.environ.get("SHOP_DATABASE", "postgresql://postgres@127.0.0.1/shop"))

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "example-only-not-secret")
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
USE_TZ = True
# Django's default is America/Chicago, and Django sets the process's TZ
# from it: the worker's and beat's log times would be Chicago's too.
TIME_ZONE = "UTC"
ROOT_URLCONF = "shop.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # The outbox: its table comes with `manage.py migrate`, its settings from OUTBOX_* below.
    "outbox_relay.integrations.django",
    "orders",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",  # psycopg 3
        "NAME": _db.get("dbname", "shop"),
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
    }
}

# Celery (shop/celery.py reads CELERY_*).
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")

# The outbox: the relay and the producers read these (docs/configuration.md).
# OUTBOX_DSN is not needed: the relay connects to DATABASES["default"].
OUTBOX_PUBLISHER = os.environ.get("OUTBOX_PUBLISHER", "http://127.0.0.1:8080/hooks/orders")
OUTBOX_ORDERED_EVENT_TYPES = ["order.*"]
OUTBOX_LEASE_SECONDS = 30
OUTBOX_CLAIM_INTERVAL_SECONDS = 1
