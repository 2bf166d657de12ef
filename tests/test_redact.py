"""outbox_relay._redact: one set of rules for every password that could be printed."""

from __future__ import annotations

import string
import urllib.parse

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox_relay._redact import (
    MASK,
    Secret,
    mask_dsn,
    mask_spec,
    password_is_unambiguous,
    redact_url,
    scrub,
)

# Passwords as people and secret managers make them: base64 (/ + =), URL
# delimiters left unencoded (# ? / @ : &), quotes, backslashes, spaces and
# non-ASCII letters.
PASSWORD_CHARS = string.ascii_letters + string.digits + "#?/@:&=+%!$*'\"\\ ;,.-_~éü"
passwords = st.text(alphabet=PASSWORD_CHARS, min_size=4, max_size=40)
URL_HEAD = "postgresql://app:"
URL_TAIL = "@db.example.com:5432/shop?sslmode=require"


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


def test_mask_dsn_hides_the_client_keys_sslpassword() -> None:
    """libpq's sslpassword is the passphrase of the client key (sslkey): as
    secret as the password, and it was printed whole by the CLI, the
    worker's log and celery report."""
    url = "postgresql://app@db:5432/x?sslmode=verify-full&sslpassword=KeyPass99&sslkey=/k.pem"
    assert (
        mask_dsn(url)
        == "postgresql://app@db:5432/x?sslmode=verify-full&sslpassword=****&sslkey=/k.pem"
    )
    assert mask_dsn("postgresql://app:pw@db/x?sslpassword=KeyPass99") == (
        "postgresql://app:****@db/x?sslpassword=****"
    )
    masked = mask_dsn("host=db sslkey=/k.pem sslpassword='Key Pass99' dbname=x")
    assert "Pass99" not in masked
    assert conninfo_to_dict(masked) == {
        "host": "db",
        "sslkey": "/k.pem",
        "sslpassword": MASK,
        "dbname": "x",
    }
    # A driver's message that quotes it is scrubbed; the password's own
    # reading is unchanged by it.
    assert scrub("bad passphrase KeyPass99", url) == f"bad passphrase {MASK}"
    assert password_is_unambiguous(url)


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


# ------------------------------------------------------------ property tests
@given(password=passwords)
@example(password="se@cret99")
@example(password="a/b?c#d")
@example(password="pw@db.example.com:5432/shop")
@example(password="a:b:c")
def test_mask_dsn_hides_any_password_written_raw_in_a_url(password: str) -> None:
    # Written as is, unencoded: libpq would misread some of these, but a
    # person pasting a password does this, and it must not be printed.
    # (A password that is a piece of the masked DSN itself proves nothing.)
    assume(password not in URL_HEAD + MASK + URL_TAIL)
    masked = mask_dsn(f"{URL_HEAD}{password}{URL_TAIL}")
    assert password not in masked
    # The rest survives as written: the reader can tell which database.
    assert masked == f"{URL_HEAD}{MASK}{URL_TAIL}"


@given(password=passwords)
def test_mask_dsn_hides_any_percent_encoded_password(password: str) -> None:
    encoded = urllib.parse.quote(password, safe="")
    expected = URL_HEAD + MASK + URL_TAIL
    assume(password not in expected and encoded not in expected)
    dsn = f"{URL_HEAD}{encoded}{URL_TAIL}"
    # libpq reads it back whole: the DSN is a correct one.
    assert conninfo_to_dict(dsn)["password"] == password
    assert password_is_unambiguous(dsn)
    masked = mask_dsn(dsn)
    assert password not in masked and encoded not in masked
    assert masked == f"{URL_HEAD}{MASK}{URL_TAIL}"


@given(password=passwords, encode=st.booleans())
def test_mask_dsn_hides_a_password_query_parameter(password: str, encode: bool) -> None:
    value = urllib.parse.quote(password, safe="") if encode else password
    # A raw "&name=" would start the next parameter for anyone, libpq included.
    assume(encode or "&" not in password)
    head = "postgresql://db.example.com:5432/shop?sslmode=require&password="
    tail = "&application_name=relay"
    assume(password not in head + MASK + tail and value not in head + MASK + tail)
    masked = mask_dsn(f"{head}{value}{tail}")
    assert password not in masked and value not in masked
    if "@" in value:
        # A raw "@" reads as the end of credentials (the widest reading):
        # more is masked than the password, the host still shows.
        assert masked.startswith("postgresql://db.example.com:****")
    else:
        assert masked == f"{head}{MASK}{tail}"


