"""A ModelSpec's `spec` (`ModelSpecSpec`) and its parts: tensors, hardware, targets, the SLO, pool floors,
dynamic batching, warm-up and runtime options. This is what the operator validates as the cluster holds it and
what the agent runs a model by; the document around it (metadata, YAML loading) is in `documents`.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
from collections.abc import Iterable
from typing import Annotated, Any

import pydantic

from volga_core.api import base, servers


class TensorSpec(base.Model):
    """One input or output tensor. A dimension of -1 accepts any size (the batch dimension, usually)."""

    name: str = pydantic.Field(
        min_length=1, max_length=128, json_schema_extra={"pattern": base._TENSOR_NAME_PATTERN},
        description="the tensor's name in the model file, as requests name it; 1-128 characters, no control or "
                    "bidirectional-override characters")
    dtype: base.DType = pydantic.Field(description="element type, named as the Open Inference Protocol names them "
                                              "(FP32, INT64, BOOL, ...)")
    shape: list[base.Dim] = pydantic.Field(
        min_length=0, max_length=8,
        description=f"dimensions, at most 8: each a positive size (at most {base.MAX_DIM}, 2^31-1) or -1 for any size "
                    "(the batch dimension, a symbolic dimension of the model); [] for a scalar",
        json_schema_extra={
            "items": {"type": "integer", "minimum": -1, "maximum": base.MAX_DIM},
            "x-kubernetes-validations": [{"rule": "self.all(d, d == -1 || d > 0)",
                                          "message": "dimensions must be positive, or -1 for any size"}]})

    @pydantic.field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if bad := base.bad_characters(name):
            raise ValueError(f"must not contain control characters, NUL or bidirectional-override characters "
                             f"(found {', '.join(dict.fromkeys(bad))})")
        return name

    @pydantic.field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        for dim in shape:
            if dim == 0 or dim < -1:
                raise ValueError(f"dimension {dim} is not allowed: use a positive size or -1 for any size")
            if dim > base.MAX_DIM:
                raise ValueError(f"dimension {dim} is too large: at most {base.MAX_DIM} (2^31-1), or -1 for any size")
        return shape


class Hardware(base.Model):
    """What a node must offer to host the model; the operator places instances only where it does."""

    gpu_product: str | None = pydantic.Field(
        default=None, max_length=256,
        description="GPU product the model needs, matched case-insensitively as a part of the node's product name "
                    "(e.g. 'NVIDIA H200'); only with gpu: true. Default: unset, any GPU")
    min_memory_gi_b: float = pydantic.Field(
        default=0.0, ge=0, alias="minMemoryGiB",
        description="GPU memory the node's GPUs must have, in GiB (2^30 bytes); only with gpu: true. Default: 0, "
                    "no minimum")
    precision: base.Precision = pydantic.Field(
        default=base.Precision.FP32,
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


class Targets(base.Model):
    """Service targets, recorded with the model (not yet acted on by placement)."""

    latency_ms: Annotated[float, pydantic.Field(gt=0)] | None = pydantic.Field(
        default=None, description="target p99 latency per request, in milliseconds (> 0). Default: unset")
    throughput_rps: Annotated[float, pydantic.Field(gt=0)] | None = pydantic.Field(
        default=None, description="target throughput, in requests per second (> 0). Default: unset")


class ToleranceStep(base.Model):
    """A step of a piecewise tolerance: `pct` while the other load is below `belowLoadPct` (the last: the rest)."""

    below_load_pct: float | None = pydantic.Field(
        default=None, gt=0, le=100,
        description="the step holds while the load of the node's other models is below this, in percent of the "
                    "node's GPU (CPU on a CPU node) utilisation (0-100, exclusive of 0); left out on the last step")
    pct: float = pydantic.Field(ge=0, le=1000, description="the tolerance in this step, in percent (0-1000)")


class BaselineTag(base.Model):
    """What a ModelSpec's baselines were measured for: `volga calibrate --write` writes it."""

    version: str = pydantic.Field(min_length=1, max_length=64, description="spec.version when measured")
    input_hash: str = pydantic.Field(max_length=64, description="the input hash (SHA-256, hex) when measured")
    device: str = pydantic.Field(default="", max_length=256,
                                 description="where: cpu, or the GPU's product name. Default: ''")


