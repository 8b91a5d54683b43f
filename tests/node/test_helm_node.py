"""Volga installed as users install it, on a real node: `helm install` of the chart onto a kubelet that runs the
operator's Deployment and the agent DaemonSet from the images `make images` builds, a ModelSpec applied with
kubectl, CRIU freezing the worker from inside the agent's privileged container, an unmodified tritonclient request
through the gateway's ClusterIP Service (kube-proxy) waking it, and a real Prometheus scraping the pods at the
addresses the API server lists for them. Then what users do to a running install: the agent pod deleted mid-traffic,
`helm upgrade`, a ModelSpec deleted, `helm uninstall`.

The tests run in order on one install (each leaves the state the next one starts from). What this node cannot do:
GPU devices (no GPU here: the tiers are HOT, FROZEN and COLD), and unprivileged workers under CRIU (root lacks
CAP_SYS_RESOURCE); a GPU cluster adds the NVIDIA container runtime, the `nvidia` runtime class and WARM/SUSPENDED.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_server import Prometheus
from tritonclient.utils import InferenceServerException

from volga_bench import cluster, realnode
from volga_core import api

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
MODEL = "node-ctr"
RESTORE_SERIES = "volga_snapshot_restore_latency_ms_count"
SERVER_FILE = pathlib.Path(__file__).resolve().parents[1] / "servers" / "aiohttp_stream_server.py"


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
    # Model code allowed, for the server ModelSpecs (the upgrade below sets the values again without it).
    return cluster.install(node, node.root / "volga", "--set", "agent.settings.allow_model_code=true")


class PodTargets:
    """Prometheus's scrape targets, the pods' metrics ports as the API server lists them. A cluster's Prometheus
    discovers them itself (kubernetes_sd_configs); Debian's build leaves Kubernetes discovery out, so the test
    writes what the discovery would find into a file Prometheus watches (file_sd_configs)."""

    def __init__(self, installed: cluster.Installed, path: pathlib.Path) -> None:
        self.installed, self.path = installed, path

    def refresh(self) -> None:
        groups = []
        for pod in self.installed.pods("agent"):
            ip = pod.get("status", {}).get("podIP")
            ports = [p for c in pod["spec"]["containers"] for p in c.get("ports", [])
                     if p.get("name") in ("agent-metrics", "gateway-metrics")]
            if ip and not pod["metadata"].get("deletionTimestamp"):
                groups.append({"targets": [f"{ip}:{p['containerPort']}" for p in ports],
                               "labels": {"pod": pod["metadata"]["name"]}})
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.rename(self.path)


@pytest.fixture(scope="module")
def prometheus(installed: cluster.Installed, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[Prometheus, PodTargets]]:
    folder = tmp_path_factory.mktemp("prometheus")
    targets = PodTargets(installed, folder / "pods.json")
    targets.refresh()
    scrape = {"job_name": "volga-pods", "file_sd_configs": [{"files": [str(targets.path)], "refresh_interval": "1s"}]}
    server = Prometheus(folder, scrape_configs=[scrape])
    try:
        yield server, targets
    finally:
        server.stop()


def pod_pids(matches: Callable[[pathlib.Path, list[bytes]], bool]) -> set[int]:
    """The processes in pods (a cgroup under the kubelet's `kubepods`) that `matches` (their /proc folder and command
    line) picks: the agent pods' own, not those of other tests running on this machine."""
    found = set()
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"/kubepods" in (entry / "cgroup").read_bytes() and matches(
                        entry, (entry / "cmdline").read_bytes().split(b"\0")):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def worker_pids() -> set[int]:
    """The node's worker processes in pods (`python -m volga_agent.worker.serve`)."""
    return pod_pids(lambda _, cmdline: b"volga_agent.worker.serve" in cmdline)


def images(installed: cluster.Installed) -> list[pathlib.Path]:
    return sorted(installed.snapshots.rglob("pstree.img"))


def agent_pod(installed: cluster.Installed) -> dict[str, Any]:
    [pod] = [p for p in installed.pods("agent") if not p["metadata"].get("deletionTimestamp")]
    return pod


