"""The ModelSpec and ExecutableModelInstance (EMI) types: the contract every Volga component shares.

These pydantic models are the one source of truth. The CRD schemas are generated from them, the operator
validates against them, `volga up` loads ModelSpec YAML through them, and the agent reads pool floors and
runtime options from them. Field names on the wire are camelCase (Kubernetes convention); Python attributes
are snake_case.

The package is the contract between the operator and the node side (docs/architecture.md): the types here,
the CRDs generated from them (`crds`), status conditions (`conditions`), the label, annotation and finalizer
names both sides use (`labels`), and a model file's tensor signature (`signature`: an ONNX ModelSpec may leave
its inputs and outputs out, and whoever can open the file fills them). It imports nothing else of Volga.
"""

from __future__ import annotations

import enum
import hashlib
import json
import pathlib
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import alias_generators

GROUP = "volga.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Kubernetes names (DNS-1123 subdomains). ModelSpec names are also label values on their EMIs, so they keep to
# a label value's 63 characters; model ids name files and URLs on the nodes, and keep to the same rule.
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_MODEL_ID = re.compile(_DNS_SUBDOMAIN)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 63
NAME_RULE = (f"must be 1-{MAX_NAME} lowercase letters, digits, '-' or '.', starting and ending with a letter or "
             "digit (a DNS-1123 subdomain, as Kubernetes names are; not a path)")
# The largest dimension a spec may write: a tensor dimension is a 32-bit signed size in every runtime Volga serves.
MAX_DIM = 2**31 - 1
# Pool floors above this are a typo more often than a plan (and each floor is a process on some node).
MAX_FLOOR = 64
# Models a chain lists after its head.
MAX_CHAIN = 16
# Control characters (NUL included) and the bidirectional marks and overrides that make a name display as
# another: a tensor name is printed in errors, logs and metrics, and must read as what it is.
_BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_TENSOR_NAME_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\x{061C}\x{200E}\x{200F}\x{202A}-\x{202E}\x{2066}-\x{2069}]*$"


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


def _show(value: Any) -> str:
    """A value as YAML spells it (true, null), for messages about what was written."""
    return json.dumps(value) if isinstance(value, bool | None | int | float) else repr(value)


def _dim(value: Any) -> Any:
    # Before pydantic's int: it would read `true` as 1 and say nothing useful about `null`.
    if isinstance(value, bool):
        raise ValueError(f"{_show(value)} is a boolean, not a size: write a positive integer, or -1 for any size")
    if value is None or isinstance(value, str):
        raise ValueError(f"{_show(value)} is not a size: write -1 for a dimension of any size (what a model "
                         "calls a symbolic dimension, such as 'batch'), or a positive integer")
    if not isinstance(value, int):
        raise ValueError(f"{_show(value)} is not a size: write a positive integer, or -1 for any size")
    return value


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{_show(value)} is a boolean: write a number")
    return value


Dim = Annotated[int, pydantic.BeforeValidator(_dim)]
Count = Annotated[int, pydantic.BeforeValidator(_no_bool)]


def bad_characters(text: str) -> list[str]:
    """The control and bidirectional-override characters in `text`, each written as its code point (U+202E)."""
    return [f"U+{ord(c):04X}" for c in text if unicodedata.category(c) == "Cc" or c in _BIDI]


class TensorSpec(Model):
    """One input or output tensor. A dimension of -1 accepts any size (the batch dimension, usually)."""

    name: str = pydantic.Field(
        min_length=1, max_length=128, json_schema_extra={"pattern": _TENSOR_NAME_PATTERN},
        description="the tensor's name in the model file, as requests name it; 1-128 characters, no control or "
                    "bidirectional-override characters")
    dtype: DType = pydantic.Field(description="element type, named as the Open Inference Protocol names them "
                                              "(FP32, INT64, BOOL, ...)")
    shape: list[Dim] = pydantic.Field(
        min_length=0, max_length=8,
        description=f"dimensions, at most 8: each a positive size (at most {MAX_DIM}, 2^31-1) or -1 for any size "
                    "(the batch dimension, a symbolic dimension of the model); [] for a scalar",
        json_schema_extra={
            "items": {"type": "integer", "minimum": -1, "maximum": MAX_DIM},
            "x-kubernetes-validations": [{"rule": "self.all(d, d == -1 || d > 0)",
                                          "message": "dimensions must be positive, or -1 for any size"}]})

    @pydantic.field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if bad := bad_characters(name):
            raise ValueError(f"must not contain control characters, NUL or bidirectional-override characters "
                             f"(found {', '.join(dict.fromkeys(bad))})")
        return name

    @pydantic.field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        for dim in shape:
            if dim == 0 or dim < -1:
                raise ValueError(f"dimension {dim} is not allowed: use a positive size or -1 for any size")
            if dim > MAX_DIM:
                raise ValueError(f"dimension {dim} is too large: at most {MAX_DIM} (2^31-1), or -1 for any size")
        return shape


class Hardware(Model):
    """What a node must offer to host the model; the operator places instances only where it does."""

    gpu_product: str | None = pydantic.Field(
        default=None, max_length=256,
        description="GPU product the model needs, matched case-insensitively as a part of the node's product name "
                    "(e.g. 'NVIDIA H200'); only with gpu: true. Default: unset, any GPU")
    min_memory_gi_b: float = pydantic.Field(
        default=0.0, ge=0, alias="minMemoryGiB",
        description="GPU memory the node's GPUs must have, in GiB (2^30 bytes); only with gpu: true. Default: 0, "
                    "no minimum")
    precision: Precision = pydantic.Field(
        default=Precision.FP32,
        description="precision a PyTorch or TorchScript model runs in: fp16 and bf16 cast its floating-point weights "
                    "at load, and its floating-point inputs and outputs at the edges (they keep their declared "
                    "dtypes); fp32 runs the file as it is. int8 is recorded only (quantize the file itself); ONNX "
                    "files carry their own types. Default: fp32")
    cuda_graphs: bool = pydantic.Field(
        default=False,
        description="capture CUDA graphs for the batch sizes named in slo.baselineLatencyMs (1 and 8 when none) "
                    "at warm-up; only on a GPU. Default: false")
    numa_affinity: bool = pydantic.Field(
        default=False,
        description="pin the worker to the CPUs of the NUMA node its GPU hangs off; only nodes that publish their "
                    "NUMA layout are eligible. Default: false")
    gpu: bool = pydantic.Field(default=False, description="run on a GPU (CUDA); CPU otherwise. Default: false")


