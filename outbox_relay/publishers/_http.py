"""The HTTP details of the webhook publisher, as pure functions.

Header-safe values, Standard Webhooks secrets and signatures, ``Retry-After``
and the excerpt of an error body that ``last_error`` quotes. Kept apart from
``webhook.py`` (the request and its outcome) so each reads on its own, and so
a receiver's tests can sign with the same ``sign``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import urllib.parse
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime

from ..errors import ConfigError

__all__ = [
    "EXCERPT_CHARS",
    "TOKEN",
    "decode_secret",
    "excerpt",
    "header_value",
    "parse_retry_after",
    "sign",
]

# A receiver's error body is only quoted in last_error; keep little of it.
EXCERPT_CHARS = 300
# A header name (RFC 9110 token).
TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_PRINTABLE = re.compile(r"^[\x20-\x7e]*$")
# Everything printable in ASCII except "%" stays as is when a value must be
# percent-encoded, so mostly-ASCII values stay readable.
_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
_SECRET_PREFIX = "whsec_"  # noqa: S105 - the format marker, not a secret


def header_value(value: str) -> str:
    """A header-safe rendering: printable ASCII as is, anything else percent-encoded.

    Aggregate ids and operation keys are user data; a newline in one must
    never reach the wire (header injection), and non-ASCII is not portable.
    The result is deterministic, so the idempotency key stays stable.
    """
    return value if _PRINTABLE.fullmatch(value) else urllib.parse.quote(value, safe=_SAFE)


def decode_secret(secret: str | bytes) -> bytes:
    """The HMAC key from ``whsec_<base64>`` (or bare base64, or raw bytes)."""
    if isinstance(secret, bytes):
        key = secret
    else:
        text = secret.strip()
        if text.startswith(_SECRET_PREFIX):
            text = text[len(_SECRET_PREFIX) :]
        try:
            # The reference library accepts unpadded base64; so do we.
            key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(
                "the webhook secret (webhook_secret) must be 'whsec_' followed by base64"
            ) from None
    if not key:
        raise ConfigError(
            "the webhook secret (webhook_secret, OUTBOX_WEBHOOK_SECRET) must not be empty: "
            "'whsec_' followed by base64 of random bytes, shared with the receiver"
        )
    return key


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: ``v1,<base64 HMAC-SHA256 of id.timestamp.body>``."""
    to_sign = msg_id.encode() + b"." + str(timestamp).encode() + b"." + body
    digest = hmac.new(key, to_sign, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def parse_retry_after(
    value: str | None, *, now: datetime | None = None, cap: float | None = None
) -> timedelta | None:
    """``Retry-After`` as a delay: delta-seconds or an HTTP date; None when absent or invalid."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    seconds: float
    if text.isdigit():
        seconds = float(int(text))
    else:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # HTTP dates are GMT
            when = when.replace(tzinfo=timezone.utc)
        seconds = (when - (now or datetime.now(timezone.utc))).total_seconds()
    seconds = max(0.0, seconds)
    if cap is not None:
        seconds = min(seconds, cap)
    return timedelta(seconds=seconds)


def excerpt(raw: bytes) -> str:
    text = " ".join(raw.decode("utf-8", errors="replace").split())
    if len(text) > EXCERPT_CHARS:
        text = text[: EXCERPT_CHARS - 3] + "..."
    return text
