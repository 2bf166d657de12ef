"""deploy/: the dashboard and alerts use only metrics the exporter serves, and
the alert rules pass their promtool unit tests (where promtool is installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from outbox_relay import Claimed, Outcome
from outbox_relay.metrics import MetricsObserver, OutboxCollector
from outbox_relay.model import LeaseRef

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
METRIC = re.compile(r"\boutbox_[a-z_]+\b")


def served_names() -> set[str]:
    """Every sample name the exporter can serve (worker metrics and DB gauges)."""
    registry = CollectorRegistry()
    observer = MetricsObserver(registry)
    msg = Claimed(1, 1, 1, "order", "1", "order.created", {})
    observer.published(msg, Outcome.done(msg), 0.01)
    observer.finalized(msg, Outcome.done(msg), 1.0)
    observer.lost_lease(LeaseRef(1, 1), "finalize")
    observer.stale(LeaseRef(1, 1), "test")
    text = generate_latest(registry).decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    names |= {family.name for family in OutboxCollector("").describe()}
    return names


def test_dashboard_queries_served_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "outbox-relay.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 10
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used <= served_names(), used - served_names()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_alerts_use_served_metrics() -> None:
    text = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    exprs = re.findall(r"expr: (?:>-\n)?(.*?)\n\s+(?:for|labels):", text, re.S)
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert {"outbox_messages", "outbox_oldest_pending_age_seconds", "outbox_expired_leases",
            "outbox_lost_leases_total"} <= used  # fmt: skip
    assert used <= served_names(), used - served_names()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_checks_config_and_alert_unit_tests() -> None:
    folder = DEPLOY / "prometheus"
    for args in (["check", "config", "prometheus.yml"], ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run(
            ["promtool", *args], cwd=folder, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
