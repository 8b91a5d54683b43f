"""The Helm chart installed into the real test API server (etcd + kube-apiserver with RBAC on,
volga_bench/controlplane.py), where the agent's, the operator's and the gateway's ServiceAccounts are asked what
they may do, and the neighbours' generated token is kept across upgrades."""

from __future__ import annotations

import json

import pytest
import yaml
from chart import CHART, GPU_VALUES, NAMESPACE, NEIGHBOURS, RELEASE, helm, run

from volga_bench.controlplane import ControlPlane

pytest_plugins = ["k8s_fixtures"]

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
    ("get", "secrets", "-n", "default"),  # the one a ModelSpec names for its remote source, by name
]
AGENT_FORBIDDEN = [
    ("list", "nodes"), ("delete", "nodes"), ("update", "nodes"), ("create", "pods"), ("list", "secrets", "-A"),
    ("watch", "secrets", "-A"),
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


GATEWAY_ALLOWED = [("list", "modelspecs.volga.dev", "-A"), ("watch", "executablemodelinstances.volga.dev", "-A")]
GATEWAY_FORBIDDEN = [("patch", "nodes"), ("get", "nodes"), ("get", "secrets", "-A"),
                     ("patch", "executablemodelinstances.volga.dev", "--subresource=status"), ("*", "*")]


def test_the_gateway_account_only_reads(installed: ControlPlane) -> None:
    wrong = [" ".join(c) + " -> no" for c in GATEWAY_ALLOWED if not can_i(installed, "volga-gateway", *c)]
    wrong += [" ".join(c) + " -> yes" for c in GATEWAY_FORBIDDEN if can_i(installed, "volga-gateway", *c)]
    assert not wrong, "volga-gateway: " + "; ".join(wrong)
    secret = json.loads(installed.kubectl("get", "secret", "volga-gateway-token", "-n", NAMESPACE, "-o",
                                          "json").stdout)
    assert secret["type"] == "kubernetes.io/service-account-token"


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
