"""End to end on a real kube-apiserver + etcd: kubectl apply a ModelSpec, the operator places EMIs on two
nodes (two agent processes with their own node names), a tritonclient request through a gateway wakes one,
the gateway keeps answering while the API server is down, kubectl delete removes everything."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import k8s_fixtures
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from kubernetes import client as k8s
from procs import Daemon, wait_for
from tritonclient.utils import InferenceServerException

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.worker import contract
from volga_bench import harness
from volga_bench.controlplane import ControlPlane, free_ports

pytest_plugins = ["k8s_fixtures"]
pytestmark = pytest.mark.slow
NODES = ("node-a", "node-b")


control_plane = k8s_fixtures.control_plane_of_its_own()  # the model's EMIs must land on this module's Nodes


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("e2e")
    api = control_plane.api_client()
    core = k8s.CoreV1Api(api)
    for node in NODES:
        core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=node)))
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig), "PYTHONUNBUFFERED": "1",
           "VOLGA_RESYNC_SEC": "5"}
    py = sys.executable
    daemons: dict[str, Daemon] = {}
    try:  # a daemon that does not start must not leave the others running against the shared API server
        daemons["operator"] = Daemon("operator", [py, "-m", "volga_operator", "--liveness", "", "-v"], env, folder)
        snapshots = {}
        # Gateways listen on ports chosen up front: each agent reports its node's gateway address in EMI status.
        gateway_ports = dict(zip(NODES, free_ports(len(NODES)), strict=True))
        for node in NODES:
            snapshots[node] = folder / f"snapshots-{node}"
            daemons[node] = Daemon(node, [py, "-m", "volga_agent.app.daemons", "--kube", "--node", node, "--port", "0",
                                          "--metrics-port", "0", "--workdir", f"/tmp/vw-{node}",
                                          "--snapshot-dir", str(snapshots[node]),
                                          "--gateway-address", f"127.0.0.1:{gateway_ports[node]}"], env, folder,
                                   "volga-agent")
        gateway = str(pathlib.Path(py).with_name("volga-gateway"))  # the console script, as the image runs it
        for node in NODES:
            agent = f"127.0.0.1:{daemons[node].port('Agent API')}"
            daemons[f"gateway-{node}"] = Daemon(f"gateway-{node}", [
                gateway, "--kube", "--agent", agent, "--node", node, "--host", "127.0.0.1", "--http-port", "0",
                "--grpc-port", str(gateway_ports[node]), "--metrics-port", "0"], env, folder, "volga-gateway")
    except BaseException:
        for started in daemons.values():
            started.stop()
        raise
    metrics_a = re.search(r"metrics :(\d+)", daemons["gateway-node-a"].line)
    assert metrics_a
    yield {"api": api, "daemons": daemons, "snapshots": snapshots, "folder": folder,
           "grpc": f"127.0.0.1:{gateway_ports['node-a']}",
           "metrics": f"http://127.0.0.1:{metrics_a.group(1)}/metrics"}
    codes = {name: d.stop() for name, d in daemons.items()}
    api.close()
    assert all(code == 0 for code in codes.values()), {n: (c, daemons[n].tail())
                                                       for n, c in codes.items() if c}


def modelspec(name: str, **spec: Any) -> dict[str, Any]:
    doc = defaultmodel.spec_document(defaultmodel.ensure().spec.source_path)
    doc["metadata"] = {"name": name, "namespace": "default"}
    doc["spec"]["modelId"] = name
    doc["spec"]["pool"] = {"hot": 0, "frozen": 2}
    doc["spec"].update(spec)
    return doc


def apply(cp: ControlPlane, doc: dict[str, Any], tmp: pathlib.Path,
          check: bool = True) -> subprocess.CompletedProcess[str]:
    path = tmp / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return cp.kubectl("apply", "-f", str(path), check=check)


def emis(cp: ControlPlane, model: str) -> list[dict[str, Any]]:
    out = cp.kubectl("get", "emi", "-l", f"volga.dev/modelspec={model}", "-o", "json")
    return list(json.loads(out.stdout)["items"])


def get_ms(cp: ControlPlane, name: str) -> dict[str, Any]:
    return dict(json.loads(cp.kubectl("get", "ms", name, "-o", "json").stdout))


def ready(obj: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in obj.get("status", {}).get("conditions", ()))


def request(grpc: str, model: str, seed: int = 5, headers: dict[str, str] | None = None) -> np.ndarray:
    decls = instance.decls(defaultmodel.ensure().spec.inputs)
    inputs = harness.triton_inputs(decls, contract.sample_inputs(decls, batch=4, seed=seed))
    client = grpcclient.InferenceServerClient(grpc)
    try:
        return client.infer(model, inputs, headers={"x-model-id": model, **(headers or {})},
                            client_timeout=120).as_numpy(
            "probability")
    finally:
        client.close()


def reference(seed: int = 5) -> np.ndarray:
    import onnxruntime

    spec = defaultmodel.ensure().spec
    decls = instance.decls(spec.inputs)
    session = onnxruntime.InferenceSession(str(spec.source_path), providers=["CPUExecutionProvider"])
    return session.run(["probability"], contract.sample_inputs(decls, batch=4, seed=seed))[0]


def test_apply_wake_outage_delete(control_plane: ControlPlane, cluster: dict[str, Any],
                                  tmp_path: pathlib.Path) -> None:
    cp = control_plane
    apply(cp, modelspec("ctr-e2e"), tmp_path)
    # The operator spreads the two FROZEN floor slots over the two nodes; the agents cold-start and freeze.
    placed = wait_for("two EMIs, one per node", lambda: sorted(e["spec"]["node"] for e in emis(cp, "ctr-e2e"))
                      == list(NODES))
    assert placed
    wait_for("both EMIs FROZEN and Ready", lambda: all(
        e.get("status", {}).get("tier") == "FROZEN" and ready(e) for e in emis(cp, "ctr-e2e"))
        and len(emis(cp, "ctr-e2e")) == 2, timeout=240)
    for node in NODES:
        assert any(cluster["snapshots"][node].rglob("pstree.img")), f"no CRIU image on {node}"
    def ready_with_two_frozen() -> dict[str, Any] | None:
        m = get_ms(cp, "ctr-e2e")
        return m if ready(m) and m["status"]["tiers"]["FROZEN"] == 2 else None

    ms = wait_for("ModelSpec Ready with tier counts", ready_with_two_frozen)
    assert ms["status"]["observedGeneration"] == ms["metadata"]["generation"]
    table = cp.kubectl("get", "ms,emi").stdout
    assert re.search(r"ctr-e2e\s+ctr-e2e\s+onnx\s+True\s+0\s+2", table), table
    assert re.search(r"ctr-e2e-0\s+ctr-e2e\s+node-\w\s+FROZEN\s+FROZEN\s+True", table), table

    # The gateway's routing table (ModelSpec + EMI watches) says the model is ready on its node.
    gateway = grpcclient.InferenceServerClient(cluster["grpc"])
    assert wait_for("model ready at the gateway", lambda: gateway.is_model_ready("ctr-e2e"))
    gateway.close()
    def ready_since(emi: dict[str, Any]) -> str:
        return next(c["lastTransitionTime"] for c in emi["status"]["conditions"] if c["type"] == "Ready")

    [frozen_a] = [e for e in emis(cp, "ctr-e2e") if e["spec"]["node"] == "node-a"]
    # A request through node-a's gateway wakes node-a's instance.
    out = request(cluster["grpc"], "ctr-e2e")
    assert np.array_equal(out, reference())
    [hot_a] = wait_for("node-a's EMI reported HOT", lambda: [
        e for e in emis(cp, "ctr-e2e") if e["spec"]["node"] == "node-a" and e.get("status", {}).get("tier") == "HOT"])
    assert ready_since(hot_a) == ready_since(frozen_a)  # still Ready: the condition did not transition

    # The API server goes away: the gateway and the agent keep serving the model they know.
    cp.stop_apiserver()
    try:
        for seed in (6, 7, 8):
            assert np.array_equal(request(cluster["grpc"], "ctr-e2e", seed), reference(seed))
    finally:
        cp.start_apiserver()
    wait_for("API server back", lambda: cp.kubectl("get", "ms", check=False).returncode == 0)

    # Deleting the ModelSpec removes its EMIs, their instances and their snapshots.
    cp.kubectl("delete", "ms", "ctr-e2e", "--timeout=120s")
    wait_for("EMIs gone", lambda: emis(cp, "ctr-e2e") == [])
    for node in NODES:
        wait_for(f"snapshots on {node} removed", lambda node=node: not any(
            cluster["snapshots"][node].rglob("pstree.img")))


def test_malformed_modelspecs(control_plane: ControlPlane, cluster: dict[str, Any], tmp_path: pathlib.Path) -> None:
    cp = control_plane
    bad = modelspec("bad-framework", framework="tensorflow")
    out = apply(cp, bad, tmp_path, check=False)
    assert out.returncode != 0 and "spec.framework" in out.stderr and "tensorflow" in out.stderr
    shape = modelspec("bad-shape")
    shape["spec"]["inputs"][0]["shape"] = [-1, 0]
    out = apply(cp, shape, tmp_path, check=False)
    assert out.returncode != 0 and "dimensions must be positive" in out.stderr
    typo = modelspec("typo")
    typo["spec"]["runtime"]["warmupIteration"] = 3
    out = apply(cp, typo, tmp_path, check=False)
    assert out.returncode != 0 and "warmupIteration" in out.stderr
    # Valid for the API server, impossible to place: a condition says why.
    gpu = modelspec("needs-h200", hardware={"gpu": True, "gpuProduct": "NVIDIA H200"})
    apply(cp, gpu, tmp_path)
    def unschedulable() -> dict[str, Any] | None:
        m = get_ms(cp, "needs-h200")
        conditions = m.get("status", {}).get("conditions", ())
        return m if any(c["type"] == "Ready" and c.get("reason") == "Unschedulable" for c in conditions) else None

    ms = wait_for("Unschedulable condition", unschedulable)
    message = next(c["message"] for c in ms["status"]["conditions"] if c["type"] == "Ready")
    assert "no GPU" in message
    cp.kubectl("delete", "ms", "needs-h200", "--timeout=60s")


def test_lost_node_gets_its_emis_placed_elsewhere(control_plane: ControlPlane, cluster: dict[str, Any],
                                                  tmp_path: pathlib.Path) -> None:
    cp = control_plane
    apply(cp, modelspec("ctr-move", pool={"hot": 0, "frozen": 1}), tmp_path)
    [emi] = wait_for("one EMI", lambda: emis(cp, "ctr-move") if len(emis(cp, "ctr-move")) == 1 else None)
    lost = emi["spec"]["node"]
    core = k8s.CoreV1Api(cluster["api"])
    core.patch_node_status(lost, {"status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "KubeletStopped", "message": "test",
         "lastHeartbeatTime": "2026-11-29T00:00:00Z", "lastTransitionTime": "2026-11-29T00:00:00Z"}]}})
    try:
        moved = wait_for("the EMI on the other node", lambda: [e for e in emis(cp, "ctr-move")
                                                               if e["spec"]["node"] != lost])
        assert moved[0]["metadata"]["name"] == emi["metadata"]["name"]
        wait_for("it is FROZEN there", lambda: emis(cp, "ctr-move")[0].get("status", {}).get("tier") == "FROZEN"
                 and ready(emis(cp, "ctr-move")[0]), timeout=180)
        # node-a's gateway answers either way: from its own agent, or by forwarding to node-b's gateway.
        [answer] = wait_for("an answer", lambda: [request(cluster["grpc"], "ctr-move")])
        assert np.array_equal(answer, reference())
        forwards = urllib.request.urlopen(cluster["metrics"], timeout=10).read().decode()
        forwarded = 'volga_gateway_forwards_total{model="ctr-move"}' in forwards
        assert forwarded == (moved[0]["spec"]["node"] == "node-b")
        if forwarded:
            # A request that was already forwarded is not forwarded again: it says where the model is.
            def placed_elsewhere() -> str | None:
                try:
                    request(cluster["grpc"], "ctr-move", headers={"x-volga-forwarded": "test"})
                except InferenceServerException as exc:  # wait_for retries exceptions: hand back the message
                    message = f"{exc.status()} {exc}"
                    return message if "no instance on node node-a" in message else None
                return None

            said = wait_for("the gateway to say where the model is", placed_elsewhere)
            assert "its instances are on node-b" in said and "UNAVAILABLE" in said
    finally:
        core.patch_node_status(lost, {"status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test",
             "lastHeartbeatTime": "2026-11-29T00:00:00Z", "lastTransitionTime": "2026-11-29T00:00:01Z"}]}})
        cp.kubectl("delete", "ms", "ctr-move", "--timeout=120s")
