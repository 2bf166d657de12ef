"""Validated settings: what producers use, and what the relay uses.

Every setting ``x`` is the keyword ``x`` (``Outbox(...)``, ``install(app,
...)``), the Celery setting ``outbox_x`` and the environment variable
``OUTBOX_X``, in that order of precedence, then the default. A bad value
fails with a message that names the setting.

There are two sets, because two kinds of process read them:

* ``ProducerSettings``: the table, which event types are ordered, the payload
  limit and NOTIFY. A web process validates only these, so a relay-only value
  in a shared ``.env`` (a short lease, say) never breaks ``enqueue``.
* ``Settings``: everything the relay needs, producer settings included. A
  relay refuses unknown ``outbox_*`` / ``OUTBOX_*`` names at start, so a
  misspelled option is reported instead of silently ignored.

Secrets (docs/configuration.md, "Secrets"): every setting ``x`` can also be
read from a file named by ``x_file`` (``OUTBOX_DSN_FILE=/run/secrets/dsn``),
so a password need be neither in the environment nor in a Celery setting.
A value that may hold a secret and sits in a Celery app's configuration is
replaced there by a ``Secret`` once the relay is installed (``hide_secrets``),
which ``celery report``, ``celery inspect conf`` and Flower print masked; the
relay reads the value inside.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, ClassVar, TypeVar

from ._parse import as_bool, as_mapping, as_names, as_number
from ._redact import MASK, Secret, mask_dsn, mask_spec, reveal
from .errors import ConfigError
from .table import OutboxTable

__all__ = [
    "CELERY_SETTING",
    "ENVIRONMENT",
    "KEYWORD",
    "PUBLISHER_OPTION_PREFIXES",
    "REDIS_VISIBILITY_SECONDS",
    "NameSource",
    "ProducerSettings",
    "Secret",
    "Settings",
    "conceal",
    "env_name",
    "hide_secrets",
    "lookup_setting",
    "producer_settings_in_conf",
    "refuse_bad_values",
    "refuse_misspelled_producer_names",
    "refuse_unknown_environment",
    "refuse_unknown_names",
]

# Settings with these prefixes are options of one kind of publisher
# (docs/publishers.md): OUTBOX_WEBHOOK_SECRET reaches the webhook publisher
# as webhook_secret. The kombu publisher's options are kombu_*, not broker_*:
# those would read like Celery's own broker_* settings.
PUBLISHER_OPTION_PREFIXES = ("webhook_", "kombu_", "celery_")
# Each built-in publisher's options, option -> its constructor's keyword. Kept
# here, not only in the publishers, so that a misspelled one is refused where
# it was written (install()'s keyword, app.conf, OUTBOX_*) even by a process
# that never builds that publisher: OUTBOX_WEBHOOK_SECERT would otherwise
# pass every check until a worker sent webhooks unsigned.
PUBLISHER_OPTIONS: Mapping[str, Mapping[str, str]] = {
    "webhook": {
        "webhook_secret": "secret",
        "webhook_envelope": "envelope",
        "webhook_connect_timeout": "connect_timeout",
        "webhook_read_timeout": "read_timeout",
        "webhook_write_timeout": "write_timeout",
        "webhook_headers": "headers",
        "webhook_verify": "verify",
        "webhook_max_retry_after": "max_retry_after",
        "webhook_forward_headers": "forward_headers",
    },
    "kombu": {
        "kombu_exchange": "exchange",
        "kombu_exchange_type": "exchange_type",
        "kombu_routing_key": "routing_key",
        "kombu_declare": "declare",
        "kombu_unroutable": "unroutable",
        "kombu_connect_timeout": "connect_timeout",
        "kombu_confirm_timeout": "confirm_timeout",
        "kombu_transport_options": "transport_options",
        "kombu_ssl": "ssl",
    },
    "celery": {
        "celery_app": "app",
        "celery_broker_url": "broker_url",
        "celery_queue": "queue",
        "celery_args_from": "args_from",
        "celery_publish_timeout": "publish_timeout",
        "celery_connect_timeout": "connect_timeout",
    },
}
_PUBLISHER_OPTION_NAMES = frozenset(name for names in PUBLISHER_OPTIONS.values() for name in names)
# Environment names under OUTBOX_ that are not settings: this project's own
# test and benchmark tooling.
_TOOLING_PREFIXES = ("OUTBOX_TEST_", "OUTBOX_BENCH_")
# Names under outbox_/OUTBOX_ read by other parts of outbox-relay, not by the
# relay: the inbox's DSN (inbox/celery.py) and docker-compose's image tag.
_OTHER_NAMES = frozenset({"inbox_dsn", "relay_version"})
# Settings of django-celery-outbox (CELERY_OUTBOX_APP ...), which a Django
# project moving from it keeps while that package is installed and its relay
# drains the old table: Celery reads them under its namespace as outbox_app
# and so on, and they are no misspelled settings of this relay.
_DJANGO_CELERY_OUTBOX_NAMES = frozenset(
    {
        "app",
        "disable_task_name_tags",
        "dlq_retention",
        "exclude_tasks",
        "log_exception_traceback",
        "monitored_tasks",
        "pii_redactor",
        "stale_timeout_seconds",
        "structlog_context_keys",
        "structlog_enabled",
    }
)
# Names that were settings once, or that people try, with what to use instead.
_HINTS = {
    "broker_url": "the Celery broker is CELERY_BROKER_URL (broker_url); a broker "
    "to publish to is OUTBOX_PUBLISHER=amqp://... or redis://...",
    "celery_broker_url": "the Celery broker is CELERY_BROKER_URL",
}

# Every setting x may be read from the file named by x_file instead.
_FILE = "_file"
# Names of values to print masked (besides dsn, publisher and *_url): what
# Celery's own HIDDEN_SETTINGS catches, and headers, whose values are
# credentials (Authorization) under names Celery does not catch.
_SECRET_NAME = re.compile(
    r"secret|passw|token|api_?key|signature|auth|credential|cookie|headers", re.IGNORECASE
)

S = TypeVar("S", bound="_Loadable")


def env_name(name: str) -> str:
    return f"OUTBOX_{name.upper()}"


def _coerce(label: str, annotation: Any, raw: Any) -> Any:
    """``raw`` as the field's type; ``label`` names the setting as it was given.

    An empty value of an optional setting leaves it unset (``OUTBOX_OWNER=``
    in a ``.env`` file, which compose passes on as it is)."""
    kind = str(annotation)
    if kind.endswith("| None") and isinstance(raw, str) and not raw.strip():
        return None
    if kind.startswith("float"):
        return as_number(float, label, raw)
    if kind.startswith("int"):
        return as_number(int, label, raw)
    if kind == "bool":
        return as_bool(label, raw)
    if kind.startswith("tuple"):
        return as_names(label, raw)
    if kind.startswith("Mapping"):
        return as_mapping(label, raw)
    if kind.startswith("str"):
        if raw is not None and not isinstance(raw, str):
            raise ConfigError(f"{label} must be a string, got {type(raw).__name__}")
        return raw
    return raw


def _conf_get(conf: Any, key: str) -> Any:
    """A Celery setting's value; the value itself when it is held in a ``Secret``."""
    return reveal(_conf_raw(conf, key))


