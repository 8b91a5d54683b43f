"""Chains on a real kube-apiserver + etcd with the real operator: the CRD's rules refuse a chain that lists its own
head, the operator marks a chain with an unknown member not Valid (naming the field) and places a good chain's
models on one node."""

from __future__ import annotations

import json
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from procs import Daemon, wait_for

from volga_bench.controlplane import ControlPlane
from volga_core import api, nodes

pytest_plugins = ["k8s_fixtures"]
NODES = ("chain-node-a", "chain-node-b", "chain-node-c")
NAMESPACE = "chains"


@pytest.fixture(scope="module")
def operator(control_plane: ControlPlane, crds: None, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[None]:
    folder = tmp_path_factory.mktemp("chains")
    client = control_plane.api_client()
    core = k8s.CoreV1Api(client)
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=NAMESPACE)))
    for node in NODES:
        # The hardware profile an agent publishes: a CPU node.
        core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(
            name=node, annotations=nodes.NodeProfile(node).annotations())))
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig), "VOLGA_RESYNC_SEC": "5"}
    daemon = Daemon("operator", [sys.executable, "-m", "volga_operator", "--liveness", "", "-v"], env, folder)
    yield
    # Leave nothing for the next module's operator to place: the ModelSpecs go while this one finalizes them.
    control_plane.kubectl("delete", "ms", "--all", "-n", NAMESPACE, "--timeout=60s")
    code = daemon.stop()
    core.delete_namespace(NAMESPACE)
    for node in NODES:
        core.delete_node(node)
    client.close()
    assert code == 0, daemon.tail()


def modelspec(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"modelId": name, "framework": "onnx", "source": "file:///models/m.onnx",
                     "inputs": [{"name": "input", "dtype": "FP32", "shape": [-1, 4]}],
                     "outputs": [{"name": "output", "dtype": "FP32", "shape": [-1, 4]}], **spec}}


def apply(cp: ControlPlane, tmp: pathlib.Path, *docs: dict[str, Any], check: bool = True) -> Any:
    path = tmp / "specs.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return cp.kubectl("apply", "-f", str(path), check=check)


def condition(cp: ControlPlane, name: str, kind: str) -> dict[str, Any] | None:
    ms = json.loads(cp.kubectl("get", "ms", "-n", NAMESPACE, name, "-o", "json").stdout)
    return next((c for c in ms.get("status", {}).get("conditions", ()) if c["type"] == kind), None)


def test_the_crd_refuses_a_chain_that_calls_its_head(operator: None, control_plane: ControlPlane,
                                                     tmp_path: pathlib.Path) -> None:
    out = apply(control_plane, tmp_path, modelspec("loop", chain=["other", "loop"]), check=False)
    assert out.returncode != 0 and "a chain that calls its head again is a cycle" in out.stderr


def test_an_unknown_member_is_a_condition_and_a_good_chain_sits_on_one_node(
        operator: None, control_plane: ControlPlane, tmp_path: pathlib.Path) -> None:
    cp = control_plane
    apply(cp, tmp_path, modelspec("det", chain=["rec", "missing"]), modelspec("rec"))
    valid = wait_for("Valid=False on det", lambda: (c := condition(cp, "det", "Valid")) and
                     c["status"] == "False" and c)
    assert valid["message"] == "spec.chain[1]: no ModelSpec has modelId 'missing'"
    assert wait_for("rec placed", lambda: (c := condition(cp, "rec", "Placed")) and c["status"] == "True")

    apply(cp, tmp_path, modelspec("det", chain=["rec", "fields"]), modelspec("rec"), modelspec("fields"))

    def placed() -> dict[str, str] | None:
        items = json.loads(cp.kubectl("get", "emi", "-n", NAMESPACE, "-o", "json").stdout)["items"]
        nodes = {e["spec"]["modelId"]: e["spec"]["node"] for e in items}
        return nodes if set(nodes) == {"det", "rec", "fields"} and len(set(nodes.values())) == 1 else None

    wait_for("the chain on one node", placed)
    assert wait_for("det Valid", lambda: (c := condition(cp, "det", "Valid")) and c["status"] == "True")
