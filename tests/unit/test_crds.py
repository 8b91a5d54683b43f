"""The CRDs are generated from the pydantic models; the committed files must be what the generator makes."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from volga_core import api
from volga_core.api import crds

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("folder", ["crds", "charts/volga/crds"])
def test_committed_crds_match_the_models(folder: str) -> None:
    for name, crd in crds.all_crds().items():
        committed = (ROOT / folder / name).read_text()
        assert committed == crds.render(crd), f"{folder}/{name} drifted: run `make crds`"


def walk(schema: dict, path: str = "") -> list[str]:
    """Paths of schema nodes that break Kubernetes' structural-schema rules."""
    bad = []
    if "$ref" in schema or "anyOf" in schema or "allOf" in schema:
        bad.append(f"{path}: $ref/anyOf/allOf")
    if "type" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        bad.append(f"{path}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        bad.append(f"{path}: properties and additionalProperties")
    for key, sub in schema.get("properties", {}).items():
        bad += walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        bad += walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        bad += walk(schema["additionalProperties"], f"{path}{{}}")
    return bad


def test_schemas_are_structural() -> None:
    for crd in crds.all_crds().values():
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert walk(schema) == []


def test_schema_keeps_the_models_constraints() -> None:
    spec = crds.modelspec_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = spec["properties"]
    assert props["framework"]["enum"] == [f.value for f in api.Framework]
    assert props["modelId"]["pattern"].startswith("^[a-z0-9]")
    assert props["runtime"]["properties"]["warmupCacheRatio"]["maximum"] == 1.0
    latency = {k: v for k, v in props["targets"]["properties"]["latencyMs"].items() if k != "description"}
    assert latency == {"type": "number", "minimum": 0, "exclusiveMinimum": True, "nullable": True}
    assert "self.all(d, d == -1 || d > 0)" in yaml.safe_dump(props["inputs"])
    # inputs and outputs may be left out (ONNX: read from the model file; a server: none); a CEL rule holds the
    # other frameworks.
    assert set(spec["required"]) == {"modelId", "framework", "source"}
    assert "self.framework in ['onnx', 'server']" in yaml.safe_dump(spec["x-kubernetes-validations"])
    tensor = props["inputs"]["items"]["properties"]
    assert tensor["shape"]["items"] == {"type": "integer", "minimum": -1, "maximum": 2**31 - 1}
    assert "\\x{202E}" in tensor["name"]["pattern"] and "\\x00-\\x1f" in tensor["name"]["pattern"]
    assert all(props["pool"]["properties"][t]["maximum"] == 64 for t in ("hot", "warm", "suspended", "frozen"))
    root = crds.modelspec_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert root["x-kubernetes-validations"][0]["rule"] == "size(self.metadata.name) <= 63"


def test_printer_columns_and_short_names() -> None:
    ms, emi = crds.modelspec_crd(), crds.emi_crd()
    assert ms["spec"]["names"]["shortNames"] == ["ms"] and emi["spec"]["names"]["shortNames"] == ["emi"]
    columns = [c["name"] for c in ms["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns[:4] == ["Model", "Framework", "Ready", "Hot"] and "Frozen" in columns
    assert ms["spec"]["versions"][0]["subresources"] == {"status": {}}


def properties(schema: dict, path: str = "") -> list[tuple[str, dict]]:
    """Every property under a schema node, with its path (array items and map values walked through)."""
    found = []
    for key, sub in schema.get("properties", {}).items():
        found.append((f"{path}.{key}", sub))
        found += properties(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        found += properties(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        found += properties(schema["additionalProperties"], f"{path}{{}}")
    return found


@pytest.mark.parametrize("crd", [crds.modelspec_crd(), crds.emi_crd()], ids=["modelspec", "emi"])
def test_every_property_has_a_description(crd: dict) -> None:
    """`kubectl explain` has something to say about every field, spec and status; a default is stated."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    found = properties(schema)
    assert {".spec", ".status", ".spec.modelId", ".status.conditions[].reason"} <= {p for p, _ in found}
    missing = [path for path, sub in found if not sub.get("description", "").strip()]
    assert missing == [], f"properties without a description: {missing}"
    silent = [path for path, sub in found if "default" in sub and "default" not in sub["description"].lower()]
    assert silent == [], f"descriptions that do not state the default: {silent}"


def test_modelspec_descriptions_name_units() -> None:
    spec = crds.modelspec_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = spec["properties"]
    assert "GiB" in props["hardware"]["properties"]["minMemoryGiB"]["description"]
    assert "milliseconds" in props["slo"]["properties"]["recoveryDeadlineMs"]["description"]
    assert "percent" in props["slo"]["properties"]["interferenceTolerancePct"]["description"]
    assert "Default: 1" in props["pool"]["properties"]["frozen"]["description"]
