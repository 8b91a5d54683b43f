"""The ModelSpec and ExecutableModelInstance (EMI) types: the contract every Volga component shares.

These pydantic models are the one source of truth. The CRD schemas are generated from them, the operator
validates against them, `volga up` loads ModelSpec YAML through them, and the agent reads pool floors and
runtime options from them. Field names on the wire are camelCase (Kubernetes convention); Python attributes
are snake_case.

The package is the contract between the operator and the node side (docs/architecture.md): the types here,
the CRDs generated from them (`crds`), status conditions (`conditions`) and the label, annotation and
finalizer names both sides use (`labels`). It imports nothing else of Volga.
"""

from __future__ import annotations

import enum
import hashlib
import json
import pathlib
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import alias_generators

GROUP = "volga.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

_MODEL_ID = re.compile(r"^[a-z0-9]([-a-z0-9_.]{0,61}[a-z0-9])?$")


class Framework(enum.StrEnum):
    ONNX = "onnx"
    TORCHSCRIPT = "torchscript"
    PYTORCH = "pytorch"


class Tier(enum.StrEnum):
    """Where an instance lives, from fastest to wake to slowest."""

    HOT = "HOT"
    WARM = "WARM"
    SUSPENDED = "SUSPENDED"
    FROZEN = "FROZEN"
    COLD = "COLD"


class DType(enum.StrEnum):
    """Tensor element types, named as the Open Inference Protocol names them."""

    BOOL = "BOOL"
    UINT8 = "UINT8"
    UINT16 = "UINT16"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    FP32 = "FP32"
    FP64 = "FP64"