def _conf_raw(conf: Any, key: str) -> Any:
    try:
        return conf.get(key)
    except Exception:  # Celery's Settings may raise on odd keys; treat as unset
        return None


def read_secret_file(label: str, path: Any) -> str:
    """The text of the file ``path`` names (setting ``label``), without trailing newlines.

    ``echo pw > file`` and most editors end a file with a newline that is not
    part of the secret; Docker and Kubernetes secrets have none.
    """
    path = reveal(path)
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{label} must be a file path, got {type(path).__name__}")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ConfigError(f"{label} ({os.fspath(path)}): {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{label} ({os.fspath(path)}): not UTF-8 text") from None
    value = text.rstrip("\r\n")
    if not value:
        raise ConfigError(f"{label} ({os.fspath(path)}) is empty")
    return value


def _pick(
    name: str,
    value: tuple[bool, Any],
    path: Any,
    label: Callable[[str], str],
) -> tuple[bool, Any]:
    """One source's ``name`` and ``name_file`` made one value: ``(found, value)``.

    Both at once is refused rather than one silently preferred; an empty
    value beside a file is taken for unset (``OUTBOX_DSN=`` left in a
    ``.env``).
    """
    found, raw = value
    if path is None or path == "":
        return found, raw
    if found and raw is not None and raw != "":
        raise ConfigError(f"{label(name)} and {label(name + _FILE)} are both set; give one of them")
    return True, read_secret_file(label(name + _FILE), path)


def _conf_label(name: str) -> str:
    return f"the Celery setting outbox_{name}"


def _keyword_label(name: str) -> str:
    return f"the keyword {name}="


def _conf_keys(conf: Any) -> list[str]:
    try:
        return [k for k in conf.keys() if isinstance(k, str)]  # noqa: SIM118 (Celery conf)
    except Exception:  # a conf object without keys(): only explicit names count
        return []


class _Loadable:
    """Loading shared by both settings classes (a dataclass supplies fields)."""

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        raise NotImplementedError

    @classmethod
    def load(
        cls: type[S],
        conf: Mapping[str, Any] | Any = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> S:
        """From ``overrides``, then Celery ``conf`` (``outbox_*``), then ``OUTBOX_*``."""
        environ = os.environ if environ is None else environ
        conf = conf if conf is not None else {}
        names = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
        strict = cls._strict
        if strict:
            _refuse_unknown(set(names), conf, environ, overrides)
        else:
            unknown_here = {k[: -len(_FILE)] if k.endswith(_FILE) else k for k in overrides} - set(
                Settings.field_names()
            )
            if unknown_here:
                raise ConfigError(
                    _unknown_message(dict.fromkeys(unknown_here, KEYWORD), set(names))
                )
            refuse_misspelled_producer_names(_found_names(conf, environ, {}))
        values: dict[str, Any] = {}
        for name, f in names.items():
            found, raw, label = lookup_setting(name, conf, environ, overrides)
            if found:
                values[name] = _coerce(label, f.type, raw)
        if "publisher_options" in names:
            options = _publisher_options(conf, environ)
            options.update(values.get("publisher_options", {}))
            options.update(
                _with_files(
                    {k: reveal(v) for k, v in overrides.items() if _is_publisher_option(k)},
                    _keyword_label,
                )
            )
            values["publisher_options"] = options
        return cls(**values)

    _strict: ClassVar[bool] = False


def lookup_setting(
    name: str, conf: Any, environ: Mapping[str, str], overrides: Mapping[str, Any]
) -> tuple[bool, Any, str]:
    """``(found, value, label)`` of setting ``name``: keyword, Celery setting,
    environment; ``label`` names it as that source spells it, for an error.

    At each of them ``name_file`` may stand for ``name``; the first source
    that has either wins.
    """
    found, raw = _pick(
        name,
        (name in overrides, reveal(overrides.get(name))),
        overrides.get(name + _FILE),
        _keyword_label,
    )
    if found:
        return found, raw, KEYWORD(name)
    conf_value = _conf_get(conf, f"outbox_{name}")
    found, raw = _pick(
        name,
        (conf_value is not None, conf_value),
        _conf_get(conf, f"outbox_{name}{_FILE}"),
        _conf_label,
    )
    if found:
        return found, raw, CELERY_SETTING(name)
    key = env_name(name)
    found, raw = _pick(
        name, (key in environ, environ.get(key)), environ.get(key + "_FILE"), env_name
    )
    return found, raw, ENVIRONMENT(name)


def _with_files(options: Mapping[str, Any], label: Callable[[str], str]) -> dict[str, Any]:
    """Publisher options of one source with each ``x_file`` read into ``x``."""
    result: dict[str, Any] = {}
    for name, value in options.items():
        if name.endswith(_FILE):
            base = name[: -len(_FILE)]
            given = base in options
            found, raw = _pick(base, (given, options.get(base)), value, label)
            if found:
                result[base] = raw
        elif name + _FILE not in options:
            result[name] = value
    return result


def _is_publisher_option(name: str) -> bool:
    return name.startswith(PUBLISHER_OPTION_PREFIXES)


@dataclass(frozen=True)
class NameSource:
    """Where a setting's name was written, to name it as it was written there."""

    where: str  # "keyword", "Celery setting"; "" for the environment
    form: Callable[[str], str]  # chunk_size -> how it is spelled there
    # Why a name that is a setting's is not read as written (its case).
    hint: str | None = None

    def __call__(self, name: str) -> str:
        return f"{self.where} {self.form(name)}".strip()


KEYWORD = NameSource("keyword", lambda name: name)
CELERY_SETTING = NameSource("Celery setting", lambda name: f"outbox_{name}")
ENVIRONMENT = NameSource("", lambda name: env_name(name))


def _unknown_message(unknown: Mapping[str, NameSource], known: set[str]) -> str:
    parts = []
    for name in sorted(unknown):
        source = unknown[name]
        hint = source.hint or _HINTS.get(name)
        if hint is None and name.startswith("broker_"):
            hint = f"the kombu publisher's options are {source.form('kombu_' + name[7:])} and so on"
        if hint is None:
            # x_file is x read from a file: a misspelled x_file is matched on its x.
            stem, tail = (name[: -len(_FILE)], _FILE) if name.endswith(_FILE) else (name, "")
            close = difflib.get_close_matches(stem, sorted(known), n=1)
            hint = f"did you mean {source.form(close[0] + tail)}?" if close else None
        parts.append(f"{source(name)} ({hint})" if hint else source(name))
    return (
        f"unknown outbox setting(s): {', '.join(parts)}; every setting is listed in "
        "docs/configuration.md"
    )


def _refuse_unknown(
    known: set[str], conf: Any, environ: Mapping[str, str], overrides: Mapping[str, Any]
) -> None:
    refuse_unknown_names(_found_names(conf, environ, overrides), known)


def refuse_misspelled_producer_names(found: Mapping[str, NameSource]) -> None:
    """A producer refuses an unknown name whose closest setting is one it reads
    (``OUTBOX_TABEL``: its rows would go to the default table), and leaves the
    others to the relay: a relay setting misspelled in a shared ``.env``
    never breaks ``enqueue``."""
    known = set(Settings.field_names())
    producer = set(ProducerSettings.field_names())
    unknown = _unknown_names(found, known)
    mine = {}
    for name, source in unknown.items():
        stem = name[: -len(_FILE)] if name.endswith(_FILE) else name
        close = difflib.get_close_matches(stem, sorted(known), n=1)
        if close and close[0] in producer:
            mine[name] = source
    if mine:
        raise ConfigError(_unknown_message(mine, producer))


def _found_names(
    conf: Any, environ: Mapping[str, str], overrides: Mapping[str, Any]
) -> dict[str, NameSource]:
    # Each name under the first source that has it (keyword, Celery, environment).
    found: dict[str, NameSource] = {}
    for key in environ:
        upper = key.upper()
        if not upper.startswith("OUTBOX_") or upper.startswith(_TOOLING_PREFIXES):
            continue
        name = upper[len("OUTBOX_") :].lower()
        if key.startswith("OUTBOX_") and (key == upper or _is_publisher_option(name)):
            # (A publisher option is read whatever the case after OUTBOX_.)
            found.setdefault(name, ENVIRONMENT)
        else:
            # OUTBOX_lease_seconds or Outbox_DSN: environment names are
            # case-sensitive and only OUTBOX_LEASE_SECONDS is read; this one
            # was neither read nor refused.
            found[name] = NameSource(
                "", _as_written(key), hint=f"not read: the relay reads {upper}, in upper case"
            )
    # An app configured with a namespace (Django's CELERY_): Celery reads
    # CELERY_OUTBOX_LEASE_SECONDS as outbox_lease_seconds, and lists it so.
    prefix = getattr(conf, "prefix", None)
    namespaced = f"{prefix}OUTBOX_" if isinstance(prefix, str) and prefix else None
    for key in _conf_keys(conf):
        if key.startswith("outbox_") and _conf_get(conf, key) is not None:
            found[key[len("outbox_") :]] = CELERY_SETTING
        elif namespaced and key.startswith(namespaced):
            name = key[len(namespaced) :].lower()
            if name in _DJANGO_CELERY_OUTBOX_NAMES:
                continue
            if _conf_get(conf, f"outbox_{name}") is not None:
                found.setdefault(name, _namespaced(namespaced))
    found.update(dict.fromkeys(overrides, KEYWORD))
    return found


def _as_written(written: str) -> Callable[[str], str]:
    """A name's form that is ``written`` itself, whatever the setting."""
    return lambda _name: written


def _namespaced(written: str) -> NameSource:
    """Names as written under Celery's namespace (``CELERY_OUTBOX_``)."""
    return NameSource("Celery setting", lambda name: f"{written}{name.upper()}")


def refuse_bad_values(values: Mapping[str, Any], source: NameSource) -> None:
    """Raise ``ConfigError`` for the first value in ``values`` that is not of
    its setting's type, named as ``source`` spells it (``settings.py
    OUTBOX_CHUNK_SIZE must be a whole number``). For settings handed on as
    keywords, which ``Settings.load`` would otherwise name as keywords."""
    types = {f.name: f.type for f in fields(Settings)}
    types.update((f.name, f.type) for f in fields(ProducerSettings))
    for name, value in values.items():
        if name in types:
            _coerce(source(name), types[name], reveal(value))


def refuse_unknown_names(found: Mapping[str, NameSource], known: Iterable[str] = ()) -> None:
    """Raise ``ConfigError`` for every name in ``found`` that is no setting,
    each named as it was written (``keyword chunk_siz (did you mean
    chunk_size?)``, ``OUTBOX_CHUNK_SIZ (did you mean OUTBOX_CHUNK_SIZE?)``).
    ``known``: the settings (default: every relay setting)."""
    known = set(known) or set(Settings.field_names())
    unknown = _unknown_names(found, known)
    if unknown:
        raise ConfigError(_unknown_message(unknown, known | _PUBLISHER_OPTION_NAMES))


def _unknown_names(found: Mapping[str, NameSource], known: set[str]) -> dict[str, NameSource]:
    def is_known(name: str) -> bool:
        if name.endswith(_FILE):
            # x_file stands for x; only for the relay's own settings and the
            # publishers' options (the inbox's DSN is read elsewhere and has
            # no file form).
            stem = name[: -len(_FILE)]
            return stem in known or stem in _PUBLISHER_OPTION_NAMES
        return name in known or name in _OTHER_NAMES or name in _PUBLISHER_OPTION_NAMES

    def refused(name: str, source: NameSource) -> bool:
        if source.hint is not None:
            # Another case than the relay reads (OUTBOX_lease_seconds): a
            # setting's name, or one under the relay's own OUTBOX_ prefix.
            # Any other (another tool's outbox_dir) is not ours to refuse.
            return is_known(name) or source(name).startswith("OUTBOX_")
        return not is_known(name)

    return {name: source for name, source in found.items() if refused(name, source)}


def refuse_unknown_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigError`` for an ``OUTBOX_*`` name that is no setting.

    For a command that reads only some settings (the operations CLI reads
    the DSN and the table): a misspelled one (``OUTBOX_CHUNK_SIZ``) is
    refused there as the worker and beat refuse it, not passed over because
    that command had no use for it. Values are checked where they are used.
    """
    environ = os.environ if environ is None else environ
    _refuse_unknown(set(Settings.field_names()), {}, environ, {})


def _publisher_options(conf: Any, environ: Mapping[str, str]) -> dict[str, Any]:
    from_env: dict[str, Any] = {}
    for key, value in environ.items():
        name = key[len("OUTBOX_") :].lower() if key.startswith("OUTBOX_") else ""
        if _is_publisher_option(name):
            from_env[name] = value
    from_conf: dict[str, Any] = {}
    for key in _conf_keys(conf):
        if key.startswith("outbox_"):
            name = key[len("outbox_") :]
            if _is_publisher_option(name) and _conf_get(conf, key) is not None:
                from_conf[name] = _conf_get(conf, key)
    # Celery settings win over the environment, option by option.
    return {
        **_with_files(from_env, lambda n: env_name(n)),
        **_with_files(from_conf, _conf_label),
    }


# ------------------------------------------------------------------ secrets
def _shown(name: str, value: Any) -> Any:
    """How setting ``name`` (without ``outbox_``) is printed: any secret in it masked."""
    if isinstance(value, Secret):
        return value.shown
    if value is None:
        return None
    if name == "dsn" or name.endswith("_dsn"):
        return mask_dsn(value) if isinstance(value, str) else MASK
    if name == "publisher":
        return _shown_publisher(value)
    if _SECRET_NAME.search(name):
        # Header names help a reader; their values are the credentials.
        return {k: MASK for k in value} if isinstance(value, Mapping) else MASK
    if (name == "url" or name.endswith("_url")) and isinstance(value, str):
        return mask_spec(value)
    if isinstance(value, Mapping):
        return {k: _shown(str(k), v) for k, v in value.items()}
    return value


def _shown_publisher(spec: Any) -> Any:
    if isinstance(spec, str):
        return mask_spec(spec)
    if isinstance(spec, Mapping):
        # A route table ({pattern: spec}) or one publisher with options
        # ({"url": ..., "secret": ...}): specs shown as specs, options as options.
        return {
            k: _shown_publisher(v)
            if isinstance(v, (str, Mapping)) and not _SECRET_NAME.search(str(k))
            else _shown(str(k), v)
            for k, v in spec.items()
        }
    return spec  # a callable: its repr names a function, not a secret


def conceal(name: str, value: Any) -> Any:
    """``value`` of setting ``name``, held in a ``Secret`` when printing it could leak.

    Values with nothing to hide (a DSN without a password, a number, a
    callable) come back as they are.
    """
    if isinstance(value, Secret):
        return value
    shown = _shown(name, value)
    if shown is value or (type(shown) is type(value) and shown == value):
        return value
    return Secret(value, shown)


def hide_secrets(conf: Any) -> None:
    """Hold every ``outbox_*`` Celery setting that may carry a secret in a ``Secret``.

    Celery prints an app's settings in ``celery report``, ``celery inspect
    conf`` and Flower's worker page, masking only names that match its
    ``HIDDEN_SETTINGS`` (``PASS``, ``SECRET``, ``KEY`` ...) and its own
    broker and backend URLs: ``outbox_dsn``, ``outbox_publisher`` or
    ``outbox_webhook_headers`` would be shown whole. A ``Secret`` is printed
    through its ``repr``, which is the masked form; the relay reads the value
    inside. ``install()`` calls this when the app is configured, when a
    command imports the app's modules and when the relay reads its settings.

    Upper-case ``OUTBOX_*`` keys too: an app configured from Django's
    settings (``config_from_object("django.conf:settings", ...)``) shows
    every setting of settings.py in the same places, the Django
    integration's ``OUTBOX_DSN`` and ``OUTBOX_PUBLISHER`` among them. What
    is replaced is Celery's copy; Django's settings, which that integration
    reads, keep their values.
    """
    for key in _conf_keys(conf):
        if not key.lower().startswith("outbox_"):
            continue
        value = _conf_raw(conf, key)
        if value is None or isinstance(value, Secret):
            continue
        concealed = conceal(key[len("outbox_") :].lower(), value)
        if concealed is not value:
            conf[key] = concealed


def producer_settings_in_conf(conf: Any) -> dict[str, tuple[str, Any]]:
    """The producer settings written as Celery settings (``outbox_table`` ...):
    field -> (the setting's name, its value as the field's type)."""
    found: dict[str, tuple[str, Any]] = {}
    for f in fields(ProducerSettings):
        present, raw, label = lookup_setting(f.name, conf, {}, {})
        if present:
            found[f.name] = (label, _coerce(label, f.type, raw))
    return found


def _positive(values: Mapping[str, float]) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"{env_name(name)} must be greater than 0, got {value!r}")


@dataclass(frozen=True)
class ProducerSettings(_Loadable):
    """What ``enqueue`` needs; the relay reads the same table from here."""

    table: str = "outbox"
    # Event types written as ordered rows: the producer takes the aggregate's
    # lock and marks the row, and the relay claims marked rows strictly in id
    # order per aggregate. Entries may end in "*" ("order.*").
    ordered_event_types: tuple[str, ...] = ()
    max_payload_bytes: int = 1_000_000
    notify: bool = True

    def _validate(self) -> None:
        OutboxTable.parse(self.table)  # raises InvalidIdentifier naming the table
        _positive({"max_payload_bytes": self.max_payload_bytes})

    @cached_property
    def outbox_table(self) -> OutboxTable:
        # Parsed once per settings object: the relay reads it for every
        # message it finalizes (a parse each time was 1% of a durable run).
        return OutboxTable.parse(self.table)

    def is_ordered(self, event_type: str) -> bool:
        for entry in self.ordered_event_types:
            if entry == event_type or (entry.endswith("*") and event_type.startswith(entry[:-1])):
                return True
        return False

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# The share of the lease a delivery's worst case should use at most, in the
# advice a lease that is too short gets (see Settings._lease_too_short).
_WORST_SHARE = 0.8
# Kombu's default visibility timeout on Redis (and SQS): a lease must be
# shorter (Installation's time-limit check), so the advice says so past it.
REDIS_VISIBILITY_SECONDS = 3600


@dataclass(frozen=True)
class Settings(ProducerSettings):
    """All relay settings: the producer settings (inherited) and the relay's own.

    Build one with ``Settings.load(conf)`` or directly.
    """

    _strict: ClassVar[bool] = True

    dsn: str | None = None  # may hold a password: masked in repr
    publisher: Any = None  # "module:callable", a URL, a callable, or a routing mapping
    lease_seconds: float = 60.0
    publish_timeout_seconds: float = 10.0
    batch_size: int = 200
    chunk_size: int = 1
    max_attempts: int = 12
    claim_interval_seconds: float = 5.0
    # How often the rescuer frees expired leases; None: the claim interval.
    rescue_interval_seconds: float | None = None
    backoff_base_seconds: float = 1.0
    backoff_cap_seconds: float = 300.0
    # The longest a message may be deferred, counted from its creation; also
    # the cap on a receiver's Retry-After.
    max_defer_seconds: float = 86_400.0
    # Live leases at most (expired ones do not count: the rescuer frees them).
    # Fan-out tasks expire before their lease ends, so this many must drain
    # within one lease; keep it a few batches deep.
    max_in_flight: int = 1_000
    # Threads publishing one chunk: chunks up to 256 rows go out in one wave,
    # and with the default lease and publish timeout chunks up to 1,024 fit.
    # A chunk waits for its slowest publish once per wave: at 64, chunks of
    # 200 with 20 ms publishes took four waves and did 8,100 a second on 4
    # processes, in one wave 13,300 to 14,400 (docs/benchmarks-changes.md item 26).
    # A chunk starts only the threads its publisher's pace needs (threads_at_once).
    publish_concurrency: int = 256
    idempotency_key_prefix: str = "outbox-"
    queue: str = "outbox"
    listen: bool = True
    # The LISTEN connection's DSN (None: dsn). Behind a pooler in transaction
    # mode the listening session goes back to the pooler's pool after the
    # LISTEN statement, and notifications reach another client or none: the
    # listener needs a direct connection to PostgreSQL.
    listen_dsn: str | None = None  # may hold a password: masked in repr
    pool_size: int = 4
    # True: dsn reaches PostgreSQL through a pooler in transaction mode
    # (PgBouncer's pool_mode = transaction), where consecutive statements of
    # one client may run in different server sessions. The relay's
    # connections then prepare no statement on the server (a statement
    # prepared in one server session was executed in another: "prepared
    # statement _pg3_1 does not exist", or another client's statement of the
    # same name) and set no session setting (a SET stays with the server
    # session, and so reached other clients of the pooler: an application
    # on the same pool got the relay's statement_timeout of 10 s).
    transaction_pooling: bool = False
    # The bound of every database call of the relay: waiting for a pooled
    # connection, connecting, each statement, and a silent (half-open) socket.
    # None: 10 s, or a third of the lease when that is shorter.
    database_timeout_seconds: float | None = None
    # True: every finalize waits for the WAL flush, like any commit. False:
    # finalizes and lease renewals commit without waiting; a database crash
    # can then forget the last moments of finalizes, whose rows are still
    # leased, expire and are delivered again (a duplicate, never a loss).
    # Claims always commit durably: a fencing token must never be handed out
    # twice.
    synchronous_finalize: bool = True
    # Per-message delivery and chunks under 100 rows: a worker process writes
    # its deliveries' done in one fenced statement at most this long after
    # each task returned (0: each task writes its own before it returns). A
    # fifth less CPU per message (docs/benchmarks-changes.md, items 31 and 32); a
    # process killed in that window leaves its rows to their leases, as one
    # killed before its own done would.
    finalize_window_seconds: float = 0.02
    purge_after_seconds: float = 7 * 86_400.0
    # Rows one purge statement deletes; a purge task runs up to 100 of them
    # (Purger's max_batches), and another task after it while more are due
    # (outbox_relay/celery/tasks.py), so retention keeps up at any rate.
    purge_batch_size: int = 5000
    owner: str | None = None
    # Keyword options for the publisher (webhook secret, exchange ...). Their
    # secrets are masked in repr, so none reaches a log line.
    publisher_options: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __repr__(self) -> str:
        # Written out rather than the dataclass's: the DSN's and the
        # publisher URL's passwords, the webhook secret and header values
        # are shown masked (a repr ends up in logs and tracebacks).
        shown = ", ".join(
            f"{f.name}={_shown(f.name, getattr(self, f.name))!r}" for f in fields(self)
        )
        return f"{type(self).__name__}({shown})"

    def _validate(self) -> None:
        super()._validate()
        _positive(
            {
                "lease_seconds": self.lease_seconds,
                "publish_timeout_seconds": self.publish_timeout_seconds,
                "batch_size": self.batch_size,
                "chunk_size": self.chunk_size,
                "max_attempts": self.max_attempts,
                "claim_interval_seconds": self.claim_interval_seconds,
                "rescue_interval_seconds": self.rescue_interval,
                "max_in_flight": self.max_in_flight,
                "publish_concurrency": self.publish_concurrency,
                "pool_size": self.pool_size,
                "database_timeout_seconds": self.database_timeout,
                "purge_after_seconds": self.purge_after_seconds,
                "purge_batch_size": self.purge_batch_size,
            }
        )
        if not 0 <= self.finalize_window_seconds <= 1:
            raise ConfigError(
                "OUTBOX_FINALIZE_WINDOW_SECONDS must be between 0 (each delivery task writes its "
                f"own done) and 1, got {self.finalize_window_seconds!r}"
            )
        for name in ("backoff_base_seconds", "backoff_cap_seconds", "max_defer_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{env_name(name)} must not be negative")
        if self.chunk_size > self.batch_size:
            raise ConfigError(
                f"OUTBOX_CHUNK_SIZE ({self.chunk_size}) must not exceed "
                f"OUTBOX_BATCH_SIZE ({self.batch_size}): a chunk is cut from one claim's "
                f"batch. Set OUTBOX_BATCH_SIZE={self.chunk_size} or more, or "
                f"OUTBOX_CHUNK_SIZE={self.batch_size} or less"
            )
        if self.database_timeout >= self.lease_seconds:
            raise ConfigError(
                f"OUTBOX_DATABASE_TIMEOUT_SECONDS ({self.database_timeout:g}) must be "
                f"less than OUTBOX_LEASE_SECONDS ({self.lease_seconds:g}): a finalize that may "
                "wait longer than a lease would be fenced off anyway"
            )
        worst = self.worst_delivery_seconds
        if worst >= self.lease_seconds:
            raise ConfigError(self._lease_too_short(worst))
        if self.transaction_pooling:
            self._check_transaction_pooling()

    def _check_transaction_pooling(self) -> None:
        """What cannot work through a pooler in transaction mode."""
        if not self.synchronous_finalize:
            raise ConfigError(
                "OUTBOX_SYNCHRONOUS_FINALIZE=false needs a session of the relay's own (it sets "
                "synchronous_commit for the session); with OUTBOX_TRANSACTION_POOLING=true that "
                "session is shared with the pooler's other clients, whose commits would stop "
                "waiting for the WAL flush too. Leave it true, or set synchronous_commit = off "
                "for a database role of the relay's own (ALTER ROLE ... SET)"
            )
        if self.listen and not self.listen_dsn:
            raise ConfigError(
                "OUTBOX_LISTEN needs a session of its own, which a pooler in transaction mode "
                "(OUTBOX_TRANSACTION_POOLING=true) does not keep: notifications would never "
                "reach the listener. Set OUTBOX_LISTEN_DSN to a direct connection to "
                "PostgreSQL (or through a pooler in session mode), or OUTBOX_LISTEN=false "
                "(new rows then wait for beat's claim tick, OUTBOX_CLAIM_INTERVAL_SECONDS)"
            )

    def _lease_too_short(self, worst: float) -> str:
        """What does not fit, and each single setting that would make it fit, with its value."""
        lease, timeout = self.lease_seconds, self.publish_timeout_seconds
        waves = self.waves
        if self.chunk_size == 1:
            problem = (
                f"OUTBOX_PUBLISH_TIMEOUT_SECONDS ({timeout:g}) must be less than "
                f"OUTBOX_LEASE_SECONDS ({lease:g}): a publish must finish inside the lease, or "
                "another worker re-claims the message while it is sent"
            )
        else:
            problem = (
                f"OUTBOX_CHUNK_SIZE {self.chunk_size} does not fit in OUTBOX_LEASE_SECONDS "
                f"({lease:g}): a delivery chunk may publish for {worst:g}s, ceil(OUTBOX_CHUNK_SIZE "
                f"{self.chunk_size} / OUTBOX_PUBLISH_CONCURRENCY {self.publish_concurrency}) = "
                f"{waves} waves x OUTBOX_PUBLISH_TIMEOUT_SECONDS {timeout:g}, and must end "
                "inside the lease"
            )
        # Each fix keeps the worst case within 80% of the lease: the rest is
        # for the time a delivery task waits in the queue (a task that starts
        # with less lease left than its worst case gives its rows back).
        room = lease * _WORST_SHARE
        longer = math.ceil(worst / _WORST_SHARE - 1e-9)
        fixes = [f"OUTBOX_LEASE_SECONDS={longer}"]
        if longer >= REDIS_VISIBILITY_SECONDS:
            # The worker refuses a lease past Redis's visibility timeout.
            fixes[0] += (
                " (with Redis as the broker, also broker_transport_options "
                f"visibility_timeout above it; its default is {REDIS_VISIBILITY_SECONDS}s)"
            )
        fitting_waves = int(room // timeout)
        if self.chunk_size > 1 and fitting_waves >= 1:
            fixes.append(f"OUTBOX_CHUNK_SIZE={fitting_waves * self.publish_concurrency}")
            fixes.append(f"OUTBOX_PUBLISH_CONCURRENCY={-(-self.chunk_size // fitting_waves)}")
        shorter = math.floor(room / waves * 10 + 1e-9) / 10
        if shorter > 0:
            fixes.append(
                f"OUTBOX_PUBLISH_TIMEOUT_SECONDS={shorter:g} (the publisher's own timeouts "
                "must then fit in it)"
            )
        return (
            f"{problem}. Set one of: {', or '.join(fixes)}; each leaves a fifth of the lease "
            "for the time a delivery task waits in the queue"
        )

    # ------------------------------------------------------------------ helpers
    @property
    def rescue_interval(self) -> float:
        if self.rescue_interval_seconds is None:
            return self.claim_interval_seconds
        return self.rescue_interval_seconds

    @property
    def database_timeout(self) -> float:
        if self.database_timeout_seconds is None:
            return min(10.0, self.lease_seconds / 3.0)
        return self.database_timeout_seconds

    @property
    def waves(self) -> int:
        """Publishing rounds one delivery task runs: ceil(chunk / concurrency)."""
        return -(-self.chunk_size // self.publish_concurrency)

    @property
    def worst_delivery_seconds(self) -> float:
        """The longest one delivery task may spend publishing."""
        return self.waves * self.publish_timeout_seconds

    def require_dsn(self) -> str:
        if not self.dsn:
            raise ConfigError(
                "OUTBOX_DSN is not set: give the relay a PostgreSQL connection string "
                "(setting outbox_dsn or environment variable OUTBOX_DSN)"
            )
        return self.dsn

    def listen_connection_dsn(self) -> str:
        """The DSN the NOTIFY listener connects with: listen_dsn, else dsn."""
        return self.listen_dsn or self.require_dsn()
