"""Relay loops without Celery, run in N processes for the side-by-side figures.

* ``literal``: the articles' loop as written: claim a batch in a short
  transaction, then per message publish and run one finalize transaction.
* ``dispatch_once``: this library's plain loop (the same shape, with the
  fence check and classification of the shared delivery step).
"""

from __future__ import annotations

import os
from datetime import timedelta

import psycopg

from outbox_relay import claim, dispatch_once, mark_done

from .publishers import noop, wait20ms

PUBLISHERS = {"noop": noop, "wait20ms": wait20ms}


def literal(dsn: str, publisher: str, batch: int = 50) -> int:
    publish = PUBLISHERS[publisher]
    owner = f"literal-{os.getpid()}"
    done = 0
    with psycopg.connect(dsn) as conn:
        while True:
            messages = claim(conn, owner=owner, batch=batch, lease=timedelta(seconds=60))
            conn.commit()
            if not messages:
                return done
            for message in messages:
                publish(message.to_message())
                with conn.transaction():
                    mark_done(conn, message)
                conn.commit()
                done += 1


def plain(dsn: str, publisher: str, batch: int = 50) -> int:
    publish = PUBLISHERS[publisher]
    owner = f"plain-{os.getpid()}"
    done = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            n = dispatch_once(conn, publish, owner=owner, batch=batch)
            if not n:
                return done
            done += n
