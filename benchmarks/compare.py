"""The ratios of several ``make bench`` runs side by side, one column per run.

    .venv/bin/python -m benchmarks.compare benchmarks/results/2026-12-06-*.md
    .venv/bin/python -m benchmarks.compare --cpu RUN.md RUN.md ...

Hosts here differ by up to three times in speed, so runs are compared by
their ratios (each taken inside one run), never by their rates. Each
results file's ratio table is read as ``benchmarks.run`` writes it (a file
without one, an A/B note or the memory run, is skipped and said so); the
output is a Markdown table with one row per ratio, one column per run
(oldest first) and the range over the runs, then each run's latency p99s,
and the anchors that tell how fast each host was (the literal loop,
pgqueuer and the plain UPDATE task, messages a second) with its load
average at the start.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Run", "compare", "main", "parse"]

# Scenario rows whose rate says how fast the host was during a run.
ANCHORS = (
    "articles' literal loop x4, no-op",
    "pgqueuer x4, no-op",
    "pgqueuer x4, 20 ms jobs",
    "celery update task x4 (pre-queued)",
)
_RATIO = re.compile(r"^([\d.]+)x$")
_LOAD = re.compile(r"load average ([\d.]+)")
_WHEN = re.compile(r"^# Benchmark run (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
_P99 = re.compile(r"p99 ([\d.,]+) ms")
# "latency at 7,526 msg/s (half the max of chunks of 200), LISTEN/NOTIFY, producers: ..."
_HALF = re.compile(r"^latency at [\d,]+ msg/s \(half the max of chunks of (\d+)\), (.*)$")


@dataclass
class Run:
    """One results file: its ratios (by rate and by CPU) and anchor rates."""

    name: str
    by_rate: dict[str, float] = field(default_factory=dict)
    by_cpu: dict[str, float] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    # Latency rows, their rate taken out of the label: p99 ms and the chunk size.
    p99: dict[str, tuple[float, int | None]] = field(default_factory=dict)
    load: float | None = None
    # When the report was written ("2026-12-06 11:58:35"), to put runs in order.
    finished: str = ""


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _ratio(cell: str) -> float | None:
    match = _RATIO.match(cell)
    return float(match.group(1)) if match else None


def parse(path: Path) -> Run:
    """Read one results file written by ``benchmarks.run``."""
    run = Run(path.stem)
    table: str | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if not run.finished and (when := _WHEN.match(line)):
            run.finished = when.group(1)
        if run.load is None and (load := _LOAD.search(line)):
            run.load = float(load.group(1))
        if not line.startswith("|"):
            table = None
            continue
        cells = _cells(line)
        if table is None:
            table = cells[0]  # the header row names the table
            continue
        if set(cells[0]) <= {"-", " "}:
            continue
        if table == "ratio" and len(cells) >= 3:
            if (value := _ratio(cells[1])) is not None:
                run.by_rate[cells[0]] = value
            if (value := _ratio(cells[2])) is not None:
                run.by_cpu[cells[0]] = value
        elif table == "scenario" and cells[0] in ANCHORS and len(cells) >= 4:
            rate = cells[3].split(" ", 1)[0].replace(",", "")
            if rate.isdigit():
                run.rates[cells[0]] = float(rate)
        elif table == "scenario" and cells[0].startswith("latency") and len(cells) >= 4:
            _latency(run, cells[0], cells[3])
    if not run.by_rate:
        raise ValueError(f"{path}: no ratio table (is it a results file of benchmarks.run?)")
    return run


def _latency(run: Run, label: str, result: str) -> None:
    p99 = _P99.search(result)
    if p99 is None:
        return
    chunk: int | None = None
    if half := _HALF.match(label):
        # The half-load rate differs from run to run; the row is the same.
        chunk = int(half.group(1))
        kind = "of chunks of 50" if chunk == 50 else "of the best chunk size"
        label = f"latency at half the rate {kind}, {half.group(2)}"
    run.p99[label.removeprefix("latency ")] = (float(p99.group(1).replace(",", "")), chunk)


def compare(runs: Sequence[Run], *, cpu: bool = False) -> str:
    """A Markdown table of the runs' ratios, the range over them, and their anchors."""
    names = [run.name for run in runs]
    pick = [run.by_cpu if cpu else run.by_rate for run in runs]
    labels: list[str] = []
    for ratios in pick:
        labels += [label for label in ratios if label not in labels]
    what = "by CPU per message" if cpu else "by rate"
    lines = [
        f"| ratio ({what}) | {' | '.join(names)} | range |",
        "| --- |" + " --- |" * (len(names) + 1),
    ]
    for label in labels:
        values = [ratios.get(label) for ratios in pick]
        known = [v for v in values if v is not None]
        span = f"{min(known):.2f}x to {max(known):.2f}x" if len(known) > 1 else ""
        shown = ["" if v is None else f"{v:.2f}x" for v in values]
        lines.append(f"| {label} | {' | '.join(shown)} | {span} |")
    lines += ["", f"| latency p99 | {' | '.join(names)} |", "| --- |" + " --- |" * len(names)]
    latencies: list[str] = []
    for run in runs:
        latencies += [label for label in run.p99 if label not in latencies]
    for label in latencies:
        shown = []
        for run in runs:
            ms, chunk = run.p99.get(label, (None, None))
            cell = "" if ms is None else f"{ms:,.0f} ms"
            shown.append(
                cell + (f" ({chunk})" if ms is not None and chunk not in (None, 50) else "")
            )
        lines.append(f"| {label} | {' | '.join(shown)} |")
    lines += ["", f"| host | {' | '.join(names)} |", "| --- |" + " --- |" * len(names)]
    for anchor in ANCHORS:
        shown = [f"{run.rates[anchor]:,.0f}/s" if anchor in run.rates else "" for run in runs]
        lines.append(f"| {anchor} | {' | '.join(shown)} |")
    loads = ["" if run.load is None else f"{run.load:.2f}" for run in runs]
    lines.append(f"| load average at the start | {' | '.join(loads)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        description="The ratios of several benchmark runs side by side.",
    )
    parser.add_argument("files", nargs="+", type=Path, help="results files (benchmarks/results/)")
    parser.add_argument("--cpu", action="store_true", help="ratios by CPU per message")
    args = parser.parse_args(argv)
    runs: list[Run] = []
    for path in args.files:
        try:
            runs.append(parse(path))
        except OSError as exc:
            parser.error(str(exc))
        except ValueError as exc:
            # A glob of results/ also matches A/B notes and the memory run.
            print(f"skipped {exc}", file=sys.stderr)
    if not runs:
        parser.error("none of the files is a results file of benchmarks.run")
    runs.sort(key=lambda run: run.finished)  # oldest first, whatever the glob's order
    print(compare(runs, cpu=args.cpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
