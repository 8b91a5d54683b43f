"""ModelSpecs built for tests: the default model's document with another source, name or fields; a small ONNX
ModelSpec document for the schema and CRD tests, and its creation on a real API server."""

from __future__ import annotations

import json
import pathlib
from typing import TYPE_CHECKING, Any

from volga_agent.app import defaultmodel
from volga_core import api

if TYPE_CHECKING:
    from kubernetes import client as k8s_client


def spec_at(source: str, name: str = "m", framework: str = "onnx", **extra: Any) -> api.ModelSpec:
    doc: dict[str, Any] = defaultmodel.spec_document(pathlib.Path("/x"))
    doc["metadata"]["name"] = name
    doc["spec"].update({"modelId": name, "source": source, "framework": framework, **extra})
    return api.parse_model_spec(doc)


def modelspec(name: str = "m", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"modelId": name, "framework": "onnx", "source": "file:///models/m.onnx",
                            "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, 3]}],
                            "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, 3]}]}
    body.update(spec)
    return {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": name}, "spec": body}


def create(custom: tuple[k8s_client.CustomObjectsApi, str], doc: dict[str, Any]) -> str:
    """"" when the API server stores the object, else its refusal. (Here rather than in k8s_fixtures: a module that
    imported the plugin before registering it would keep it from pytest's assertion rewriting.)"""
    from kubernetes.client.exceptions import ApiException

    objects, namespace = custom
    try:
        objects.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "modelspecs", doc)
    except ApiException as exc:
        assert exc.status == 422, exc.body
        return str(json.loads(exc.body)["message"])
    return ""
