"""CustomResourceDefinitions generated from the pydantic models in `api` (the one source of truth).

Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no `$ref`, no `anyOf` with null
(`nullable` instead), no `additionalProperties: false` next to `properties` (unknown fields are rejected by
the API server's strict field validation, `kubectl`'s default), OpenAPI-3.0-style boolean
`exclusiveMinimum`. This module rewrites pydantic's JSON Schema into that form, keeps the constraints
(min/max, patterns, enums, lengths) and the CEL rules that the models carry in `json_schema_extra`, and
adds the status subresource, printer columns and short names.

    python -m volga_core.api.crds --out crds/     # regenerate; a test fails when crds/ drifts
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys
from typing import Any

import pydantic
import yaml

from volga_core import api

DROP = {"title", "$defs", "additionalProperties", "discriminator"}


def structural(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Pydantic JSON Schema -> Kubernetes structural schema (recursive, refs inlined)."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        target = copy.deepcopy(defs[schema["$ref"].split("/")[-1]])
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural(merged, defs)
    if "anyOf" in schema:
        options = [o for o in schema["anyOf"] if o.get("type") != "null"]
        nullable = len(options) < len(schema["anyOf"])
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {schema['anyOf']} structurally")
        inner = structural({**options[0], **rest}, defs)
        if nullable:
            inner["nullable"] = True
            if inner.get("default", 0) is None:
                del inner["default"]
        return inner
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in DROP:
            continue
        if key == "properties":
            out["properties"] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out["items"] = structural(value, defs)
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "minLength" and schema.get("type") == "object":
            out["minProperties"] = value
        elif key == "maxLength" and schema.get("type") == "object":
            out["maxProperties"] = value
        else:
            out[key] = copy.deepcopy(value)
    additional = schema.get("additionalProperties")
    if isinstance(additional, dict) and "properties" not in schema:
        out["additionalProperties"] = structural(additional, defs)
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def spec_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    schema = structural(model.model_json_schema(by_alias=True, mode="validation"))
    schema["description"] = _first_line(model)
    return schema


def status_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """A status written by Volga: optional fields without null or defaults (the API server would fill those in
    on every write), and room for fields a newer writer adds."""
    schema = _strip(structural(model.model_json_schema(by_alias=True, mode="validation")), {"nullable", "default"})
    schema["description"] = _first_line(model)
    schema["x-kubernetes-preserve-unknown-fields"] = True
    return schema


def _first_line(model: type[pydantic.BaseModel]) -> str:
    return (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")


def _strip(schema: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    out = {k: v for k, v in schema.items() if k not in keys}
    if "properties" in out:
        out["properties"] = {name: _strip(sub, keys) for name, sub in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = _strip(out["items"], keys)
    return out


def _crd(plural: str, kind: str, short: str, spec: dict[str, Any], status: dict[str, Any],
         columns: list[dict[str, Any]], description: str, rules: list[dict[str, str]] | None = None
         ) -> dict[str, Any]:
    root: dict[str, Any] = {"type": "object", "description": description, "required": ["spec"],
                            "properties": {"spec": spec, "status": status}}
    if rules:
        root["x-kubernetes-validations"] = rules
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind, "shortNames": [short],
                      "categories": ["volga"]},
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


def ready_column() -> dict[str, Any]:
    return {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'}


# The API server already holds names to DNS-1123 subdomains; a ModelSpec's name is also a label value on its EMIs.
NAME_RULE = {"rule": f"size(self.metadata.name) <= {api.MAX_NAME}",
             "message": f"metadata.name: at most {api.MAX_NAME} characters (it labels the ModelSpec's EMIs)"}


def modelspec_crd() -> dict[str, Any]:
    columns = [{"name": "Model", "type": "string", "jsonPath": ".spec.modelId"},
               {"name": "Framework", "type": "string", "jsonPath": ".spec.framework"},
               ready_column(),
               {"name": "Hot", "type": "integer", "jsonPath": ".status.tiers.HOT"},
               {"name": "Warm", "type": "integer", "jsonPath": ".status.tiers.WARM", "priority": 1},
               {"name": "Suspended", "type": "integer", "jsonPath": ".status.tiers.SUSPENDED", "priority": 1},
               {"name": "Frozen", "type": "integer", "jsonPath": ".status.tiers.FROZEN"},
               {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    return _crd("modelspecs", "ModelSpec", "ms", spec_schema(api.ModelSpecSpec), status_schema(api.ModelSpecStatus),
                columns, "A model Volga keeps ready in snapshot tiers: its file, tensors, hardware, SLO and pool "
                "floors.", [NAME_RULE])


def emi_crd() -> dict[str, Any]:
    columns = [{"name": "Model", "type": "string", "jsonPath": ".spec.modelId"},
               {"name": "Node", "type": "string", "jsonPath": ".spec.node"},
               {"name": "Target", "type": "string", "jsonPath": ".spec.targetTier"},
               {"name": "Tier", "type": "string", "jsonPath": ".status.tier"},
               ready_column(),
               {"name": "Wake ms", "type": "number", "jsonPath": ".status.lastWakeMs", "priority": 1},
               {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    return _crd("executablemodelinstances", "ExecutableModelInstance", "emi", spec_schema(api.EmiSpec),
                status_schema(api.EmiStatus), columns, "One instance of a model on one node, and the tier it rests in.")


def all_crds() -> dict[str, dict[str, Any]]:
    return {"modelspecs.volga.dev.yaml": modelspec_crd(), "executablemodelinstances.volga.dev.yaml": emi_crd()}


def render(crd: dict[str, Any]) -> str:
    header = ("# Generated by `python -m volga_core.api.crds --out crds/` from volga_core/api/. "
              "Do not edit.\n")
    return header + yaml.safe_dump(crd, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the CRDs generated from the API types")
    parser.add_argument("--out", default="crds", help="folder (also: charts/volga/crds)")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, crd in all_crds().items():
        (out / name).write_text(render(crd))
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
