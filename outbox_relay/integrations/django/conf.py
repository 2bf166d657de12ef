"""The outbox's settings from Django's ``settings.py`` (``OUTBOX_*``).

Each ``OUTBOX_NAME`` setting is the relay's ``name`` setting (the names of
docs/configuration.md), so ``OUTBOX_PUBLISHER``, ``OUTBOX_LEASE_SECONDS``,
``OUTBOX_ORDERED_EVENT_TYPES`` ... mean what they mean everywhere. Keyword
arguments to ``install`` win over them; ``OUTBOX_*`` environment variables
apply where neither sets a value. ``OUTBOX_DATABASE`` (Django only) names the
``DATABASES`` alias that holds the outbox.
"""

from __future__ import annotations

import threading
from typing import Any

from django.conf import settings as django_settings
from django.db import connections
from psycopg.conninfo import make_conninfo

from ...config import (
    KEYWORD,
    NameSource,
    ProducerSettings,
    env_name,
    refuse_bad_values,
    refuse_misspelled_producer_names,
    refuse_unknown_names,
)
from ...errors import ConfigError
from ...outbox import Outbox, configure

__all__ = ["database_alias", "install", "outbox", "relay_settings"]

_PREFIX = "OUTBOX_"
_DATABASE = "OUTBOX_DATABASE"
_SETTINGS_PY = NameSource("settings.py", env_name)
_PRODUCER_FIELDS = frozenset(ProducerSettings.field_names())
_lock = threading.Lock()
_outbox: Outbox | None = None


def database_alias() -> str:
    """The ``DATABASES`` alias that holds the outbox (``OUTBOX_DATABASE``, default "default")."""
    alias = getattr(django_settings, _DATABASE, "default")
    if alias not in connections:
        raise ConfigError(f"{_DATABASE} = {alias!r} is not a database in DATABASES")
    return str(alias)


def _from_settings() -> dict[str, Any]:
    return {
        name[len(_PREFIX) :].lower(): getattr(django_settings, name)
        for name in dir(django_settings)
        if name.startswith(_PREFIX) and name != _DATABASE
    }


# Keys of DATABASES[...]["OPTIONS"] that Django's backend consumes itself;
# every other one is a libpq parameter (sslmode, sslrootcert, options,
# service, passfile, connect_timeout, application_name ...) that Django
# passes to psycopg.connect, and so must the relay.
_DJANGO_ONLY_OPTIONS = frozenset(
    {"isolation_level", "server_side_binding", "pool", "assume_role", "cursor_factory", "context"}
)


def _dsn(alias: str) -> str:
    """A psycopg conninfo for a Django database alias (the relay's own connections)."""
    db = connections[alias].settings_dict
    options = {k: v for k, v in (db.get("OPTIONS") or {}).items() if k not in _DJANGO_ONLY_OPTIONS}
    params = {
        **options,
        "dbname": db.get("NAME"),
        "user": db.get("USER"),
        "password": db.get("PASSWORD"),
        "host": db.get("HOST"),
        "port": db.get("PORT"),
    }
    return make_conninfo("", **{k: str(v) for k, v in params.items() if v})


def relay_settings(**overrides: Any) -> dict[str, Any]:
    """The relay's settings from ``OUTBOX_*`` in settings.py, then ``overrides``.

    Producer settings (table, ordering, payload limit, NOTIFY) are left out:
    they belong to the ``Outbox`` (``outbox()``), which ``install`` passes on.
    """
    values = {**_from_settings(), **overrides}
    if "dsn" not in values and "dsn_file" not in values:
        values["dsn"] = _dsn(database_alias())
    return {k: v for k, v in values.items() if k not in _PRODUCER_FIELDS}


def outbox() -> Outbox:
    """The project's ``Outbox``: producer settings from ``OUTBOX_*`` in settings.py.

    Made once, and made the process default (``outbox_relay.configure``), so
    ``outbox_relay.enqueue`` and this app's ``enqueue`` agree with the relay.
    """
    global _outbox
    with _lock:
        if _outbox is None:
            written = _from_settings()
            # OUTBOX_TABEL in settings.py: refused here, in every process
            # that produces, not only by the relay's worker.
            refuse_misspelled_producer_names(dict.fromkeys(written, _SETTINGS_PY))
            producer = {k: v for k, v in written.items() if k in _PRODUCER_FIELDS}
            refuse_bad_values(producer, _SETTINGS_PY)
            _outbox = configure(**producer)
        return _outbox


def install(
    app: Any,
    *,
    beat: bool = True,
    consume: bool = True,
    task_options: dict[str, Any] | None = None,
    **overrides: Any,
) -> Any:
    """``outbox_relay.install(app)`` with the settings of settings.py; returns the Installation.

    Call it in the module that makes your Celery app (``proj/celery.py``),
    after ``django.setup()`` or ``app.config_from_object("django.conf:settings")``.
    """
    from ...celery.install import install as install_relay

    written = _from_settings()
    # Misspellings named as written: in settings.py, or as a keyword here.
    refuse_unknown_names(
        {**dict.fromkeys(written, _SETTINGS_PY), **dict.fromkeys(overrides, KEYWORD)}
    )
    # settings.py's values reach the relay as keywords: check them here, so
    # that a bad one is named where it was written.
    refuse_bad_values(written, _SETTINGS_PY)
    producer_keys = sorted(_PRODUCER_FIELDS.intersection(overrides))
    if producer_keys:
        raise ConfigError(
            f"install(): set {', '.join('OUTBOX_' + k.upper() for k in producer_keys)} in "
            "settings.py instead, so that producers and the relay share them"
        )
    return install_relay(
        app,
        outbox=outbox(),
        beat=beat,
        consume=consume,
        task_options=task_options,
        **relay_settings(**overrides),
    )
