"""The Grafana dashboard kept as code (stam/ops/dashboard.py) and its committed JSON copies."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

pytest.importorskip("grafana_foundation_sdk", reason="the deploy extra (make deploy-setup)")

from stam.ops import dashboard  # noqa: E402
from stam.ops.helm_check import promtool  # noqa: E402

FORBIDDEN = {"patient", "patient_id", "subject", "subject_id", "pseudonym", "mrn"}


def test_committed_json_is_up_to_date() -> None:
    stale = [str(p.relative_to(dashboard.ROOT)) for p in dashboard.stale()]
    assert stale == [], "run `python -m stam.ops.dashboard --write`"


def test_staleness_is_detected(tmp_path: Path) -> None:
    old = tmp_path / "stam.json"
    old.write_text(dashboard.render().replace("Entries/s per stage", "Entries per stage"))
    assert dashboard.stale((old,)) == [old]


def test_panels_cover_what_the_issue_asks() -> None:
    titles = {t for t, _ in dashboard.queries()}
    for wanted in ["Entries/s per stage", "Stage latency p50/p99", "Hop wait p50/p99", "Commit and delivery p50/p99",
                   "Transitions by kind and reason",
                   "Dead letters by stage and error type", "Consumer lag per topic and partition",
                   "Link and impact work at the updater",
                   "Queries/s", "Query latency p50/p99", "HISTORY served", "Served tokens", "Language-model calls/s",
                   "Language-model tokens/s", "Language-model latency p50/p99", "Process memory (RSS)"]:
        assert wanted in titles
    panels = [p for p in dashboard.build()["panels"] if p["type"] == "timeseries"]
    assert all(p["datasource"]["uid"] == "${datasource}" and p["targets"] for p in panels)


def _check_with_promtool(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    rules = [{"record": f"stam:dashboard_query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    tool = promtool()
    assert tool is not None
    return subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True)


def test_every_expression_parses(tmp_path: Path) -> None:
    if promtool() is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    exprs = [e for _, e in dashboard.queries()]
    proc = _check_with_promtool(exprs, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # ... and the check can fail.
    assert _check_with_promtool(["sum by (stage (rate(stam_messages_total[1m]))"], tmp_path).returncode != 0


def test_grafana_macros_are_substituted() -> None:
    raw = [e for _, e in dashboard.queries(None)]
    assert any("$__rate_interval" in e for e in raw)
    assert not any("$" in e for _, e in dashboard.queries("2m"))


def _labels(expr: str) -> set[str]:
    """Label names an expression groups by, matches on or prints."""
    names: set[str] = set()
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        names.update(n.strip() for n in clause.split(",") if n.strip())
    for matchers in re.findall(r"\{([^{}]*)\}", expr):
        names.update(m.group(1) for m in re.finditer(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    return names


def test_no_patient_label_in_any_query_or_legend() -> None:
    assert _labels('sum by (patient_id) (x{subject="1"})') == {"patient_id", "subject"}  # the check can fail
    board = dashboard.build()
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            assert not _labels(target["expr"]) & FORBIDDEN, target["expr"]
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            assert not legend & FORBIDDEN, target["legendFormat"]


def test_no_patient_label_on_any_declared_metric() -> None:
    import prometheus_client

    import stam.llm.client  # noqa: F401 - declares stam_llm_*
    import stam.metrics  # noqa: F401

    labelled = {}
    for collector in list(prometheus_client.REGISTRY._collector_to_names):  # noqa: SLF001
        names = getattr(collector, "_labelnames", None)
        if names is not None and getattr(collector, "_name", "").startswith("stam_"):
            labelled[collector._name] = set(names)  # noqa: SLF001
    assert "stam_messages_total" in labelled or "stam_messages" in labelled
    bad = {name: labels & FORBIDDEN for name, labels in labelled.items() if labels & FORBIDDEN}
    assert bad == {}


def test_dashboard_uses_declared_metrics() -> None:
    """Every stam_* metric a query names is declared in the code (or in the list of those the service surface
    adds); a renamed metric would leave a panel empty."""
    import prometheus_client

    import stam.llm.client  # noqa: F401
    import stam.metrics  # noqa: F401

    declared: set[str] = set()
    for names in prometheus_client.REGISTRY._collector_to_names.values():  # noqa: SLF001
        declared.update(names)
    # Declared by the service-surface work of issue 14 (stam/metrics.py there): gauges of the workers.
    declared.update({"stam_consumer_lag", "stam_ready"})
    used = {m for _, e in dashboard.queries() for m in re.findall(r"\b(stam_[a-z_]+)\b", e)}
    assert used - declared == set()