class Slo(base.Model):
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
        default=default, ge=0, json_schema_extra={"maximum": base.MAX_FLOOR},
        description=f"instances of this model kept in the {tier} tier across the cluster, 0-{base.MAX_FLOOR}. "
                    f"Default: {default}")


class Pool(base.Model):
    """Pool floors: how many instances of this model to keep in each tier, across the cluster."""

    hot: base.Count = _floor("HOT", 0)
    warm: base.Count = _floor("WARM", 0)
    suspended: base.Count = _floor("SUSPENDED", 0)
    frozen: base.Count = _floor("FROZEN", 1)

    @pydantic.field_validator("hot", "warm", "suspended", "frozen")
    @classmethod
    def _cap(cls, value: int) -> int:
        if value > base.MAX_FLOOR:
            raise ValueError(f"{value} is more than {base.MAX_FLOOR}, the most instances a pool keeps in one tier")
        return value

    def floor(self, tier: base.Tier) -> int:
        return {base.Tier.HOT: self.hot, base.Tier.WARM: self.warm, base.Tier.SUSPENDED: self.suspended,
                base.Tier.FROZEN: self.frozen, base.Tier.COLD: 0}[tier]


MAX_BATCH = 65_536


def _field_error(model: str, loc: tuple[str, ...], message: str) -> pydantic.ValidationError:
    """A validation error at `loc` (below the model that raises it), with our own message."""
    return pydantic.ValidationError.from_exception_data(model, [{
        "type": "value_error", "loc": loc, "input": None, "ctx": {"error": ValueError(message)}}])


class DynamicBatching(base.Model):
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


class WarmupInput(base.Model):
    """One input of a warm-up sample: a shape (filled, drawn from a range, or made up) or literal values."""

    model_config = pydantic.ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "[has(self.fill), has(self.range), has(self.values)].filter(x, x).size() <= 1",
         "message": "give one of fill, range and values"},
        {"rule": "has(self.shape) || has(self.values)", "message": "shape is required (unless values are given)"}]})

    shape: list[Annotated[int, pydantic.BeforeValidator(base._no_bool)]] | None = pydantic.Field(
        default=None, max_length=8,
        description="the input's shape in this sample, every dimension a size (0 or more, no -1); [] for a "
                    "scalar. Default: [len(values)] with values, required otherwise",
        json_schema_extra={"items": {"type": "integer", "minimum": 0, "maximum": base.MAX_DIM}})
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
            if dim < 0 or dim > base.MAX_DIM:
                raise ValueError(f"shape: dimension {dim} is not a size (0 to {base.MAX_DIM})")
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


class WarmupSample(base.Model):
    """One warm-up inference: inputs by name; an input left out gets made-up values of its declared shape."""

    inputs: dict[str, WarmupInput] = pydantic.Field(
        min_length=1, max_length=64, description="input name -> its shape and values in this sample, 1-64 inputs")


class Runtime(base.Model):
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
_SIGNATURE_READ = "self.framework in ['onnx', 'server'] || (has(self.inputs) && has(self.outputs))"
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


_SOURCE_DIGEST = r"^sha256:[0-9a-f]{64}$"
# The remote sources' shapes (volga_agent.sources parses them): scheme -> pattern, and what to write instead.
_REMOTE = {"s3": re.compile(r"^s3://[^/]+/.+$"), "https": re.compile(r"^https://[^/]+/.*[^/]$"),
           "http": re.compile(r"^http://[^/]+/.*[^/]$"),
           "oci": re.compile(r"^oci://[A-Za-z0-9.-]+(:[0-9]+)?/[a-z0-9]+([._/-][a-z0-9]+)*"
                             r"(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?(@sha256:[0-9a-f]{64})?$")}
_SOURCE_FORMS = {"s3": "an s3 source is s3://bucket/key (a folder: s3://bucket/prefix/)",
                 "https": "an https source names a file: https://host/path (a folder cannot be listed over HTTP)",
                 "http": "an http source names a file: http://host/path (a folder cannot be listed over HTTP)",
                 "oci": "an oci source is oci://registry/repository:tag or oci://registry/repository@sha256:<64 hex>"}


