"""The chart's SLO alerts and autonomy panels: they read only what the agent exports, promtool accepts the rules,
and the rules fire over synthetic series of a model that keeps violating its SLO (and stay quiet for one that does
not)."""

from __future__ import annotations

import json
import pathlib

import test_chart
import yaml


def test_slo_rules_read_exported_metrics_and_fire(tmp_path: pathlib.Path) -> None:
    rendered = test_chart.template("-f", str(test_chart.GPU_VALUES))
    groups = rendered.get("PrometheusRule", "volga-slo")["spec"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    used = set().union(*(test_chart.metric_names(r["expr"]) for r in rules))
    assert used == {"volga_slo_violating_windows_total", "volga_slo_past_recovery_deadline"}
    assert used <= test_chart.exported_metric_names()
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    test_chart.run(test_chart.promtool(), "check", "rules", str(path))
    bare = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]} for g in groups]
    path.write_text(yaml.safe_dump({"groups": bare}))
    node = {"node": "n1", "pod": "p1", "namespace": "volga-system"}
    labels = ",".join(f'{k}="{v}"' for k, v in node.items())
    series = [  # m: 8 of 10 windows a second violating (480 a minute); ok: 1 a second
        {"series": f'volga_slo_violating_windows_total{{model="m",{labels}}}', "values": "0+480x30"},
        {"series": f'volga_slo_violating_windows_total{{model="ok",{labels}}}', "values": "0+60x30"},
        {"series": f'volga_slo_past_recovery_deadline{{model="m",{labels}}}', "values": "0 0 1x30"},
        {"series": f'volga_slo_past_recovery_deadline{{model="ok",{labels}}}', "values": "0x30"},
    ]
    expected = {"severity": "warning", "model": "m", **node}
    unit = {
        "rule_files": [str(path)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "VolgaSloViolationSustained", "exp_alerts": []},  # pending
                {"eval_time": "10m", "alertname": "VolgaSloViolationSustained",
                 "exp_alerts": [{"exp_labels": expected}]},
                {"eval_time": "2m", "alertname": "VolgaSloRecoveryDeadlineMissed", "exp_alerts": []},
                {"eval_time": "4m", "alertname": "VolgaSloRecoveryDeadlineMissed",
                 "exp_alerts": [{"exp_labels": expected}]},
            ],
        }],
    }
    test_file = tmp_path / "slo-test.yaml"
    test_file.write_text(yaml.safe_dump(unit))
    out = test_chart.run(test_chart.promtool(), "test", "rules", str(test_file), check=False)
    assert out.returncode == 0, f"promtool test rules:\n{out.stdout}{out.stderr}"


def test_the_dashboard_shows_the_autonomy_loop() -> None:
    dashboard = json.loads(test_chart.DASHBOARD.read_text())
    used = set().union(*map(test_chart.metric_names, test_chart.promql_exprs(dashboard)))
    assert {"volga_autonomy_state", "volga_autonomy_decisions_total", "volga_slo_violating_windows_total",
            "volga_slo_past_recovery_deadline", "volga_autonomy_sample_jitter_ms_bucket",
            "volga_autonomy_decision_latency_us_bucket"} <= used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
