"""Keeping passwords out of what outbox-relay prints, logs and stores.

Four kinds of text leave the process carrying values that may hold a
secret, and each has one rule here, so every place masks alike:

* a **DSN shown to a person** (the CLI, the demo, ``Settings`` reprs):
  ``mask_dsn`` replaces the password and keeps everything else, so the
  reader can still tell which database or broker it is;
* an **endpoint URL in a log line, a repr or ``last_error``** (the
  publishers): ``redact_url`` masks the password and drops the query and
  fragment, where webhook tokens and signed-URL signatures travel;
* an **error message** from a driver, which may echo what it was given:
  ``scrub`` removes a known DSN's password from it, and ``connect_error``
  withholds a connection error whose text cannot be cleaned reliably;
* a **setting's value kept in a Celery app's configuration**, which
  ``celery report``, ``celery inspect conf`` and Flower print: ``Secret``
  holds it and prints only its masked form.

Each masking function returns its input unchanged when there is nothing to
mask, so an address without a password (``redis+socket:///tmp/redis.sock``)
is never rewritten into something that no longer works when pasted back.

Credentials in a URL are read the widest way: they run from ``://`` to the
*last* ``@``. libpq stops at the first ``@`` or ``/``, urllib at the first
``/``, ``?`` or ``#``; a password with any of those characters left
unencoded would then be cut short and its tail printed as a host or a path.
Reading wider can only mask too much (an ``@`` in a query or path after a
port hides the host), never too little.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = [
    "MASK",
    "Secret",
    "connect_error",
    "invalid_url",
    "mask_dsn",
    "mask_spec",
    "password_is_unambiguous",
    "redact_url",
    "reveal",
    "scrub",
]

MASK = "****"
_UNPARSEABLE = "<DSN hidden: not parseable>"
# "scheme://" at the start: the URL form. Anything else is key=value (a
# key=value password may itself contain "://").
_URL_FORM = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.\-]*://")
_QUERY_START = re.compile(r"[?#]")
# libpq's parameters that hold a secret: the password, and sslpassword (the
# passphrase of the client certificate's key, sslkey).
_SECRET_PARAMS = ("password", "sslpassword")
# A password (or sslpassword) query parameter: its value runs to the next
# "&name=" (a raw "&" inside the password does not end it) or to the end, a
# "#" included.
_PASSWORD_PARAM = re.compile(
    r"(?<=[?&])((?:ssl)?password=)((?:[^&]|&(?![A-Za-z_][A-Za-z0-9_]*=))*)"
)
# A mistyped URL ("amqp//user:pw@host"): keep a leading "scheme:" or
# "scheme//", or the user of "user:pw@host"; what follows up to the last "@"
# may be a password.
_SPEC_PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*[:/]+")
# password=... in a key=value string libpq could not parse: quoted (to the
# closing quote, or the end) or bare.
_KV_PASSWORD = re.compile(r"password\s*=\s*(?:'((?:[^'\\]|\\.)*)'?|(\S+))")
# The pieces a driver's message is cut into when looking for fragments of a
# password it quoted under another name (a host, a port, a database).
_TOKEN = re.compile(r"[^\s'\"`@:/=?#&,;()\[\]{}<>]+")
# Fragments shorter than this are not looked for: masking every "a" or "10"
# of a message would leave nothing readable.
_MIN_FRAGMENT = 3


def _password_span(rest: str) -> tuple[int, int] | None:
    """Where the user-info password lies in what follows ``scheme://``, or None.

    The credentials end at the *last* ``@`` (see the module docstring); the
    user ends at the first ``:``. An empty password hides nothing.
    """
    at = rest.rfind("@")
    colon = rest.find(":", 0, at) if at >= 0 else -1
    if colon < 0 or colon + 1 == at:
        return None
    return colon + 1, at


def _credentials(rest: str) -> tuple[str, str, str] | None:
    """``(user, password, "@" + the rest)`` of what follows ``scheme://``, or None."""
    span = _password_span(rest)
    if span is None:
        return None
    return rest[: span[0] - 1], rest[span[0] : span[1]], rest[span[1] :]


