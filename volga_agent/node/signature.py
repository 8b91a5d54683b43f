"""A model file's tensor signature, compared with the one a ModelSpec writes, or filling the one it leaves out.

An ONNX file declares its inputs and outputs (names, element types, shapes with fixed or symbolic dimensions);
a TorchScript or PyTorch file does not. Whoever can open the file reads it here: `volga validate` and `volga up`
on the machine they run on, the agent on its node. The operator cannot (the file lives on the nodes), so a
ModelSpec in the cluster keeps its spec as written and each node fills it when it loads it (docs/architecture.md).

    fill(spec)                  the spec with inputs/outputs it leaves out read from its ONNX file
    check(spec)                 (field path, reason) for each way the written signature disagrees with the file
    inspect_document(path)      a ready ModelSpec document for an ONNX file (`volga inspect`)
    load(files)                 the ModelSpecs of files, signatures filled; those that cannot be served refused
                                one by one (`volga up`)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import re
from collections.abc import Callable
from typing import Any

import pydantic

from volga_core import api

# ONNX element types (onnx.TensorProto.DataType) that have an Open Inference Protocol dtype Volga serves.
_DTYPES = {"FLOAT": api.DType.FP32, "UINT8": api.DType.UINT8, "INT8": api.DType.INT8, "UINT16": api.DType.UINT16,
           "INT16": api.DType.INT16, "INT32": api.DType.INT32, "INT64": api.DType.INT64, "BOOL": api.DType.BOOL,
           "FLOAT16": api.DType.FP16, "DOUBLE": api.DType.FP64, "UINT32": api.DType.UINT32,
           "UINT64": api.DType.UINT64}


@dataclasses.dataclass(frozen=True)
class ModelTensor:
    """One graph input or output as the file declares it: `elem_type` is ONNX's name for the element type,
    `shape` None when the file gives no rank, a dimension None when it is symbolic (or unnamed)."""

    name: str
    elem_type: str
    shape: tuple[int | None, ...] | None

    @property
    def dtype(self) -> api.DType | None:
        return _DTYPES.get(self.elem_type)

    def describe(self) -> str:
        dims = "unknown rank" if self.shape is None else "[" + ", ".join(
            "-1" if d is None else str(d) for d in self.shape) + "]"
        return f"{self.name!r} ({self.dtype.value if self.dtype else self.elem_type}, shape {dims})"


@dataclasses.dataclass(frozen=True)
class ModelSignature:
    inputs: tuple[ModelTensor, ...]
    outputs: tuple[ModelTensor, ...]


def _path(spec: api.ModelSpecSpec) -> pathlib.Path:
    path = spec.source_path
    if not path.exists():
        raise api.SpecError(str(path), [("spec.source", f"model file {path} does not exist")])
    return path


def read_onnx(path: pathlib.Path) -> ModelSignature:
    """The graph's inputs (initializers excluded: they are weights, not inputs) and outputs."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise api.SpecError(str(path), [("spec.source", f"cannot read model file {path}: {exc.strerror}")]) from None
    return _read_onnx(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _read_onnx(path: str, mtime_ns: int, size: int) -> ModelSignature:
    # Keyed on the file's mtime and size: a changed file is read again, an unchanged one once (the agent fills
    # specs again on every change of the ModelSpecs).
    del mtime_ns, size
    import onnx

    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as exc:  # onnx raises protobuf's DecodeError, ValueError and others on a file not its own
        hint = " (it looks like a TorchScript/PyTorch archive)" if _is_zip(path) else ""
        raise api.SpecError(path, [("spec.source", f"{path} is not an ONNX model{hint}: {exc}")]) from None
    if any(not o.type.tensor_type.HasField("shape") for o in model.graph.output):
        # Exporters often leave output shapes out; ONNX's shape inference can usually say them.
        # A graph inference cannot follow leaves the outputs without a rank.
        with contextlib.suppress(Exception):
            model = onnx.shape_inference.infer_shapes(model)
    graph = model.graph
    weights = {i.name for i in graph.initializer} | {s.values.name for s in graph.sparse_initializer}

    def tensor(value: Any) -> ModelTensor:
        kind = value.type.WhichOneof("value")
        if kind != "tensor_type":
            return ModelTensor(value.name, (kind or "unknown").removesuffix("_type").upper(), None)
        t = value.type.tensor_type
        elem = onnx.TensorProto.DataType.Name(t.elem_type) if t.elem_type else "UNDEFINED"
        if not t.HasField("shape"):
            return ModelTensor(value.name, elem, None)
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim)
        return ModelTensor(value.name, elem, dims)

    return ModelSignature(tuple(tensor(v) for v in graph.input if v.name not in weights),
                          tuple(tensor(v) for v in graph.output))