class Targets(Model):
    """Service targets, recorded with the model (not yet acted on by placement)."""

    latency_ms: Annotated[float, pydantic.Field(gt=0)] | None = pydantic.Field(
        default=None, description="target p99 latency per request, in milliseconds (> 0). Default: unset")
    throughput_rps: Annotated[float, pydantic.Field(gt=0)] | None = pydantic.Field(
        default=None, description="target throughput, in requests per second (> 0). Default: unset")


class ToleranceStep(Model):
    """A step of a piecewise tolerance: `pct` while the other load is below `belowLoadPct` (the last: the rest)."""

    below_load_pct: float | None = pydantic.Field(
        default=None, gt=0, le=100,
        description="the step holds while the load of the node's other models is below this, in percent of the "
                    "node's GPU (CPU on a CPU node) utilisation (0-100, exclusive of 0); left out on the last step")
    pct: float = pydantic.Field(ge=0, le=1000, description="the tolerance in this step, in percent (0-1000)")


class BaselineTag(Model):
    """What a ModelSpec's baselines were measured for: `volga calibrate --write` writes it."""

    version: str = pydantic.Field(min_length=1, max_length=64, description="spec.version when measured")
    input_hash: str = pydantic.Field(max_length=64, description="the input hash (SHA-256, hex) when measured")
    device: str = pydantic.Field(default="", max_length=256,
                                 description="where: cpu, or the GPU's product name. Default: ''")


class Slo(Model):
    """The three-part SLO contract: baseline latency per batch size, interference tolerance, recovery."""

    baseline_latency_ms: dict[str, Annotated[float, pydantic.Field(gt=0)]] = pydantic.Field(
        default_factory=dict, max_length=64,
        description="batch size -> p99 latency in milliseconds when the model runs alone, at most 64 entries; "
                    "the batch sizes also choose the CUDA graphs captured (hardware.cudaGraphs). Default: empty",
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": "self.all(k, k.matches('^[1-9][0-9]{0,5}$'))", "message": "keys must be batch sizes"}]})
    interference_tolerance_pct: float = pydantic.Field(
        default=20.0, ge=0, le=1000,
        description="how much slower than the baseline the model may run beside others, in percent (0-1000). "
                    "Default: 20")
    recovery_deadline_ms: float = pydantic.Field(
        default=1000.0, gt=0,
        description="how long the model may stay out of its SLO before it must recover, in milliseconds (> 0). "
                    "Default: 1000")
    calibration_pace_ms: float = pydantic.Field(
        default=0.0, ge=0, le=60_000,
        description="how calibrations time the baselines (`volga calibrate`, a cluster's volga.dev/calibrate): "
                    "one request every calibrationPaceMs milliseconds, as a model that gets a few requests a "
                    "second sees them (an idle CPU or GPU answers slower than back-to-back requests), or back to "
                    "back with 0 (0-60000). Default: 0")

    @pydantic.field_validator("baseline_latency_ms")
    @classmethod
    def _batch_keys(cls, value: dict[str, float]) -> dict[str, float]:
        for key in value:
            if not key.isdigit() or int(key) < 1:
                raise ValueError(f"key {key!r} must be a batch size (a positive integer)")
        return value
    interference_tolerance: list[ToleranceStep] | None = pydantic.Field(
        default=None, max_length=8,
        description="the tolerance piecewise by the load of the node's other models, at most 8 steps in ascending "
                    "belowLoadPct, the last without it (e.g. [{belowLoadPct: 50, pct: 15}, {pct: 50}]); when "
                    "given it replaces interferenceTolerancePct. Default: none",
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": "self.size() == 0 || (!has(self[self.size() - 1].belowLoadPct) && "
                     "self.filter(s, !has(s.belowLoadPct)).size() == 1)",
             "message": "only the last step leaves belowLoadPct out"}]})
    baseline_for: BaselineTag | None = pydantic.Field(
        default=None,
        description="the version and input hash the baselines were measured for (volga calibrate --write); a "
                    "ModelSpec of another version or input hash has no baselines until calibrated again. "
                    "Default: unset, the baselines hold for any version")

    @pydantic.model_validator(mode="after")
    def _steps(self) -> Slo:
        steps = self.interference_tolerance or []
        problems: list[tuple[tuple[int | str, ...], str]] = []
        previous = 0.0
        for index, step in enumerate(steps):
            last = index == len(steps) - 1
            where: tuple[int | str, ...] = ("interferenceTolerance", index, "belowLoadPct")
            if last and step.below_load_pct is not None:
                problems.append((where, "the last step covers the rest of the load: leave belowLoadPct out"))
            elif not last and step.below_load_pct is None:
                problems.append((where, "required on every step but the last"))
            elif step.below_load_pct is not None:
                if step.below_load_pct <= previous:
                    problems.append((where, f"{step.below_load_pct:g} must be above the previous step's "
                                            f"{previous:g} (steps go in ascending load)"))
                previous = step.below_load_pct
        if problems:
            raise pydantic.ValidationError.from_exception_data("Slo", [
                {"type": "value_error", "loc": loc, "input": None, "ctx": {"error": ValueError(reason)}}
                for loc, reason in problems])
        return self

    def tolerance_pct(self, other_load_pct: float) -> float:
        """The tolerance while the node's other models load it by `other_load_pct` percent."""
        for step in self.interference_tolerance or ():
            if step.below_load_pct is None or other_load_pct < step.below_load_pct:
                return step.pct
        return self.interference_tolerance_pct

    def baselines_for(self, version: str, input_hash: str) -> dict[int, float]:
        """Batch size -> baseline p99 in milliseconds; empty when they were measured for another version or input
        hash (a new version invalidates them)."""
        tag = self.baseline_for
        if tag is not None and (tag.version != version or tag.input_hash != input_hash):
            return {}
        return {int(size): ms for size, ms in self.baseline_latency_ms.items()}


def _floor(tier: str, default: int) -> Any:
    return pydantic.Field(
        default=default, ge=0, json_schema_extra={"maximum": MAX_FLOOR},
        description=f"instances of this model kept in the {tier} tier across the cluster, 0-{MAX_FLOOR}. "
                    f"Default: {default}")


class Pool(Model):
    """Pool floors: how many instances of this model to keep in each tier, across the cluster."""

    hot: Count = _floor("HOT", 0)
    warm: Count = _floor("WARM", 0)
    suspended: Count = _floor("SUSPENDED", 0)
    frozen: Count = _floor("FROZEN", 1)

    @pydantic.field_validator("hot", "warm", "suspended", "frozen")
    @classmethod
    def _cap(cls, value: int) -> int:
        if value > MAX_FLOOR:
            raise ValueError(f"{value} is more than {MAX_FLOOR}, the most instances a pool keeps in one tier")
        return value

    def floor(self, tier: Tier) -> int:
        return {Tier.HOT: self.hot, Tier.WARM: self.warm, Tier.SUSPENDED: self.suspended,
                Tier.FROZEN: self.frozen, Tier.COLD: 0}[tier]


