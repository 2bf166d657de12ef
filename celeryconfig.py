"""Example configuration for the standalone relay app.

``celery -A outbox_relay.app worker`` loads this module when it is importable
(run from this folder, or set CELERY_CONFIG_MODULE). Every value falls back
to the environment, so the same file serves development and containers.
"""

import os

# The broker that carries the relay's tasks: only (id, lease_version) pairs.
broker_url = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
# Redis redelivers unacknowledged tasks after this long; it must exceed the
# lease (the relay checks at start).
broker_transport_options = {"visibility_timeout": 3600}

task_serializer = "json"
accept_content = ["json"]
task_ignore_result = True
task_default_queue = "outbox"

# The relay (each also readable as OUTBOX_<NAME> from the environment).
# No defaults for where the outbox lives and where messages go: a relay that
# is not told must refuse to start, naming the setting, rather than read a
# guessed database or publish to a placeholder URL. Keep passwords out of
# OUTBOX_DSN (use PGPASSWORD or ~/.pgpass): `celery report` and Flower print
# the settings.
if os.environ.get("OUTBOX_DSN"):
    outbox_dsn = os.environ["OUTBOX_DSN"]
if os.environ.get("OUTBOX_PUBLISHER"):
    outbox_publisher = os.environ["OUTBOX_PUBLISHER"]
outbox_lease_seconds = float(os.environ.get("OUTBOX_LEASE_SECONDS", "60"))
outbox_publish_timeout_seconds = float(os.environ.get("OUTBOX_PUBLISH_TIMEOUT_SECONDS", "10"))
outbox_claim_interval_seconds = float(os.environ.get("OUTBOX_CLAIM_INTERVAL_SECONDS", "5"))
outbox_chunk_size = int(os.environ.get("OUTBOX_CHUNK_SIZE", "1"))

# The deliver task's Celery retry options are the relay's retry policy,
# applied in the database (never as broker ETAs). Uncomment for 8 attempts
# with full-jitter backoff from 2 s up to 10 minutes:
# task_annotations = {
#     "outbox_relay.deliver": {"max_retries": 7, "retry_backoff": 2, "retry_backoff_max": 600},
# }
