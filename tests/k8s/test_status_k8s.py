"""`volga status` against a real API server: ModelSpecs and EMIs read with the kubernetes client (the kubeconfig
and namespace given), per model instances, tiers, last use and wake, image sizes and why an instance is not ready,
as a table and as JSON. The CRD's rules refuse a malformed warm-up sample before any node sees it."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import pytest
from kubernetes import client as k8s_client
from kubernetes.client import V1Namespace, V1ObjectMeta
from kubernetes.client.exceptions import ApiException

from volga_bench.controlplane import ControlPlane
from volga_core import api
from volga_core.api import labels

pytest_plugins = ["k8s_fixtures"]


def modelspec(name: str, **runtime: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"modelId": name, "framework": "onnx", "source": "file:///models/m.onnx"}
    if runtime:
        spec["runtime"] = runtime
    return {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": name}, "spec": spec}


def emi(name: str, model: str, node: str, status: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {"apiVersion": api.API_VERSION, "kind": "ExecutableModelInstance",
            "metadata": {"name": name, "labels": {labels.LABEL_SPEC: model, labels.LABEL_NODE: node}},
            "spec": {"modelSpec": model, "modelId": model, "node": node, "targetTier": "FROZEN"}}
    return body, {"status": status}


def ready(ok: bool, message: str) -> list[dict[str, Any]]:
    return [{"type": "Ready", "status": "True" if ok else "False", "reason": "Ready" if ok else "WorkerStartError",
             "message": message, "lastTransitionTime": "2026-01-01T00:00:00Z"}]


def test_volga_status_reads_a_cluster(crds: None, control_plane: ControlPlane,
                                      kube_client: k8s_client.ApiClient) -> None:
    namespace = f"vs-{uuid.uuid4().hex[:8]}"
    k8s_client.CoreV1Api(kube_client).create_namespace(V1Namespace(metadata=V1ObjectMeta(name=namespace)))
    objects = k8s_client.CustomObjectsApi(kube_client)
    for doc in (modelspec("ocr"), modelspec("vad"), modelspec("unplaced")):
        objects.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "modelspecs", doc)
    for body, status in (
            emi("ocr-0", "ocr", "node-a", {"tier": "FROZEN", "snapshotBytes": 3 * 2**20, "lastWakeMs": 41.5,
                                           "lastUsed": "2026-03-01T10:00:00Z", "conditions": ready(True, "FROZEN")}),
            emi("ocr-1", "ocr", "node-b", {"tier": "HOT", "snapshotBytes": 2**20, "lastWakeMs": 12.25,
                                           "lastUsed": "2026-03-01T11:00:00Z", "conditions": ready(True, "HOT")}),
            emi("vad-0", "vad", "node-a", {"tier": "COLD", "conditions": ready(
                False, "WorkerStartError: vad-0: worker failed: WarmupError: warm-up sample 1 (input 'x' shape "
                       "[1, 1]): Pad reflect requires axis length >= 2")})):
        objects.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "executablemodelinstances", body)
        objects.patch_namespaced_custom_object_status(api.GROUP, api.VERSION, namespace, "executablemodelinstances",
                                                      body["metadata"]["name"], status)
    kubeconfig = str(control_plane.kubeconfig)

    def volga_status(*extra: str) -> str:
        out = subprocess.run([sys.executable, "-m", "volga_agent.cli", "status", "--kubeconfig", kubeconfig,
                              "--namespace", namespace, *extra], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    models = {m["modelId"]: m for m in json.loads(volga_status("--json"))["models"]}
    assert list(models) == ["ocr", "unplaced", "vad"]
    ocr = models["ocr"]
    assert ocr["instances"] == 2 and ocr["tiers"] == {"HOT": 1, "FROZEN": 1}
    assert ocr["lastUsed"] == "2026-03-01T11:00:00Z" and ocr["lastWakeMs"] == 12.25
    assert ocr["imageBytes"] == 4 * 2**20
    assert [(i["name"], i["node"], i["tier"]) for i in ocr["instanceList"]] == [
        ("ocr-0", "node-a", "FROZEN"), ("ocr-1", "node-b", "HOT")]
    assert models["unplaced"]["instances"] == 0 and models["unplaced"]["tiers"] == {}
    assert models["vad"]["tiers"] == {"COLD": 1}
    assert "warm-up sample 1 (input 'x' shape [1, 1])" in models["vad"]["instanceList"][0]["reason"]

    header, *rows = volga_status().splitlines()
    assert header.split()[:3] == ["MODEL", "INSTANCES", "TIERS"]
    assert rows[0].split()[:5] == ["ocr", "2", "HOT", "1,", "FROZEN"] and "4.0 MiB" in rows[0] and "12.2 ms" in rows[0]
    assert rows[-1].startswith("vad-0 (vad, COLD): WorkerStartError")

    wrong = subprocess.run([sys.executable, "-m", "volga_agent.cli", "status", "--kubeconfig", "/nonexistent"],
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and wrong.stderr.startswith("volga status: kubeconfig /nonexistent:")
    objects.delete_collection_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "executablemodelinstances")
    objects.delete_collection_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "modelspecs")


def test_the_crd_refuses_a_malformed_warmup_sample(crds: None, kube_client: k8s_client.ApiClient) -> None:
    namespace = f"vs-{uuid.uuid4().hex[:8]}"
    k8s_client.CoreV1Api(kube_client).create_namespace(V1Namespace(metadata=V1ObjectMeta(name=namespace)))
    objects = k8s_client.CustomObjectsApi(kube_client)
    at = "spec.runtime.warmup[0].inputs"
    for given, path, message in (
            ({"shape": [1], "fill": 0, "range": [0, 1]}, f"{at}[x]", "give one of fill, range and values"),
            ({"fill": 0}, f"{at}[x]", "shape is required (unless values are given)"),
            ({"shape": [-1]}, f"{at}.x.shape[0]", "should be greater than or equal to 0")):
        doc = modelspec("bad", warmup=[{"inputs": {"x": given}}])
        with pytest.raises(ApiException) as caught:
            objects.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "modelspecs", doc)
        assert caught.value.status == 422
        found = json.loads(caught.value.body)["message"]
        assert path in found and message in found, found
    objects.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "modelspecs",
                                            modelspec("good", warmup=[{"inputs": {"x": {"shape": [1, 3]}}}]))
    objects.delete_collection_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "modelspecs")
