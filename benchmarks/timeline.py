"""Where a Celery pool process's time goes: every task's span, from Celery's signals.

A pool process runs one task at a time, so its time over a window is the
sum of its tasks' spans plus the gaps between them (waiting for the worker's
main process to hand it the next task, or for a task to exist). ``relay_app``
installs this in every pool child when ``BENCH_TIMELINE_DIR`` is set; each
child appends ``kind start end`` lines (wall clock, ``time.time()``) to
``<dir>/<pid>.txt`` a few times a second, and ``shares()`` sums them over a
window. The spans are taken by ``task_prerun``/``task_postrun``: Celery's own
bookkeeping around a task (receiving it, reporting its result) counts as
idle here. This is for measuring only; nothing in ``outbox_relay`` uses it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "install", "shares"]

# What a task name counts as; anything else is "other" (rescue, purge ...).
_KIND = {
    "outbox_relay.deliver_batch": "deliveries",
    "outbox_relay.deliver": "deliveries",
    "outbox_relay.claim": "claims",
}
KINDS = ("deliveries", "claims", "other", "idle")

_lock = threading.Lock()
_pending: list[str] = []
_started: dict[str, float] = {}
_installed_pid: int | None = None
# A task run inside another (a durable task's run that follows, running the
# rows it took) is part of the outer span: only the outermost counts.
_depth = threading.local()


def _on_prerun(task_id: str | None = None, **_: Any) -> None:
    depth = getattr(_depth, "n", 0)
    _depth.n = depth + 1
    if depth == 0:
        _started[task_id or ""] = time.time()


def _on_postrun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    _depth.n = max(0, getattr(_depth, "n", 1) - 1)
    start = _started.pop(task_id or "", None)
    if start is None:
        return
    kind = _KIND.get(getattr(task, "name", ""), "other")
    with _lock:
        _pending.append(f"{kind} {start:.6f} {time.time():.6f}\n")


def _writer(path: Path) -> None:
    while True:
        time.sleep(0.2)
        with _lock:
            lines = _pending[:]
            _pending.clear()
        if lines:
            with path.open("a") as f:
                f.writelines(lines)


def install() -> None:
    """Record this pool process's task spans (once per process, after fork)."""
    global _installed_pid
    folder = os.environ.get("BENCH_TIMELINE_DIR")
    if not folder or _installed_pid == os.getpid():
        return
    _installed_pid = os.getpid()
    from celery.signals import task_postrun, task_prerun

    task_prerun.connect(_on_prerun, weak=False)
    task_postrun.connect(_on_postrun, weak=False)
    path = Path(folder) / f"{os.getpid()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_writer, args=(path,), name="bench-timeline", daemon=True).start()


def shares(folder: Path, start: float, end: float) -> dict[str, float] | None:
    """Each kind's share of the pool processes' time in ``[start, end]``, averaged
    over the processes that ran a task (idle: the time between their tasks)."""
    window = end - start
    if window <= 0 or not folder.is_dir():
        return None
    time.sleep(0.5)  # the writers' last lines
    per_process: list[dict[str, float]] = []
    for path in folder.glob("*.txt"):
        busy = dict.fromkeys(KINDS, 0.0)
        for line in path.read_text().splitlines():
            kind, a, b = line.split()
            overlap = min(float(b), end) - max(float(a), start)
            if overlap > 0:
                busy[kind] += overlap
        used = sum(busy.values())
        if used > 0:
            busy["idle"] = max(0.0, window - used)
            per_process.append({k: v / window for k, v in busy.items()})
    if not per_process:
        return None
    return {k: sum(p[k] for p in per_process) / len(per_process) for k in KINDS}
