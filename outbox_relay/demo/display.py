"""What the demo shows while it runs: live progress, or plain lines when not on a terminal."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

__all__ = ["ProgressView", "Sample", "format_statuses"]

# Without a terminal (CI logs, a pipe) a line every this many seconds.
PLAIN_EVERY_SECONDS = 2.0


@dataclass(frozen=True)
class Sample:
    """One reading of the demo's progress."""

    elapsed: float
    enqueued: int
    delivered: int
    dead: int
    in_flight: int
    retrying: int
    oldest_pending_seconds: float
    receiver: dict[int, int]

    @classmethod
    def from_status(
        cls,
        snapshot: dict[str, Any],
        *,
        baseline: dict[str, Any],
        enqueued: int,
        elapsed: float,
        receiver: dict[int, int],
    ) -> Sample:
        """From ``operations.status`` output, counted from the ``baseline`` reading.

        A database used before (your own, via OUTBOX_DSN) may hold earlier
        runs' rows; only what changed since the start counts as this run's.
        """
        processing = int(snapshot["processing"])
        # attempts covers pending and processing rows; every processing row
        # has at least one attempt, so what remains are the pending rows that
        # failed before and wait out their backoff.
        tried = sum(n for k, n in snapshot["attempts"].items() if int(k) >= 1)
        return cls(
            elapsed=elapsed,
            enqueued=enqueued,
            delivered=int(snapshot["done"]) - int(baseline["done"]),
            dead=int(snapshot["dead"]) - int(baseline["dead"]),
            in_flight=processing,
            retrying=max(0, tried - processing),
            oldest_pending_seconds=snapshot["oldest_pending_age_seconds"] or 0.0,
            receiver=receiver,
        )

    def line(self) -> str:
        return (
            f"in flight {self.in_flight} · retrying {self.retrying} · dead {self.dead} · "
            f"oldest pending {self.oldest_pending_seconds:.1f}s · "
            f"webhook HTTP {format_statuses(self.receiver)}"
        )


def format_statuses(counts: dict[int, int]) -> str:
    """``200: 250, 429: 43, 503: 60`` (HTTP status: requests), or ``nothing yet``."""
    if not counts:
        return "nothing yet"
    return ", ".join(f"{status}: {n}" for status, n in sorted(counts.items()))


class ProgressView:
    """Bars for enqueued and delivered orders, and a line of details below.

    On a terminal it redraws in place (rich ``Live``); otherwise it prints a
    plain line every few seconds, which reads well in a CI log.
    """

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self.live_mode = console.is_terminal
        self._progress = Progress(
            TextColumn("{task.description:>9}"),
            BarColumn(bar_width=40),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        self._enqueued = self._progress.add_task("enqueued", total=total)
        self._delivered = self._progress.add_task("delivered", total=total)
        self._detail = Text("starting ...", style="dim")
        self._live: Live | None = None
        self._last_plain = float("-inf")

    def _render(self) -> RenderableType:
        return Group(self._progress, self._detail)

    def __enter__(self) -> ProgressView:
        if self.live_mode:
            self._live = Live(
                get_renderable=self._render, console=self.console, refresh_per_second=8
            )
            self._live.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def update(self, sample: Sample, *, final: bool = False) -> None:
        self._progress.update(self._enqueued, completed=sample.enqueued)
        self._progress.update(self._delivered, completed=max(0, sample.delivered))
        self._detail = Text(sample.line(), style="dim")
        if self.live_mode:
            return
        now = time.monotonic()
        if final or now - self._last_plain >= PLAIN_EVERY_SECONDS:
            self._last_plain = now
            self.console.print(
                f"[{sample.elapsed:5.1f}s] enqueued {sample.enqueued}/{self.total} · "
                f"delivered {max(0, sample.delivered)}/{self.total} · {sample.line()}",
                soft_wrap=True,
            )
