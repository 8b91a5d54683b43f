"""Checkpoint once, restore anywhere, on a real kube-apiserver + etcd: the operator and two node agents (each with
its gateway) share one snapshot folder. A ModelSpec's instance runs on node A first (node B is not Ready); A
cold-starts, freezes and publishes its image. Then the instance moves to node B, and B's first request (an
unmodified tritonclient through B's gateway) is answered by a worker restored from A's image: B's metrics count
the shared restore, the answer is A's, B's EMI status names the image it restored from, and the ModelSpec status
lists the image.

A restored worker needs the paths it had, so every node sees its own folder at one common path: each agent and
its gateway run in their own mount namespace (unshare(1)) with the node's folder bind-mounted there, as each
agent pod mounts its own volumes at the same paths.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from kubernetes import client as k8s
from procs import Daemon, wait_for
from prometheus_client import parser

from volga_agent.app import defaultmodel
from volga_agent.gateway import links
from volga_agent.node import instance
from volga_agent.snapshot import shared
from volga_agent.worker import contract
from volga_bench import harness
from volga_bench.controlplane import ControlPlane, free_ports

pytest_plugins = ["k8s_fixtures"]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for the two nodes")]
NODES = ("node-a", "node-b")
MODEL = "shared-k8s"


def in_node(folder: pathlib.Path, common: pathlib.Path, argv: list[str]) -> list[str]:
    """`argv` in a new mount namespace where `folder` (the node's own) is mounted on `common` (every node's)."""
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            'mount --bind "$0" "$1" && shift && exec "$@"', str(folder), str(common), *argv]


def set_ready(core: k8s.CoreV1Api, node: str, ready: bool) -> None:
    status = "True" if ready else "False"
    core.patch_node_status(node, {"status": {"conditions": [
        {"type": "Ready", "status": status, "reason": "KubeletReady" if ready else "KubeletStopped",
         "message": "test", "lastHeartbeatTime": "2026-11-29T00:00:00Z",
         "lastTransitionTime": "2026-11-29T00:00:00Z"}]}})


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, crds: None) -> Iterator[dict[str, Any]]:
    base = pathlib.Path(tempfile.mkdtemp(prefix="vsk-", dir="/tmp"))  # short: AF_UNIX paths are <= 107 bytes
    common, store = base / "node", base / "shared"
    for folder in (common, store, *(base / node for node in NODES)):
        folder.mkdir()
    api = control_plane.api_client()
    core = k8s.CoreV1Api(api)
    created = []
    for node in NODES:
        try:
            core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=node)))
            created.append(node)
        except k8s.ApiException as exc:  # left by an earlier module on the session's API server: reused
            if exc.status != 409:
                raise
    set_ready(core, "node-a", True)
    set_ready(core, "node-b", False)  # the instance goes to node A first
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig), "PYTHONUNBUFFERED": "1",
           "VOLGA_RESYNC_SEC": "5"}
    py = sys.executable
    daemons: dict[str, Daemon] = {
        "operator": Daemon("operator", [py, "-m", "volga_operator", "--liveness", "", "-v"], env, base)}
    ports = free_ports(2 * len(NODES))
    grpc_ports = dict(zip(NODES, ports[:len(NODES)], strict=True))
    metrics_ports = dict(zip(NODES, ports[len(NODES):], strict=True))
    gateway = str(pathlib.Path(py).with_name("volga-gateway"))  # the console script, as the image runs it
    try:
        for node in NODES:
            daemons[node] = Daemon(node, in_node(base / node, common, [
                py, "-m", "volga_agent.app.daemons", "--kube", "--node", node, "--port", "0",
                "--metrics-port", str(metrics_ports[node]), "--workdir", str(common / "work"),
                "--snapshot-dir", str(common / "snapshots"), "--shared-snapshots", str(store),
                "--gateway-address", f"127.0.0.1:{grpc_ports[node]}", "-v"]), env, base, "volga-agent")
            agent = f"127.0.0.1:{daemons[node].port('Agent API')}"
            # The gateway sees the node's folder where its agent does: it connects to the workers' sockets.
            daemons[f"gateway-{node}"] = Daemon(f"gateway-{node}", in_node(base / node, common, [
                gateway, "--kube", "--agent", agent, "--node", node, "--host", "127.0.0.1", "--http-port", "0",
                "--grpc-port", str(grpc_ports[node]), "--metrics-port", "0"]), env, base, "volga-gateway")
    except BaseException:
        for d in daemons.values():
            d.stop()
        raise
    yield {"api": api, "core": core, "base": base, "store": store, "daemons": daemons,
           "grpc": {node: f"127.0.0.1:{port}" for node, port in grpc_ports.items()},
           "metrics": {node: f"http://127.0.0.1:{port}/metrics" for node, port in metrics_ports.items()}}
    codes = {name: d.stop() for name, d in daemons.items()}
    for node in NODES:
        set_ready(core, node, True)
    for node in created:
        core.delete_node(node)
    api.close()  # type: ignore[no-untyped-call]
    shutil.rmtree(base, ignore_errors=True)
    assert all(code == 0 for code in codes.values()), {n: (c, daemons[n].tail())
                                                       for n, c in codes.items() if c}


def apply(cp: ControlPlane, pool: dict[str, int], folder: pathlib.Path) -> None:
    doc: dict[str, Any] = defaultmodel.spec_document(defaultmodel.ensure().spec.source_path)
    doc["metadata"] = {"name": MODEL, "namespace": "default"}
    doc["spec"]["modelId"] = MODEL
    doc["spec"]["pool"] = pool
    path = folder / f"{MODEL}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cp.kubectl("apply", "-f", str(path))


def the_emi(cp: ControlPlane) -> dict[str, Any] | None:
    items = json.loads(cp.kubectl("get", "emi", "-l", f"volga.dev/modelspec={MODEL}", "-o", "json").stdout)["items"]
    return items[0] if len(items) == 1 else None


def request(grpc: str, headers: dict[str, str] | None = None) -> np.ndarray:
    decls = instance.decls(defaultmodel.ensure().spec.inputs)
    inputs = harness.triton_inputs(decls, contract.sample_inputs(decls, batch=4, seed=11))
    client = grpcclient.InferenceServerClient(grpc)
    try:
        result = client.infer(MODEL, inputs, headers={"x-model-id": MODEL, **(headers or {})},
                              client_timeout=120)
        answer: np.ndarray = result.as_numpy("probability")
        return answer
    finally:
        client.close()


def shared_counts(url: str) -> dict[str, float]:
    """The agent's shared snapshot counters for the model, read from its /metrics."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    counts = {}
    for family in parser.text_string_to_metric_families(text):
        if family.name.startswith("volga_snapshot_shared_"):
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("model") == MODEL:
                    counts[sample.name] = sample.value
    return counts


