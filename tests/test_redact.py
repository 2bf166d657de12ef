"""outbox_relay._redact: one set of rules for every password that could be printed."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict

from outbox_relay._redact import MASK, mask_dsn, redact_url, scrub


def test_mask_dsn_in_url_form_keeps_everything_but_the_password() -> None:
    assert mask_dsn("postgresql://app:pw@db:5432/x?sslmode=require") == (
        "postgresql://app:****@db:5432/x?sslmode=require"
    )
    # A password parameter in the query is masked; other parameters stay byte for byte.
    assert mask_dsn("postgresql://db/x?password=pw&sslrootcert=/etc/ca.pem") == (
        "postgresql://db/x?password=****&sslrootcert=/etc/ca.pem"
    )
    # libpq reads a raw "?" before the "@" as part of the password: so do we.
    assert mask_dsn("postgresql://app:p?w#d@db/x") == "postgresql://app:****@db/x"
    assert mask_dsn("postgresql://app@db/x") == "postgresql://app@db/x"
    # An empty password (pgserver's URIs have one) hides nothing: nothing to mask.
    empty = "postgresql://postgres:@/postgres?host=/tmp/pg&password="
    assert mask_dsn(empty) == empty


def test_mask_dsn_in_key_value_form() -> None:
    masked = mask_dsn(r"host=db password='it\'s secret' dbname=x")
    assert conninfo_to_dict(masked) == {"host": "db", "password": MASK, "dbname": "x"}
    assert "secret" not in masked
    # Nothing to mask: returned as written, not re-rendered.
    assert mask_dsn("host=db  dbname=x") == "host=db  dbname=x"
    assert mask_dsn("host='unterminated") == "<DSN hidden: not parseable>"


def test_an_address_without_a_password_is_kept_intact() -> None:
    # urlunsplit() would drop the "//" of an empty host and break the address.
    for url in ("redis+socket:///tmp/demo/redis.sock", "redis://127.0.0.1:6379/0", "memory://"):
        assert mask_dsn(url) == url
        assert redact_url(url) == url


def test_broker_urls_with_a_password() -> None:
    assert mask_dsn("amqp://guest:guest@rabbit:5672//") == "amqp://guest:****@rabbit:5672//"
    assert redact_url("amqps://app:s3cret@rabbit:5671/vhost?ssl=1") == (
        "amqps://app:****@rabbit:5671/vhost"
    )
    # Redis has a password and no user.
    assert redact_url("redis://:s3cret@cache:6379/0") == "redis://:****@cache:6379/0"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://hooks.example.com/in?token=t0ken", "https://hooks.example.com/in"),
        ("https://h.example.com/x?sig=abc#frag", "https://h.example.com/x"),
        ("https://u:p4ss@h.example.com:8443/x?a=1", "https://u:****@h.example.com:8443/x"),
        # An "@" in the path is not a credential.
        ("https://h.example.com/users/bob@example.com/hook", None),
        ("http://[::1]:8080/events", None),
    ],
)
def test_redact_url_drops_the_query_where_credentials_may_travel(
    url: str, shown: str | None
) -> None:
    assert redact_url(url) == (shown or url)


def test_scrub_takes_a_known_password_out_of_an_error_message() -> None:
    dsn = "postgresql://app:s3cret@db/x"
    text = f'connection to {dsn} failed: password "s3cret" was rejected'
    assert scrub(text, dsn) == (
        'connection to postgresql://app:****@db/x failed: password "****" was rejected'
    )
    # Percent-encoded in the DSN, quoted decoded by the driver.
    assert scrub("bad password p@ss", "postgresql://app:p%40ss@db/x") == "bad password ****"
    assert scrub("no p4ss here? p4ss", "host=db password=p4ss") == "no **** here? ****"
    assert scrub("as is", None) == "as is"
    assert scrub("as is", "postgresql://app@db/x") == "as is"
