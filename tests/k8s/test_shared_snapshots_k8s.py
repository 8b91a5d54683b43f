"""The shared snapshot fields against a real API server: an agent's EMI status naming the shared image it
restored from, and the ModelSpec status listing the images, survive the CRDs' structural schemas (unknown fields
would be pruned), and the operator's status for the ModelSpec lists what its EMIs report."""

from __future__ import annotations

import uuid
from typing import Any

from kubernetes import client as k8s_client
from kubernetes.client import V1Namespace, V1ObjectMeta

from volga_core import api
from volga_core.api import labels
from volga_operator import reconcile

pytest_plugins = ["k8s_fixtures"]


def test_shared_snapshot_statuses_round_trip(crds: None, kube_client: k8s_client.ApiClient) -> None:
    namespace = f"vss-{uuid.uuid4().hex[:8]}"
    k8s_client.CoreV1Api(kube_client).create_namespace(V1Namespace(metadata=V1ObjectMeta(name=namespace)))
    objects = k8s_client.CustomObjectsApi(kube_client)
    objects.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "modelspecs", {
        "apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": "ocr"},
        "spec": {"modelId": "ocr", "framework": "onnx", "source": "file:///models/m.onnx"}})
    ref = {"key": "40f101f28bf9c20ddf808cb0589953f3", "node": "node-a", "sizeBytes": 102722326,
           "publishedAt": "2026-03-01T10:00:00Z", "gpuProduct": "NVIDIA H200", "gpuDriver": "580.65.06"}
    emis: list[reconcile.EmiRecord] = []
    for name, node, role in (("ocr-0", "node-a", "published"), ("ocr-1", "node-b", "restored")):
        body: dict[str, Any] = {
            "apiVersion": api.API_VERSION, "kind": "ExecutableModelInstance",
            "metadata": {"name": name, "labels": {labels.LABEL_SPEC: "ocr", labels.LABEL_NODE: node}},
            "spec": {"modelSpec": "ocr", "modelId": "ocr", "node": node, "targetTier": "FROZEN"}}
        objects.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "executablemodelinstances", body)
        stored = objects.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, namespace, "executablemodelinstances", name,
            {"status": {"tier": "HOT", "sharedSnapshot": {**ref, "role": role}}})
        assert stored["status"]["sharedSnapshot"] == {**ref, "role": role}
        emis.append(reconcile.EmiRecord(namespace, name, stored["spec"], stored["status"]))
    listed = reconcile.shared_snapshots(emis)
    assert listed == [ref]
    stored = objects.patch_namespaced_custom_object_status(api.GROUP, api.VERSION, namespace, "modelspecs", "ocr",
                                                           {"status": {"sharedSnapshots": listed}})
    assert stored["status"]["sharedSnapshots"] == [ref]
    # Without a namespace controller the objects would outlive their namespace (and other tests' operators and
    # agents would see them): they go first.
    for name in ("ocr-0", "ocr-1"):
        objects.delete_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "executablemodelinstances", name)
    objects.delete_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "modelspecs", "ocr")
    k8s_client.CoreV1Api(kube_client).delete_namespace(namespace)