def test_install_freeze_wake_refreeze(node: realnode.RealNode, installed: cluster.Installed,
                                      prometheus: tuple[Prometheus, PodTargets]) -> None:
    # The chart's pods run from the imported images on this node.
    for component in ("operator", "agent"):
        [pod] = installed.pods(component)
        assert pod["spec"]["nodeName"] == realnode.NODE_NAME
        assert cluster.pod_ready(pod), pod["status"]
    cluster.apply(node, cluster.modelspec(installed, MODEL))
    # The operator places one EMI; the agent cold-starts the worker and CRIU freezes it inside its container.
    node.wait("the EMI FROZEN", lambda: cluster.tiers(node, MODEL) == ["FROZEN"], timeout=300)
    assert images(installed), f"no CRIU image under {installed.snapshots}"
    assert not worker_pids(), "a FROZEN instance has no process"
    # criu in the agent's container reads its kernel probes from the cache the freeze left, rather than probing the
    # kernel again in every restore (~40 ms of each wake; it needs a tmpfs on /run, which the chart mounts).
    pod = agent_pod(installed)["metadata"]["name"]
    check = node.kubectl("exec", "-n", installed.namespace, pod, "-c", "agent", "--", "sh", "-c",
                         '"$VOLGA_CRIU" check -v4 -o /tmp/kdat-check.log >/dev/null 2>&1; cat /tmp/kdat-check.log')
    assert "Loaded kdat cache from /run/criu.kdat" in check.stdout, check.stdout[-2000:]

    # An unmodified tritonclient through the gateway's ClusterIP wakes it; the answer is the model's own.
    answer = cluster.first_answer(installed.grpc_target(), MODEL, timeout=120)
    assert np.array_equal(answer, cluster.reference())
    node.wait("the EMI HOT", lambda: cluster.tiers(node, MODEL) == ["HOT"], timeout=30)
    assert len(worker_pids()) == 1
    # Idle for a few seconds (cluster.IDLE_SETTINGS), it is frozen again.
    node.wait("the EMI FROZEN again after idling", lambda: cluster.tiers(node, MODEL) == ["FROZEN"], timeout=120)
    assert np.array_equal(cluster.ask(installed.grpc_target(), MODEL, seed=6), cluster.reference(6))

    # Prometheus scrapes the pods and has the restore-latency series of those wakes.
    server, _ = prometheus

    def restores() -> float | None:
        value = server.scalar(f'sum({RESTORE_SERIES}{{tier="FROZEN"}})')
        return value if value and value >= 2 else None

    node.wait("the restore-latency series in Prometheus", restores, timeout=90)
    pods = {r["metric"].get("pod", "") for r in server.query('up{job="volga-pods"} == 1')}
    assert pods == {agent_pod(installed)["metadata"]["name"]}, pods


def server_pids(installed: cluster.Installed, model: str) -> set[int]:
    """The processes in pods that run the server ModelSpec `model`: its file, in its folder of the models folder."""
    folder = str(installed.models / model)
    return pod_pids(lambda entry, cmdline: b"server.py" in cmdline and os.readlink(entry / "cwd") == folder)


def server_modelspec(installed: cluster.Installed, name: str, listen: str) -> dict[str, Any]:
    """A user's aiohttp app copied into the node's models folder, run by the agent image's Python, listening on a
    Unix socket in its instance's folder or on a port of the pod the agent gives it; its floor FROZEN."""
    folder = installed.models / name
    folder.mkdir(exist_ok=True)
    shutil.copyfile(SERVER_FILE, folder / "server.py")
    folder.chmod(0o755)
    where = ["--unix", "{socket}"] if listen == "unix" else ["--port", "{port}"]
    canary = {"path": "/v1/generate", "body": json.dumps({"prompt": "canary", "tokens": 4})}
    return {"apiVersion": api.API_VERSION, "kind": "ModelSpec",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"modelId": name, "framework": "server", "source": str(folder), "pool": {"hot": 0, "frozen": 1},
                     "server": {"command": ["python", "server.py", *where], "listen": listen,
                                "readiness": {"path": "/health"}, "canary": canary}}}


def stream(installed: cluster.Installed, model: str) -> list[bytes]:
    """A streamed answer through the gateway Service's HTTP port, chunk by chunk as they come."""
    request = urllib.request.Request(
        f"http://{installed.service_ip()}:8000/v1/stream", headers={"x-model-id": model,
                                                                    "Content-Type": "application/json"},
        data=json.dumps({"prompt": "volga", "tokens": 6, "delay_ms": 30}).encode())
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200, reply.status
        chunks = []
        while chunk := reply.read1():
            chunks.append(chunk)
        return chunks


