"""Validated settings, read from a Celery app's configuration and the environment.

Every setting ``x`` is the Celery setting ``outbox_x`` and the environment
variable ``OUTBOX_X``; a value in the Celery configuration wins over the
environment, which wins over the default. A bad value fails at start with a
message that names the setting.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ConfigError
from .table import OutboxTable

__all__ = ["Settings"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _env_name(name: str) -> str:
    return f"OUTBOX_{name.upper()}"


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{_env_name(name)} must be true or false, got {value!r}")


def _as_number(kind: Callable[[Any], Any], name: str, value: Any) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"{_env_name(name)} must be a number, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{_env_name(name)} must be a number, got {value!r}") from None


def _as_names(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = [str(part).strip() for part in value]
    else:
        raise ConfigError(f"{_env_name(name)} must be a comma-separated list, got {value!r}")
    return tuple(sorted({item for item in items if item}))


@dataclass(frozen=True)
class Settings:
    """All relay settings. Build one with ``Settings.load(conf)`` or directly."""

    dsn: str | None = field(default=None, repr=False)  # may hold a password
    table: str = "outbox"
    publisher: Any = None  # "module:callable", a URL, a callable, or a routing mapping
    lease_seconds: float = 60.0
    publish_timeout_seconds: float = 10.0
    batch_size: int = 200
    chunk_size: int = 1
    max_attempts: int = 12
    claim_interval_seconds: float = 5.0
    ordered_event_types: tuple[str, ...] = ()
    backoff_base_seconds: float = 1.0
    backoff_cap_seconds: float = 300.0
    max_defer_seconds: float = 86_400.0
    # Leased-but-unfinished rows at most. Fan-out tasks expire before their
    # lease ends, so this many must drain within OUTBOX_LEASE_SECONDS -
    # OUTBOX_PUBLISH_TIMEOUT_SECONDS; keep it a few batches deep.
    max_in_flight: int = 1_000
    publish_concurrency: int = 32
    idempotency_key_prefix: str = "outbox-"
    max_payload_bytes: int = 1_000_000
    queue: str = "outbox"
    notify: bool = True
    listen: bool = True
    pool_size: int = 4
    # True: every finalize waits for the WAL flush, like any commit. False:
    # finalizes (done, retry, dead) and lease renewals commit without waiting;
    # a database crash can then forget the last moments of finalizes, whose
    # rows are still leased, expire and are delivered again (a duplicate, never
    # a loss). Claims always commit durably: a fencing token must never be
    # handed out twice. Measured on the benchmark machine the gain was within
    # noise, so durable is the default.
    synchronous_finalize: bool = True
    purge_after_seconds: float = 7 * 86_400.0
    owner: str | None = None
    # Keyword options for the publisher (webhook secret, exchange ...). Kept
    # out of repr so a secret never reaches a log line.
    publisher_options: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        conf: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> Settings:
        """Settings from ``overrides``, then Celery ``conf`` (``outbox_*``), then ``OUTBOX_*``."""
        environ = os.environ if environ is None else environ
        conf = conf or {}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in overrides:
                raw = overrides[f.name]
            elif _conf_get(conf, f"outbox_{f.name}") is not None:
                raw = _conf_get(conf, f"outbox_{f.name}")
            elif _env_name(f.name) in environ:
                raw = environ[_env_name(f.name)]
            else:
                continue
            values[f.name] = _coerce(f.name, f.type, raw)
        options = _publisher_options(conf, environ)
        options.update(values.get("publisher_options", {}))
        values["publisher_options"] = options
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown outbox setting(s): {', '.join(sorted(unknown))}")
        return cls(**values)

    # --------------------------------------------------------------- validation
    def _validate(self) -> None:
        OutboxTable.parse(self.table)  # raises InvalidIdentifier naming the table
        positive = {
            "lease_seconds": self.lease_seconds,
            "publish_timeout_seconds": self.publish_timeout_seconds,
            "batch_size": self.batch_size,
            "chunk_size": self.chunk_size,
            "max_attempts": self.max_attempts,
            "claim_interval_seconds": self.claim_interval_seconds,
            "max_in_flight": self.max_in_flight,
            "publish_concurrency": self.publish_concurrency,
            "max_payload_bytes": self.max_payload_bytes,
            "pool_size": self.pool_size,
            "purge_after_seconds": self.purge_after_seconds,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{_env_name(name)} must be greater than 0, got {value!r}")
        for name in ("backoff_base_seconds", "backoff_cap_seconds", "max_defer_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{_env_name(name)} must not be negative")
        if self.publish_timeout_seconds >= self.lease_seconds:
            raise ConfigError(
                f"OUTBOX_PUBLISH_TIMEOUT_SECONDS ({self.publish_timeout_seconds:g}) must be less "
                f"than OUTBOX_LEASE_SECONDS ({self.lease_seconds:g}): a publish must finish "
                "inside the lease, or another worker re-claims the message while it is sent"
            )
        if self.chunk_size > self.batch_size:
            raise ConfigError(
                f"OUTBOX_CHUNK_SIZE ({self.chunk_size}) must not exceed "
                f"OUTBOX_BATCH_SIZE ({self.batch_size})"
            )

    # ------------------------------------------------------------------ helpers
    @property
    def outbox_table(self) -> OutboxTable:
        return OutboxTable.parse(self.table)

    def require_dsn(self) -> str:
        if not self.dsn:
            raise ConfigError(
                "OUTBOX_DSN is not set: give the relay a PostgreSQL connection string "
                "(setting outbox_dsn or environment variable OUTBOX_DSN)"
            )
        return self.dsn


# Settings with these prefixes belong to a publisher (docs/publishers.md):
# OUTBOX_WEBHOOK_SECRET reaches the webhook publisher as webhook_secret.
_PUBLISHER_OPTION_PREFIXES = ("webhook_", "broker_", "celery_")


def _publisher_options(conf: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in environ.items():
        name = key[len("OUTBOX_") :].lower() if key.startswith("OUTBOX_") else ""
        if name.startswith(_PUBLISHER_OPTION_PREFIXES):
            found[name] = value
    try:
        keys = list(conf.keys())
    except Exception:  # a conf object without keys(): only the environment counts
        keys = []
    for key in keys:
        if isinstance(key, str) and key.startswith("outbox_"):
            name = key[len("outbox_") :]
            if name.startswith(_PUBLISHER_OPTION_PREFIXES) and conf.get(key) is not None:
                found[name] = conf.get(key)
    return found


def _conf_get(conf: Mapping[str, Any], key: str) -> Any:
    try:
        return conf.get(key)
    except Exception:  # Celery's Settings may raise on odd keys; treat as unset
        return None


def _coerce(name: str, annotation: Any, raw: Any) -> Any:
    kind = str(annotation)
    if kind.startswith("float"):
        return _as_number(float, name, raw)
    if kind.startswith("int"):
        return _as_number(int, name, raw)
    if kind == "bool":
        return _as_bool(name, raw)
    if kind.startswith("tuple"):
        return _as_names(name, raw)
    if kind.startswith("Mapping"):
        if isinstance(raw, str):
            try:
                raw = json.loads(raw) if raw.strip() else {}
            except ValueError:
                raise ConfigError(f"{_env_name(name)} must be a JSON object") from None
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{_env_name(name)} must be a mapping, got {raw!r}")
        return dict(raw)
    if kind.startswith("str | None") or kind == "str":
        if raw is not None and not isinstance(raw, str):
            raise ConfigError(f"{_env_name(name)} must be a string, got {raw!r}")
        return raw
    return raw
