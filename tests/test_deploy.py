"""deploy/: the dashboard and alerts use only metrics the exporter serves, and
the alert rules pass their promtool unit tests (where promtool is installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from outbox_relay import Claimed, Outcome
from outbox_relay.metrics import _STATUSES as STATUSES
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


def served_labels() -> dict[str, dict[str, set[str]]]:
    """Each served sample name's labels, with the values they take."""
    registry = CollectorRegistry()
    observer = MetricsObserver(registry)
    msg = Claimed(1, 1, 1, "order", "1", "order.created", {})
    for outcome in (
        Outcome.done(msg),
        Outcome.retry(msg, delay=timedelta(seconds=1), error="retryable: 503"),
        Outcome.dead(msg, error="permanent: 400"),
    ):
        observer.published(msg, outcome, 0.01)
        observer.finalized(msg, outcome, 1.0)
    found: dict[str, dict[str, set[str]]] = {}
    for family in registry.collect():
        for sample in family.samples:
            labels = found.setdefault(sample.name, {})
            for name, value in sample.labels.items():
                labels.setdefault(name, set()).add(value)
    # The database gauges (they need a database to collect).
    for family in OutboxCollector("").describe():
        found.setdefault(family.name, {})
    found["outbox_messages"] = {"status": set(STATUSES)}
    return found


SELECTOR = re.compile(r"\b(outbox_[a-z_]+)\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = {"job", "instance", "pod"}


def all_queries() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "outbox-relay.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    alerts = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    exprs += re.findall(r"expr: (?:>-\n)?(.*?)\n\s+(?:for|labels):", alerts, re.S)
    return exprs


def test_queries_use_served_labels_and_values() -> None:
    # A misspelled label or value (status="daed", outcome="sucess") is a
    # query that matches nothing: a panel that stays empty, an alert that
    # never fires.
    served = served_labels()
    every_label = TARGET_LABELS | {name for labels in served.values() for name in labels}
    checked = 0
    for expr in all_queries():
        for metric, body in SELECTOR.findall(expr):
            labels = served[metric]
            for name, op, value in MATCHER.findall(body):
                if name in TARGET_LABELS:
                    continue
                assert name in labels, f"{metric} has no label {name!r}: {expr}"
                if op in ("=", "!="):
                    assert value in labels[name], f"{metric}{{{name}={value!r}}}: {expr}"
                checked += 1
        for grouping in GROUPING.findall(expr):
            for name in filter(None, (part.strip() for part in grouping.split(","))):
                assert name in every_label, f"no served metric has label {name!r}: {expr}"
    assert checked >= 5  # the status and outcome selectors were seen


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
