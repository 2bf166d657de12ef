"""The docs keep up with the code: every setting is documented, every alert has a
runbook entry, every make variable shown is one the Makefile reads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from outbox_relay import Settings

DOCS = Path(__file__).resolve().parent.parent / "docs"
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_every_setting_is_in_configuration_md() -> None:
    text = (DOCS / "configuration.md").read_text()
    for f in fields(Settings):
        for name in (f"`{f.name}`", f"`outbox_{f.name}`", f"`OUTBOX_{f.name.upper()}"):
            assert name in text, f"docs/configuration.md does not mention {name}"


def test_every_alert_has_a_runbook_entry() -> None:
    alerts = re.findall(r"- alert: (\w+)", (DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert len(alerts) >= 5
    headings = "\n".join(
        line for line in (DOCS / "operations.md").read_text().splitlines() if line.startswith("#")
    )
    for alert in alerts:
        assert alert in headings, f"docs/operations.md has no section for {alert}"


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings (lower case, punctuation
    dropped, spaces to hyphens)."""
    headings = re.findall(r"^#{1,6} (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_resolve() -> None:
    """Every link from the docs and the README to a page, and to a heading
    of one, leads somewhere (pages are split and headings renamed often)."""
    for page in [*DOCS.glob("*.md"), DOCS.parent / "README.md"]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
        for target, anchor in re.findall(r"\]\(([^)#:\s]*\.md|)(?:#([^)\s]*))?\)", text):
            if not target and not anchor:
                continue
            linked = page.parent / target if target else page
            assert linked.is_file(), f"{page.name} links to missing {target}"
            if anchor:
                assert anchor in _anchors(linked), (
                    f"{page.name} links to {target}#{anchor}: no such heading"
                )


def test_integrations_python_examples_compile_and_links_resolve() -> None:
    """docs/integrations.md's snippets are Python as written, and the examples
    it points to exist (each is run by tests/test_examples.py)."""
    page = DOCS / "integrations.md"
    text = page.read_text()
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", text, re.MULTILINE | re.DOTALL)
    assert len(blocks) >= 8
    for indent, block in blocks:
        code = "\n".join(line[len(indent) :] for line in block.splitlines())
        compile(code, f"{page.name} snippet", "exec")
    for target in re.findall(r"\]\((\.\./[^)#]+)\)", text):
        assert (page.parent / target).exists(), f"integrations.md links to missing {target}"
    for folder in ("fastapi_app", "django_project"):
        readme = (DOCS.parent / "examples" / folder / "README.md").read_text()
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme):
            assert (DOCS.parent / "examples" / folder / target).exists(), (folder, target)


def test_make_variables_in_the_docs_are_read_and_a_misspelled_one_is_refused() -> None:
    """Every ``make target VAR=...`` the docs show names a variable the
    Makefile reads; a misspelled one stops make before it runs anything."""
    root = DOCS.parent
    shown = set()
    for page in [*DOCS.glob("*.md"), root / "README.md"]:
        shown.update(re.findall(r"\bmake [a-z-]+ ([A-Z_]+)=", page.read_text()))
    assert "SOAK_SECONDS" in shown and "FAULT_JOBS" in shown
    for name in sorted(shown):
        ran = subprocess.run(
            ["make", "-n", "clean", f"{name}=1"], cwd=root, capture_output=True, text=True
        )
        assert ran.returncode == 0, f"make refuses {name}, which the docs show: {ran.stderr}"
    ran = subprocess.run(
        ["make", "-n", "soak", "SOAK_SECOND=60"], cwd=root, capture_output=True, text=True
    )
    assert ran.returncode != 0
    assert "unknown variable(s) SOAK_SECOND" in ran.stderr
    assert ".venv/bin/pytest" not in ran.stdout


def test_test_variables_in_the_docs_are_read_and_a_misspelled_one_is_refused() -> None:
    """A misspelled ``OUTBOX_TEST_DNS`` stops the run by name instead of
    sending it to the embedded servers."""
    from .conftest import TEST_VARIABLES

    root = DOCS.parent
    for page in [*DOCS.glob("*.md"), root / "README.md"]:
        for name in re.findall(r"OUTBOX_TEST_[A-Z_]+[A-Z]", page.read_text()):
            assert name in TEST_VARIABLES, f"{page.name} shows {name}, which no test reads"
    env = {**os.environ, "OUTBOX_TEST_DNS": "postgresql://x@127.0.0.1/x"}
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "--collect-only", "-q", "tests/test_docs.py"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 4, ran.stdout + ran.stderr
    assert "OUTBOX_TEST_DNS (did you mean OUTBOX_TEST_DSN?)" in ran.stderr


def test_every_exported_name_is_in_the_api_reference() -> None:
    """docs/api.md lists each public module's __all__ under the module's
    heading: a name exported but never explained was a walkthrough finding."""
    import importlib

    text = (DOCS / "api.md").read_text()
    sections = dict(re.findall(r"^## `([\w.]+)`[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    modules = {
        "outbox_relay": "outbox_relay",
        "outbox_relay.aio": "outbox_relay.aio",
        "outbox_relay.celery": "outbox_relay.celery",
        "outbox_relay.publishers": "outbox_relay.publishers",
        "outbox_relay.inbox": "outbox_relay.inbox",
        "outbox_relay.operations": "outbox_relay.operations",
        "outbox_relay.integrations.sqlalchemy": "outbox_relay.integrations.sqlalchemy",
        "outbox_relay.integrations.sqlalchemy_asyncio": "outbox_relay.integrations.sqlalchemy",
    }
    missing = []
    for module, heading in modules.items():
        listed = set(re.findall(r"`(\w+)`", sections[heading]))
        missing += [
            f"{module}.{n}" for n in importlib.import_module(module).__all__ if n not in listed
        ]
    assert not missing, f"not in docs/api.md: {missing}"
