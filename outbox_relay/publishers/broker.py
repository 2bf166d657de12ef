"""Deliver messages to a message broker (RabbitMQ or Redis) with kombu.

A publish counts only when the broker took the message:

* on RabbitMQ the channel runs in publisher-confirm mode, so ``publish``
  returns only after the broker's ``basic.ack`` (a ``basic.nack`` or no
  answer within ``confirm_timeout`` raises), and messages are persistent
  (``delivery_mode=2``) on a durable exchange;
* ``mandatory`` makes RabbitMQ hand back a message that no queue is bound
  for (``basic.return``), instead of dropping it silently. What happens then
  is the ``unroutable`` policy: ``"retry"`` (default: a binding may appear,
  e.g. the consumer is not deployed yet; the message ends ``dead`` with the
  reason once attempts run out), ``"dead"`` (at once), or ``"drop"``
  (publish without ``mandatory``: events nobody subscribes to are fine).
  On Redis, kombu has no ``mandatory`` flag, so the bindings are looked up
  before publishing to the same effect.
* a missing exchange (``declare=False``), a closed channel, a refused
  connection, a timeout: ``RetryableError``, never done.
"""

from __future__ import annotations

import json
import logging
import select
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from ssl import CERT_NONE, CERT_REQUIRED
from typing import Any, Literal

import kombu.common
import kombu.connection
import kombu.entity
import kombu.exceptions
import kombu.messaging
from amqp.exceptions import MessageNacked, PreconditionFailed  # type: ignore[import-untyped]
from kombu.transport import virtual
from kombu.utils.url import parse_url

from .._parse import as_bool, as_mapping
from .._redact import redact_url, scrub
from ..config import PUBLISHER_OPTIONS
from ..errors import ConfigError, PermanentError, RetryableError
from ..model import Message
from ._options import as_callable_or, constructor_kwargs, split_budget
from ._process import IdlePool, PerProcess

__all__ = ["BROKER_SCHEMES", "BrokerPublisher"]

log = logging.getLogger("outbox_relay.publishers.broker")

BROKER_SCHEMES = ("amqp", "amqps", "redis", "rediss", "redis+socket")
_AMQP_SCHEMES = ("amqp", "amqps")
# AMQP short strings (routing keys, exchange names) are at most 255 bytes.
_MAX_SHORTSTR = 255

# kombu's annotations are partial; its objects are handled as Any here
# rather than sprinkling ignores over every call.
_Connection: Any = kombu.connection.Connection
_Exchange: Any = kombu.entity.Exchange
_Producer: Any = kombu.messaging.Producer
_maybe_declare: Any = kombu.common.maybe_declare

RoutingKey = Literal["event_type", "aggregate"] | Callable[[Message], str]
Unroutable = Literal["retry", "dead", "drop"]


