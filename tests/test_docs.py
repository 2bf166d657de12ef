"""The docs keep up with the code: every setting is documented, every alert has a runbook entry."""

from __future__ import annotations

import re
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


def test_relative_links_resolve() -> None:
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).is_file(), f"{page.name} links to missing {target}"


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
