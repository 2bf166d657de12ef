"""The protocol model (model/relay.pml) checked with Spin, through model/check.sh.

The correct model must pass its safety assertions and its liveness claim
under weak fairness; the FREEZE_BUG variant (rescue only inside a claim that
is skipped at the cap) must fail liveness with an acceptance cycle, which
shows the checker can find the freeze the relay once had. docs/model.md
explains the model and the figures.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.model

CHECK = Path(__file__).resolve().parent.parent / "model" / "check.sh"

if shutil.which("spin") is None:
    pytest.skip(
        "spin is not installed (apt-get install -y spin gcc); CI installs it",
        allow_module_level=True,
    )


def pan(mode: str, *defines: str) -> str:
    """One check's pan output (``check.sh run``): ``mode`` is safety or liveness."""
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


@dataclass(frozen=True)
class Check:
    """One line of check.sh's report, and the violation it printed under it."""

    verdict: str  # ok or WRONG
    expected: str  # pass or fail
    got: str  # pass, fail or broken (a search cut short, or no summary)
    violation: str  # pan's first "pan:1:" line for a failing check, else ""


_LINE = re.compile(
    r"^(ok|WRONG) +(safety|liveness) +(.+?) +expected (pass|fail) +got (pass|fail|broken)\b"
)


def checks(stdout: str) -> dict[tuple[str, str], Check]:
    """check.sh's report by (mode, label)."""
    found: dict[tuple[str, str], Check] = {}
    last: tuple[str, str] | None = None
    for line in stdout.splitlines():
        m = _LINE.match(line)
        if m:
            last = (m[2], m[3])
            found[last] = Check(m[1], m[4], m[5], "")
        elif last and line.strip().startswith("pan:1:"):
            found[last] = replace(found[last], violation=line.strip())
    return found


@pytest.fixture(scope="session")
def suite(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str
) -> tuple[subprocess.CompletedProcess[str], dict[tuple[str, str], Check]]:
    """model/check.sh as CI and docs/model.md run it: every check once (each
    check was also run on its own by a test, which doubled the model's time).

    Once per test run, not once per xdist process: the first process to need
    it runs it under a lock, in the run's own temporary folder, and the others
    read its report. Each process ran it before (three times under make
    test's -n 3, a minute of both CPUs each: the slowest setups of CI)."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent  # this run's folder, one per pytest run
    report = shared / "model-suite.json"
    with open(shared / "model-suite.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not report.exists():
            ran = subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, timeout=280)
            report.write_text(json.dumps([ran.returncode, ran.stdout, ran.stderr]))
        returncode, stdout, stderr = json.loads(report.read_text())
    done = subprocess.CompletedProcess(["bash", str(CHECK)], returncode, stdout, stderr)
    return done, checks(done.stdout)


def test_check_sh_runs_every_check_with_the_expected_result(suite: Any) -> None:
    done, found = suite
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every check gave the expected result" in done.stdout
    assert len(found) >= 14, done.stdout
    assert all(c.verdict == "ok" for c in found.values()), done.stdout


def test_the_model_is_safe_and_every_row_ends_done_or_dead(suite: Any) -> None:
    """Safety, and liveness under weak fairness: check.sh calls a search that
    did not see every state "broken", never "pass"."""
    _, found = suite
    for mode in ("safety", "liveness"):
        assert found[(mode, "model")].got == "pass", found
    for label in ("max_attempts 3", "cap 2", "3 workers"):
        assert found[("safety", label)].got == "pass", found


def test_a_claim_that_leaves_rows_for_following_runs_still_ends_every_row(suite: Any) -> None:
    """The claim's hold (queries.sql frag_held) where the cap does not
    already stop the claim: live with its queue rule, not without it."""
    _, found = suite
    assert found[("liveness", "hold, cap 2")].got == "pass", found
    always = found[("liveness", "HOLD_ALWAYS, cap 2")]
    assert always.got == "fail" and "acceptance cycle" in always.violation, always


def test_the_historical_freeze_fails_liveness_and_only_liveness(suite: Any) -> None:
    _, found = suite
    assert found[("safety", "FREEZE_BUG")].got == "pass"
    freeze = found[("liveness", "FREEZE_BUG")]
    assert freeze.got == "fail"
    assert "acceptance cycle" in freeze.violation
    # The same check as pan prints it, through ``check.sh run``.
    out = pan("liveness", "-DFREEZE_BUG")
    assert "acceptance cycle" in out.replace("acceptance   cycles", ""), out
    assert errors(out) == 1, out


@pytest.mark.parametrize(
    ("label", "violated"),
    [
        # The fence without its lease test lets a stale write through.
        ("WEAK_FENCE (no lease test)", "&& !(ended[r]))"),
        # Without its version test, an older lease's worker writes into a
        # newer lease of the row.
        ("NO_VERSION_FENCE", "assertion violated ((wv[w]==ver[wr[w]])"),
        # Without its began_version guard, a release takes the lease of a
        # delivery that began (docs/model.md, finding 2).
        ("NO_STEAL, RELEASE_BEGUN", "assertion violated"),
        # Duplicated tasks by design (docs/model.md).
        ("EXCLUSIVE", "assertion violated"),
    ],
)
def test_the_checker_finds_known_violations(suite: Any, label: str, violated: str) -> None:
    _, found = suite
    check = found[("safety", label)]
    assert (check.expected, check.got) == ("fail", "fail"), check
    assert violated in check.violation, check


@pytest.mark.parametrize(
    "label",
    [
        # It failed before the release left begun rows alone (unless_begun).
        "NO_STEAL",
        # It failed before begin counted once per lease version (migration 0005).
        "STRICT_ATTEMPTS",
        "STRICT_ATTEMPTS, no duplicates",
    ],
)
def test_the_fixed_findings_hold(suite: Any, label: str) -> None:
    _, found = suite
    assert found[("safety", label)].got == "pass", found


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
        # The model's two checks are enough (ONLY): the whole suite again
        # took a minute under CI's load.
        env={**os.environ, "CC": str(cc), "ONLY": "^model$"},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"WRONG +safety +model +expected pass got broken", done.stdout), done.stdout
    assert len(checks(done.stdout)) == 2, done.stdout