@dataclass
class _Link:
    """One connection, its channel and producer; used by one thread at a time."""

    connection: Any  # kombu.Connection
    producer: Any  # kombu.Producer
    returned: list[str] = field(default_factory=list)

    def quiet(self) -> bool:
        """Whether this idle AMQP link's socket has nothing to read.

        An idle publisher connection receives nothing (no heartbeats, every
        confirm consumed): bytes or EOF mean the broker closed it (a restart
        sends connection.close, then FIN). A publish on it would fail and
        spend its message's attempt.
        """
        connection = self.connection
        if not connection.connected:  # known closed (and .connection would reconnect)
            return False
        try:
            sock = connection.connection.transport.sock
            readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError, AttributeError):  # closed, or no socket at all
            return False
        return not readable

    def close(self) -> None:
        try:
            self.connection.release()
        except Exception:  # the connection is already broken; nothing to save
            log.debug("error while closing a broker connection", exc_info=True)


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def _tls_options(scheme: str, url: str, given: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """kombu's ``ssl`` argument: TLS that verifies the certificate and the host name.

    kombu's own defaults do not: ``rediss://`` without options connects with
    ``ssl_cert_reqs=CERT_NONE`` (any certificate), and ``amqps://`` checks the
    chain but not the host name (py-amqp only checks it when given a
    ``server_hostname``; kombu fills in the URL's host when the key is there
    and None). Options given (``kombu_ssl``, or ``ssl_*`` in a rediss URL's
    query, which kombu reads itself) win over these defaults.
    """
    if scheme in ("redis", "rediss", "redis+socket"):
        if scheme != "rediss" and not given:
            return None
        if "ssl" in parse_url(url):  # ?ssl_cert_reqs=... in the URL: kombu applies it
            return None
        # ssl_check_hostname explicitly: redis-py before 6 defaulted it to False.
        return {"ssl_cert_reqs": CERT_REQUIRED, "ssl_check_hostname": True, **(given or {})}
    if scheme != "amqps" and not given:
        return None
    return {"cert_reqs": CERT_REQUIRED, "server_hostname": None, **(given or {})}


def _unverified(options: Mapping[str, Any]) -> str | None:
    """Why these TLS options do not verify the broker, or None."""
    for key in ("cert_reqs", "ssl_cert_reqs"):
        value = options.get(key)
        text = value.lower() if isinstance(value, str) else None
        if value == CERT_NONE or text in ("none", "cert_none"):
            return f"{key}=CERT_NONE"
    for key in ("check_hostname", "ssl_check_hostname"):
        if options.get(key) is False:
            return f"{key}=False"
    return None


class BrokerPublisher:
    """Publish each message's payload as JSON to an exchange.

    The idempotency key is the AMQP ``message_id``; ``outbox-*`` headers
    carry the row id, event type and aggregate. ``timeout_seconds`` (connect +
    write + confirm) is the worst case of one publish.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "outbox",
        exchange_type: str = "topic",
        routing_key: RoutingKey = "event_type",
        declare: bool = True,
        durable: bool = True,
        unroutable: Unroutable = "retry",
        connect_timeout: float = 2.0,
        write_timeout: float | None = None,
        confirm_timeout: float = 6.0,
        transport_options: Mapping[str, Any] | None = None,
        ssl: Mapping[str, Any] | None = None,
    ) -> None:
        scheme = _scheme(url)
        if scheme not in BROKER_SCHEMES:
            raise ConfigError(
                f"broker URL must start with one of {', '.join(s + '://' for s in BROKER_SCHEMES)}"
            )
        if routing_key not in ("event_type", "aggregate") and not callable(routing_key):
            raise ConfigError(
                f"broker routing_key must be 'event_type', 'aggregate' or a callable, "
                f"not {routing_key!r}"
            )
        if unroutable not in ("retry", "dead", "drop"):
            raise ConfigError(f"broker unroutable must be retry, dead or drop, not {unroutable!r}")
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("confirm_timeout", confirm_timeout),
        ):
            if not value > 0:
                raise ConfigError(f"broker {name} must be greater than 0, got {value!r}")
        if len(exchange.encode()) > _MAX_SHORTSTR:
            raise ConfigError("broker exchange name is longer than 255 bytes")
        self.url = url
        self.is_amqp = scheme in _AMQP_SCHEMES
        self.exchange = _Exchange(exchange, type=exchange_type, durable=durable, delivery_mode=2)
        self.routing_key = routing_key
        self.declare = declare and bool(exchange)  # the default exchange "" always exists
        self.unroutable: Unroutable = unroutable
        self.connect_timeout = float(connect_timeout)
        self.write_timeout = float(write_timeout if write_timeout is not None else connect_timeout)
        self.confirm_timeout = float(confirm_timeout)
        self._transport_options = dict(transport_options or {})
        self._ssl = _tls_options(scheme, url, ssl)
        # Never connected: the error classes, and the TLS options kombu will
        # really use (a rediss URL's own ssl_* parameters win over ours).
        template = _Connection(url, ssl=self._ssl if self._ssl is not None else False)
        self._where = redact_url(url)
        effective = template.ssl
        weak = _unverified(effective) if isinstance(effective, Mapping) else None
        if weak is not None:
            log.warning(
                "broker %s: TLS certificate verification is off (%s): anyone who can "
                "intercept the connection can read and change every message; trust a "
                "private CA with its path (ca_certs for amqps, ssl_ca_certs for rediss) instead",
                self._where,
                weak,
            )
        # The transport's own error classes (py-amqp's, redis-py's ...).
        self._errors: tuple[type[BaseException], ...] = tuple(
            template.connection_errors + template.channel_errors
        )
        # kombu channels are not thread-safe: one link per publishing thread.
        self._links = PerProcess(
            lambda: IdlePool(_Link.close, usable=_Link.quiet if self.is_amqp else None)
        )

    @property
    def timeout_seconds(self) -> float:
        """The longest one publish can take (connect + write + confirm)."""
        return self.connect_timeout + self.write_timeout + self.confirm_timeout

    def __repr__(self) -> str:
        return (
            f"BrokerPublisher({self._where!r}, exchange={self.exchange.name!r}, "
            f"unroutable={self.unroutable!r}, timeout_seconds={self.timeout_seconds:g})"
        )

    @classmethod
    def from_options(
        cls, url: str, options: Mapping[str, Any], overrides: Mapping[str, Any] | None = None
    ) -> BrokerPublisher:
        """Build from the relay's option bag; timeouts fit in ``publish_timeout_seconds``."""
        # kombu_*, not broker_*: OUTBOX_BROKER_* would read like Celery's own
        # broker settings, which configure the relay's broker, not this one.
        names = PUBLISHER_OPTIONS["kombu"]
        kwargs = constructor_kwargs(
            options, overrides, names, split_budget(options, last="confirm_timeout")
        )
        if "declare" in kwargs:
            kwargs["declare"] = as_bool("kombu_declare", kwargs["declare"])
        if "routing_key" in kwargs:
            kwargs["routing_key"] = as_callable_or(
                "kombu_routing_key", kwargs["routing_key"], ("event_type", "aggregate")
            )
        if kwargs.get("transport_options") is not None:
            kwargs["transport_options"] = as_mapping(
                "kombu_transport_options", kwargs["transport_options"]
            )
        if kwargs.get("ssl") is not None:
            kwargs["ssl"] = as_mapping("kombu_ssl", kwargs["ssl"])
        publisher = cls(url, **kwargs)
        budget = options.get("publish_timeout_seconds")
        if budget is not None and publisher.timeout_seconds > float(budget) + 1e-9:
            raise ConfigError(
                f"broker timeouts add up to {publisher.timeout_seconds:g}s (connect "
                f"{publisher.connect_timeout:g} + write {publisher.write_timeout:g} + confirm "
                f"{publisher.confirm_timeout:g}), more than OUTBOX_PUBLISH_TIMEOUT_SECONDS "
                f"({float(budget):g})"
            )
        return publisher

    # ------------------------------------------------------------ connection
    def _connect(self) -> _Link:
        options: dict[str, Any] = dict(self._transport_options)
        if self.is_amqp:
            # confirm_publish: basic_publish waits for the broker's ack.
            options.update(
                confirm_publish=True,
                read_timeout=self.confirm_timeout,
                write_timeout=self.write_timeout,
            )
        else:
            options.setdefault("socket_connect_timeout", self.connect_timeout)
            options.setdefault("socket_timeout", self.confirm_timeout)
        connection = _Connection(
            self.url,
            connect_timeout=self.connect_timeout,
            transport_options=options,
            # A copy: kombu writes the host name into it (server_hostname).
            ssl=dict(self._ssl) if self._ssl is not None else False,
            # No heartbeats: nothing here would service them between publishes,
            # and the broker would then close an idle connection.
            heartbeat=0,
        )
        returned: list[str] = []

        def on_return(exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
            returned.append(str(exc))

        try:
            # One attempt only: the relay's backoff is the retry loop; kombu's
            # own would sleep for seconds inside our publish timeout.
            connection.ensure_connection(max_retries=0, reraise_as_library_errors=False)
            channel = connection.channel()
            if self.exchange.name and (self.declare or not self.is_amqp):
                # Declared before the first publish (not lazily by it) so the
                # routing check below knows the type. On Redis an exchange is
                # only client-side state, so it is always "declared" there.
                _maybe_declare(self.exchange(channel), channel)
            producer = _Producer(
                channel,
                exchange=self.exchange,
                auto_declare=self.declare,
                # Only py-amqp channels deliver basic.return (virtual ones have no events).
                on_return=on_return if self.is_amqp else None,
            )
        except BaseException:
            connection.release()
            raise
        return _Link(connection, producer, returned)

    def close(self) -> None:
        """Close this process's idle connections."""
        links = self._links.peek()
        if links is not None:
            links.close()

    # ------------------------------------------------------------ publishing
    def routing_key_for(self, message: Message) -> str:
        if self.routing_key == "event_type":
            key = message.event_type
        elif self.routing_key == "aggregate":
            key = f"{message.aggregate_type}.{message.aggregate_id}"
        else:
            key = self.routing_key(message)
        if not isinstance(key, str) or len(key.encode()) > _MAX_SHORTSTR:
            raise PermanentError(
                f"routing key for outbox message {message.id} must be a string of at most "
                f"{_MAX_SHORTSTR} bytes"
            )
        return key

    def _hint(self, exc: BaseException) -> str:
        """What to do about an error an operator must fix, for last_error."""
        if isinstance(exc, PreconditionFailed) and "inequivalent arg 'type'" in str(exc):
            # Retried, not permanent: the message goes through once the old
            # exchange is deleted. Seen after an upgrade: older relays bound
            # their Celery queue to a direct exchange named "outbox".
            name = self.exchange.name
            return (
                f"; exchange {name!r} exists with another type: delete it "
                f"(rabbitmqadmin delete exchange name={name}) or set kombu_exchange "
                "to another name"
            )
        return ""

    def _unroutable(self, routing_key: str, reason: str) -> None:
        text = (
            f"broker {self._where}: unroutable: no queue bound to exchange "
            f"{self.exchange.name!r} for routing key {routing_key!r} ({reason})"
        )
        if self.unroutable == "dead":
            raise PermanentError(text)
        raise RetryableError(text)

    def _has_route(self, link: _Link, routing_key: str) -> bool:
        # Virtual transports (Redis) route in the client: ask the same lookup
        # kombu would use, which otherwise sends unroutable messages to its
        # catch-all "ae.undeliver" list with only a warning.
        if not isinstance(link.producer.channel, virtual.Channel) or not self.exchange.name:
            return True
        channel: Any = link.producer.channel
        table = channel.get_table(self.exchange.name)
        found = channel.typeof(self.exchange.name).lookup(
            table, self.exchange.name, routing_key, None
        )
        return bool(found)

    def __call__(self, message: Message) -> None:
        routing_key = self.routing_key_for(message)
        body = json.dumps(
            message.payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
        headers: dict[str, Any] = dict(message.headers or {})
        headers.update(
            {
                "idempotency-key": message.idempotency_key,
                "outbox-id": message.id,
                "outbox-event-type": message.event_type,
                "outbox-aggregate-type": message.aggregate_type,
                "outbox-aggregate-id": message.aggregate_id,
                "outbox-attempt": message.attempts,
            }
        )
        if message.created_at is not None:
            headers["outbox-created-at"] = message.created_at.isoformat()

        links = self._links.get()
        link = links.take()
        healthy = False
        try:
            if link is None:
                link = self._connect()
            link.returned.clear()
            if self.unroutable != "drop" and not self._has_route(link, routing_key):
                healthy = True
                self._unroutable(routing_key, "no binding matches")
            link.producer.publish(
                body,
                routing_key=routing_key,
                content_type="application/json",
                content_encoding="utf-8",
                headers=headers,
                message_id=message.idempotency_key,
                type=message.event_type,
                app_id="outbox-relay",
                delivery_mode=2,
                mandatory=self.unroutable != "drop",
                retry=False,
                timeout=self.write_timeout,
                confirm_timeout=self.confirm_timeout,
            )
            healthy = True
            # RabbitMQ sends basic.return before the ack that publish waited
            # for, so by now the on_return callback has run if it will.
            if link.returned:
                self._unroutable(routing_key, link.returned[0])
        except (RetryableError, PermanentError):
            raise
        except (kombu.exceptions.KombuError, MessageNacked, OSError, *self._errors) as exc:
            # kombu and py-amqp may quote the URL they were given: no password
            # may reach last_error through them.
            text = scrub(str(exc), self.url) + self._hint(exc)
            raise RetryableError(f"broker {self._where}: {type(exc).__name__}: {text}") from exc
        finally:
            if link is not None:
                if healthy:
                    links.give_back(link)
                else:
                    # After any error the channel's state is unknown (a closed
                    # channel, an ack still in flight): never reuse it.
                    link.close()
