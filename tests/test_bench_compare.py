"""``python -m benchmarks.compare``: several runs' ratios side by side.

Read from results files kept in benchmarks/results/ (written by
``benchmarks.run``), so a change to the report's format that the compare
tool no longer reads fails here, not in the next person's hands.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compare import compare, parse

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
SIXTEENTH = RESULTS / "2026-12-06-sixteenth.md"
SEVENTEENTH = RESULTS / "2026-12-06-seventeenth.md"


def _row(table: str, label: str) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no row {label!r} in:\n{table}")


def test_a_results_file_gives_its_ratios_anchors_and_load() -> None:
    run = parse(SEVENTEENTH)
    assert run.name == "2026-12-06-seventeenth"
    assert run.by_rate["chunked 50 / literal loop"] == 4.37
    assert run.by_cpu["chunked 50 / literal loop"] == 5.23
    assert run.by_rate["per-message / Celery UPDATE task, both ack_emulation off"] == 0.73
    # A ratio with no by-CPU figure is absent there, not zero.
    assert "chunked 50 / pgqueuer" not in run.by_cpu
    assert run.rates["articles' literal loop x4, no-op"] == 2454
    assert run.rates["pgqueuer x4, 20 ms jobs"] == 5128
    assert run.load == 1.72
    assert run.finished == "2026-12-06 11:58:35"


def test_runs_side_by_side_with_the_range() -> None:
    table = compare([parse(SIXTEENTH), parse(SEVENTEENTH)])
    assert table.splitlines()[0] == (
        "| ratio (by rate) | 2026-12-06-sixteenth | 2026-12-06-seventeenth | range |"
    )
    assert _row(table, "chunked 500 / literal loop") == ["4.09x", "5.74x", "4.09x to 5.74x"]
    assert _row(table, "articles' literal loop x4, no-op") == ["2,385/s", "2,454/s"]
    by_cpu = compare([parse(SIXTEENTH), parse(SEVENTEENTH)], cpu=True)
    assert _row(by_cpu, "chunked 50 / literal loop") == ["3.95x", "5.23x", "3.95x to 5.23x"]


def test_a_ratio_one_run_lacks_is_left_blank() -> None:
    # The like-for-like rows exist since the sixteenth run only.
    table = compare([parse(RESULTS / "2026-12-06-fifteenth.md"), parse(SEVENTEENTH)])
    assert _row(table, "durable task / Celery UPDATE task, both ack_emulation off") == [
        "",
        "0.52x",
        "",
    ]


def test_a_file_that_is_not_a_results_file_is_skipped_by_name(tmp_path: Path) -> None:
    stray = tmp_path / "notes.md"
    stray.write_text("# notes\n\nno table here\n")
    with pytest.raises(ValueError, match=r"notes\.md: no ratio table"):
        parse(stray)

    def compare_cli(*files: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "benchmarks.compare", *map(str, files)],
            capture_output=True,
            text=True,
            cwd=RESULTS.parent.parent,
            check=False,
        )

    # Beside a results file (a glob of results/ also matches notes): skipped, said so.
    done = compare_cli(stray, SEVENTEENTH)
    assert done.returncode == 0, done.stderr
    assert "skipped" in done.stderr and "notes.md: no ratio table" in done.stderr
    assert done.stdout.splitlines()[0] == "| ratio (by rate) | 2026-12-06-seventeenth | range |"
    # Columns oldest first, in whatever order the files were named.
    done = compare_cli(SEVENTEENTH, SIXTEENTH)
    assert done.stdout.splitlines()[0].startswith(
        "| ratio (by rate) | 2026-12-06-sixteenth | 2026-12-06-seventeenth |"
    )
    # Alone: nothing to compare is an error, and so is a file that is not there.
    for files in ((stray,), (SEVENTEENTH, tmp_path / "missing.md")):
        done = compare_cli(*files)
        assert done.returncode == 2
        assert "Traceback" not in done.stderr
    assert "missing.md" in done.stderr