@given(password=passwords)
@example(password="a b")
@example(password="it's")
@example(password="back\\slash")
def test_mask_dsn_hides_any_password_in_key_value_form(password: str) -> None:
    # make_conninfo quotes and escapes as libpq wants (password='a b').
    dsn = make_conninfo("", host="db.example.com", dbname="shop", password=password)
    masked = mask_dsn(dsn)
    assume(password not in make_conninfo("", host="db.example.com", dbname="shop", password=MASK))
    assert password not in masked
    assert conninfo_to_dict(masked) == {
        "host": "db.example.com",
        "dbname": "shop",
        "password": MASK,
    }


@given(password=passwords)
def test_redact_url_hides_any_password_of_a_broker_or_webhook_url(password: str) -> None:
    head, tail = "amqp://relay:", "@rabbit.example.com:5672/vhost?heartbeat=10"
    assume(password not in head + MASK + tail)
    shown = redact_url(f"{head}{password}{tail}")
    assert password not in shown
    if "?" in password or "#" in password:
        # Where the query starts cannot be told: nothing after the user shows.
        assert shown == f"{head}{MASK}"
    else:
        assert shown == f"{head}{MASK}@rabbit.example.com:5672/vhost"


@given(token=passwords)
def test_redact_url_never_shows_the_query(token: str) -> None:
    for url in (
        f"https://hooks.example.com:8443/in?token={token}",
        f"https://h.example.com/in#{token}",
    ):
        assume(token not in url.partition(token)[0])
        assert token not in redact_url(url)


@given(password=passwords)
def test_scrub_leaves_no_piece_of_the_password_a_driver_quoted(password: str) -> None:
    dsn = f"{URL_HEAD}{password}{URL_TAIL}"
    assume(password not in URL_HEAD + MASK + URL_TAIL and "*" not in password)
    # A driver that stops the password at its first "@" or "/" quotes the
    # rest as a host; one that decodes quotes it decoded.
    cut = min((i for i in (password.find("@"), password.find("/")) if i >= 0), default=-1)
    quoted = password[cut + 1 :] if cut >= 0 else password
    text = f"failed to resolve host '{quoted}@db.example.com': error; password {password!r}"
    scrubbed = scrub(text, dsn)
    assert password not in scrubbed
    if len(quoted) >= 3 and not any(c in quoted for c in " '\"\\@:/=?#&,;"):
        assert quoted not in scrubbed


def test_password_is_unambiguous_only_where_libpq_reads_what_was_written() -> None:
    assert password_is_unambiguous("postgresql://u:pw@db/x")
    assert password_is_unambiguous("postgresql://u:se%40cret@db/x")
    assert password_is_unambiguous("host=db password='a b'")
    assert password_is_unambiguous("postgresql://db/x")
    # libpq: password "se", host "cret99@127.0.0.1".
    assert not password_is_unambiguous("postgresql://u:se@cret99@127.0.0.1/db")
    # libpq: host "u", port "ab", no password at all.
    assert not password_is_unambiguous("postgresql://u:ab/cd@h/db")
    assert not password_is_unambiguous("host=db password='unterminated")


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        ("amqp//guest:S3cret@rabbit//", "amqp//****@rabbit//"),
        ("amqp:/guest:S3cret@rabbit//", "amqp:/****@rabbit//"),
        ("guest:S3cret@rabbit", "guest:****@rabbit"),
        ("S3cret@rabbit", "****@rabbit"),
        (
            "https://u:S3cret@hooks.example.com/in?token=T0ken",
            "https://u:****@hooks.example.com/in",
        ),
        ("shop.events:publish", "shop.events:publish"),
        ("celery:billing.charge", "celery:billing.charge"),
    ],
)
def test_mask_spec_masks_what_may_be_a_password_in_a_publisher_setting(
    spec: str, shown: str
) -> None:
    assert mask_spec(spec) == shown


def test_secret_prints_only_its_masked_form() -> None:
    secret = Secret("postgresql://u:S3cret@db/x", "postgresql://u:****@db/x")
    assert repr(secret) == "'postgresql://u:****@db/x'"
    assert str(secret) == "postgresql://u:****@db/x"
    assert f"{secret}" == "postgresql://u:****@db/x"
    assert secret.get_secret_value() == "postgresql://u:S3cret@db/x"
    headers = Secret({"Authorization": "Bearer S3cret"}, {"Authorization": MASK})
    assert "S3cret" not in repr(headers) and "S3cret" not in str(headers)
    assert Secret(secret).get_secret_value() == secret.get_secret_value()
