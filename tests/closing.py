"""Close every publisher a test made, so that its connections do not outlive
the test (they would be garbage-collected open, a ResourceWarning each)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


def closing_every(monkeypatch: pytest.MonkeyPatch, *classes: type) -> Iterator[None]:
    """For an autouse fixture: record each instance of ``classes`` made while
    the test runs (subclasses included) and close it at the end."""
    made: list[Any] = []
    for cls in classes:
        init = cls.__init__

        def recording(self: Any, *args: Any, __init: Any = init, **kwargs: Any) -> None:
            __init(self, *args, **kwargs)
            made.append(self)

        monkeypatch.setattr(cls, "__init__", recording)
    yield
    for publisher in made:
        publisher.close()
