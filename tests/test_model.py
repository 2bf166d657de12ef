"""The protocol model (model/relay.pml) checked with Spin, through model/check.sh.

The correct model must pass its safety assertions and its liveness claim
under weak fairness; the FREEZE_BUG variant (rescue only inside a claim that
is skipped at the cap) must fail liveness with an acceptance cycle, which
shows the checker can find the freeze the relay once had. docs/model.md
explains the model and the figures.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

CHECK = Path(__file__).resolve().parent.parent / "model" / "check.sh"

if shutil.which("spin") is None:
    pytest.skip(
        "spin is not installed (apt-get install -y spin gcc); CI installs it",
        allow_module_level=True,
    )


def pan(mode: str, *defines: str) -> str:
    """One check's pan output: ``mode`` is safety or liveness."""
    done = subprocess.run(
        ["bash", str(CHECK), "run", mode, *defines],
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def errors(output: str) -> int:
    found = re.findall(r"errors: (\d+)", output)
    assert found, f"no pan summary in the output:\n{output}"
    return int(found[-1])


def complete(output: str) -> None:
    """The search saw every state: pan prints "Full statespace search" even
    when its memory limit cut it short, so the warnings are checked too."""
    assert "max search depth too small" not in output, output
    assert "Full statespace search" in output, output
    assert "Search not completed" not in output, output
    assert "reached -DMEMLIM bound" not in output, output


def test_the_model_is_safe() -> None:
    out = pan("safety")
    complete(out)
    assert errors(out) == 0, out
    assert "assertion violations\t+" in out
    assert "Search not completed" not in out


def test_every_row_ends_done_or_dead_under_weak_fairness() -> None:
    out = pan("liveness")
    complete(out)
    assert "acceptance   cycles \t+ (fairness enabled)" in out, out
    assert errors(out) == 0, out
    assert "acceptance cycle" not in out.replace("acceptance   cycles", "")


def test_the_historical_freeze_fails_liveness() -> None:
    out = pan("liveness", "-DFREEZE_BUG")
    assert "acceptance cycle" in out.replace("acceptance   cycles", ""), out
    assert errors(out) == 1, out


def test_the_historical_freeze_is_not_a_safety_bug() -> None:
    out = pan("safety", "-DFREEZE_BUG")
    complete(out)
    assert errors(out) == 0, out


@pytest.mark.parametrize(
    ("define", "violated"),
    [
        # The fence without its lease test lets a stale write through.
        ("-DWEAK_FENCE", "&& !(ended[r]))"),
        # Without its version test, an older lease's worker writes into a
        # newer lease of the row.
        ("-DNO_VERSION_FENCE", "assertion violated ((wv[w]==ver[wr[w]])"),
        # Without its began_version guard, a release takes the lease of a
        # delivery that began (docs/model.md, finding 2).
        ("-DNO_STEAL -DRELEASE_BEGUN", "assertion violated"),
    ],
)
def test_the_checker_finds_known_violations(define: str, violated: str) -> None:
    out = pan("safety", *define.split())
    assert violated in out, out
    assert errors(out) == 1, out


def test_a_release_never_takes_the_lease_of_a_delivery_that_began() -> None:
    # It failed before the release left begun rows alone (unless_begun).
    out = pan("safety", "-DNO_STEAL")
    complete(out)
    assert errors(out) == 0, out


def test_duplicated_tasks_never_push_attempts_past_the_limit() -> None:
    # It failed before begin counted once per lease version (migration 0005).
    out = pan("safety", "-DSTRICT_ATTEMPTS")
    complete(out)
    assert errors(out) == 0, out


def test_check_sh_runs_every_check_with_the_expected_result() -> None:
    done = subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every check gave the expected result" in done.stdout


def test_check_sh_calls_a_search_cut_short_broken_not_a_pass(tmp_path: Path) -> None:
    # pan stops at its memory limit with "errors: 0" and "Search not
    # completed": a check that saw a fraction of the states must not pass.
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nexec gcc "$@" -DMEMLIM=16\n')  # the last -D wins
    cc.chmod(0o755)
    done = subprocess.run(
        ["bash", str(CHECK)],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "CC": str(cc)},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"WRONG +safety +model +expected pass got broken", done.stdout), done.stdout