MAX_BATCH = 65_536


def _field_error(model: str, loc: tuple[str, ...], message: str) -> pydantic.ValidationError:
    """A validation error at `loc` (below the model that raises it), with our own message."""
    return pydantic.ValidationError.from_exception_data(model, [{
        "type": "value_error", "loc": loc, "input": None, "ctx": {"error": ValueError(message)}}])


class DynamicBatching(Model):
    """Dynamic batching in the gateway, as Triton's dynamic batcher does it: requests for the model wait a short
    while in a bounded queue and run together, concatenated along their first dimension (the batch)."""

    enabled: bool = pydantic.Field(
        default=False,
        description="batch requests in the gateway; only for models whose every input and output has the batch "
                    "as its first dimension (-1). Default: false")
    preferred_batch_sizes: list[Annotated[int, pydantic.Field(ge=1, le=MAX_BATCH)]] = pydantic.Field(
        default_factory=list, max_length=16,
        description="batch sizes (in samples, rows of the first dimension) the gateway prefers to send, each at "
                    "most runtime.maxBatchSize, at most 16, no repeats; empty: any size up to "
                    "runtime.maxBatchSize. Default: empty",
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": "self.all(a, self.filter(b, b == a).size() == 1)",
             "message": "preferred batch sizes must not repeat"}]})
    max_queue_delay_microseconds: int = pydantic.Field(
        default=0, ge=0, le=10_000_000,
        description="how long a request may wait for others to join its batch, in microseconds (0-10000000, "
                    "10 s); 0 sends what is queued as soon as the model is free. Default: 0")
    max_queue_size: int = pydantic.Field(
        default=1024, ge=1, le=1_000_000,
        description="requests that may wait in the model's queue (1-1000000); past it a request is refused "
                    "with RESOURCE_EXHAUSTED (HTTP 429). Default: 1024")

    @pydantic.field_validator("preferred_batch_sizes")
    @classmethod
    def _unique(cls, sizes: list[int]) -> list[int]:
        if dupes := sorted({s for s in sizes if sizes.count(s) > 1}):
            raise ValueError(f"preferred batch sizes must not repeat, repeated: {', '.join(map(str, dupes))}")
        return sorted(sizes)


_PREFERRED_FIT = ("!has(self.dynamicBatching) || !has(self.dynamicBatching.preferredBatchSizes) || "
                  "self.dynamicBatching.preferredBatchSizes.all(s, s <= (has(self.maxBatchSize) ? "
                  "self.maxBatchSize : 256))")

# A warm-up tensor is allocated in the worker: more elements than this is a typo more often than a plan.
MAX_WARMUP_ELEMENTS = 2**27


class WarmupInput(Model):
    """One input of a warm-up sample: a shape (filled, drawn from a range, or made up) or literal values."""

    model_config = pydantic.ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "[has(self.fill), has(self.range), has(self.values)].filter(x, x).size() <= 1",
         "message": "give one of fill, range and values"},
        {"rule": "has(self.shape) || has(self.values)", "message": "shape is required (unless values are given)"}]})

    shape: list[Annotated[int, pydantic.BeforeValidator(_no_bool)]] | None = pydantic.Field(
        default=None, max_length=8,
        description="the input's shape in this sample, every dimension a size (0 or more, no -1); [] for a "
                    "scalar. Default: [len(values)] with values, required otherwise",
        json_schema_extra={"items": {"type": "integer", "minimum": 0, "maximum": MAX_DIM}})
    fill: float | None = pydantic.Field(default=None, description="one value for every element. Default: unset")
    value_range: list[float] | None = pydantic.Field(
        default=None, alias="range", min_length=2, max_length=2,
        description="[low, high): values drawn uniformly (integers for integer inputs), with a fixed seed. "
                    "Default: unset")
    values: list[float] | None = pydantic.Field(
        default=None, max_length=65_536,
        description="literal values, flat in row-major order (at most 65536; 0 and 1 for BOOL); with shape, as "
                    "many as its elements. Default: unset")

    @pydantic.model_validator(mode="after")
    def _one_source(self) -> WarmupInput:
        given = [name for name, value in (("fill", self.fill), ("range", self.value_range), ("values", self.values))
                 if value is not None]
        if len(given) > 1:
            raise ValueError(f"give one of fill, range and values, not {' and '.join(given)}")
        if self.shape is None and self.values is None:
            raise ValueError("shape is required (unless values are given)")
        for dim in self.shape or ():
            if dim < 0 or dim > MAX_DIM:
                raise ValueError(f"shape: dimension {dim} is not a size (0 to {MAX_DIM})")
        elements = self.elements
        if self.values is not None and self.shape is not None and len(self.values) != elements:
            raise ValueError(f"{len(self.values)} values given for shape {self.shape}, which has {elements} elements")
        if elements > MAX_WARMUP_ELEMENTS:
            raise ValueError(f"shape {self.shape} has {elements} elements, more than {MAX_WARMUP_ELEMENTS}")
        if self.value_range is not None and not self.value_range[0] < self.value_range[1]:
            raise ValueError(f"range {self.value_range}: low must be below high")
        return self

    @property
    def resolved_shape(self) -> list[int]:
        return list(self.shape) if self.shape is not None else [len(self.values or ())]

    @property
    def elements(self) -> int:
        count = 1
        for dim in self.resolved_shape:
            count *= dim
        return count


class WarmupSample(Model):
    """One warm-up inference: inputs by name; an input left out gets made-up values of its declared shape."""

    inputs: dict[str, WarmupInput] = pydantic.Field(
        min_length=1, max_length=64, description="input name -> its shape and values in this sample, 1-64 inputs")


