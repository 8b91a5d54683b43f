"""ModelSpecs built for tests: the default model's document with another source, name or fields; a small ONNX
ModelSpec document for the schema and CRD tests."""

from __future__ import annotations

import pathlib
from typing import Any

from volga_agent.app import defaultmodel
from volga_core import api


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
