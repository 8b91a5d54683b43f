"""Volga installed as users install it, on a real node: `helm install` of the chart onto a kubelet that runs the
operator's Deployment and the agent DaemonSet from the images `make images` builds, a ModelSpec applied with
kubectl, CRIU freezing the worker from inside the agent's privileged container, an unmodified tritonclient request
through the gateway's ClusterIP Service (kube-proxy) waking it, and a real Prometheus discovering the pods through
the API server and scraping them. Then what users do to a running install: the agent pod deleted mid-traffic,
`helm upgrade`, a ModelSpec deleted, `helm uninstall`.

The tests run in order on one install (each leaves the state the next one starts from). What this node cannot do:
GPU devices (no GPU here: the tiers are HOT, FROZEN and COLD), and unprivileged workers under CRIU (root lacks
CAP_SYS_RESOURCE); a GPU cluster adds the NVIDIA container runtime, the `nvidia` runtime class and WARM/SUSPENDED.
"""

from __future__ import annotations

import json
import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_server import Prometheus
from tritonclient.utils import InferenceServerException

from volga_bench import cluster, realnode

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
MODEL = "node-ctr"
RESTORE_SERIES = "volga_snapshot_restore_latency_ms_count"


@pytest.fixture(scope="module")
def node() -> Iterator[realnode.RealNode]:
    try:
        started = realnode.RealNode()
    except realnode.MissingPartsError as exc:
        pytest.fail(f"{exc} (`make setup` installs and builds them)", pytrace=False)
    with started:
        started.import_images((*cluster.IMAGES, realnode.PAUSE_IMAGE))
        yield started


@pytest.fixture(scope="module")
def installed(node: realnode.RealNode) -> cluster.Installed:
    return cluster.install(node, node.root / "volga")