class Runtime(Model):
    """How the worker runs the model."""

    model_config = pydantic.ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": _PREFERRED_FIT, "message": "dynamicBatching.preferredBatchSizes must be at most maxBatchSize"}]})

    warmup_iterations: int = pydantic.Field(
        default=3, ge=0, le=10_000,
        description="inferences on sample inputs after loading, before the first snapshot and the first request "
                    "(0-10000). Default: 3")
    warmup_cache_ratio: float = pydantic.Field(
        default=0.0, ge=0.0, le=1.0,
        description="share of the warmup iterations run again after each restore, before the first request: brings "
                    "back caches (and lazily restored pages) at wake cost (0-1; 0 leaves it to the node's "
                    "setting). Default: 0")
    reset_rng_on_restore: bool = pydantic.Field(
        default=True,
        description="re-seed the worker's random number generators after every restore, so that copies restored "
                    "from one image do not share random streams. Default: true")
    intra_op_threads: int = pydantic.Field(
        default=0, ge=0, le=256,
        description="threads one operator may use (0-256; 0: the runtime's default). Default: 0")
    max_batch_size: int = pydantic.Field(
        default=256, ge=1, le=65_536,
        description="the largest batch (first dimension) a request may send, in samples (1-65536). Default: 256")
    dynamic_batching: DynamicBatching = pydantic.Field(
        default_factory=DynamicBatching,
        description="batching of requests in the gateway (enabled, preferred sizes, queue delay and size). "
                    "Default: off")

    @pydantic.model_validator(mode="after")
    def _preferred_fit(self) -> Runtime:
        over = [s for s in self.dynamic_batching.preferred_batch_sizes if s > self.max_batch_size]
        if over:
            raise _field_error("Runtime", ("dynamicBatching", "preferredBatchSizes"),
                               f"{', '.join(map(str, over))} over runtime.maxBatchSize {self.max_batch_size}: "
                               "a preferred batch size must be at most the largest batch")
        return self
    warmup: list[WarmupSample] = pydantic.Field(
        default_factory=list, max_length=64,
        description="warm-up samples, at most 64, each run warmupIterations times after loading and before the "
                    "first snapshot, so every shape listed is warm in the image; the first one is also the canary "
                    "that checks restores. Default: one sample of made-up values (-1 dimensions as 1, integers "
                    "0-99)")
    warmup_file: str | None = pydantic.Field(
        default=None, min_length=1, max_length=4096, json_schema_extra={"pattern": "^(file://.+|[^:]+)$"},
        description="an .npz file of real inputs to warm up with, run after the warmup samples: arrays named as "
                    "the inputs (one sample), or 'K/NAME' for sample K; a relative path is relative to the "
                    "ModelSpec file (`volga up`); inputs a sample leaves out get made-up values. Default: unset")

    @property
    def warmup_path(self) -> pathlib.Path | None:
        return pathlib.Path(self.warmup_file.removeprefix("file://")) if self.warmup_file else None


_UNIQUE_NAMES = "self.all(a, self.filter(b, b.name == a.name).size() == 1)"
_SIGNATURE_READ = "self.framework == 'onnx' || (has(self.inputs) && has(self.outputs))"
_BATCH_FIRST = ("!has(self.runtime) || !has(self.runtime.dynamicBatching) || "
                "!has(self.runtime.dynamicBatching.enabled) || !self.runtime.dynamicBatching.enabled || "
                "((!has(self.inputs) || self.inputs.all(t, size(t.shape) > 0 && t.shape[0] == -1)) && "
                "(!has(self.outputs) || self.outputs.all(t, size(t.shape) > 0 && t.shape[0] == -1)))")
NOT_BATCHED = ("dynamic batching needs every input and output to have the batch as its first dimension (-1); "
               "{which}")
NO_SIGNATURE = ("a {framework} file carries no tensor signature (names, dtypes and shapes) to read: write inputs and "
                "outputs in the spec (only ONNX signatures are read from the model file)")


