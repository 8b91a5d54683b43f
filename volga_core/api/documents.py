"""ModelSpec documents as people write them: metadata around a spec, read from YAML files and folders
(`volga up`, `volga validate`), with each problem named by its field path (`SpecError`). Apart from the spec
types (`modelspec`), which the operator and the agents use alone: `validate_spec` checks a spec as the cluster
holds it by wrapping it in a document.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import pydantic
import yaml

from volga_core.api import base, modelspec


class ObjectMeta(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow", frozen=True)

    name: base.Name
    namespace: str | None = None

    @pydantic.field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > base.MAX_NAME or not base._DNS_LABEL.match(value)):
            raise ValueError(f"must be 1-{base.MAX_NAME} lowercase letters, digits or '-', starting and ending with a "
                             "letter or digit (a DNS-1123 label)")
        return value


class ModelSpec(base.Model):
    api_version: Literal["volga.dev/v1alpha1"] = "volga.dev/v1alpha1"
    kind: Literal["ModelSpec"] = "ModelSpec"
    metadata: ObjectMeta
    spec: modelspec.ModelSpecSpec
    status: dict[str, Any] | None = None


class SpecError(ValueError):
    """A ModelSpec that cannot be used; `problems` lists (field path, reason) pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {path}: {reason}" for path, reason in problems)
        super().__init__(f"{source}: invalid ModelSpec\n{lines}")


def _field_path(loc: Iterable[int | str]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(document)"


def problems_of(exc: pydantic.ValidationError, prefix: Iterable[int | str] = ()) -> list[tuple[str, str]]:
    """(field path, reason) for each error pydantic found; `prefix` is where the validated value sits."""
    found = []
    for err in exc.errors():
        reason = err["msg"]
        if err["type"] == "extra_forbidden":
            reason = "unknown field"
        elif err["type"] == "value_error" and "error" in err.get("ctx", {}):
            reason = str(err["ctx"]["error"])  # our own message, without pydantic's "Value error, "
        found.append((_field_path([*prefix, *err["loc"]]), reason))
    return found


def parse_model_spec(document: Any, source: str = "<input>") -> ModelSpec:
    """Validate one decoded document; raise SpecError naming each bad field and why."""
    if not isinstance(document, dict):
        raise SpecError(source, [("(document)", "expected a mapping with apiVersion, kind, metadata, spec")])
    try:
        return ModelSpec.model_validate(document)
    except pydantic.ValidationError as exc:
        raise SpecError(source, problems_of(exc)) from None


def validate_spec(spec: Mapping[str, Any]) -> tuple[modelspec.ModelSpecSpec | None, str]:
    """A ModelSpec's `spec` as found in the cluster: the typed spec, or None and a message naming each bad field.

    The spec stays as written: inputs and outputs left out are read from the model file by whoever can open it
    (`signature.fill`, on the node)."""
    try:
        parsed = parse_model_spec({"apiVersion": base.API_VERSION, "kind": "ModelSpec", "metadata": {"name": "x"},
                                   "spec": dict(spec)})
    except SpecError as exc:
        return None, "; ".join(f"{path}: {reason}" for path, reason in exc.problems)
    return parsed.spec, ""


def load_labelled(path: str | pathlib.Path) -> list[tuple[str, ModelSpec]]:
    """Every ModelSpec in a YAML file (multi-document) or a folder of them, each with where it was found
    (`file`, or `file#index` in a multi-document file)."""
    path = pathlib.Path(path)
    files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml")) if path.is_dir() else [path]
    specs = []
    for file in files:
        try:
            documents = list(yaml.safe_load_all(file.read_text()))
        except yaml.YAMLError as exc:
            raise SpecError(str(file), [("(document)", f"not valid YAML: {exc}")]) from None
        for index, document in enumerate(d for d in documents if d is not None):
            label = str(file) if len(documents) == 1 else f"{file}#{index}"
            spec = parse_model_spec(document, label)
            if not spec.spec.remote_source and not spec.spec.source_path.is_absolute():
                # Relative model paths are relative to the file that names them.
                resolved = (file.parent / spec.spec.source_path).resolve()
                spec = spec.model_copy(update={"spec": spec.spec.model_copy(update={"source": str(resolved)})})
            warmup = spec.spec.runtime.warmup_path
            if warmup is not None and not warmup.is_absolute():
                # Like the model file, a warm-up file is relative to the file that names it.
                runtime = spec.spec.runtime.model_copy(update={"warmup_file": str((file.parent / warmup).resolve())})
                spec = spec.model_copy(update={"spec": spec.spec.model_copy(update={"runtime": runtime})})
            specs.append((label, spec))
    return specs


def load_model_specs(path: str | pathlib.Path) -> list[ModelSpec]:
    """Load every ModelSpec in a YAML file (multi-document) or a folder of them."""
    return [spec for _, spec in load_labelled(path)]


def repeated(labelled: Iterable[tuple[str, ModelSpec]]) -> list[SpecError]:
    """A ModelSpec whose metadata.name or modelId an earlier one already uses, naming both places: in one store
    (`volga up`, a namespace) each must be unique."""
    first: dict[tuple[str, str], str] = {}
    errors = []
    for label, spec in labelled:
        found = []
        for path, value in (("metadata.name", spec.metadata.name), ("spec.modelId", spec.spec.model_id)):
            if (path, value) in first:
                found.append((path, f"{value!r} is already used by the ModelSpec in {first[path, value]}"))
            else:
                first[path, value] = label
        if found:
            errors.append(SpecError(label, found))
    return errors