class ModelSpecSpec(base.Model):
    """What a model is and how Volga keeps it: its file, tensors, hardware, SLO, pool floors and runtime."""

    model_config = pydantic.ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": _SIGNATURE_READ, "message": NO_SIGNATURE.format(framework="torchscript or pytorch")},
        {"rule": _BATCH_FIRST, "message": NOT_BATCHED.format(which="a tensor's shape does not start with -1")},
        {"rule": "!has(self.chain) || !(self.modelId in self.chain)",
         "message": "chain lists the model's own modelId: a chain that calls its head again is a cycle"},
        {"rule": "!has(self.ensemble) || (has(self.chain) && size(self.chain) > 0 && self.ensemble != self.modelId)",
         "message": "ensemble needs a chain, and a model id other than the head's"}]})

    model_id: base.Name = pydantic.Field(
        json_schema_extra={"maxLength": base.MAX_NAME, "pattern": base._MODEL_ID.pattern},
        description=f"the model's name in requests (the Open Inference Protocol's model name, or x-model-id); "
                    f"1-{base.MAX_NAME} lowercase letters, digits, '-' or '.' (a DNS-1123 subdomain), unique")
    framework: base.Framework = pydantic.Field(description="how the file is loaded: onnx (onnxruntime), torchscript "
                                                      "(torch.jit.load) or pytorch; server: run `server`")
    source: str = pydantic.Field(
        min_length=1, max_length=4096, json_schema_extra={"pattern": "^(file://.+|(s3|https?|oci)://.+|[^:]+)$"},
        description="where the model file (or folder) is, at most 4096 characters: a local path or file:// URI on "
                    "the node (a relative path is relative to the ModelSpec file, `volga up`), s3://bucket/key "
                    "(s3://bucket/prefix/ for a folder; any S3-compatible store), https://host/path, or "
                    "oci://registry/repository:tag or @sha256:... (an artifact pushed with ORAS). Remote sources "
                    "are fetched into the node's model cache before the model loads (docs/models.md, Sources)")
    source_digest: str | None = pydantic.Field(
        default=None, json_schema_extra={"pattern": _SOURCE_DIGEST},
        description="sha256:<64 hex digits>: the content the source must have (a file's sha256; a folder's, "
                    "docs/models.md); other bytes are refused, never served. Default: unpinned (a changed object "
                    "is a new model version)")
    source_secret: str | None = pydantic.Field(
        default=None, max_length=253, json_schema_extra={"pattern": base._MODEL_ID.pattern},
        description="the Secret in the ModelSpec's namespace whose keys are the credentials for a remote source "
                    "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...; SOURCE_USERNAME, "
                    "SOURCE_PASSWORD, SOURCE_TOKEN). Default: none (`volga up` reads the same names from its "
                    "environment)")
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
        f"how many instances to keep in each tier across the cluster, 0-{base.MAX_FLOOR} per tier. Default: 1 FROZEN"))
    runtime: Runtime = pydantic.Field(default_factory=Runtime, description=(
        "how the worker runs the model: warm-up, threads, batch size, re-seeding after restores"))
    chain: list[str] = pydantic.Field(
        default_factory=list, max_length=base.MAX_CHAIN,
        description=f"model ids called after this one, in order, at most {base.MAX_CHAIN}: this model heads a chain, "
                    "which wakes as one (waking any member wakes the others in parallel), is kept on one node "
                    "(one GPU where memory allows) and whose slo is end to end; a model is in one chain at most. "
                    "Default: none",
        json_schema_extra={"items": {"type": "string", "maxLength": base.MAX_NAME, "pattern": base._MODEL_ID.pattern},
                           "x-kubernetes-validations": [
                               {"rule": "self.all(a, self.filter(b, b == a).size() == 1)",
                                "message": "a chain lists each model once"}]})
    ensemble: base.Name | None = pydantic.Field(
        default=None, json_schema_extra={"maxLength": base.MAX_NAME, "pattern": base._MODEL_ID.pattern},
        description="with chain: a model id under which the gateway serves the whole chain as one model (a "
                    "Triton ensemble): the head's inputs in, each member's inputs taken by name from the outputs "
                    "before it, the last member's outputs out. Default: unset (the members are called one by one)")

    @pydantic.model_validator(mode="after")
    def _chain_shape(self) -> ModelSpecSpec:
        problems: list[tuple[tuple[int | str, ...], str]] = []
        for index, member in enumerate(self.chain):
            if not base.is_name(member):
                problems.append((("chain", index), f"{member!r}: a model id {base.NAME_RULE}"))
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

    @pydantic.field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        scheme = value.split("://", 1)[0] if "://" in value else ""
        if scheme and scheme != "file" and (scheme not in _REMOTE or not _REMOTE[scheme].match(value)):
            raise ValueError(_SOURCE_FORMS.get(scheme, f"unknown scheme {scheme}://: a source is a node path, "
                                                       "file://, s3://, https:// or oci://"))
        return value

    @pydantic.field_validator("source_digest")
    @classmethod
    def _digest(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(_SOURCE_DIGEST, value):
            raise ValueError(f"{value!r} is not a content digest: write sha256: and 64 lowercase hex digits")
        return value

    server: servers.ServerSpec | None = pydantic.Field(default=None, description=(
        "with framework: server, the model server Volga runs instead of loading a file; source is then the "
        "server's folder (on the node, or fetched: an s3:// folder, an oci:// artifact, an https:// file). "
        "Default: unset"))

    @pydantic.model_validator(mode="after")
    def _server(self) -> ModelSpecSpec:
        if self.framework is base.Framework.SERVER and self.server is None:
            raise _field_error("ModelSpecSpec", ("server",), "framework: server needs server (its command, protocol, "
                                                             "readiness and hooks)")
        if self.framework is not base.Framework.SERVER and self.server is not None:
            raise _field_error("ModelSpecSpec", ("framework",), f"server is set, but framework is "
                                                                f"{self.framework.value}: write framework: server")
        working = self.server.working_dir if self.server is not None else None
        if working is not None and pathlib.PurePosixPath(working).is_absolute() and self.remote_source:
            raise _field_error("ModelSpecSpec", ("server", "workingDir"), (
                f"{working}: the server's files are fetched from {self.source} into the node's model cache, so its "
                "working folder is a folder inside them: give it relative to the source's top"))
        if working is not None and not pathlib.PurePosixPath(working).is_absolute() and \
                ".." in pathlib.PurePosixPath(working).parts:
            raise _field_error("ModelSpecSpec", ("server", "workingDir"),
                               f"{working}: a working folder relative to the source lies inside it: no '..'")
        return self

    @pydantic.model_validator(mode="after")
    def _signature(self) -> ModelSpecSpec:
        if self.framework not in (base.Framework.ONNX, base.Framework.SERVER):
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
    def remote_source(self) -> bool:
        """The source is fetched into the node's model cache (s3://, https://, oci://) before it loads."""
        return "://" in self.source and not self.source.startswith("file://")

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


def _dtype_problem(dtype: base.DType, given: WarmupInput) -> str:
    # Values arrive as floats (JSON numbers): 2.0 reads back as the 2 that was written.
    numbers = [int(v) if float(v).is_integer() else v
               for v in [*(given.values or ()), *([given.fill] if given.fill is not None else [])]]
    if dtype is base.DType.BOOL:
        bad = [v for v in numbers if v not in (0, 1)]
        return f"{base._show(bad[0])} is not a boolean (write 0 or 1)" if bad else (
            "a range does not apply (write fill or values)" if given.value_range is not None else "")
    if dtype.value.startswith(("INT", "UINT")):
        bad = [v for v in [*numbers, *(given.value_range or ())] if not float(v).is_integer()]
        if bad:
            return f"{base._show(bad[0])} is not an integer"
        if dtype.value.startswith("UINT") and any(v < 0 for v in [*numbers, *(given.value_range or ())]):
            return "negative values do not fit an unsigned type"
    return ""
