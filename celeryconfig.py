"""Example configuration for the standalone relay app.

``celery -A outbox_relay.app worker`` loads this module when it is importable
(run from this folder, or set CELERY_CONFIG_MODULE). The relay reads its own
settings from the environment (``OUTBOX_*``), so the same file serves
development and containers.
"""

import os

# The broker that carries the relay's tasks: only (id, lease_version) pairs.
# Celery masks this one's password in `celery report` and Flower.
broker_url = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
# Redis redelivers unacknowledged tasks after this long; it must exceed the
# lease (the relay checks at start).
broker_transport_options = {"visibility_timeout": 3600}

task_serializer = "json"
accept_content = ["json"]
task_ignore_result = True
task_default_queue = "outbox"

# The relay. Where the outbox lives (OUTBOX_DSN) and where messages go
# (OUTBOX_PUBLISHER) are deliberately not set here: the relay reads them from
# the environment itself, or from the files OUTBOX_DSN_FILE and
# OUTBOX_PUBLISHER_FILE name (Docker and Kubernetes secrets). Without a DSN it
# refuses to start, naming the setting; without a publisher it starts, says so,
# and sends only the Celery tasks written with outbox_relay.apply_async (any
# other row ends dead, its reason naming OUTBOX_PUBLISHER). Copying them into this
# module would put their passwords among the Celery settings that
# `celery report`, `celery inspect conf` and Flower print. (The relay masks
# the outbox_* settings it knows to hold secrets, but a value that never
# enters the Celery configuration cannot be printed from it.) Read
# docs/configuration.md, "Secrets".
#
# Every other relay setting is read from the environment too
# (OUTBOX_LEASE_SECONDS, OUTBOX_CHUNK_SIZE, ...), checked and refused with a
# one-line message naming it when it is not valid. One set here, as
# outbox_<name>, wins over the environment:
# outbox_lease_seconds = 60
# outbox_chunk_size = 50

# The deliver task's Celery retry options are the relay's retry policy,
# applied in the database (never as broker ETAs). Uncomment for 8 attempts
# with full-jitter backoff from 2 s up to 10 minutes:
# task_annotations = {
#     "outbox_relay.deliver": {"max_retries": 7, "retry_backoff": 2, "retry_backoff_max": 600},
# }
