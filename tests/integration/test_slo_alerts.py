"""The chart's SLO alerts: they read only what the agent exports, promtool accepts the rules, and the rules fire over
synthetic series of a model that keeps violating its SLO (and stay quiet for one that does not). The autonomy
panels: tests/unit/test_chart_files.py."""

from __future__ import annotations

import pathlib

import chart
import yaml


def test_slo_rules_read_exported_metrics_and_fire(tmp_path: pathlib.Path) -> None:
    rendered = chart.template("-f", str(chart.GPU_VALUES))
    groups = rendered.get("PrometheusRule", "volga-slo")["spec"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    used = set().union(*(chart.metric_names(r["expr"]) for r in rules))
    assert used == {"volga_slo_violating_windows_total", "volga_slo_past_recovery_deadline"}
    assert used <= chart.exported_metric_names()
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    chart.run(chart.promtool(), "check", "rules", str(path))
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
    chart.promtool_test(path, series, [
        {"eval_time": "4m", "alertname": "VolgaSloViolationSustained", "exp_alerts": []},  # pending
        {"eval_time": "10m", "alertname": "VolgaSloViolationSustained", "exp_alerts": [{"exp_labels": expected}]},
        {"eval_time": "2m", "alertname": "VolgaSloRecoveryDeadlineMissed", "exp_alerts": []},
        {"eval_time": "4m", "alertname": "VolgaSloRecoveryDeadlineMissed", "exp_alerts": [{"exp_labels": expected}]},
    ], tmp_path / "slo-test.yaml")
