"""Deliver messages as HTTP POSTs (webhooks), signed per Standard Webhooks.

The body is the message payload as JSON, or with ``envelope=True`` the
Standard Webhooks envelope ``{"type", "timestamp", "data"}``. Metadata and
the signature travel in headers, so a receiver that only wants the payload
reads the body as is.

How a response becomes a delivery outcome:

======================================  =================================
2xx                                     done
408, 425, 429, 5xx                      ``RetryableError`` (``Retry-After`` honoured)
timeouts, refused/reset/dropped conns   ``RetryableError``
3xx                                     ``PermanentError`` (redirects are not followed)
any other 4xx                           ``PermanentError`` with an excerpt of the body
======================================  =================================
"""

from __future__ import annotations

import base64
import ipaddress
import json
import logging
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

import httpx

from .._parse import as_bool, as_mapping, as_names, bool_or_same
from .._redact import MASK, redact_url, scrub
from ..config import PUBLISHER_OPTIONS
from ..errors import ConfigError, PermanentError, RetryableError
from ..model import Message
from ._http import TOKEN, decode_secret, excerpt, header_value, parse_retry_after, sign
from ._options import constructor_kwargs, split_budget
from ._process import IdlePool, PerProcess

__all__ = [
    "DEFAULT_FORWARD_HEADERS",
    "NEVER_FORWARDED",
    "WebhookPublisher",
    "parse_retry_after",
    "sign",
]

log = logging.getLogger("outbox_relay.publishers.webhook")

# A receiver's error body is only quoted in last_error; read little of it.
_EXCERPT_BYTES = 4096
# A 2xx body is read (and discarded) so the connection can be reused; a
# longer one is cut off and the connection closed instead.
_DRAIN_BYTES = 64 * 1024
_RETRYABLE_4XX = frozenset({408, 425, 429})
# Which of a message's own ``headers`` (from enqueue) are sent: trace
# context by default. Producers are application code; what they put in a row
# must not become the relay's credentials or override its metadata, so only
# names an operator lists travel (webhook_forward_headers).
DEFAULT_FORWARD_HEADERS = ("traceparent", "tracestate", "baggage")
# Headers that frame the request: the HTTP client sets them. A configured
# Transfer-Encoding beside httpx's Content-Length is the shape of request
# smuggling; a Host sends the request to another virtual host.
_FRAMING_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "content-encoding",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
    }
)
# What the relay sets for every message (names ending in "-" are prefixes):
# neither a producer nor webhook_headers may replace it.
_RELAY_HEADERS = ("content-type", "user-agent", "idempotency-key", "outbox-", "webhook-")
# Never taken from a message, even when listed: credentials, the framing
# headers and the relay's own metadata and signature.
NEVER_FORWARDED = frozenset(
    {"authorization", "proxy-", "cookie", "set-cookie", *_FRAMING_HEADERS, *_RELAY_HEADERS}
)
# Configured header names (webhook_headers) that carry credentials, for the
# plain-HTTP warning.
_CREDENTIAL_WORDS = ("auth", "cookie", "token", "secret", "key", "password", "session", "signature")
_FORWARD_OPTION = "OUTBOX_WEBHOOK_FORWARD_HEADERS (webhook_forward_headers)"


def _listed(name: str, entries: Iterable[str]) -> bool:
    """Whether header ``name`` is one of ``entries`` (those ending in "-": a prefix)."""
    lower = name.lower()
    return any(lower.startswith(e) if e.endswith("-") else lower == e for e in entries)


def _never_forwarded(name: str) -> bool:
    return _listed(name, NEVER_FORWARDED)


def _forward_set(value: str | Iterable[str] | None) -> frozenset[str]:
    """The allowlist, lower-cased; a ConfigError naming the setting for a bad entry."""
    if value is None:
        return frozenset(DEFAULT_FORWARD_HEADERS)
    if not isinstance(value, str) and not isinstance(value, (list, tuple, set, frozenset)):
        raise ConfigError(f"{_FORWARD_OPTION} must be a comma-separated list of header names")
    names = as_names(_FORWARD_OPTION, value)
    invalid = [n for n in names if not TOKEN.fullmatch(n)]
    if invalid:
        raise ConfigError(f"{_FORWARD_OPTION}: invalid header name(s): {', '.join(invalid)}")
    refused = [n for n in names if _never_forwarded(n)]
    if refused:
        raise ConfigError(
            f"{_FORWARD_OPTION} lists {', '.join(refused)}, which a message may never set: "
            "credentials (Authorization, Cookie, Proxy-*), the request's framing (Host, "
            "Content-Length, ...) and the relay's own Outbox-*, Idempotency-Key and webhook-* "
            "headers. Configure fixed credentials with OUTBOX_WEBHOOK_HEADERS instead."
        )
    return frozenset(n.lower() for n in names)


