"""The Helm chart (charts/volga) and the images' Dockerfiles.

Rendered with the real helm (scripts/build-k8s-bins.sh builds it), linted with the real hadolint and promtool.
Nothing is skipped: a missing tool fails the test with the command that installs it. Installed into the real test
API server: tests/k8s/test_chart_k8s.py; the chart's files read without a tool: tests/unit/test_chart_files.py.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import re
import socket
import tempfile
from typing import Any

import pytest
import yaml
from chart import (
    CHART,
    DASHBOARD,
    GPU_VALUES,
    NAMESPACE,
    NEIGHBOURS,
    RELEASE,
    ROOT,
    Rendered,
    exported_metric_names,
    hadolint,
    helm,
    metric_names,
    promtool,
    promtool_test,
    run,
    template,
)

from volga_agent import auth
from volga_agent.node.settings import Settings
from volga_core import api

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
    ("", "secrets"): {"get"},  # a remote source's credentials, the Secret spec.sourceSecret names
}


# --- rendering -----------------------------------------------------------------------------------------------------


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


def test_dockerfiles_pass_hadolint() -> None:
    dockerfiles = [ROOT / "Dockerfile.operator", ROOT / "Dockerfile.agent"]
    proc = run(hadolint(), "--config", str(ROOT / ".hadolint.yaml"), *map(str, dockerfiles), check=False)
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"
    agent = (ROOT / "Dockerfile.agent").read_text()
    # CRIU comes from the same script `make setup` runs; the worker runtime from the `gpu` extra + onnxruntime-gpu.
    assert "install-criu.sh" in agent and "[gpu]" in agent and "onnxruntime-gpu==" in agent
    assert re.search(r'^ENTRYPOINT \["volga-agent"\]', agent, re.M)
    operator = (ROOT / "Dockerfile.operator").read_text()
    # Users build on python:3.11-slim by default; `make images` passes its own Debian base
    # (tests/images/test_images.py).
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", operator, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", operator, re.M)
    assert re.search(r"^USER 10001", operator, re.M) and re.search(r'^ENTRYPOINT \["volga-operator"\]', operator, re.M)


# --- what the chart renders ----------------------------------------------------------------------------------------


def test_default_values_render_the_core_objects_only(default: Rendered) -> None:
    # The Secret is the gateway's own ServiceAccount token (gateway-rbac.yaml).
    assert default.kinds() == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                               "Deployment", "DaemonSet", "Service", "ConfigMap", "NetworkPolicy", "Secret"}
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
    # The agent writes only its snapshot folder and its model cache on the host; other host paths are read-only.
    for mount in rendered.container("agent")["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "hostPath" in volume and mount["name"] not in ("snapshots", "model-cache"):
            assert mount.get("readOnly") is True, mount
    models = next(m for m in rendered.container("agent")["volumeMounts"] if m["name"] == "models")
    assert models["readOnly"] is True and volumes["models"]["hostPath"]["path"] == "/var/lib/volga/models"
    cache = next(m for m in rendered.container("agent")["volumeMounts"] if m["name"] == "model-cache")
    env = {e["name"]: e.get("value") for e in rendered.container("agent")["env"]}
    assert cache["mountPath"] == env["VOLGA_MODEL_CACHE"] == volumes["model-cache"]["hostPath"]["path"] == \
        "/var/lib/volga/model-cache" and env["VOLGA_MODEL_CACHE_BYTES"] == "0"


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
    settings = Settings.from_mapping(yaml.safe_load(text))
    assert "--settings=/etc/volga/settings.yaml" in rendered.container("agent")["args"]
    if values == "gpu":
        assert settings.scheduler_eviction_policy == "hybrid" and settings.budgets.host_memory_bytes == 256 * 2**30


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
    promtool_test(rules, series, [
        {"eval_time": "20m", "alertname": "VolgaRestoreLatencyAboveSLO",
         "exp_alerts": [{"exp_labels": {**warning, "tier": "FROZEN"}}]},
        {"eval_time": "20m", "alertname": "VolgaRestoreFailures",
         "exp_alerts": [{"exp_labels": {**warning, "tier": "SUSPENDED"}}]},
        {"eval_time": "2m", "alertname": "VolgaSnapshotCircuitOpen", "exp_alerts": []},  # still pending
        {"eval_time": "4m", "alertname": "VolgaSnapshotCircuitOpen",
         "exp_alerts": [{"exp_labels": {**warning, "node": "n1", "pod": "p1", "namespace": "volga-system"}}]},
    ], tmp_path / "alerts-test.yaml")


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
    assert set(writable) == {"/run", "/run/volga", "/dev/shm", "/var/lib/volga/snapshots", "/tmp",
                             "/var/lib/volga/home", "/var/lib/volga/model-cache"}
    # /run is a tmpfs, so CRIU keeps its kernel probes there (/run/criu.kdat) instead of probing in every call.
    assert volumes[mounts_of(agent)["/run"]["name"]]["emptyDir"]["medium"] == "Memory"
    for path, volume in writable.items():
        assert "emptyDir" in volume or path in ("/var/lib/volga/snapshots", "/var/lib/volga/model-cache"), (path,
                                                                                                            volume)
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["HOME"] == "/var/lib/volga/home" and env["TMPDIR"] == "/tmp"
    # The Agent API stays on the pod's loopback: no port of the pod, no probe on it.
    assert "--agent-host=127.0.0.1" in agent["args"]
    assert all(p["containerPort"] != 8010 for c in pod["containers"] for p in c["ports"])
    assert agent["readinessProbe"]["httpGet"]["port"] == "agent-metrics"
    writable_root = template("--set", "agent.readOnlyRootFilesystem=false")
    assert writable_root.container("agent")["securityContext"]["readOnlyRootFilesystem"] is False
    assert "scratch" not in {v["name"] for v in writable_root.agent_pod()["volumes"]}


@pytest.mark.parametrize("workdir", ["/run", "/run/"])
def test_the_workdir_cannot_be_the_agents_run(workdir: str) -> None:
    proc = run(helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set", f"agent.workdir={workdir}",
               check=False)
    assert proc.returncode != 0 and "agent.workdir: /run is the agent's own tmpfs" in proc.stderr, proc.stderr


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
    settings = Settings.from_mapping(yaml.safe_load(text))
    assert settings.model_roots == ("/var/lib/volga/models",) and settings.allow_model_code is False
    assert settings.max_instances == 0 and settings.budgets.host_memory_fraction == 0.8  # taken from the node
    moved = template("--set", "agent.models.hostPath=/data/models").get("ConfigMap", "volga-agent-settings")
    assert Settings.from_mapping(yaml.safe_load(moved["data"]["settings.yaml"])).model_roots == (
        "/data/models",)


def test_a_claim_turns_shared_snapshots_on(default: Rendered, gpu: Rendered) -> None:
    """persistentVolumeClaim mode mounts the volume's `.shared` folder beside the node's own and points
    settings.shared.folder at it; hostPath mode keeps its images on the node, with the kept copies in `.kept`."""
    mounts = [m for m in gpu.container("agent")["volumeMounts"] if m["name"] == "snapshots"]
    assert [m.get("subPathExpr") or m.get("subPath") for m in mounts] == ["$(NODE_NAME)", ".shared"]
    text = gpu.get("ConfigMap", "volga-agent-settings")["data"]["settings.yaml"]
    shared = Settings.from_mapping(yaml.safe_load(text)).shared
    assert (shared.folder, shared.node_local) == (mounts[1]["mountPath"], False)
    mount = next(m for m in default.container("agent")["volumeMounts"] if m["name"] == "snapshots")
    assert mount.get("subPath") is None
    text = default.get("ConfigMap", "volga-agent-settings")["data"]["settings.yaml"]
    shared = Settings.from_mapping(yaml.safe_load(text)).shared
    assert (shared.folder, shared.node_local) == (f"{mount['mountPath']}/.kept", True)
    off = template("--set", "agent.snapshots.keepAcrossRestarts=false")
    text = off.get("ConfigMap", "volga-agent-settings")["data"]["settings.yaml"]
    assert Settings.from_mapping(yaml.safe_load(text)).shared.folder == ""


def test_the_agent_reads_only_its_own_daemonset(default: Rendered) -> None:
    """The agent follows its DaemonSet (gone: uninstalled, and the kept images go too): one Role in the release
    namespace, on that one DaemonSet."""
    role = default.get("Role", "volga-agent")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": ["volga-agent"],
                              "verbs": ["get", "list", "watch"]}]
    binding = default.get("RoleBinding", "volga-agent")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "volga-agent", "namespace": NAMESPACE}]
    env = {e["name"]: e.get("value") for e in default.container("agent")["env"]}
    assert env["VOLGA_DAEMONSET"] == f"{NAMESPACE}/volga-agent"


def test_the_cluster_tier_renders_with_the_autonomy_loop_only(default: Rendered) -> None:
    """With agent.settings.autonomy_enabled the operator and the agents get the watermarks ConfigMap of the release
    namespace (the operator writes it, the agents watch it) and nothing more; without it, none of this renders."""
    assert {name for kind, name in default.by_key if kind in ("Role", "RoleBinding")} == {"volga-agent"}
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
    assert Settings.from_mapping(yaml.safe_load(text)).autonomy.enabled is True


# --- neighbours: the Agent API opened to the other agents (docs/architecture.md, "Neighbours") -----------------------

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
        assert Settings.from_mapping(yaml.safe_load(text)).neighbours.enabled is False
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
    settings = Settings.from_mapping(yaml.safe_load(
        rendered.get("ConfigMap", "volga-agent-settings")["data"]["settings.yaml"]))
    assert settings.neighbours.enabled is True and settings.autonomy.enabled is True

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