class Precision(enum.StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"


class Model(pydantic.BaseModel):
    """Base: camelCase on the wire, unknown fields rejected (a typo must not pass silently)."""

    model_config = pydantic.ConfigDict(
        alias_generator=alias_generators.to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)


class TensorSpec(Model):
    """One input or output tensor. A dimension of -1 accepts any size (the batch dimension, usually)."""

    name: Annotated[str, pydantic.Field(min_length=1, max_length=128)]
    dtype: DType
    shape: Annotated[list[int], pydantic.Field(min_length=0, max_length=8, json_schema_extra={
        "items": {"type": "integer", "minimum": -1},
        "x-kubernetes-validations": [{"rule": "self.all(d, d == -1 || d > 0)",
                                      "message": "dimensions must be positive, or -1 for any size"}]})]

    @pydantic.field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        for dim in shape:
            if dim == 0 or dim < -1:
                raise ValueError(f"dimension {dim} is not allowed: use a positive size or -1 for any size")
        return shape


class Hardware(Model):
    gpu_product: str | None = pydantic.Field(default=None, description="e.g. 'NVIDIA H200'; empty: any GPU")
    min_memory_gi_b: Annotated[float, pydantic.Field(ge=0, alias="minMemoryGiB")] = 0.0
    precision: Precision = Precision.FP32
    cuda_graphs: bool = False
    numa_affinity: bool = False
    gpu: bool = pydantic.Field(default=False, description="run on a GPU (CUDA); CPU otherwise")


class Targets(Model):
    latency_ms: Annotated[float, pydantic.Field(gt=0)] | None = None
    throughput_rps: Annotated[float, pydantic.Field(gt=0)] | None = None


class Slo(Model):
    """The three-part SLO contract: baseline latency per batch size, interference tolerance, recovery."""

    baseline_latency_ms: dict[str, Annotated[float, pydantic.Field(gt=0)]] = pydantic.Field(
        default_factory=dict, description="batch size -> p99 latency in ms when running alone", max_length=64,
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": "self.all(k, k.matches('^[1-9][0-9]{0,5}$'))", "message": "keys must be batch sizes"}]})
    interference_tolerance_pct: Annotated[float, pydantic.Field(ge=0, le=1000)] = 20.0
    recovery_deadline_ms: Annotated[float, pydantic.Field(gt=0)] = 1000.0

    @pydantic.field_validator("baseline_latency_ms")
    @classmethod
    def _batch_keys(cls, value: dict[str, float]) -> dict[str, float]:
        for key in value:
            if not key.isdigit() or int(key) < 1:
                raise ValueError(f"key {key!r} must be a batch size (a positive integer)")
        return value


class Pool(Model):
    """Pool floors: how many instances of this model to keep in each tier, across the cluster."""

    hot: Annotated[int, pydantic.Field(ge=0, le=1024)] = 0
    warm: Annotated[int, pydantic.Field(ge=0, le=1024)] = 0
    suspended: Annotated[int, pydantic.Field(ge=0, le=1024)] = 0
    frozen: Annotated[int, pydantic.Field(ge=0, le=1024)] = 1

    def floor(self, tier: Tier) -> int:
        return {Tier.HOT: self.hot, Tier.WARM: self.warm, Tier.SUSPENDED: self.suspended,
                Tier.FROZEN: self.frozen, Tier.COLD: 0}[tier]


class Runtime(Model):
    warmup_iterations: Annotated[int, pydantic.Field(ge=0, le=10_000)] = 3
    warmup_cache_ratio: Annotated[float, pydantic.Field(
        ge=0.0, le=1.0, description="share of the warmup iterations run again after each restore, before the "
                                    "first request: brings back caches (and lazily restored pages) at wake cost")] = 0.0
    reset_rng_on_restore: bool = True
    intra_op_threads: Annotated[int, pydantic.Field(ge=0, le=256)] = 0
    max_batch_size: Annotated[int, pydantic.Field(ge=1, le=65_536)] = 256


_UNIQUE_NAMES = "self.all(a, self.filter(b, b.name == a.name).size() == 1)"


class ModelSpecSpec(Model):
    model_id: str = pydantic.Field(max_length=63, json_schema_extra={"pattern": _MODEL_ID.pattern})
    framework: Framework
    source: str = pydantic.Field(description="file:// URI or local path of the model file", min_length=1,
                                 max_length=4096, json_schema_extra={"pattern": "^(file://.+|[^:]+)$"})
    version: str = pydantic.Field(default="1", min_length=1, max_length=64)
    inputs: Annotated[list[TensorSpec], pydantic.Field(min_length=1, max_length=64, json_schema_extra={
        "x-kubernetes-validations": [{"rule": _UNIQUE_NAMES, "message": "input names must be unique"}]})]
    outputs: Annotated[list[TensorSpec], pydantic.Field(min_length=1, max_length=64, json_schema_extra={
        "x-kubernetes-validations": [{"rule": _UNIQUE_NAMES, "message": "output names must be unique"}]})]
    hardware: Hardware = pydantic.Field(default_factory=Hardware)
    targets: Targets = pydantic.Field(default_factory=Targets)
    slo: Slo = pydantic.Field(default_factory=Slo)
    pool: Pool = pydantic.Field(default_factory=Pool)
    runtime: Runtime = pydantic.Field(default_factory=Runtime)
    chain: list[str] = pydantic.Field(default_factory=list, max_length=16,
                                      description="model ids called after this one")

    @pydantic.field_validator("model_id")
    @classmethod
    def _model_id(cls, value: str) -> str:
        if not _MODEL_ID.match(value):
            raise ValueError("must be 1-63 lowercase letters, digits, '-', '_' or '.', starting and ending "
                             "with a letter or digit")
        return value

    @pydantic.field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if "://" in value and not value.startswith("file://"):
            raise ValueError("only file:// URIs and local paths are supported")
        return value

    @pydantic.model_validator(mode="after")
    def _unique_names(self) -> ModelSpecSpec:
        for field, tensors in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [t.name for t in tensors]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{field}: tensor names must be unique, repeated: {', '.join(dupes)}")
        return self

    @property
    def source_path(self) -> pathlib.Path:
        return pathlib.Path(self.source.removeprefix("file://"))

    def input_hash(self) -> str:
        """SHA-256 of the input schema, as clients send it in `x-input-hash`."""
        schema = [{"name": t.name, "dtype": t.dtype.value, "shape": list(t.shape)} for t in self.inputs]
        return hashlib.sha256(json.dumps(schema, separators=(",", ":")).encode()).hexdigest()


class ObjectMeta(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow", frozen=True)

    name: Annotated[str, pydantic.Field(min_length=1, max_length=253)]
    namespace: str | None = None


class ModelSpec(Model):
    api_version: Literal["volga.dev/v1alpha1"] = "volga.dev/v1alpha1"
    kind: Literal["ModelSpec"] = "ModelSpec"
    metadata: ObjectMeta
    spec: ModelSpecSpec
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


def parse_model_spec(document: Any, source: str = "<input>") -> ModelSpec:
    """Validate one decoded document; raise SpecError naming each bad field and why."""
    if not isinstance(document, dict):
        raise SpecError(source, [("(document)", "expected a mapping with apiVersion, kind, metadata, spec")])
    try:
        return ModelSpec.model_validate(document)
    except pydantic.ValidationError as exc:
        problems = []
        for err in exc.errors():
            reason = err["msg"]
            if err["type"] == "extra_forbidden":
                reason = "unknown field"
            problems.append((_field_path(err["loc"]), reason))
        raise SpecError(source, problems) from None


def validate_spec(spec: Mapping[str, Any]) -> tuple[ModelSpecSpec | None, str]:
    """A ModelSpec's `spec` as found in the cluster: the typed spec, or None and a message naming each bad field."""
    try:
        parsed = parse_model_spec({"apiVersion": API_VERSION, "kind": "ModelSpec", "metadata": {"name": "x"},
                                   "spec": dict(spec)})
    except SpecError as exc:
        return None, "; ".join(f"{path}: {reason}" for path, reason in exc.problems)
    return parsed.spec, ""


def load_model_specs(path: str | pathlib.Path) -> list[ModelSpec]:
    """Load every ModelSpec in a YAML file (multi-document) or a folder of them."""
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
            if not spec.spec.source_path.is_absolute():
                # Relative model paths are relative to the file that names them.
                resolved = (file.parent / spec.spec.source_path).resolve()
                spec = spec.model_copy(update={"spec": spec.spec.model_copy(update={"source": str(resolved)})})
            specs.append(spec)
    return specs


class GpuRef(Model):
    index: Annotated[int, pydantic.Field(ge=0)]
    uuid: str = ""


class EmiSpec(Model):
    """Desired state of one instance: which model, where, and the tier the pool wants it in."""

    model_spec: str = pydantic.Field(description="name of the owning ModelSpec")
    model_id: str
    node: str
    gpu: GpuRef | None = None
    target_tier: Tier = Tier.FROZEN
