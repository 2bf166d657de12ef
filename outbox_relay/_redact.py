"""Keeping passwords out of what outbox-relay prints, logs and stores.

Three kinds of text leave the process carrying addresses that may hold a
secret, and each has one rule here, so every place masks alike:

* a **DSN shown to a person** (the CLI, the demo): ``mask_dsn`` replaces the
  password and keeps everything else, so the reader can still tell which
  database or broker it is;
* an **endpoint URL in a log line, a repr or ``last_error``** (the
  publishers): ``redact_url`` masks the password and drops the query and
  fragment, where webhook tokens and signed-URL signatures travel;
* an **error message** from a driver, which may echo what it was given:
  ``scrub`` removes a known DSN's password from it.

Each function returns its input unchanged when there is nothing to mask, so
an address without a password (``redis+socket:///tmp/redis.sock``) is never
rewritten into something that no longer works when pasted back.
"""

from __future__ import annotations

import re
import urllib.parse

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["MASK", "mask_dsn", "redact_url", "scrub"]

MASK = "****"
_UNPARSEABLE = "<DSN hidden: not parseable>"
# Where a URL's host ends, and where its path ends.
_HOST_END = re.compile(r"[/?#]")
_QUERY_START = re.compile(r"[?#]")


def _split(url: str) -> tuple[str, str, str, str]:
    """``(scheme + "://", credentials-and-host, path, query-and-fragment)``.

    Hand-rolled rather than ``urlsplit``, to read credentials the way libpq
    does: they run up to an ``@`` before the first ``/``, so a password with
    a raw ``?`` or ``#`` in it is still a password (``urlsplit`` would cut it
    there and leave the rest unmasked). The *last* such ``@`` ends them,
    which can only mask too much, never too little.
    """
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    slash = rest.find("/")
    credentials, at, _ = (rest if slash < 0 else rest[:slash]).rpartition("@")
    if at:
        credentials += at
        rest = rest[len(credentials) :]
    end = _HOST_END.search(rest)
    host, rest = (rest[: end.start()], rest[end.start() :]) if end else (rest, "")
    cut = _QUERY_START.search(rest)
    path, query = (rest[: cut.start()], rest[cut.start() :]) if cut else (rest, "")
    return f"{head}{sep}", credentials + host, path, query


def _mask_authority(authority: str) -> str:
    userinfo, at, host = authority.rpartition("@")
    user, colon, password = userinfo.partition(":")
    # An empty password hides nothing; "****" there would suggest one to fill in.
    if at and colon and password:
        return f"{user}:{MASK}@{host}"
    return authority


def _mask_query(query: str) -> str:
    """A ``?...#...`` tail with any ``password=`` parameter masked, the rest byte for byte."""
    body, hash_, fragment = query.partition("#")
    pieces = body[1:].split("&") if body.startswith("?") else []
    masked = [
        f"{piece.partition('=')[0]}={MASK}"
        if urllib.parse.unquote_plus(piece.partition("=")[0]) == "password"
        and piece.partition("=")[2]
        else piece
        for piece in pieces
    ]
    return ("?" + "&".join(masked) if body.startswith("?") else body) + hash_ + fragment


def mask_dsn(dsn: str) -> str:
    """``dsn`` with its password replaced by ``****``, in URL or ``key=value`` form.

    The password may sit in the URL's user info or in a ``password=``
    parameter (of the query, or of a key=value string). Everything else is
    kept as written. A DSN that cannot be parsed is hidden whole.
    """
    if "://" in dsn:
        head, authority, path, query = _split(dsn)
        masked = f"{head}{_mask_authority(authority)}{path}{_mask_query(query)}"
        return dsn if masked == dsn else masked
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return _UNPARSEABLE
    if not params.get("password"):
        return dsn
    params["password"] = MASK
    return make_conninfo("", **params)


def redact_url(url: str) -> str:
    """An endpoint URL safe for logs, reprs and ``last_error``.

    The password is masked (the user name stays, to tell accounts apart)
    and the query and fragment are dropped: a webhook's ``?token=...`` or a
    signed URL's signature is as secret as a password, and there is no
    telling which parameters are.
    """
    head, authority, path, _ = _split(url)
    return f"{head}{_mask_authority(authority)}{path}"


def _passwords(dsn: str) -> set[str]:
    """Every form in which ``dsn``'s password could appear in a message."""
    found: set[str] = set()
    if "://" in dsn:
        _, authority, _, query = _split(dsn)
        userinfo, at, _ = authority.rpartition("@")
        if at and ":" in userinfo:
            found.add(userinfo.split(":", 1)[1])
        body = query.partition("#")[0][1:]
        for key, value in urllib.parse.parse_qsl(body, keep_blank_values=True):
            if key == "password":
                found.add(value)
    else:
        try:
            password = conninfo_to_dict(dsn).get("password")
        except psycopg.ProgrammingError:
            return found
        if password is not None:
            found.add(str(password))
    # A driver may quote the password as given or percent-decoded.
    found |= {urllib.parse.unquote(p) for p in found}
    return {p for p in found if p}


def scrub(text: str, dsn: str | None) -> str:
    """``text`` (an error message) without ``dsn``'s password, should a driver echo it.

    The whole DSN, when quoted, becomes its masked form; then every
    remaining occurrence of the password becomes ``****``.
    """
    if not dsn:
        return text
    masked = mask_dsn(dsn)
    text = text.replace(dsn, masked if masked != _UNPARSEABLE else "<DSN>")
    # Longest first, so a password that contains another form is replaced whole.
    for password in sorted(_passwords(dsn), key=len, reverse=True):
        text = text.replace(password, MASK)
    return text
