"""The relay's task names and beat entries (all under ``outbox_relay.``)."""

from __future__ import annotations

__all__ = [
    "BEAT_CLAIM",
    "BEAT_PURGE",
    "BEAT_RESCUE",
    "CLAIM",
    "DELIVER",
    "DELIVER_BATCH",
    "PURGE",
    "PURGE_EVERY_SECONDS",
    "RELAY_EXCHANGE",
    "RESCUE",
    "STANDALONE_APP",
]

CLAIM = "outbox_relay.claim"
DELIVER = "outbox_relay.deliver"
DELIVER_BATCH = "outbox_relay.deliver_batch"
RESCUE = "outbox_relay.rescue"
PURGE = "outbox_relay.purge"

# The standalone app's name (outbox_relay.app): its workers run the relay alone.
STANDALONE_APP = "outbox_relay"

BEAT_CLAIM = "outbox-relay-claim"
BEAT_RESCUE = "outbox-relay-rescue"
BEAT_PURGE = "outbox-relay-purge"
PURGE_EVERY_SECONDS = 3600.0

# The exchange the relay's queue is bound to. Celery would name it after the
# queue ("outbox", type direct), and the broker publisher's default exchange
# is "outbox" of type topic: on one RabbitMQ vhost (the relay's broker and
# the publisher's target) the second declaration was refused
# (PRECONDITION_FAILED) and no message was ever published.
RELAY_EXCHANGE = "outbox_relay"
