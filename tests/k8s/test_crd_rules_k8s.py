"""The generated CRDs on a real API server: `kubectl explain` describes every field, and the schema's caps and
CEL rules refuse what `volga validate` refuses (dimension caps, booleans as sizes, tensor names with control or
bidirectional-override characters, pool floors, long names), while an ONNX ModelSpec may leave its signature out."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client as k8s_client
from procs import wait_for
from specs import create, modelspec

from volga_bench.controlplane import ControlPlane
from volga_core import api

pytest_plugins = ["k8s_fixtures"]


def test_kubectl_explain_describes_fields(crds: None, control_plane: ControlPlane) -> None:
    def explain(field: str) -> str:
        out = control_plane.kubectl("explain", field, check=False)
        # Descriptions come wrapped: compare them as one line.
        return " ".join(out.stdout.split()) if out.returncode == 0 and "DESCRIPTION" in out.stdout else ""

    assert "x-model-id" in wait_for("modelspec.spec.modelId explained", lambda: explain("modelspec.spec.modelId"))
    assert "GiB" in explain("modelspec.spec.hardware.minMemoryGiB")
    assert "read from the model" in explain("modelspec.spec.inputs")
    assert "x-input-hash" in explain("modelspec.status.inputHash")
    assert "milliseconds" in explain("emi.status.lastWakeMs")
    assert "Default: FROZEN" in explain("emi.spec.targetTier")


def test_onnx_modelspec_may_leave_its_signature_out(custom: tuple[k8s_client.CustomObjectsApi, str]) -> None:
    doc = modelspec("left-out")
    del doc["spec"]["inputs"], doc["spec"]["outputs"]
    assert create(custom, doc) == ""
    stored = custom[0].get_namespaced_custom_object(api.GROUP, api.VERSION, custom[1], "modelspecs", "left-out")
    assert "inputs" not in stored["spec"]
    spec, problem = api.validate_spec(stored["spec"])  # what the operator and the agents make of it
    assert problem == "" and spec is not None and not spec.has_signature
    torch = modelspec("ts", framework="torchscript")
    del torch["spec"]["outputs"]
    assert "carries no tensor signature" in create(custom, torch)
    assert "spec.inputs" in create(custom, modelspec("empty", inputs=[]))


def test_schema_refuses_what_validate_refuses(custom: tuple[k8s_client.CustomObjectsApi, str]) -> None:
    def tensor(name: str = "x", shape: list[Any] | None = None) -> list[dict[str, Any]]:
        return [{"name": name, "dtype": "FP32", "shape": [-1, 3] if shape is None else shape}]

    assert create(custom, modelspec("ok", inputs=tensor(shape=[-1, 2**31 - 1]), pool={"hot": 64})) == ""
    for big in (2**31, 10**12):
        refused = create(custom, modelspec("big", inputs=tensor(shape=[-1, big])))
        assert "spec.inputs[0].shape[1]" in refused and "less than or equal to 2147483647" in refused
    refused = create(custom, modelspec("flag", inputs=tensor(shape=[True, 13])))
    assert "spec.inputs[0].shape[0]" in refused and "integer" in refused
    for name in ("y\u202eevil", "y\x00", "tab\there", "\u2066y"):
        refused = create(custom, modelspec("names", outputs=tensor(name)))
        assert "spec.outputs[0].name" in refused and "should match" in refused, name
    refused = create(custom, modelspec("floors", pool={"frozen": 65}))
    assert "spec.pool.frozen" in refused and "less than or equal to 64" in refused
    refused = create(custom, modelspec("pace", slo={"calibrationPaceMs": -5}))
    assert "spec.slo.calibrationPaceMs" in refused and "greater than or equal to 0" in refused
    refused = create(custom, modelspec("a" * 64, modelId="long"))
    assert "metadata.name: at most 63 characters" in refused
    refused = create(custom, modelspec("under", modelId="a_b"))
    assert "spec.modelId" in refused and "should match" in refused
    # The API server holds names to DNS-1123 subdomains itself: no paths.
    assert "metadata.name" in create(custom, modelspec("../.."))
    # Everything the server refused, `volga validate`'s parser refuses too.
    for doc in (modelspec("big", inputs=tensor(shape=[-1, 2**31])), modelspec("floors", pool={"frozen": 65}),
                modelspec("names", outputs=tensor("y\u202e")), modelspec("a" * 64, modelId="long"),
                modelspec("flag", inputs=tensor(shape=[True, 13])), modelspec("under", modelId="a_b"),
                modelspec("pace", slo={"calibrationPaceMs": -5})):
        with pytest.raises(api.SpecError):
            api.parse_model_spec(doc)