@pytest.fixture(scope="module")
def prometheus(node: realnode.RealNode, installed: cluster.Installed,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Prometheus as a cluster runs it: pods discovered through the API server, the agent's and the gateway's
    metrics ports (named in the pod spec) scraped."""
    scrape = {
        "job_name": "volga-pods",
        "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(node.kubeconfig),
                                   "namespaces": {"names": [installed.namespace]}}],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "action": "keep",
             "regex": "agent-metrics|gateway-metrics"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ],
    }
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), scrape_configs=[scrape])
    try:
        yield server
    finally:
        server.stop()


def worker_pids() -> set[int]:
    """The host's worker processes (any agent's): `python -m volga_agent.worker.serve`."""
    found = set()
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"volga_agent.worker.serve" in cmdline:
                found.add(int(entry.name))
    return found


def images(installed: cluster.Installed) -> list[pathlib.Path]:
    return sorted(installed.snapshots.rglob("pstree.img"))


def agent_pod(installed: cluster.Installed) -> dict[str, Any]:
    [pod] = [p for p in installed.pods("agent") if not p["metadata"].get("deletionTimestamp")]
    return pod


def test_install_freeze_wake_refreeze(node: realnode.RealNode, installed: cluster.Installed,
                                      prometheus: Prometheus) -> None:
    # The chart's pods run from the imported images on this node.
    for component in ("operator", "agent"):
        [pod] = installed.pods(component)
        assert pod["spec"]["nodeName"] == realnode.NODE_NAME
        assert cluster._pod_ready(pod), pod["status"]
    cluster.apply(node, cluster.modelspec(installed, MODEL))
    # The operator places one EMI; the agent cold-starts the worker and CRIU freezes it inside its container.
    node.wait("the EMI FROZEN", lambda: cluster.tiers(node, MODEL) == ["FROZEN"], timeout=300)
    assert images(installed), f"no CRIU image under {installed.snapshots}"
    assert not worker_pids(), "a FROZEN instance has no process"

    # An unmodified tritonclient through the gateway's ClusterIP wakes it; the answer is the model's own.
    answer = cluster.first_answer(installed.grpc_target(), MODEL, timeout=120)
    assert np.array_equal(answer, cluster.reference())
    node.wait("the EMI HOT", lambda: cluster.tiers(node, MODEL) == ["HOT"], timeout=30)
    assert len(worker_pids()) == 1
    # Idle for hot_idle_sec, it is frozen again.
    node.wait("the EMI FROZEN again after idling", lambda: cluster.tiers(node, MODEL) == ["FROZEN"], timeout=120)
    assert np.array_equal(cluster.ask(installed.grpc_target(), MODEL, seed=6), cluster.reference(6))

    # Prometheus found the pods through the API server and has the restore-latency series of those wakes.
    def restores() -> float | None:
        value = prometheus.scalar(f'sum({RESTORE_SERIES}{{tier="FROZEN"}})')
        return value if value and value >= 2 else None

    node.wait("the restore-latency series in Prometheus", restores, timeout=90)
    pods = {r["metric"].get("pod", "") for r in prometheus.query('up{job="volga-pods"} == 1')}
    assert pods == {agent_pod(installed)["metadata"]["name"]}, pods


def test_agent_pod_deleted_mid_traffic(node: realnode.RealNode, installed: cluster.Installed) -> None:
    old = agent_pod(installed)["metadata"]["name"]
    answers: list[bool] = []
    errors: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        seed = 10
        while not stop.is_set():
            try:
                out = cluster.ask(installed.grpc_target(), MODEL, seed=seed, timeout=30)
                answers.append(bool(np.array_equal(out, cluster.reference(seed))))
            except InferenceServerException as exc:
                errors.append(str(exc))  # the gateway's pod is going away: refused or unavailable
                time.sleep(0.2)
            seed += 1

    sender = threading.Thread(target=traffic)
    sender.start()
    try:
        node.wait("traffic answered", lambda: len(answers) >= 3, timeout=60)
        node.kubectl("delete", "pod", "-n", installed.namespace, old, "--wait=false")
        # The DaemonSet's new pod comes up and serves again.
        node.wait("a new agent pod Ready", lambda: any(
            p["metadata"]["name"] != old and cluster._pod_ready(p) for p in installed.pods("agent")), timeout=240)
        served = len(answers)
        node.wait("traffic answered by the new pod", lambda: len(answers) >= served + 3, timeout=120)
    finally:
        stop.set()
        sender.join(60)
    assert all(answers), "an answer differed from the model's own"
    # The old pod's workers died with it (nothing leaks): the new agent holds the only one.
    node.wait("one worker left", lambda: len(worker_pids()) <= 1, timeout=60)
    node.wait("the EMI reported by the new agent", lambda: cluster.tiers(node, MODEL) in (["HOT"], ["FROZEN"]),
              timeout=60)


def shared_role(node: realnode.RealNode, model: str) -> str:
    [emi] = cluster.emis(node, model)
    return str((emi.get("status", {}).get("sharedSnapshot") or {}).get("role", ""))


def test_helm_upgrade_keeps_frozen_images(node: realnode.RealNode, installed: cluster.Installed) -> None:
    node.wait("the EMI FROZEN", lambda: cluster.tiers(node, MODEL) == ["FROZEN"], timeout=120)
    kept = sorted((installed.snapshots / ".kept").rglob("pstree.img"))
    assert len(kept) == 1, f"one kept image expected under {installed.snapshots / '.kept'}: {kept}"
    old = agent_pod(installed)["metadata"]["name"]
    # A settings change rolls the agent pod (the settings checksum annotation). The agent's image is the same, so
    # the kept image's compatibility key holds, and the new agent restores it instead of cold-starting.
    node.helm("upgrade", installed.release, str(cluster.CHART), "--namespace", installed.namespace,
              *cluster.values_args(installed.folder, hot_idle_sec=cluster.HOT_IDLE_SEC,
                                   snapshot_interval_sec=45))
    node.wait("the upgraded agent pod Ready", lambda: any(
        p["metadata"]["name"] != old and cluster._pod_ready(p) for p in installed.pods("agent")), timeout=240)
    cluster.wait_ready(installed)
    node.wait("the EMI FROZEN under the new agent", lambda: cluster.tiers(node, MODEL) == ["FROZEN"], timeout=180)
    assert shared_role(node, MODEL) == "restored", cluster.emis(node, MODEL)[0]["status"]
    assert sorted((installed.snapshots / ".kept").rglob("pstree.img")) == kept
    assert np.array_equal(cluster.first_answer(installed.grpc_target(), MODEL, timeout=120, seed=7),
                          cluster.reference(7))


def test_modelspec_deleted(node: realnode.RealNode, installed: cluster.Installed) -> None:
    node.kubectl("delete", "ms", "-n", "default", MODEL, "--timeout=120s")
    node.wait("the EMIs gone", lambda: cluster.emis(node, MODEL) == [], timeout=120)
    node.wait("the workers gone", lambda: not worker_pids(), timeout=60)
    node.wait("the images gone", lambda: not images(installed), timeout=60)


def test_helm_uninstall_leaves_nothing(node: realnode.RealNode, installed: cluster.Installed) -> None:
    cluster.apply(node, cluster.modelspec(installed, "left-behind"))
    node.wait("a second model FROZEN", lambda: cluster.tiers(node, "left-behind") == ["FROZEN"], timeout=300)
    service_ip = installed.service_ip()
    node.helm("uninstall", installed.release, "--namespace", installed.namespace, "--wait", "--timeout", "180s")
    node.wait("the release's pods gone", lambda: not node.kubectl(
        "get", "pods", "-n", installed.namespace, "-o", "name").stdout.strip(), timeout=180)
    # No process, image, mount or Service rule of Volga's on the node.
    node.wait("no worker process", lambda: not worker_pids(), timeout=60)
    leftovers = [line for line in pathlib.Path("/proc/self/mounts").read_text().splitlines()
                 if "volga" in line and str(node.kubelet_root) in line]
    assert not leftovers, leftovers
    rules = realnode._out(["iptables-save", "-t", "nat"])
    assert service_ip not in rules, f"kube-proxy still routes {service_ip}"
    # Nor any image: the agent removed its own at its stop, and the kept ones because its DaemonSet was gone.
    assert not images(installed), [str(p) for p in images(installed)]
    # The CRDs stay (Helm never deletes a chart's crds/), and so do ModelSpecs; their EMIs say no agent serves them.
    out = json.loads(node.kubectl("get", "ms", "-n", "default", "-o", "json").stdout)
    assert [m["metadata"]["name"] for m in out["items"]] == ["left-behind"]