def woken_through_the_service(node: realnode.RealNode, installed: cluster.Installed, server: Prometheus,
                              name: str) -> None:
    """The server ModelSpec `name`, FROZEN: woken by a streamed request, the same events as HOT, frozen again."""
    assert not server_pids(installed, name), f"{name} FROZEN, yet its processes run"
    woken = stream(installed, name)
    node.wait(f"{name} HOT", lambda: cluster.tiers(node, name) == ["HOT"], timeout=30)
    assert len(server_pids(installed, name)) == 1, f"{name} HOT, yet not one server process"
    hot = stream(installed, name)
    assert len(woken) > 1 and b"".join(woken) == b"".join(hot), (woken, hot)
    assert b"".join(woken).count(b"data: ") == 7, woken
    # Woken from its image, not started again: counted as a FROZEN wake, and no restore failed.
    node.wait(f"{name}'s wake from FROZEN in Prometheus", lambda: server.scalar(
        f'sum(volga_activations_total{{model="{name}",tier="FROZEN"}})'), timeout=60)
    failures = server.scalar(f'sum(volga_snapshot_restore_failures_total{{model="{name}"}})')
    assert not failures, f"{name}: {failures} wakes fell back to a cold start"
    node.wait(f"{name} FROZEN again once idle", lambda: cluster.tiers(node, name) == ["FROZEN"], timeout=120)
    assert b"".join(stream(installed, name)) == b"".join(hot)


def deleted(node: realnode.RealNode, installed: cluster.Installed, name: str) -> None:
    node.kubectl("delete", "ms", "-n", "default", name, "--timeout=120s")
    node.wait(f"{name}'s EMI gone", lambda: cluster.emis(node, name) == [], timeout=120)
    node.wait(f"{name}'s processes gone", lambda: not server_pids(installed, name), timeout=60)
    node.wait(f"{name}'s image removed", lambda: not [p for p in images(installed) if name in str(p)], timeout=60)


def test_servers_in_the_agent_pod_frozen_and_woken_through_the_service(
        node: realnode.RealNode, installed: cluster.Installed, prometheus: tuple[Prometheus, PodTargets]) -> None:
    """A user's own server (framework: server) as the chart runs it: started by the agent in its container, frozen by
    CRIU there, woken by a streamed request through the gateway Service (the gateway container, not root, reaching a
    Unix socket through the pod's fsGroup, or the server's port on the pod's loopback), the same events as HOT, in
    more than one chunk; frozen again once idle; deleted with its image."""
    server, targets = prometheus
    names = ("node-stream-uds", "node-stream-tcp")
    cluster.apply(node, server_modelspec(installed, names[0], "unix"))
    cluster.apply(node, server_modelspec(installed, names[1], "port"))
    try:
        node.wait("the servers FROZEN", lambda: all(cluster.tiers(node, n) == ["FROZEN"] for n in names), timeout=240)
    except realnode.NodeError:
        pod = agent_pod(installed)["metadata"]["name"]
        logs = node.kubectl("logs", "-n", installed.namespace, pod, "-c", "agent", "--tail", "60").stdout
        pytest.fail(f"{[cluster.emis(node, n) for n in names]}\n--- the agent:\n{logs}")
    targets.refresh()
    for name in names:
        woken_through_the_service(node, installed, server, name)
    for name in names:
        deleted(node, installed, name)


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
            p["metadata"]["name"] != old and cluster.pod_ready(p) for p in installed.pods("agent")), timeout=240)
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
              *cluster.values_args(installed.folder, **cluster.IDLE_SETTINGS, snapshot_interval_sec=45))
    node.wait("the upgraded agent pod Ready", lambda: any(
        p["metadata"]["name"] != old and cluster.pod_ready(p) for p in installed.pods("agent")), timeout=240)
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
    pods = f"{node.kubelet_root}/pods/"
    leftovers = [line for line in pathlib.Path("/proc/self/mounts").read_text().splitlines()
                 if line.split()[1].startswith(pods)]
    assert not leftovers, leftovers
    rules = realnode._out(["iptables-save", "-t", "nat"])
    assert service_ip not in rules, f"kube-proxy still routes {service_ip}"
    # Nor any image: the agent removed its own at its stop, and the kept ones because its DaemonSet was gone.
    assert not images(installed), [str(p) for p in images(installed)]
    # The CRDs stay (Helm never deletes a chart's crds/), and so do ModelSpecs; their EMIs say no agent serves them.
    out = json.loads(node.kubectl("get", "ms", "-n", "default", "-o", "json").stdout)
    assert [m["metadata"]["name"] for m in out["items"]] == ["left-behind"]
