from __future__ import annotations

from collections.abc import Iterator

import pytest

from .servers import OwnedRedis


@pytest.fixture
def owned_redis() -> Iterator[OwnedRedis]:
    """A Redis server this test alone uses, so it may flush, kill and restart it."""
    server = OwnedRedis()
    try:
        yield server
    finally:
        server.close()
