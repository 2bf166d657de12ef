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
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from ._parse import as_bool, as_mapping, as_names, as_number
from .errors import ConfigError
from .table import OutboxTable

__all__ = ["PUBLISHER_OPTION_PREFIXES", "ProducerSettings", "Settings", "env_name"]

# Settings with these prefixes are options of one kind of publisher
# (docs/publishers.md): OUTBOX_WEBHOOK_SECRET reaches the webhook publisher
# as webhook_secret. The kombu publisher's options are kombu_*, not broker_*:
# those would read like Celery's own broker_* settings.
PUBLISHER_OPTION_PREFIXES = ("webhook_", "kombu_", "celery_")
# Environment names under OUTBOX_ that are not settings: this project's own
# test and benchmark tooling.
_TOOLING_PREFIXES = ("OUTBOX_TEST_", "OUTBOX_BENCH_")
# Names under outbox_/OUTBOX_ read by other parts of outbox-relay, not by the
# relay: the inbox's DSN (inbox/celery.py) and docker-compose's image tag.
_OTHER_NAMES = frozenset({"inbox_dsn", "relay_version"})
# Names that were settings once, or that people try, with what to use instead.
_HINTS = {
    "broker_url": "the Celery broker is CELERY_BROKER_URL (broker_url); a broker "
    "to publish to is OUTBOX_PUBLISHER=amqp://... or redis://...",
    "celery_broker_url": "the Celery broker is CELERY_BROKER_URL",
}

S = TypeVar("S", bound="_Loadable")


def env_name(name: str) -> str:
    return f"OUTBOX_{name.upper()}"


def _coerce(name: str, annotation: Any, raw: Any) -> Any:
    label = env_name(name)
    kind = str(annotation)
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
    try:
        return conf.get(key)
    except Exception:  # Celery's Settings may raise on odd keys; treat as unset
        return None


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
            unknown_here = set(overrides) - set(Settings.field_names())
            if unknown_here:
                raise ConfigError(_unknown_message(sorted(unknown_here), set(names)))
        values: dict[str, Any] = {}
        for name, f in names.items():
            if name in overrides:
                raw = overrides[name]
            elif _conf_get(conf, f"outbox_{name}") is not None:
                raw = _conf_get(conf, f"outbox_{name}")
            elif env_name(name) in environ:
                raw = environ[env_name(name)]
            else:
                continue
            values[name] = _coerce(name, f.type, raw)
        if "publisher_options" in names:
            options = _publisher_options(conf, environ)
            options.update(values.get("publisher_options", {}))
            options.update({k: v for k, v in overrides.items() if _is_publisher_option(k)})
            values["publisher_options"] = options
        return cls(**values)

    _strict: ClassVar[bool] = False


def _is_publisher_option(name: str) -> bool:
    return name.startswith(PUBLISHER_OPTION_PREFIXES)


def _unknown_message(unknown: list[str], known: set[str]) -> str:
    parts = []
    for name in unknown:
        hint = _HINTS.get(name)
        if hint is None and name.startswith("broker_"):
            hint = f"the kombu publisher's options are {env_name('kombu_' + name[7:])} and so on"
        if hint is None:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean {env_name(close[0])}?" if close else None
        parts.append(f"{env_name(name)} ({hint})" if hint else env_name(name))
    return (
        f"unknown outbox setting(s): {', '.join(parts)}; every setting is listed in "
        "docs/configuration.md"
    )


def _refuse_unknown(
    known: set[str], conf: Any, environ: Mapping[str, str], overrides: Mapping[str, Any]
) -> None:
    found: set[str] = set()
    for key in overrides:
        found.add(key)
    for key in _conf_keys(conf):
        if key.startswith("outbox_") and _conf_get(conf, key) is not None:
            found.add(key[len("outbox_") :])
    for key in environ:
        if key.startswith("OUTBOX_") and not key.startswith(_TOOLING_PREFIXES):
            found.add(key[len("OUTBOX_") :].lower())
    unknown = sorted(
        n for n in found if n not in known and n not in _OTHER_NAMES and not _is_publisher_option(n)
    )
    if unknown:
        raise ConfigError(_unknown_message(unknown, known))


def _publisher_options(conf: Any, environ: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in environ.items():
        name = key[len("OUTBOX_") :].lower() if key.startswith("OUTBOX_") else ""
        if _is_publisher_option(name):
            found[name] = value
    for key in _conf_keys(conf):
        if key.startswith("outbox_"):
            name = key[len("outbox_") :]
            if _is_publisher_option(name) and _conf_get(conf, key) is not None:
                found[name] = _conf_get(conf, key)
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

    @property
    def outbox_table(self) -> OutboxTable:
        return OutboxTable.parse(self.table)

    def is_ordered(self, event_type: str) -> bool:
        for entry in self.ordered_event_types:
            if entry == event_type or (entry.endswith("*") and event_type.startswith(entry[:-1])):
                return True
        return False

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True)
class Settings(ProducerSettings):
    """All relay settings: the producer settings (inherited) and the relay's own.

    Build one with ``Settings.load(conf)`` or directly.
    """

    _strict: ClassVar[bool] = True

    dsn: str | None = field(default=None, repr=False)  # may hold a password
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
    publish_concurrency: int = 32
    idempotency_key_prefix: str = "outbox-"
    queue: str = "outbox"
    listen: bool = True
    pool_size: int = 4
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
    purge_after_seconds: float = 7 * 86_400.0
    owner: str | None = None
    # Keyword options for the publisher (webhook secret, exchange ...). Kept
    # out of repr so a secret never reaches a log line.
    publisher_options: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

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
            }
        )
        for name in ("backoff_base_seconds", "backoff_cap_seconds", "max_defer_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{env_name(name)} must not be negative")
        if self.chunk_size > self.batch_size:
            raise ConfigError(
                f"OUTBOX_CHUNK_SIZE ({self.chunk_size}) must not exceed "
                f"OUTBOX_BATCH_SIZE ({self.batch_size})"
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

    def _lease_too_short(self, worst: float) -> str:
        if self.chunk_size == 1:
            return (
                f"OUTBOX_PUBLISH_TIMEOUT_SECONDS ({self.publish_timeout_seconds:g}) must be "
                f"less than OUTBOX_LEASE_SECONDS ({self.lease_seconds:g}): a publish must "
                "finish inside the lease, or another worker re-claims the message while it "
                f"is sent; raise OUTBOX_LEASE_SECONDS above {worst:g}"
            )
        waves = self.waves
        fits = max(1, int((self.lease_seconds * 0.8) // self.publish_timeout_seconds))
        return (
            f"a delivery chunk may publish for {worst:g}s: ceil(OUTBOX_CHUNK_SIZE "
            f"{self.chunk_size} / OUTBOX_PUBLISH_CONCURRENCY {self.publish_concurrency}) = "
            f"{waves} waves x OUTBOX_PUBLISH_TIMEOUT_SECONDS {self.publish_timeout_seconds:g}, "
            f"which does not fit inside OUTBOX_LEASE_SECONDS ({self.lease_seconds:g}). "
            f"Raise OUTBOX_LEASE_SECONDS above {worst:g}, or OUTBOX_PUBLISH_CONCURRENCY to "
            f"{-(-self.chunk_size // fits)}, or lower OUTBOX_CHUNK_SIZE to "
            f"{fits * self.publish_concurrency}"
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