def _tensors(kind: str) -> Any:
    return pydantic.Field(
        default_factory=list, min_length=1, max_length=64,
        description=f"the model's {kind} tensors, 1-64, names unique. Default (ONNX only): read from the model "
                    "file where the file is (`volga up`, `volga validate`, the agent on its node), with symbolic "
                    "dimensions as -1",
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": _UNIQUE_NAMES, "message": f"{kind} names must be unique"}]})


class ModelSpecSpec(Model):
    """What a model is and how Volga keeps it: its file, tensors, hardware, SLO, pool floors and runtime."""

    model_config = pydantic.ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": _SIGNATURE_READ, "message": NO_SIGNATURE.format(framework="torchscript or pytorch")},
        {"rule": _BATCH_FIRST, "message": NOT_BATCHED.format(which="a tensor's shape does not start with -1")},
        {"rule": "!has(self.chain) || !(self.modelId in self.chain)",
         "message": "chain lists the model's own modelId: a chain that calls its head again is a cycle"},
        {"rule": "!has(self.ensemble) || (has(self.chain) && size(self.chain) > 0 && self.ensemble != self.modelId)",
         "message": "ensemble needs a chain, and a model id other than the head's"}]})

    model_id: str = pydantic.Field(
        json_schema_extra={"maxLength": MAX_NAME, "pattern": _MODEL_ID.pattern},
        description=f"the model's name in requests (the Open Inference Protocol's model name, or x-model-id); "
                    f"1-{MAX_NAME} lowercase letters, digits, '-' or '.' (a DNS-1123 subdomain), unique")
    framework: Framework = pydantic.Field(description="how the file is loaded: onnx (onnxruntime), torchscript "
                                                      "(torch.jit.load) or pytorch")
    source: str = pydantic.Field(
        min_length=1, max_length=4096, json_schema_extra={"pattern": "^(file://.+|[^:]+)$"},
        description="file:// URI or local path of the model file on the node (at most 4096 characters); a "
                    "relative path is relative to the ModelSpec file (`volga up`)")
    version: str = pydantic.Field(default="1", min_length=1, max_length=64,
                                  description="the model's version as the protocol reports it. Default: '1'")
    inputs: list[TensorSpec] = _tensors("input")
    outputs: list[TensorSpec] = _tensors("output")
    hardware: Hardware = pydantic.Field(default_factory=Hardware, description=(
        "what a node must offer: GPU or CPU, GPU product and memory, NUMA affinity. Default: a CPU"))
    targets: Targets = pydantic.Field(default_factory=Targets, description=(
        "service targets (latency, throughput), recorded. Default: none"))
    slo: Slo = pydantic.Field(default_factory=Slo, description=(
        "the SLO contract: baseline latency per batch size, interference tolerance, recovery deadline"))
    pool: Pool = pydantic.Field(default_factory=Pool, description=(
        f"how many instances to keep in each tier across the cluster, 0-{MAX_FLOOR} per tier. Default: 1 FROZEN"))
    runtime: Runtime = pydantic.Field(default_factory=Runtime, description=(
        "how the worker runs the model: warm-up, threads, batch size, re-seeding after restores"))
    chain: list[str] = pydantic.Field(
        default_factory=list, max_length=MAX_CHAIN,
        description=f"model ids called after this one, in order, at most {MAX_CHAIN}: this model heads a chain, "
                    "which wakes as one (waking any member wakes the others in parallel), is kept on one node "
                    "(one GPU where memory allows) and whose slo is end to end; a model is in one chain at most. "
                    "Default: none",
        json_schema_extra={"items": {"type": "string", "maxLength": MAX_NAME, "pattern": _MODEL_ID.pattern},
                           "x-kubernetes-validations": [
                               {"rule": "self.all(a, self.filter(b, b == a).size() == 1)",
                                "message": "a chain lists each model once"}]})
    ensemble: str | None = pydantic.Field(
        default=None, json_schema_extra={"maxLength": MAX_NAME, "pattern": _MODEL_ID.pattern},
        description="with chain: a model id under which the gateway serves the whole chain as one model (a "
                    "Triton ensemble): the head's inputs in, each member's inputs taken by name from the outputs "
                    "before it, the last member's outputs out. Default: unset (the members are called one by one)")

    @pydantic.field_validator("ensemble")
    @classmethod
    def _ensemble_id(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > MAX_NAME or not _MODEL_ID.match(value)):
            raise ValueError(NAME_RULE)
        return value

    @pydantic.model_validator(mode="after")
    def _chain_shape(self) -> ModelSpecSpec:
        problems: list[tuple[tuple[int | str, ...], str]] = []
        for index, member in enumerate(self.chain):
            if len(member) > MAX_NAME or not _MODEL_ID.match(member):
                problems.append((("chain", index), f"{member!r}: a model id {NAME_RULE}"))
            elif member == self.model_id:
                problems.append((("chain", index), f"{member!r} is this model's own modelId: a chain that calls "
                                                   "its head again is a cycle"))
            elif member in self.chain[:index]:
                problems.append((("chain", index), f"{member!r} is listed twice: a chain lists each model once"))
        if self.ensemble is not None and not self.chain:
            problems.append((("ensemble",), "an ensemble serves a chain: list its members in chain"))
        elif self.ensemble is not None and self.ensemble == self.model_id:
            problems.append((("ensemble",), f"{self.ensemble!r} is the head's own modelId: give the ensemble a "
                                            "model id of its own"))
        if problems:
            raise pydantic.ValidationError.from_exception_data("ModelSpecSpec", [
                {"type": "value_error", "loc": loc, "input": None, "ctx": {"error": ValueError(reason)}}
                for loc, reason in problems])
        return self

    @pydantic.field_validator("model_id")
    @classmethod
    def _model_id(cls, value: str) -> str:
        if len(value) > MAX_NAME or not _MODEL_ID.match(value):
            raise ValueError(NAME_RULE)
        return value

    @pydantic.field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if "://" in value and not value.startswith("file://"):
            raise ValueError("only file:// URIs and local paths are supported")
        return value

    @pydantic.model_validator(mode="after")
    def _signature(self) -> ModelSpecSpec:
        if self.framework is not Framework.ONNX:
            for field, tensors in (("inputs", self.inputs), ("outputs", self.outputs)):
                if not tensors:
                    raise pydantic.ValidationError.from_exception_data("ModelSpecSpec", [{
                        "type": "value_error", "loc": (field,), "input": None,
                        "ctx": {"error": ValueError(NO_SIGNATURE.format(framework=self.framework.value))}}])
        for field, tensors in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [t.name for t in tensors]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{field}: tensor names must be unique, repeated: {', '.join(dupes)}")
        if self.runtime.dynamic_batching.enabled:
            unbatched = [f"{field}[{i}] {t.name!r} has shape {t.shape}"
                         for field, tensors in (("inputs", self.inputs), ("outputs", self.outputs))
                         for i, t in enumerate(tensors) if not t.shape or t.shape[0] != -1]
            if unbatched:
                raise _field_error("ModelSpecSpec", ("runtime", "dynamicBatching", "enabled"),
                                   NOT_BATCHED.format(which="; ".join(unbatched)))
        if problems := warmup_problems(self):
            raise pydantic.ValidationError.from_exception_data("ModelSpecSpec", [
                {"type": "value_error", "loc": loc, "input": None, "ctx": {"error": ValueError(reason)}}
                for loc, reason in problems])
        return self

    @property
    def batches(self) -> bool:
        """Every input and output has the batch as its first dimension (-1): requests can be concatenated."""
        return self.has_signature and all(t.shape and t.shape[0] == -1 for t in [*self.inputs, *self.outputs])

    @pydantic.model_serializer(mode="wrap")
    def _omit_unread(self, handler: pydantic.SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Inputs and outputs left out stay out: [] would be refused when the document is read back.
        data: dict[str, Any] = handler(self)
        for field in ("inputs", "outputs"):
            if data.get(field) == []:
                del data[field]
        return data

    @property
    def has_signature(self) -> bool:
        """False while inputs or outputs are left out, to be read from the model file (`signature.fill`)."""
        return bool(self.inputs) and bool(self.outputs)

    @property
    def source_path(self) -> pathlib.Path:
        return pathlib.Path(self.source.removeprefix("file://"))

    def input_hash(self) -> str:
        """SHA-256 of the input schema, as clients send it in `x-input-hash`; "" while the inputs are unread."""
        if not self.inputs:
            return ""
        schema = [{"name": t.name, "dtype": t.dtype.value, "shape": list(t.shape)} for t in self.inputs]
        return hashlib.sha256(json.dumps(schema, separators=(",", ":")).encode()).hexdigest()


def _shape_text(shape: Iterable[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def warmup_problems(spec: ModelSpecSpec) -> list[tuple[tuple[int | str, ...], str]]:
    """(field location, reason) for each warm-up sample input that the declared inputs refuse: an unknown name,
    another rank, a size where the input fixes another, values its dtype cannot hold, a batch over maxBatchSize.
    [] while the inputs are still to be read from the model file."""
    by_name = {t.name: t for t in spec.inputs}
    if not by_name:
        return []
    problems: list[tuple[tuple[int | str, ...], str]] = []
    for index, sample in enumerate(spec.runtime.warmup):
        for name, given in sample.inputs.items():
            loc: tuple[int | str, ...] = ("runtime", "warmup", index, "inputs", name)
            decl = by_name.get(name)
            if decl is None:
                problems.append((loc, f"the model has no input {name!r} (it has "
                                      f"{', '.join(repr(n) for n in by_name)})"))
                continue
            shape = given.resolved_shape
            if len(shape) != len(decl.shape):
                problems.append((loc, f"shape {_shape_text(shape)} has rank {len(shape)}; input {name!r} has rank "
                                      f"{len(decl.shape)} ({_shape_text(decl.shape)})"))
                continue
            fixed = [f"dimension {j} is {g}, the input fixes it at {d}"
                     for j, (d, g) in enumerate(zip(decl.shape, shape, strict=True)) if d != -1 and d != g]
            if fixed:
                problems.append((loc, f"shape {_shape_text(shape)} does not fit input {name!r} "
                                      f"{_shape_text(decl.shape)}: {'; '.join(fixed)}"))
            elif decl.shape and decl.shape[0] == -1 and shape[0] > spec.runtime.max_batch_size:
                problems.append((loc, f"batch {shape[0]} is over runtime.maxBatchSize {spec.runtime.max_batch_size}"))
            if reason := _dtype_problem(decl.dtype, given):
                problems.append((loc, f"input {name!r} is {decl.dtype.value}: {reason}"))
    return problems


def _dtype_problem(dtype: DType, given: WarmupInput) -> str:
    # Values arrive as floats (JSON numbers): 2.0 reads back as the 2 that was written.
    numbers = [int(v) if float(v).is_integer() else v
               for v in [*(given.values or ()), *([given.fill] if given.fill is not None else [])]]
    if dtype is DType.BOOL:
        bad = [v for v in numbers if v not in (0, 1)]
        return f"{_show(bad[0])} is not a boolean (write 0 or 1)" if bad else (
            "a range does not apply (write fill or values)" if given.value_range is not None else "")
    if dtype.value.startswith(("INT", "UINT")):
        bad = [v for v in [*numbers, *(given.value_range or ())] if not float(v).is_integer()]
        if bad:
            return f"{_show(bad[0])} is not an integer"
        if dtype.value.startswith("UINT") and any(v < 0 for v in [*numbers, *(given.value_range or ())]):
            return "negative values do not fit an unsigned type"
    return ""


class ObjectMeta(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow", frozen=True)

    name: str
    namespace: str | None = None

    @pydantic.field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if len(value) > MAX_NAME or not _MODEL_ID.match(value):
            raise ValueError(NAME_RULE)
        return value

    @pydantic.field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > MAX_NAME or not _DNS_LABEL.match(value)):
            raise ValueError(f"must be 1-{MAX_NAME} lowercase letters, digits or '-', starting and ending with a "
                             "letter or digit (a DNS-1123 label)")
        return value


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


def validate_spec(spec: Mapping[str, Any]) -> tuple[ModelSpecSpec | None, str]:
    """A ModelSpec's `spec` as found in the cluster: the typed spec, or None and a message naming each bad field.

    The spec stays as written: inputs and outputs left out are read from the model file by whoever can open it
    (`signature.fill`, on the node)."""
    try:
        parsed = parse_model_spec({"apiVersion": API_VERSION, "kind": "ModelSpec", "metadata": {"name": "x"},
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
            if not spec.spec.source_path.is_absolute():
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



def _way_back(head: str, member: str, chains: Mapping[str, list[str]]) -> list[str] | None:
    """The model ids from `head` through `member` along chains back to `head`; None when there is no cycle."""
    stack, seen = [[head, member]], set()
    while stack:
        path = stack.pop()
        if path[-1] in seen:
            continue
        seen.add(path[-1])
        for nxt in chains.get(path[-1], ()):
            if nxt == head:
                return [*path, head]
            stack.append([*path, nxt])
    return None


def _fits(given: TensorSpec, wanted: TensorSpec) -> bool:
    return given.dtype == wanted.dtype and len(given.shape) == len(wanted.shape) and all(
        g == w or -1 in (g, w) for g, w in zip(given.shape, wanted.shape, strict=True))


def _tensor_text(t: TensorSpec) -> str:
    return f"{t.dtype.value} {_shape_text(t.shape)}"


def ensemble_problems(steps: Sequence[ModelSpecSpec]) -> list[tuple[str, str]]:
    """(field path in the head, reason) for each input of a chain's later members that neither the head's inputs
    nor an output before it provides by name, with that dtype and a shape that fits; [] while a signature is
    unread."""
    if not all(step.has_signature for step in steps):
        return []
    available: dict[str, tuple[TensorSpec, str]] = {t.name: (t, "the ensemble's input") for t in steps[0].inputs}
    problems = []
    for index, step in enumerate(steps):
        for t in step.inputs if index else ():
            source = available.get(t.name)
            path = f"spec.chain[{index - 1}]"
            if source is None:
                problems.append((path, f"input {t.name!r} of {step.model_id!r} is neither an input of the head nor "
                                       f"an output of a model before it (those are "
                                       f"{', '.join(repr(n) for n in available)})"))
            elif not _fits(source[0], t):
                problems.append((path, f"input {t.name!r} of {step.model_id!r} is {_tensor_text(t)}, and "
                                       f"{source[1]} {t.name!r} is {_tensor_text(source[0])}"))
        available.update({t.name: (t, f"the output of {step.model_id!r}") for t in step.outputs})
    return problems


def chain_problems(specs: Mapping[str, ModelSpecSpec]) -> dict[str, list[tuple[str, str]]]:
    """The chains of one store's ModelSpecs (a `volga up` set, a namespace), keyed as `specs` is (where each was
    found): (field path, reason) for a member no ModelSpec has, a cycle, a model in two chains (the later head in
    `specs`' order is the one refused, and a head listed as another's member), an ensemble id another model or
    ensemble uses, and an ensemble whose members' inputs the outputs before them do not provide."""
    by_id = {spec.model_id: label for label, spec in specs.items()}
    chains = {spec.model_id: spec.chain for spec in specs.values() if spec.chain}
    claimed: dict[str, str] = {}  # model id -> the head of the chain it is in
    ensembles: dict[str, str] = {}
    found: dict[str, list[tuple[str, str]]] = {}
    for label, spec in specs.items():
        if not spec.chain:
            continue
        problems = []
        if spec.model_id in claimed:
            problems.append(("spec.chain", f"{spec.model_id!r} is already in the chain headed by "
                                           f"{claimed[spec.model_id]!r} ({by_id[claimed[spec.model_id]]}): a model "
                                           "is in one chain at most"))
        mine = []
        for index, member in enumerate(spec.chain):
            path = f"spec.chain[{index}]"
            if member not in by_id:
                problems.append((path, f"no ModelSpec has modelId {member!r}"))
            elif cycle := _way_back(spec.model_id, member, chains):
                problems.append((path, f"{' -> '.join(cycle)} is a cycle: a chain runs one way"))
            elif member in chains:
                problems.append((path, f"{member!r} heads a chain of its own ({by_id[member]}): a model is in one "
                                       "chain at most (list its members here instead)"))
            elif member in claimed:
                problems.append((path, f"{member!r} is already in the chain headed by {claimed[member]!r} "
                                       f"({by_id[claimed[member]]}): a model is in one chain at most"))
            else:
                mine.append(member)
        if spec.ensemble is not None:
            if spec.ensemble in by_id:
                problems.append(("spec.ensemble", f"{spec.ensemble!r} is the modelId of the ModelSpec in "
                                                  f"{by_id[spec.ensemble]}"))
            elif spec.ensemble in ensembles:
                problems.append(("spec.ensemble", f"{spec.ensemble!r} is already the ensemble of the chain headed "
                                                  f"by {ensembles[spec.ensemble]!r}"))
            elif not problems:
                problems += ensemble_problems([spec, *(specs[by_id[m]] for m in spec.chain)])
        if problems:
            found[label] = problems
            continue
        claimed.update({m: spec.model_id for m in [spec.model_id, *mine]})
        if spec.ensemble is not None:
            ensembles[spec.ensemble] = spec.model_id
    return found


def chain_errors(labelled: Iterable[tuple[str, ModelSpec]]) -> list[SpecError]:
    """`chain_problems` of labelled ModelSpecs (as `load_labelled` gives them), one SpecError per ModelSpec."""
    found = chain_problems({label: spec.spec for label, spec in labelled})
    return [SpecError(label, problems) for label, problems in found.items()]


def chain_peers(keys: Iterable[tuple[str, str]], specs: Mapping[tuple[str, str], Mapping[str, Any]]
                ) -> set[tuple[str, str]]:
    """`keys` (namespace, name) and the ModelSpecs in a chain with one of them, so that a chain is planned as one;
    `specs` holds every ModelSpec's spec as the cluster has it. Reads only modelId and chain."""
    found = set(keys)
    by_id = {(key[0], str(spec.get("modelId", ""))): key for key, spec in specs.items()}
    for key, spec in specs.items():
        chain = spec.get("chain")
        if isinstance(chain, list) and chain:
            group = {key, *(by_id[key[0], m] for m in chain if isinstance(m, str) and (key[0], m) in by_id)}
            if group & found:
                found |= group
    return found

def chain_invalid(valid: Mapping[str, ModelSpecSpec], everything: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Of the ModelSpecs in `valid` (keyed 'namespace/name'), those whose chain cannot be used, with the message
    their Valid condition carries; `everything` holds every ModelSpec's spec as the cluster has it, by the same
    keys. A namespace in which no ModelSpec lists a chain costs one look at each of its specs."""
    invalid: dict[str, str] = {}
    for namespace in sorted({key.partition("/")[0] for key in valid}):
        keys = sorted(key for key in everything if key.partition("/")[0] == namespace)
        if not any(everything[key].get("chain") or everything[key].get("ensemble") for key in keys):
            continue
        typed = {key: spec for key in keys
                 if (spec := valid.get(key) or validate_spec(everything[key])[0]) is not None}
        for key, problems in chain_problems(typed).items():
            if key in valid:
                invalid[key] = "; ".join(f"{path}: {reason}" for path, reason in problems)
    return invalid

class GpuRef(Model):
    """The GPU of the node an instance runs on."""

    index: int = pydantic.Field(ge=0, description="the GPU's index on its node, as CUDA numbers it (>= 0)")
    uuid: str = pydantic.Field(default="", description="the GPU's UUID, where known. Default: ''")


class EmiSpec(Model):
    """Desired state of one instance: which model, where, and the tier the pool wants it in."""

    model_spec: str = pydantic.Field(description="name of the owning ModelSpec, in the same namespace")
    model_id: str = pydantic.Field(description="the owning ModelSpec's spec.modelId")
    node: str = pydantic.Field(description="the node the instance is placed on; that node's agent runs it")
    gpu: GpuRef | None = pydantic.Field(default=None, description="the GPU it runs on. Default: unset, a CPU "
                                                                  "instance")
    target_tier: Tier = pydantic.Field(default=Tier.FROZEN, description=(
        "the tier the pool wants the instance to rest in (HOT, WARM, SUSPENDED, FROZEN or COLD); a request wakes it "
        "to HOT, idleness brings it back. Default: FROZEN"))


# Status: written by the operator (ModelSpec) and the agents (EMI), read by people and by the other side. The
# models exist for the CRDs' schemas and descriptions; the writers build plain mappings (`conditions`).

class Condition(Model):
    """One Kubernetes-style condition."""

    type: str = pydantic.Field(description="Ready, Valid or Placed")
    status: Literal["True", "False", "Unknown"] = pydantic.Field(description="True, False or Unknown")
    reason: str | None = pydantic.Field(default=None, description="one CamelCase word saying why")
    message: str | None = pydantic.Field(default=None, description="why, for people")
    last_transition_time: str | None = pydantic.Field(
        default=None, json_schema_extra={"format": "date-time"},
        description="when the status last changed, RFC 3339 in UTC")
    observed_generation: int | None = pydantic.Field(
        default=None, description="the object's metadata.generation the condition was written for")


def _conditions() -> Any:
    return pydantic.Field(default=None, description="Ready (and for a ModelSpec Valid and Placed), with why",
                          json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})


class TierCounts(Model):
    """Instances per tier."""

    hot: int | None = pydantic.Field(default=None, alias="HOT", description="instances HOT")
    warm: int | None = pydantic.Field(default=None, alias="WARM", description="instances WARM")
    suspended: int | None = pydantic.Field(default=None, alias="SUSPENDED", description="instances SUSPENDED")
    frozen: int | None = pydantic.Field(default=None, alias="FROZEN", description="instances FROZEN")
    cold: int | None = pydantic.Field(default=None, alias="COLD", description="instances COLD")


class BatchProfile(Model):
    """One batch size as measured alone on a device."""

    batch_size: int = pydantic.Field(ge=1, description="samples per request")
    p50_ms: float = pydantic.Field(ge=0, description="median latency, in milliseconds")
    p99_ms: float = pydantic.Field(ge=0, description="p99 latency (the baseline), in milliseconds")
    memory_bytes: int = pydantic.Field(ge=0, description="the worker's peak memory at this batch size (host RSS "
                                                         "on a CPU, GPU memory allocated on a GPU), in bytes")
    throughput_per_sec: float = pydantic.Field(ge=0, description="samples per second, one request at a time")
    worker_p50_ms: float | None = pydantic.Field(
        default=None, ge=0, description="median latency of the worker alone (the gateway's worker client, no "
                                        "gateway), in milliseconds; unset when only the worker was measured")
    worker_p99_ms: float | None = pydantic.Field(
        default=None, ge=0, description="p99 latency of the worker alone, in milliseconds; the gateway's overhead "
                                        "is p99Ms minus this")


class Calibration(Model):
    """Baselines and a node profile measured on one device kind (`volga calibrate`)."""

    device: str = pydantic.Field(min_length=1, max_length=256, description="cpu, or the GPU's product name")
    version: str = pydantic.Field(description="spec.version measured")
    input_hash: str = pydantic.Field(description="the input hash measured")
    measured_at: str = pydantic.Field(default="", description="when, RFC 3339 in UTC")
    node: str = pydantic.Field(default="", description="the node measured on")
    iterations: int = pydantic.Field(default=0, ge=0, description="timed requests per batch size")
    pace_ms: float = pydantic.Field(default=0.0, ge=0, description="milliseconds between the starts of two timed "
                                                                   "requests; 0: back to back")
    batches: list[BatchProfile] = pydantic.Field(default_factory=list, max_length=64,
                                                 description="per batch size, ascending")

    measured_through: Literal["gateway", "worker"] = pydantic.Field(
        default="worker", description="what p50Ms and p99Ms time: gateway (an unmodified tritonclient through a "
                                      "gateway data plane to the worker, the path requests take) or worker (the "
                                      "gateway's worker client straight to the worker). Default: worker")

    def baselines(self) -> dict[str, float]:
        """batch size -> p99 ms, as slo.baselineLatencyMs writes it."""
        return {str(b.batch_size): b.p99_ms for b in self.batches}

    def holds_for(self, version: str, input_hash: str) -> bool:
        """Whether these baselines count for a ModelSpec of this version and input hash."""
        return (self.version, self.input_hash) == (version, input_hash)


class SharedSnapshotRef(Model):
    """A CRIU image on the nodes' shared snapshot storage, which any node of its GPU product and driver restores
    instead of cold-starting."""

    key: str = pydantic.Field(description="digest of the image's compatibility key (model, version, input hash, "
                                          "runtimes, CRIU, GPU, CPU features, kernel)")
    node: str = pydantic.Field(description="the node that published it")
    size_bytes: int = pydantic.Field(ge=0, description="size of the image, in bytes")
    published_at: str = pydantic.Field(description="when it was published, RFC 3339 in UTC")
    gpu_product: str = pydantic.Field(default="", description="the GPU product it needs; empty for a CPU image")
    gpu_driver: str = pydantic.Field(default="", description="the GPU driver version it was written with")
    role: str | None = pydantic.Field(default=None, description="in an EMI status: restored (the instance came "
                                                                "from it) or published (the instance wrote it)")


class ChainMigration(Model):
    """A move of a chain's instances off a node whose agent reported EMERGENCY for too long."""

    from_node: str = pydantic.Field(description="the node the chain left")
    to_node: str = pydantic.Field(description="the node the chain went to")
    time: str = pydantic.Field(description="when the operator moved it, RFC 3339 in UTC")
    reason: str = pydantic.Field(description="why, e.g. how long the node had been in EMERGENCY")


class ChainStatus(Model):
    """A head ModelSpec's chain as the operator placed it (the chain registry)."""

    members: list[str] = pydantic.Field(max_length=64, description="the chain's ModelSpecs, head first")
    node: str = pydantic.Field(default="", description="the node of the chain's first instances (index 0); empty "
                                                       "while it is not placed")
    nodes: list[str] = pydantic.Field(default_factory=list, max_length=1024,
                                      description="the node of the chain's K-th instances, by K")
    migrations: int = pydantic.Field(default=0, ge=0, description="moves off a node in EMERGENCY so far")
    last_migration: ChainMigration | None = pydantic.Field(default=None, description="the latest such move")


class CalibrationAnswer(Model):
    """One device kind's answer to a calibration request: the request's token, the node that took it (and holds
    it while it runs: a lease, renewed), and how it went as a `Calibrated` condition."""

    device: str = pydantic.Field(min_length=1, max_length=256, description="cpu, or the GPU's product name")
    token: str = pydantic.Field(description="the value of the volga.dev/calibrate annotation answered")
    node: str = pydantic.Field(description="the node that measured (or is measuring)")
    renewed_at: str = pydantic.Field(
        default="", json_schema_extra={"format": "date-time"},
        description="when the node last renewed its hold on the request, RFC 3339 in UTC")
    lease_sec: int = pydantic.Field(
        default=60, ge=1, description="while the condition is Unknown (measuring): how long after renewedAt "
                                      "another node of the device may take the request over, in seconds")
    condition: Condition = pydantic.Field(
        description="type Calibrated: Unknown while measuring; True when status.calibrated holds the result; "
                    "False with the reason (StartFailed: the model did not start; CalibrationFailed; InvalidSpec)")


class ModelSpecStatus(Model):
    """What the operator last made of a ModelSpec."""

    observed_generation: int | None = pydantic.Field(
        default=None, description="the metadata.generation this status was written for")
    conditions: list[Condition] | None = _conditions()
    input_hash: str | None = pydantic.Field(
        default=None, description="SHA-256 (hex) of the input schema, as clients send it in x-input-hash; empty "
                                  "while the inputs are to be read from the model file on the nodes")
    tiers: TierCounts | None = pydantic.Field(default=None, description="the model's instances per tier")
    instances: int | None = pydantic.Field(default=None, description="the model's instances (EMIs)")
    calibrated: list[Calibration] | None = pydantic.Field(
        default=None, max_length=64,
        description="baselines measured per device (GPU product, or cpu), with the node profile",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["device"]})
    shared_snapshots: list[SharedSnapshotRef] | None = pydantic.Field(
        default=None, max_length=64, description="the images of this model on the shared snapshot storage that "
                                                 "its instances report (restored from or published)")
    chain: ChainStatus | None = pydantic.Field(
        default=None, description="on a chain's head: its members and the nodes their instances are on")
    calibrated_for: list[CalibrationAnswer] | None = pydantic.Field(
        default=None, max_length=64,
        description="per device (GPU product, or cpu): the calibration request (the volga.dev/calibrate "
                    "annotation) last taken up by a node of that device, and how it went",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["device"]})


class EmiStatus(Model):
    """What the instance's agent last reported."""

    tier: Tier | None = pydantic.Field(default=None, description="the tier the instance is in now")
    conditions: list[Condition] | None = _conditions()
    snapshot_id: str | None = pydantic.Field(default=None, description="the instance's latest snapshot image")
    snapshot_bytes: int | None = pydantic.Field(default=None, description="size of that image, in bytes")
    last_used: str | None = pydantic.Field(default=None, description="when a request last reached the instance, "
                                                                     "RFC 3339 in UTC")
    last_wake_ms: float | None = pydantic.Field(default=None, description="how long the last wake took (to an "
                                                                          "answering HOT instance), in milliseconds")
    device: str | None = pydantic.Field(default=None, description="where it runs: cpu, or cuda:N")
    observed_generation: int | None = pydantic.Field(
        default=None, description="the metadata.generation this status was written for")
    gateway: str | None = pydantic.Field(default=None, description="gRPC address of the gateway on the instance's "
                                                                   "node")
    shared_snapshot: SharedSnapshotRef | None = pydantic.Field(
        default=None, description="the shared image the instance was restored from, or the last one it published")