def _is_zip(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _tensor_specs(field: str, tensors: tuple[ModelTensor, ...]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    out, problems = [], []
    for t in tensors:
        if t.dtype is None:
            problems.append((f"spec.{field}", f"the model's {field[:-1]} {t.name!r} is {t.elem_type}, which has no "
                                              "dtype Volga serves: this model cannot be served as it is"))
        elif t.shape is None:
            problems.append((f"spec.{field}", f"the model does not declare the rank of its {field[:-1]} {t.name!r}: "
                                              f"write {field} in the spec"))
        else:
            out.append({"name": t.name, "dtype": t.dtype.value, "shape": [-1 if d is None else d for d in t.shape]})
    return out, problems


def fill(spec: api.ModelSpecSpec) -> api.ModelSpecSpec:
    """The spec with the inputs and outputs it leaves out read from its model file (ONNX), symbolic dimensions
    as -1; a spec that writes both comes back as it is, without opening the file. Raises SpecError naming the
    field and the reason when the file is missing, is not ONNX, or declares what a spec cannot say."""
    if spec.has_signature or spec.framework is api.Framework.SERVER:  # a server: no file to read
        return spec
    if spec.framework is not api.Framework.ONNX:
        raise api.SpecError(spec.source, [("spec.inputs" if not spec.inputs else "spec.outputs",
                                           api.NO_SIGNATURE.format(framework=spec.framework.value))])
    path = _path(spec)
    signature = read_onnx(path)
    wire = spec.to_wire()
    problems: list[tuple[str, str]] = []
    for field, tensors in (("inputs", signature.inputs), ("outputs", signature.outputs)):
        if not wire.get(field):
            wire[field], found = _tensor_specs(field, tensors)
            problems += found
    if problems:
        raise api.SpecError(str(path), problems)
    try:
        return api.ModelSpecSpec.model_validate(wire)
    except pydantic.ValidationError as exc:
        # What the file declares, but a spec may not say; or a warm-up sample the signature read refuses.
        raise api.SpecError(str(path), [(p, r if p.startswith("spec.runtime") else f"read from the model file: {r}")
                                        for p, r in api.problems_of(exc, ("spec",))]) from None


def warmup_file_problems(spec: api.ModelSpecSpec) -> list[tuple[str, str]]:
    """(field path, reason) for each way runtime.warmupFile disagrees with the spec's inputs: a missing or
    unreadable file, an array named for no input, or one of another dtype or shape. [] without a warm-up file
    (or while the inputs are unread)."""
    path = spec.runtime.warmup_path
    if path is None or not spec.inputs:
        return []
    import numpy as np

    at = "spec.runtime.warmupFile"
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as exc:
        return [(at, f"cannot read {path} as an .npz file of arrays: {exc}")]
    by_name = {t.name: t for t in spec.inputs}
    problems = []
    for key, array in arrays.items():
        index, _, name = key.partition("/")
        name = name if index.isdigit() and name else key
        decl = by_name.get(name)
        if decl is None:
            problems.append((at, f"{path}: array {key!r} names no input (the inputs are "
                                 f"{', '.join(repr(n) for n in by_name)}; name arrays as inputs, or 'K/NAME')"))
            continue
        dtype = api.DType(_NP_DTYPES[array.dtype.str[1:]]) if array.dtype.str[1:] in _NP_DTYPES else None
        if dtype is not decl.dtype:
            problems.append((at, f"{path}: array {key!r} is {array.dtype}, input {name!r} is {decl.dtype.value}"))
        shape = list(array.shape)
        if len(shape) != len(decl.shape) or any(d != -1 and d != g for d, g in zip(decl.shape, shape, strict=False)):
            problems.append((at, f"{path}: array {key!r} has shape {shape}, input {name!r} takes "
                                 f"[{', '.join(map(str, decl.shape))}]"))
    if not problems and not arrays:
        problems.append((at, f"{path} holds no arrays"))
    return problems


# numpy's type codes (without byte order) -> the protocol's dtype names.
_NP_DTYPES = {"b1": "BOOL", "u1": "UINT8", "u2": "UINT16", "u4": "UINT32", "u8": "UINT64", "i1": "INT8", "i2": "INT16",
              "i4": "INT32", "i8": "INT64", "f2": "FP16", "f4": "FP32", "f8": "FP64"}


def check(spec: api.ModelSpecSpec) -> list[tuple[str, str]]:
    """(field path, reason) for each way the spec's written signature disagrees with its ONNX model file; []
    where they agree (or for frameworks whose files declare no signature, once the file exists)."""
    try:
        path = _path(spec)
        if spec.framework is not api.Framework.ONNX:
            return []
        signature = read_onnx(path)
    except api.SpecError as exc:
        return exc.problems
    problems = _compare("inputs", spec.inputs, signature.inputs, every=True)
    problems += _compare("outputs", spec.outputs, signature.outputs, every=False)
    return problems


def _compare(field: str, written: list[api.TensorSpec], declared: tuple[ModelTensor, ...],
             every: bool) -> list[tuple[str, str]]:
    """`every`: the model needs all of them (inputs); outputs may be a subset."""
    problems = []
    kind = field[:-1]
    by_name = {t.name: t for t in declared}
    for i, tensor in enumerate(written):
        at = f"spec.{field}[{i}]"
        model = by_name.get(tensor.name)
        if model is None:
            names = ", ".join(repr(t.name) for t in declared) or "none"
            problems.append((f"{at}.name", f"the model has no {kind} {tensor.name!r} (it has {names})"))
            continue
        if model.dtype is None:
            problems.append((f"{at}.dtype", f"the model declares {model.elem_type}, which has no dtype Volga serves"))
        elif model.dtype is not tensor.dtype:
            problems.append((f"{at}.dtype", f"the model declares {model.dtype.value}, the spec {tensor.dtype.value}"))
        if model.shape is None:
            continue  # the file gives no rank: nothing to hold the written shape to
        if len(model.shape) != len(tensor.shape):
            problems.append((f"{at}.shape", f"rank {len(model.shape)} in the model, {len(tensor.shape)} here"))
            continue
        for j, (fixed, dim) in enumerate(zip(model.shape, tensor.shape, strict=True)):
            if fixed is not None and dim != -1 and dim != fixed:
                problems.append((f"{at}.shape[{j}]", f"the model fixes this dimension at {fixed}, the spec {dim}"))
    if every:
        written_names = {t.name for t in written}
        for model in declared:
            if model.name not in written_names:
                problems.append((f"spec.{field}", f"the model's {kind} {model.describe()} is missing here"))
    return problems


def name_for(path: pathlib.Path) -> str:
    """A ModelSpec name (and model id) made from a file's name: lowercase letters and digits, runs of
    anything else as '-'."""
    name = re.sub(r"[^a-z0-9]+", "-", path.stem.lower()).strip("-")[:api.MAX_NAME].strip("-")
    return name or "model"


def inspect_document(path: pathlib.Path) -> dict[str, Any]:
    """A ready ModelSpec document for an ONNX file: name and modelId from the file's name, its signature, a
    FROZEN pool floor of 1. Raises SpecError where the file cannot give one."""
    path = path.resolve()
    if not path.exists():
        raise api.SpecError(str(path), [("spec.source", f"model file {path} does not exist")])
    if path.suffix.lower() in (".pt", ".pth", ".torchscript") or (path.is_file() and _is_zip(str(path))):
        raise api.SpecError(str(path), [("spec.inputs", api.NO_SIGNATURE.format(framework="TorchScript/PyTorch"))])
    name = name_for(path)
    document: dict[str, Any] = {
        "apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": name},
        "spec": {"modelId": name, "framework": api.Framework.ONNX.value, "source": f"file://{path}"}}
    spec = fill(api.parse_model_spec(document, str(path)).spec)
    document["spec"]["inputs"] = [t.to_wire() for t in spec.inputs]
    document["spec"]["outputs"] = [t.to_wire() for t in spec.outputs]
    document["spec"]["pool"] = {"frozen": 1}
    return document


@dataclasses.dataclass(frozen=True)
class Refused:
    """A ModelSpec `load` went on past: where it was read (`label`), the spec as written, and why it cannot be
    served (`error`, its source the label)."""

    label: str
    spec: api.ModelSpec
    error: api.SpecError

    @property
    def model_id(self) -> str:
        return self.spec.spec.model_id

    @property
    def reason(self) -> str:
        """The problems on one line: 'spec.source: ... is not an ONNX model: ...'."""
        return "; ".join(f"{path}: {reason}" for path, reason in self.error.problems)


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What `load` read: the ModelSpecs to serve (signatures filled), each with where it was read, and those
    refused one by one."""

    labelled: list[tuple[str, api.ModelSpec]]
    refused: list[Refused] = dataclasses.field(default_factory=list)

    @property
    def specs(self) -> list[api.ModelSpec]:
        return [spec for _, spec in self.labelled]


def load(files: list[str], keep_going: bool = True,
         fetch: Callable[[api.ModelSpecSpec], api.ModelSpecSpec] | None = None) -> Loaded:
    """The ModelSpecs in `files` (YAML files or folders), inputs and outputs they leave out read from their model
    files. A ModelSpec whose model file cannot give its signature (missing, not ONNX, ...) or whose warm-up file
    disagrees is refused on its own, with the models chained with it (a chain is served whole or not at all);
    without `keep_going`, its SpecError is raised instead. What is no single model's problem raises SpecError
    either way: a document that does not parse, a name or model id used twice (naming both files), a chain that
    cannot be used. `fetch` puts a remote source's bytes on this node, or checks a node file's sourceDigest
    (SpecError when it cannot), before the signature is read; its spec names the local copy."""
    labelled: list[tuple[str, api.ModelSpec]] = []
    for target in files:
        labelled += api.load_labelled(target)
    if repeats := api.repeated(labelled):
        raise repeats[0]
    good: list[tuple[str, api.ModelSpec]] = []
    refused: list[Refused] = []
    for label, spec in labelled:
        try:
            pinned = spec.spec.remote_source or spec.spec.source_digest
            filled = fill(fetch(spec.spec) if fetch is not None and pinned else spec.spec)
        except api.SpecError as exc:
            problems = exc.problems
        else:
            problems = warmup_file_problems(filled)
            if not problems:
                good.append((label, spec.model_copy(update={"spec": filled})))
                continue
        if not keep_going:
            raise api.SpecError(label, problems)
        refused.append(Refused(label, spec, api.SpecError(label, problems)))
    if refused:
        good, refused = _refuse_chained(labelled, good, refused)
    if chained := api.chain_errors(good):
        raise chained[0]
    return Loaded(good, refused)


def _refuse_chained(labelled: list[tuple[str, api.ModelSpec]], good: list[tuple[str, api.ModelSpec]],
                    refused: list[Refused]) -> tuple[list[tuple[str, api.ModelSpec]], list[Refused]]:
    """`good` without the ModelSpecs chained (directly or through others) with a refused one, those added to
    `refused` naming it."""
    groups: list[set[str]] = []
    for _, spec in labelled:
        if spec.spec.chain:
            group = {spec.spec.model_id, *spec.spec.chain}
            for other in [g for g in groups if g & group]:
                group |= other
                groups.remove(other)
            groups.append(group)
    down = {r.model_id: r for r in refused}
    kept, more = [], []
    for label, spec in good:
        group = next((g for g in groups if spec.spec.model_id in g), set())
        cause = next((down[m] for m in sorted(group) if m in down), None)
        if cause is None:
            kept.append((label, spec))
            continue
        problem = ("spec.chain", f"it is in a chain with model {cause.model_id!r} ({cause.label}), which cannot be "
                                 f"served: {cause.reason}")
        more.append(Refused(label, spec, api.SpecError(label, [problem])))
    return kept, refused + more


def load_files(files: list[str]) -> list[api.ModelSpec]:
    """The ModelSpecs in `files` (YAML files or folders), inputs and outputs they leave out read from their model
    files; SpecError for the first problem, a name or model id used twice included (naming both files)."""
    return load(files, keep_going=False).specs
