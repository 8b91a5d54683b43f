"""The CRDs are generated from the pydantic models; the committed files must be what the generator makes."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from volga_operator import api
from volga_operator.api import crds

ROOT = pathlib.Path(__file__).resolve().parent.parent


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
    assert props["targets"]["properties"]["latencyMs"] == {"type": "number", "minimum": 0, "exclusiveMinimum": True,
                                                           "nullable": True}
    assert "self.all(d, d == -1 || d > 0)" in yaml.safe_dump(props["inputs"])
    assert set(spec["required"]) == {"modelId", "framework", "source", "inputs", "outputs"}


def test_printer_columns_and_short_names() -> None:
    ms, emi = crds.modelspec_crd(), crds.emi_crd()
    assert ms["spec"]["names"]["shortNames"] == ["ms"] and emi["spec"]["names"]["shortNames"] == ["emi"]
    columns = [c["name"] for c in ms["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns[:4] == ["Model", "Framework", "Ready", "Hot"] and "Frozen" in columns
    assert ms["spec"]["versions"][0]["subresources"] == {"status": {}}