def test_node_b_answers_its_first_request_from_the_image_node_a_published(
        control_plane: ControlPlane, cluster: dict[str, Any], tmp_path: pathlib.Path) -> None:
    cp, core = control_plane, cluster["core"]
    apply(cp, {"hot": 0, "frozen": 1}, tmp_path)
    # Node A cold-starts the instance, freezes it and publishes the image; its EMI status says so.
    try:
        emi = wait_for("node A's EMI FROZEN with a published shared image", lambda: (e := the_emi(cp)) and (
            e["spec"]["node"] == "node-a" and e.get("status", {}).get("tier") == "FROZEN"
            and e["status"].get("sharedSnapshot", {}).get("role") == "published") and e, timeout=240)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nEMI: {the_emi(cp)}\nnode-a's agent:\n"
                             f"{cluster['daemons']['node-a'].log.read_text()[-4000:]}") from None
    [entry] = shared.Store(cluster["store"]).entries()
    assert entry.manifest.node == "node-a" and entry.manifest.key["model_id"] == MODEL
    assert emi["status"]["sharedSnapshot"]["key"] == entry.digest
    assert shared_counts(cluster["metrics"]["node-a"])["volga_snapshot_shared_publishes_total"] == 1.0
    answer_a = wait_for("node A's answer", lambda: [request(cluster["grpc"]["node-a"])])[0]

    # The ModelSpec keeps one instance, COLD; then node A goes away and node B comes: the instance moves there.
    apply(cp, {"hot": 0, "frozen": 0}, tmp_path)
    wait_for("the instance COLD on node A", lambda: (e := the_emi(cp)) and e["spec"]["targetTier"] == "COLD"
             and e["spec"]["node"] == "node-a")
    set_ready(core, "node-a", False)
    set_ready(core, "node-b", True)
    wait_for("node B's agent reporting the instance", lambda: (e := the_emi(cp)) and e["spec"]["node"] == "node-b"
             and e.get("status", {}).get("gateway") == cluster["grpc"]["node-b"]
             and e["status"].get("tier") == "COLD", timeout=120)
    assert "volga_snapshot_shared_restores_total" not in shared_counts(cluster["metrics"]["node-b"])

    # B's first request, through B's gateway, kept on B (a forwarded request is not forwarded again: until B's
    # gateway has seen the move it answers UNAVAILABLE, and wait_for asks again).
    answer_b = wait_for("node B's answer", lambda: [request(cluster["grpc"]["node-b"],
                                                            {links.FORWARDED: "test"})])[0]
    assert np.array_equal(answer_b, answer_a)
    counts = shared_counts(cluster["metrics"]["node-b"])
    # At least one: an instance woken by a request may be sent back to its resting tier (COLD here) by the next
    # watch event, and a request it was about to serve then wakes it again, from the same shared image.
    assert counts["volga_snapshot_shared_restores_total"] >= 1.0, counts
    assert counts["volga_snapshot_shared_restore_failures_total"] == 0.0, counts
    assert counts["volga_snapshot_shared_publishes_total"] == 0.0, counts  # the key has its image already

    ref = wait_for("node B's EMI status naming the image it restored from", lambda: (e := the_emi(cp)) and (
        e["status"].get("gateway") == cluster["grpc"]["node-b"]
        and e["status"].get("sharedSnapshot", {}).get("role") == "restored") and e["status"]["sharedSnapshot"])
    assert ref["key"] == entry.digest and ref["node"] == "node-a" and ref["sizeBytes"] == entry.size_bytes
    listed = wait_for("the ModelSpec status listing the image", lambda: [
        r for r in json.loads(cp.kubectl("get", "ms", MODEL, "-o", "json").stdout).get("status", {}).get(
            "sharedSnapshots", ()) if r["key"] == entry.digest])
    assert listed == [{k: v for k, v in ref.items() if k != "role"}]
    assert [e.digest for e in shared.Store(cluster["store"]).entries()] == [entry.digest]  # checked, kept

    cp.kubectl("delete", "ms", MODEL, "--timeout=120s")
    wait_for("the EMI gone", lambda: the_emi(cp) is None and not json.loads(cp.kubectl(
        "get", "emi", "-l", f"volga.dev/modelspec={MODEL}", "-o", "json").stdout)["items"])