def _masked(text: str, spans: list[tuple[int, int]]) -> str:
    """``text`` with each span, overlapping or touching ones merged, replaced by ``****``."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    for start, end in reversed(merged):
        text = text[:start] + MASK + text[end:]
    return text


def _mask_password_params(text: str) -> str:
    return _PASSWORD_PARAM.sub(lambda m: m.group(1) + (MASK if m.group(2) else ""), text)


def mask_dsn(dsn: str) -> str:
    """``dsn`` with its password replaced by ``****``, in URL or ``key=value`` form.

    The password may sit in the URL's user info or in a ``password=``
    parameter (of the query, or of a key=value string); an ``sslpassword=``
    (the passphrase of the client key) is masked the same way. Everything else is
    kept as written. A key=value DSN that cannot be parsed is hidden whole.
    """
    form = _URL_FORM.match(dsn)
    if form:
        head, rest = dsn[: form.end()], dsn[form.end() :]
        # Both readings at once, on the text as written: a raw "@" inside a
        # password= parameter would otherwise end the "credentials" and leave
        # the rest of that value showing as a host.
        spans = [m.span(2) for m in _PASSWORD_PARAM.finditer(rest) if m.group(2)]
        password = _password_span(rest)
        if password:
            spans.append(password)
        return head + _masked(rest, spans)
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return _UNPARSEABLE
    secret = [name for name in _SECRET_PARAMS if params.get(name)]
    if not secret:
        return dsn
    params.update(dict.fromkeys(secret, MASK))
    return make_conninfo("", **params)


def redact_url(url: str) -> str:
    """An endpoint URL safe for logs, reprs and ``last_error``.

    The password is masked (the user name stays, to tell accounts apart)
    and the query and fragment are dropped: a webhook's ``?token=...`` or a
    signed URL's signature is as secret as a password, and there is no
    telling which parameters are.
    """
    form = _URL_FORM.match(url)
    head, rest = (url[: form.end()], url[form.end() :]) if form else ("", url)
    password = _password_span(rest)
    query = _QUERY_START.search(rest)
    cut = query.start() if query else len(rest)
    if password is None or cut < password[0]:
        # No password, or one inside the query (dropped with it).
        return head + rest[:cut]
    start, end = password
    if cut < end:
        # A "?" or "#" inside what may be the password: the query may start
        # there as well, so nothing after it is shown.
        return head + rest[:start] + MASK
    return head + rest[:start] + MASK + rest[end:cut]


def _spec_credentials(spec: str) -> tuple[str, str, str] | None:
    """``(kept prefix, hidden part, "@" + the rest)`` of a mistyped URL, or None."""
    at = spec.rfind("@")
    if at <= 0:
        return None
    prefix = _SPEC_PREFIX.match(spec, 0, at)
    keep = prefix.end() if prefix else 0
    if keep >= at:
        return None
    return spec[:keep], spec[keep:at], spec[at:]


def mask_spec(spec: str) -> str:
    """A publisher setting (``OUTBOX_PUBLISHER``) safe to print.

    A URL is shown as ``redact_url`` shows it. Anything else holding an
    ``@`` is taken for a mistyped URL (``amqp//guest:pw@rabbit//``, a
    forgotten ``:``), whose text before the ``@`` may be a password: it is
    masked. ``package.module:callable`` and ``celery:task`` stay as written.
    """
    if _URL_FORM.match(spec):
        return redact_url(spec)
    found = _spec_credentials(spec)
    if found is None:
        return spec
    return f"{found[0]}{MASK}{found[2]}"


def _url_passwords(dsn: str, *, ssl: bool = False) -> set[str]:
    """The passwords of a URL as written: user info (widest reading) and
    query; with ``ssl``, its ``sslpassword`` too."""
    form = _URL_FORM.match(dsn)
    if not form:
        return set()
    rest = dsn[form.end() :]
    found: set[str] = set()
    credentials = _credentials(rest)
    if credentials:
        found.add(credentials[1])
    found.update(
        m.group(2) for m in _PASSWORD_PARAM.finditer(rest) if ssl or m.group(1) == "password="
    )
    return found


def _libpq_password(dsn: str) -> str | None:
    """The password libpq itself reads from ``dsn``; raises on a DSN it cannot parse."""
    password = conninfo_to_dict(dsn).get("password")
    return None if password is None else str(password)


def _passwords(dsn: str) -> set[str]:
    """Every form in which ``dsn``'s password could appear in a message.

    The password as written, and as libpq reads it where that differs (a
    piece of it, for a URL whose password holds a raw ``@``); pieces shorter
    than three characters are left to be found whole.
    """
    found = _url_passwords(dsn)
    ssl_password: Any = None
    try:
        libpq = _libpq_password(dsn)
        # The client key's passphrase (sslpassword), as libpq reads it.
        ssl_password = conninfo_to_dict(dsn).get("sslpassword")
    except (psycopg.ProgrammingError, ValueError):
        libpq = None
        if not _URL_FORM.match(dsn):
            # key=value that libpq cannot parse (an unclosed quote): the
            # password's text as far as it can be told.
            found.update(m.group(1) or m.group(2) for m in _KV_PASSWORD.finditer(dsn))
            # Neither a URL nor key=value: perhaps a mistyped URL.
            credentials = _spec_credentials(dsn) if "=" not in dsn else None
            if credentials:
                found.add(credentials[1])
    if libpq is not None and (not found or len(libpq) >= _MIN_FRAGMENT):
        found.add(libpq)
    found |= _url_passwords(dsn, ssl=True)
    if ssl_password:
        found.add(str(ssl_password))
    # A driver may quote the password as given or percent-decoded.
    found |= {urllib.parse.unquote(p) for p in found}
    found |= {urllib.parse.unquote_plus(p) for p in found}
    return {p for p in found if p}


def password_is_unambiguous(dsn: str) -> bool:
    """True when libpq reads ``dsn``'s password exactly where it is written.

    False when libpq cannot parse the DSN at all, or reads a different
    password than the one written (a raw ``@`` or ``/`` in a URL's
    password: ``postgresql://u:se@cret@db/x`` gives libpq the password
    ``se`` and the host ``cret@db``). Then any of its messages may quote a
    piece of the password as a host, a port or a database name.
    """
    try:
        libpq = _libpq_password(dsn)
    except (psycopg.ProgrammingError, ValueError):
        return False
    if not _URL_FORM.match(dsn):
        return True  # key=value: libpq's parse is the only one there is
    written = _url_passwords(dsn)
    if not written:
        return libpq is None
    decoded = {urllib.parse.unquote(p) for p in written}
    return libpq is not None and libpq in decoded and len(decoded) == 1


def _mask_fragments(text: str, secrets: Iterable[str]) -> str:
    """Mask each token of ``text`` that is a piece (3 characters or more) of a secret."""
    secrets = [s for s in secrets if len(s) >= _MIN_FRAGMENT]
    if not secrets:
        return text

    def mask(match: re.Match[str]) -> str:
        token = match.group(0)
        if len(token) >= _MIN_FRAGMENT and any(token in s for s in secrets):
            return MASK
        return token

    return _TOKEN.sub(mask, text)


def scrub(text: str, dsn: str | None) -> str:
    """``text`` (an error message) without ``dsn``'s password, should a driver echo it.

    ``dsn`` may be a DSN, a URL or a publisher setting. The whole of it,
    when quoted, becomes its masked form; then every remaining occurrence of
    the password becomes ``****``, and so does every word of the message
    that is a piece of it (a driver that splits the address differently may
    quote the password's tail as a host).
    """
    if not dsn:
        return text
    if _URL_FORM.match(dsn) or "=" in dsn:
        masked = mask_dsn(dsn)
        text = text.replace(dsn, masked if masked != _UNPARSEABLE else "<DSN>")
    else:
        text = text.replace(dsn, mask_spec(dsn))
    passwords = _passwords(dsn)
    # Longest first, so a password that contains another form is replaced whole.
    for password in sorted(passwords, key=len, reverse=True):
        text = text.replace(password, MASK)
    return _mask_fragments(text, passwords)


def connect_error(exc: BaseException, dsn: str) -> str:
    """What to say about a failed connection to ``dsn``: the driver's first line, scrubbed.

    When libpq reads the password somewhere other than where it is written
    (``password_is_unambiguous``), its message may quote a piece of the
    password as a host or a port, in a form no scrubbing can be sure to
    find: the message is then withheld, and the reader is told why and what
    to fix. A DSN libpq cannot parse at all (``?application_nam=x``,
    ``postgres//host``) gives no password to misread; its message names what
    it could not parse, and is shown unless some piece of it could be a piece
    of the password.
    """
    name = type(exc).__name__
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    if password_is_unambiguous(dsn):
        return f"{name}: {scrub(first, dsn)}" if first else name
    if not _parses(dsn):
        if not _may_quote(first, _conceivable_passwords(dsn)):
            return f"{name}: {first}" if first else name
        return (
            f"{name} (the driver's message is withheld: libpq cannot parse the DSN and its "
            "message quotes a part that may hold the password; check its form, "
            "postgresql://USER:PASSWORD@HOST:PORT/DBNAME?PARAM=VALUE or key=value pairs, "
            "and percent-encode @ : / ? # & % in a URL's password, e.g. @ as %40)"
        )
    return (
        f"{name} (the driver's message is withheld: libpq does not read the password "
        "where it is written, so the message could quote part of it; percent-encode "
        "@ : / ? # & in a URL's password, e.g. @ as %40, or quote it in key=value form)"
    )


def invalid_url(exc: BaseException, url: str) -> str:
    """What to say about a URL the parser refused (``ValueError``, httpx's
    ``InvalidURL``): the URL masked, and the parser's message unless a word
    of it could be a piece of the password.

    A raw ``/``, ``?`` or ``#`` in a URL's password ends the address where
    urllib and httpx read it: ``amqp://relay:Zx9k/Qw7@rabbit//`` has, to
    them, the host ``relay`` and the port ``Zx9k``, and their message
    ("Port could not be cast to integer value as 'Zx9k'") quotes the
    password's head.
    """
    name = type(exc).__name__
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    where = mask_spec(url)
    if first and not _quotes_a_piece(first, _conceivable_passwords(url)):
        return f"{where!r} is not a valid URL: {name}: {first}"
    return (
        f"{where!r} is not a valid URL ({name}; the parser's message is withheld, as it may "
        "quote part of the password): percent-encode @ : / ? # & % in its password, "
        "e.g. / as %2F"
    )


# What a parser's message quotes: 'x' or "x".
_QUOTED = re.compile(r"'([^']*)'|\"([^\"]*)\"")


def _quotes_a_piece(text: str, secrets: set[str]) -> bool:
    """True when ``text`` holds a secret, quotes (between quotes, however
    short) a piece of one, or has a word of 3 characters or more that is one:
    parsers quote what they could not read ("Invalid port: 'pa'")."""
    if any(secret in text for secret in secrets):
        return True
    pairs = _QUOTED.findall(text)
    quoted = [part for pair in pairs for part in pair if part]
    if any(q in secret for q in quoted for secret in secrets):
        return True
    words = [w for w in _TOKEN.findall(text) if len(w) >= _MIN_FRAGMENT]
    return any(word in secret for word in words for secret in secrets)


def _parses(dsn: str) -> bool:
    try:
        _libpq_password(dsn)
    except (psycopg.ProgrammingError, ValueError):
        return False
    return True


def _conceivable_passwords(dsn: str) -> set[str]:
    """``_passwords``, and every stretch of a DSN libpq could not parse that
    could hold a password: from ``password`` to the end (an unquoted value
    may run on past a space, a query's past a raw ``&name=``) and, for a
    mistyped URL, what comes before its last ``@`` (a ``=`` in it makes it
    look like key=value)."""
    found = _passwords(dsn)
    at = dsn.lower().find("password")
    if at >= 0:
        found.add(dsn[at + len("password") :])
    # libpq's own test: any other "scheme://" is key=value text to it.
    if not dsn.startswith(("postgresql://", "postgres://")):
        credentials = _spec_credentials(dsn)
        if credentials:
            found.add(credentials[1])
    return {p for p in found if p}


def _may_quote(text: str, secrets: set[str]) -> bool:
    """True when ``text`` holds a secret, or any word of it (however short)
    is a piece of one: stricter than ``scrub``, which leaves words under
    three characters alone to keep messages readable."""
    if any(secret in text for secret in secrets):
        return True
    return any(word in secret for word in _TOKEN.findall(text) for secret in secrets)


class Secret:
    """A value that prints masked: ``repr`` and ``str`` give ``shown``, never ``value``.

    The relay stores its secret-bearing Celery settings (``outbox_dsn``,
    ``outbox_publisher``, ``outbox_webhook_secret``, ``outbox_webhook_headers``
    ...) as ``Secret`` once it has read them, so that ``celery report``,
    ``celery inspect conf`` and Flower, which print settings with ``repr``,
    show the masked form. It is deliberately not a ``str``: Celery's
    ``inspect conf`` passes strings into its JSON reply as they are, and
    sends every other object as its ``repr``. The value itself is
    ``get_secret_value()`` (the name pydantic's ``SecretStr`` uses).
    """

    __slots__ = ("_shown", "_value")

    def __init__(self, value: Any, shown: Any = MASK) -> None:
        if isinstance(value, Secret):
            value = value.get_secret_value()
        self._value = value
        self._shown = shown

    def get_secret_value(self) -> Any:
        return self._value

    @property
    def shown(self) -> Any:
        """The masked form, the only one printed."""
        return self._shown

    def __repr__(self) -> str:
        return repr(self._shown)

    def __str__(self) -> str:
        return self._shown if isinstance(self._shown, str) else repr(self._shown)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Secret):
            return bool(self._value == other._value)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("Secret", self._shown if isinstance(self._shown, str) else id(self)))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (a prefork pool or a copy of the configuration needs
        # the value); a pickle is data, never printed.
        return (Secret, (self._value, self._shown))


def reveal(value: Any) -> Any:
    """The value inside a ``Secret``; any other value as it is."""
    return value.get_secret_value() if isinstance(value, Secret) else value