def _is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost: traffic that never leaves the machine."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _verification_off(verify: bool | ssl.SSLContext) -> bool:
    if isinstance(verify, ssl.SSLContext):
        return verify.verify_mode == ssl.CERT_NONE or not verify.check_hostname
    return verify is False


class _RedactUrls(logging.Filter):
    """Rewrites httpx's and httpcore's log records so no webhook URL's
    password or query token reaches a log.

    httpx logs every request at INFO ("HTTP Request: POST <url> ..."), query
    string included; the publisher sends credentials from the URL's user info
    as an Authorization header instead, so the URL it logs has none, but a
    receiver's ``?token=`` stays in the URL. Only the URLs of webhook
    publishers are rewritten (to their ``redact_url`` form): the
    application's own httpx logging is left as it is.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._forms: dict[str, str] = {}
        # (form, redacted) pairs, longest form first so that a URL extending
        # another is replaced whole. Replaced, never mutated: log records are
        # filtered in any thread while publishers may be built in another.
        self._pairs: tuple[tuple[str, str], ...] = ()

    def register(self, forms: Iterable[str]) -> None:
        """Rewrite each of ``forms`` (spellings of one URL) to its ``redact_url``.

        A form with nothing to hide is left out: rewriting it (``https://host/``
        to ``https://host``) would mangle every longer URL that starts with it.
        """
        with self._lock:
            for form in forms:
                safe = redact_url(form)
                if safe != form:
                    self._forms[form] = safe
            ordered = sorted(self._forms.items(), key=lambda pair: len(pair[0]), reverse=True)
            self._pairs = tuple(ordered)

    def redact(self, text: str) -> str:
        for form, safe in self._pairs:
            if form in text:
                text = text.replace(form, safe)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._pairs:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is logging's problem, not ours
            return True
        redacted = self.redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


_REDACT = _RedactUrls()
# Filters on a logger apply only to records created by that very logger (not
# to its children's), so each logger that may quote a URL gets it.
_HTTP_LOGGERS = (
    "httpx",
    "httpcore",
    "httpcore.connection",
    "httpcore.http11",
    "httpcore.http2",
    "httpcore.proxy",
    "httpcore.socks",
)
_installed = False
_install_lock = threading.Lock()


def _install_redaction() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        for name in _HTTP_LOGGERS:
            logging.getLogger(name).addFilter(_REDACT)
        _installed = True


def _user_agent() -> str:
    try:
        version = metadata.version("outbox-relay")
    except metadata.PackageNotFoundError:  # running from a source tree
        version = "dev"
    return f"outbox-relay/{version}"


def _iso(moment: datetime) -> str:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


class WebhookPublisher:
    """POST each message to ``url``; one HTTP connection pool per process.

    ``timeout_seconds`` is the worst case of one publish (connect + write +
    read), which the relay checks against the lease at start-up. The read
    timeout bounds each wait for bytes (httpx has no overall deadline), so a
    server that trickles its response headers byte by byte is bounded per
    read only; the body is read only up to a small limit and only while a
    whole read timeout fits before the deadline.
    """

    def __init__(
        self,
        url: str,
        *,
        secret: str | bytes | None = None,
        envelope: bool = False,
        connect_timeout: float = 2.0,
        read_timeout: float = 6.0,
        write_timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
        verify: bool | str | ssl.SSLContext = True,
        max_retry_after: float = 86_400.0,
        trust_env: bool = True,
        forward_headers: str | Iterable[str] | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"webhook URL {redact_url(url)!r} must be an http(s) URL with a host")
        for name, value in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout)):
            if not value > 0:
                raise ConfigError(f"webhook {name} must be greater than 0, got {value!r}")
        if write_timeout is not None and not write_timeout > 0:
            raise ConfigError(
                f"webhook write_timeout must be greater than 0, got {write_timeout!r}"
            )
        self.url = url
        self.envelope = envelope
        self.connect_timeout = float(connect_timeout)
        self.read_timeout = float(read_timeout)
        # Writing a small JSON body only blocks when the peer stopped reading,
        # which is as much a sign of a dead peer as a slow connect.
        self.write_timeout = float(write_timeout if write_timeout is not None else connect_timeout)
        self.max_retry_after = float(max_retry_after)
        self._key = decode_secret(secret) if secret is not None else None
        self._static_headers = {str(k): header_value(str(v)) for k, v in (headers or {}).items()}
        bad = [k for k in self._static_headers if not TOKEN.fullmatch(k)]
        if bad:
            raise ConfigError(f"invalid webhook header name(s): {', '.join(sorted(bad))}")
        _check_static_headers(self._static_headers)
        padded = sorted(k for k, v in self._static_headers.items() if v != v.strip())
        if padded:
            # HTTP forbids it, and the HTTP client's refusal quoted the value
            # (a credential) into last_error and its DEBUG log, for every message.
            raise ConfigError(
                f"webhook_headers {', '.join(padded)}: the value begins or ends with "
                "whitespace, which HTTP does not allow (a space copied with a token?)"
            )
        self.forward_headers = _forward_set(forward_headers)
        if isinstance(verify, str):
            verify = ssl.create_default_context(cafile=verify)
        self._verify: bool | ssl.SSLContext = verify
        self._trust_env = trust_env
        self._where = redact_url(url)
        # Credentials in the URL's user info travel as an Authorization
        # header (as httpx would send them anyway), and the URL handed to
        # httpx has none: httpx logs that URL with every request.
        target = httpx.URL(url)
        self._auth: httpx.Auth | None = None
        secrets = _credentials(self._static_headers.values(), secret, parts)
        if target.username or target.password:
            # Basic auth wins over an Authorization of webhook_headers, which
            # applies to every route of a table: this route's URL chose.
            self._auth = httpx.BasicAuth(target.username, target.password)
            # What the request carries: "Basic base64(user:password)".
            pair = f"{target.username}:{target.password}".encode()
            secrets |= _credentials([f"Basic {base64.b64encode(pair).decode()}"], None, None)
            target = target.copy_with(username=None, password=None)
        if trust_env:
            # httpx sends a proxy's credentials (HTTP_PROXY=http://u:pw@proxy)
            # as Proxy-Authorization, which a proxy's error page may echo.
            secrets |= _proxy_credentials()
        # A receiver may quote what it was sent percent-encoded (a URL of the
        # request, a form field): those spellings are masked too.
        secrets |= {quoted for value in secrets for quoted in _encoded(value)}
        self._target = target
        # Never quoted back into last_error from a response that echoes the
        # request (a receiver's 400 may repeat its headers): longest first.
        self._secrets = sorted(secrets, key=len, reverse=True)
        _REDACT.register({url, str(target)})
        _install_redaction()
        self._user_agent = _user_agent()
        # One client (one keep-alive connection) per publishing thread at a
        # time: a client shared by every thread scans its whole pool under one
        # lock per request, which halved the rate (docs/benchmarks-changes.md item 28).
        self._clients: PerProcess[IdlePool[httpx.Client]] = PerProcess(
            lambda: IdlePool(httpx.Client.close)
        )
        self._tls_context = PerProcess(self._tls)
        self._warn_if_insecure(parts)

    def _warn_if_insecure(self, parts: urllib.parse.SplitResult) -> None:
        """Say so at start when this configuration exposes what it sends.

        Loopback is exempt: plain HTTP to 127.0.0.1 (tests, a local sidecar)
        never leaves the machine.
        """
        if parts.scheme == "https" and _verification_off(self._verify):
            log.warning(
                "webhook %s: TLS certificate verification is off (webhook_verify): anyone "
                "who can intercept the connection can read and change every message; "
                "trust a private CA with webhook_verify=/path/to/ca.pem instead",
                self._where,
            )
        if parts.scheme != "http" or _is_loopback(parts.hostname or ""):
            return
        exposed = []
        if parts.password:
            exposed.append("the password in the URL")
        if parts.query:
            exposed.append("the URL's query string")
        credentials = sorted(
            name
            for name in self._static_headers
            if any(word in name.lower() for word in _CREDENTIAL_WORDS)
        )
        if credentials:
            exposed.append(f"the configured header(s) {', '.join(credentials)} (webhook_headers)")
        if self._key is not None:
            exposed.append("signed requests (webhook_secret), which anyone on the path can replay")
        if exposed:
            log.warning(
                "webhook %s: sending %s over plain http:// to a host that is not loopback; "
                "anyone on the network path can read them. Use an https:// URL",
                self._where,
                "; ".join(exposed),
            )

    # ------------------------------------------------------------- settings
    @property
    def timeout_seconds(self) -> float:
        """The longest one publish can take (connect + write + read)."""
        return self.connect_timeout + self.write_timeout + self.read_timeout

    @property
    def signed(self) -> bool:
        return self._key is not None

    def __repr__(self) -> str:
        # Never the secret, nor credentials or a token in the URL's query.
        return (
            f"WebhookPublisher({self._where!r}, signed={self.signed}, envelope={self.envelope}, "
            f"timeout_seconds={self.timeout_seconds:g})"
        )

    @classmethod
    def from_options(
        cls, url: str, options: Mapping[str, Any], overrides: Mapping[str, Any] | None = None
    ) -> WebhookPublisher:
        """Build from the relay's option bag (see docs/publishers.md for the names).

        Timeouts not given explicitly are carved out of
        ``publish_timeout_seconds`` so that a whole publish fits in it.
        """
        names = PUBLISHER_OPTIONS["webhook"]
        kwargs = constructor_kwargs(
            options, overrides, names, split_budget(options, last="read_timeout")
        )
        if "envelope" in kwargs:
            kwargs["envelope"] = as_bool("webhook_envelope", kwargs["envelope"])
        if "verify" in kwargs:
            # A CA bundle path or an SSLContext is a valid value too.
            kwargs["verify"] = bool_or_same(kwargs["verify"])
        if "headers" in kwargs and kwargs["headers"] is not None:
            kwargs["headers"] = as_mapping("webhook_headers", kwargs["headers"])
        publisher = cls(url, **kwargs)
        budget = options.get("publish_timeout_seconds")
        if budget is not None and publisher.timeout_seconds > float(budget) + 1e-9:
            raise ConfigError(
                f"webhook timeouts for {publisher._where} add up to "
                f"{publisher.timeout_seconds:g}s (connect {publisher.connect_timeout:g} + write "
                f"{publisher.write_timeout:g} + read {publisher.read_timeout:g}), more than "
                f"OUTBOX_PUBLISH_TIMEOUT_SECONDS ({float(budget):g})"
            )
        return publisher

    # --------------------------------------------------------------- client
    def _tls(self) -> ssl.SSLContext:
        """This process's TLS context, shared by its clients: building one
        (loading the CA bundle) takes about 20 ms, reusing it nothing."""
        if isinstance(self._verify, ssl.SSLContext):
            return self._verify
        return httpx.create_ssl_context(verify=self._verify, trust_env=self._trust_env)

    def _build_client(self, tls: ssl.SSLContext) -> httpx.Client:
        return httpx.Client(
            timeout=httpx.Timeout(
                connect=self.connect_timeout,
                read=self.read_timeout,
                write=self.write_timeout,
                # No connection cap, so no wait for a free connection either.
                pool=None,
            ),
            # One thread's client: it sends one request at a time.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1),
            verify=tls,
            auth=self._auth,
            follow_redirects=False,
            trust_env=self._trust_env,
        )

    def close(self) -> None:
        """Close this process's idle clients (new ones are built on next use)."""
        clients = self._clients.reset()
        if clients is not None:
            clients.close()

    # -------------------------------------------------------------- request
    def body(self, message: Message) -> bytes:
        """The exact bytes POSTed (and signed) for ``message``."""
        document: Any = message.payload
        if self.envelope:
            # The envelope's timestamp is when the event was recorded, so the
            # body (and the receiver's view of it) is the same on every retry.
            occurred = message.created_at or datetime.now(timezone.utc)
            document = {"type": message.event_type, "timestamp": _iso(occurred), "data": document}
        return json.dumps(
            document, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")

    def headers(self, message: Message, body: bytes, *, now: float | None = None) -> dict[str, str]:
        """Every header of the request for ``message`` (signature included when configured)."""
        headers: dict[str, str] = {}
        for name, value in (message.headers or {}).items():
            # Only allowlisted names (which never include credentials or
            # framing headers, see _forward_set).
            if (
                isinstance(value, (str, int, float, bool))
                and isinstance(name, str)
                and name.lower() in self.forward_headers
                and TOKEN.fullmatch(name)
            ):
                headers[name] = header_value(str(value))
        headers.update(self._static_headers)
        key = header_value(message.idempotency_key)
        headers.update(
            {
                "Content-Type": "application/json",
                "User-Agent": self._user_agent,
                "Idempotency-Key": key,
                "Outbox-Message-Id": str(message.id),
                "Outbox-Event-Type": header_value(message.event_type),
                "Outbox-Aggregate-Type": header_value(message.aggregate_type),
                "Outbox-Aggregate-Id": header_value(message.aggregate_id),
                "Outbox-Attempt": str(message.attempts),
            }
        )
        if self._key is not None:
            # Signed at send time: receivers reject timestamps older than a few
            # minutes, so a retry must not reuse the first attempt's signature.
            timestamp = int(now if now is not None else time.time())
            headers["webhook-id"] = key
            headers["webhook-timestamp"] = str(timestamp)
            headers["webhook-signature"] = sign(self._key, key, timestamp, body)
        return headers

    def __call__(self, message: Message) -> None:
        body = self.body(message)
        headers = self.headers(message, body)
        deadline = time.monotonic() + self.timeout_seconds
        clients = self._clients.get()
        client = clients.take() or self._build_client(self._tls_context.get())
        try:
            with client.stream("POST", self._target, content=body, headers=headers) as response:
                status = response.status_code
                if 200 <= status < 300:
                    self._read(response, _DRAIN_BYTES, deadline)
                    return
                raw = self._read(response, _EXCERPT_BYTES, deadline)
                retry_after = response.headers.get("Retry-After")
                location = response.headers.get("Location")
        except httpx.TimeoutException as exc:
            raise RetryableError(
                f"webhook {self._where}: {type(exc).__name__} (connect "
                f"{self.connect_timeout:g}s, write {self.write_timeout:g}s, read "
                f"{self.read_timeout:g}s)"
            ) from exc
        except (httpx.LocalProtocolError, httpx.UnsupportedProtocol) as exc:
            # The request itself cannot be sent; sending it again will not help.
            raise PermanentError(f"webhook {self._where}: {self._error(exc)}") from exc
        except httpx.RemoteProtocolError as exc:
            raise RetryableError(
                f"webhook {self._where}: the server closed the connection without a valid "
                f"response ({self._scrub(str(exc))})"
            ) from exc
        except httpx.HTTPError as exc:  # connect refused/reset, TLS, proxy ...
            raise RetryableError(f"webhook {self._where}: {self._error(exc)}") from exc
        finally:
            # httpx drops a broken connection itself: the client stays usable.
            clients.give_back(client)
        self._raise_for(status, raw, retry_after, location)

    def _error(self, exc: BaseException) -> str:
        # The text ends up in last_error: an exception that quotes the URL
        # it was given must not carry the URL's password or token there.
        return f"{type(exc).__name__}: {self._scrub(str(exc))}"

    def _scrub(self, text: str) -> str:
        text = scrub(_REDACT.redact(text), self.url)
        # An HTTP library's message may quote a header it refused.
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return text

    def _without_secrets(self, raw: bytes, *, cut: bool = False) -> bytes:
        """A response body with this publisher's own credentials masked, before
        any of it is quoted (a body cut short could keep part of one).

        ``cut``: the body was read only up to a limit, which may fall inside
        a credential: a tail that begins one is masked as well (the excerpt
        collapses whitespace, so a long blank stretch can bring that tail
        into the quoted part)."""
        if not self._secrets:
            return raw
        text = raw.decode("utf-8", errors="replace")
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        if cut:
            # A multi-byte character cut in two decodes as U+FFFD.
            text = text.rstrip("\ufffd")
            heads = [
                n
                for secret in self._secrets
                for n in range(1, len(secret))
                if text.endswith(secret[:n])
            ]
            if heads:
                text = text[: -max(heads)] + MASK
        return text.encode("utf-8")

    def _read(self, response: httpx.Response, limit: int, deadline: float) -> bytes:
        """Up to ``limit`` bytes of the body, without overrunning the deadline.

        Each read may wait up to the read timeout, so a read starts only while
        that much time is left; otherwise the connection is closed unread.
        """
        chunks: list[bytes] = []
        size = 0
        stream = response.iter_bytes()
        try:
            while size < limit and deadline - time.monotonic() >= self.read_timeout:
                chunk = next(stream, None)
                if chunk is None:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except (httpx.TransportError, httpx.StreamError, httpx.DecodingError):
            # The status line already decided the outcome; a body cut short
            # only shortens the excerpt.
            pass
        return b"".join(chunks)[:limit]

    def _raise_for(
        self, status: int, raw: bytes, retry_after: str | None, location: str | None
    ) -> None:
        quoted = excerpt(self._without_secrets(raw, cut=len(raw) >= _EXCERPT_BYTES))
        detail = f"webhook {self._where}: HTTP {status}" + (f": {quoted}" if quoted else "")
        if status in _RETRYABLE_4XX or 500 <= status < 600:
            delay = parse_retry_after(retry_after, cap=self.max_retry_after)
            raise RetryableError(detail, retry_after=delay)
        if 300 <= status < 400:
            target = f" to {redact_url(location)}" if location else ""
            raise PermanentError(
                f"webhook {self._where}: HTTP {status} redirect{target}; redirects are not "
                "followed, configure the final URL"
            )
        if 400 <= status < 500:
            raise PermanentError(detail)
        raise RetryableError(f"{detail} (unexpected status)")


def _check_static_headers(headers: Mapping[str, str]) -> None:
    framing = sorted(k for k in headers if _listed(k, _FRAMING_HEADERS))
    if framing:
        raise ConfigError(
            f"webhook_headers may not set {', '.join(framing)}: those frame the request, which "
            "the HTTP client does itself"
        )
    owned = sorted(k for k in headers if _listed(k, _RELAY_HEADERS))
    if owned:
        raise ConfigError(
            f"webhook_headers may not set {', '.join(owned)}: the relay sets it for every "
            "message (content type, idempotency key, outbox metadata, signature)"
        )


# Shorter pieces would mask ordinary words of a response.
_SHORTEST_SECRET = 4


def _encoded(value: str) -> set[str]:
    """``value`` percent-encoded, as a receiver may quote it, where that differs."""
    forms = {urllib.parse.quote(value, safe=""), urllib.parse.quote_plus(value, safe="")}
    return forms - {value}


def _proxy_credentials() -> set[str]:
    """The credentials of the proxies the environment names (``HTTPS_PROXY``
    ...), as the URL holds them and as the Proxy-Authorization header sends
    them."""
    found: list[str] = []
    for proxy in urllib.request.getproxies().values():
        try:
            url = httpx.URL(proxy if "://" in proxy else f"http://{proxy}")
        except (httpx.InvalidURL, TypeError, ValueError):
            continue
        if url.password:
            pair = f"{url.username}:{url.password}".encode()
            found += [url.password, base64.b64encode(pair).decode()]
    return {v for v in found if len(v) >= _SHORTEST_SECRET}


def _credentials(
    values: Iterable[str], secret: str | bytes | None, url: urllib.parse.SplitResult | None
) -> set[str]:
    """What this publisher sends that is a credential: configured header
    values (and the token after "Bearer", "Basic" ...), the signing secret,
    the URL's password and query values."""
    found: set[str] = set()
    for value in values:
        found.add(value)
        scheme, _, token = value.partition(" ")
        if token and scheme.isalpha():
            found.add(token.strip())
    if isinstance(secret, str):
        found |= {secret.strip(), secret.strip().removeprefix("whsec_")}
    if url is not None:
        if url.password:
            found.add(urllib.parse.unquote(url.password))
        found |= {v for _, v in urllib.parse.parse_qsl(url.query)}
        # As written too: a receiver echoing the request's path quotes a
        # token such as "?sig=ab%2Bc%3D" or "?t=a+b" undecoded.
        found |= {p.partition("=")[2] for p in url.query.split("&")}
    return {v for v in found if len(v) >= _SHORTEST_SECRET}
