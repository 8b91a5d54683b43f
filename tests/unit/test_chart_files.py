"""The chart's files read as they are, without helm: every value commented, the chart's CRDs the generated ones,
and the dashboard reading only what the code exports (the autonomy loop's panels among them)."""

from __future__ import annotations

import json
import re

from chart import CHART, DASHBOARD, ROOT, exported_metric_names, metric_names, promql_exprs


def test_every_value_is_commented() -> None:
    """Each value in values.yaml has a comment line right above it, or sits inside a commented block."""
    lines = CHART.joinpath("values.yaml").read_text().splitlines()
    key = re.compile(r"^(\s*)([A-Za-z0-9_.\-/]+):(.*)$")
    stack: list[tuple[int, bool]] = []  # (indent, commented) of the enclosing keys
    missing = []
    for i, line in enumerate(lines):
        m = key.match(line)
        if not m or line.lstrip().startswith("#"):
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        previous = lines[i - 1].strip() if i else ""
        commented = previous.startswith("#") or any(c for _, c in stack)
        rest = m.group(3).split("#")[0].strip()
        following = next((ln for ln in lines[i + 1:] if ln.strip() and not ln.strip().startswith("#")), "")
        nested = len(following) - len(following.lstrip()) > indent or following.lstrip().startswith("- ")
        is_leaf = bool(rest) or not nested
        if is_leaf and not commented:
            missing.append(f"line {i + 1}: {line.strip()}")
        stack.append((indent, commented))
    assert not missing, "values without a comment:\n" + "\n".join(missing)


def test_chart_crds_are_the_generated_ones() -> None:
    """The chart ships the CRDs of crds/ (generated from volga_core.api) byte for byte."""
    generated = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    shipped = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert generated, "crds/ is empty"
    assert shipped.keys() == generated.keys()
    for name in generated:
        assert shipped[name] == generated[name], f"charts/volga/crds/{name} differs from crds/{name}: copy it"


def test_dashboard_reads_exported_metrics_only() -> None:
    exported = exported_metric_names()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = list(promql_exprs(dashboard))
    used = set().union(*map(metric_names, exprs))
    assert used - exported == set(), f"the dashboard reads metrics nobody exports: {sorted(used - exported)}"
    assert {"volga_snapshot_restore_latency_ms_bucket", "volga_activations_total", "volga_snapshot_evictions_total",
            "volga_snapshot_eviction_rate", "volga_gateway_request_latency_ms_bucket", "volga_gateway_requests_total",
            "volga_emis_active_total"} <= used
    titles = {p["title"]: p for p in dashboard["panels"]}
    for title, quantile, labels in (("Restore latency p50 by tier and model", "0.5", "(le, tier, model)"),
                                    ("Restore latency p99 by tier and model", "0.99", "(le, tier, model)")):
        (target,) = titles[title]["targets"]
        assert target["expr"].startswith(f"histogram_quantile({quantile}, sum by {labels}")
    gateway = [t["expr"] for t in titles["Gateway latency p50 / p99"]["targets"]]
    assert [e.split(",")[0] for e in gateway] == ["histogram_quantile(0.5", "histogram_quantile(0.99"]
    assert "sum by (code)" in titles["Requests by code"]["targets"][0]["expr"]


def test_the_dashboard_shows_the_autonomy_loop() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = set().union(*map(metric_names, promql_exprs(dashboard)))
    assert {"volga_autonomy_state", "volga_autonomy_decisions_total", "volga_slo_violating_windows_total",
            "volga_slo_past_recovery_deadline", "volga_autonomy_sample_jitter_ms_bucket",
            "volga_autonomy_decision_latency_us_bucket"} <= used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
