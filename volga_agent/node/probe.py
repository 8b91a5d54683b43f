"""Running a model before it is served: the warm-up inputs `volga inspect` writes, and `volga validate --run`.

Without runtime.warmup a worker warms up with made-up inputs, dynamic dimensions as 1 (`worker.warmup`). A model
whose non-batch dimensions are dynamic (a detector's height and width, an audio model's sample count) often refuses
those: a convolution wider than the input, feature maps that no longer concatenate. It then serves unwarmed (the
warm-up is recorded as skipped). So `volga inspect` probes the file with onnxruntime for input sizes it runs:

    ladder(keys)            candidate sizes for the dynamic non-batch dimensions, smallest first: the same size for
                            all of them up a ladder of powers of two (1, 2, 4, ... LADDER[-1]), then mixed sizes
    probe(...)              the first candidate the model runs (`Probed`), trying at most MAX_TRIALS
    for_inspect(path, ins)  the same on an ONNX file; `Probed.warmup` is the runtime.warmup section to write, and
                            `Probed.comment` the YAML comment that says it was probed (or that nothing ran)

Dimensions that share a symbol in the file (`height` on two inputs) get the same size; the batch dimension (the
first, when dynamic) is 1. `run_once(spec)` is `volga validate --run`: the model loaded and its warm-up run once,
as a worker would, in a process of its own (`worker.trial`), reporting what the worker reports (`WarmupReport`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from volga_agent.node import instance
from volga_agent.worker import contract
from volga_core import api

LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MAX_TRIALS = 48  # candidates tried at most, per model
MAX_ELEMENTS = 1 << 24  # a candidate with a larger input is not tried (a probe is not a load test)
TRIAL_TIMEOUT_SEC = 300.0  # `run_once`: loading and one warm-up of the model
COMMENT_WIDTH = 110  # `volga inspect`'s comment lines, after their indent and '#'


@dataclasses.dataclass(frozen=True)
class Probed:
    """What probing found: the input shapes of the first candidate the model ran (None when none did), the dynamic
    dimensions probed (described), how many candidates were tried, and the last refusal."""

    shapes: dict[str, tuple[int, ...]] | None
    dynamic: str
    tried: int
    error: str = ""

    @property
    def warmup(self) -> list[dict[str, Any]]:
        """The runtime.warmup section for the shapes found: one sample, made-up values; [] when none ran."""
        if self.shapes is None:
            return []
        return [{"inputs": {name: {"shape": list(shape)} for name, shape in self.shapes.items()}}]

    @property
    def comment(self) -> list[str]:
        """The comment lines (without '#') that say where runtime.warmup came from, or why there is none."""
        if self.shapes is not None:
            found = ", ".join(f"{name} {_text(shape)}" for name, shape in self.shapes.items())
            return [f"runtime.warmup was probed by `volga inspect`: the model's non-batch dimensions are dynamic "
                    f"({self.dynamic}),",
                    "and made-up warm-up inputs (those dimensions as 1) may not run; the smallest probed shapes it "
                    f"ran are {found}.",
                    "Write the sizes your clients send instead: the warm-up then prepares (and the snapshot holds) "
                    "the shapes requests use."]
        tried = (f"of {self.tried} probed sizes (up to {LADDER[-1]}) it ran none" if self.tried
                 else "it could not be probed")
        return [f"No runtime.warmup: the model's non-batch dimensions are dynamic ({self.dynamic}), and {tried}",
                f"({self.error[:300]}).",
                "Without runtime.warmup the made-up warm-up is skipped when the model refuses it, and the model serves "
                "unwarmed: write runtime.warmup with the sizes your clients send."]


def _text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def dynamic_dims(inputs: Sequence[api.TensorSpec], symbols: Mapping[str, Sequence[str | None]]
                 ) -> dict[tuple[str, int], str]:
    """(input, axis) -> key of each dynamic non-batch dimension: its symbol in the file where it has one (dimensions
    that share it share a size), else 'INPUT[AXIS]'. A symbol the batch dimension of some input has is the batch."""
    def symbol(name: str, axis: int) -> str | None:
        found = symbols.get(name, ())
        return found[axis] if axis < len(found) else None

    batch = {symbol(t.name, 0) for t in inputs if t.shape and t.shape[0] == -1} - {None}
    out: dict[tuple[str, int], str] = {}
    for t in inputs:
        for axis, dim in enumerate(t.shape):
            if dim != -1 or axis == 0:
                continue
            key = symbol(t.name, axis) or f"{t.name}[{axis}]"
            if key not in batch:
                out[(t.name, axis)] = key
    return out


def ladder(keys: Sequence[str], limit: int = MAX_TRIALS) -> Iterator[dict[str, int]]:
    """Sizes for the dynamic dimensions `keys`, smallest first, at most `limit`: every key at the same size up the
    ladder, then mixed sizes by their total, the first ones first."""
    if not keys:
        return
    seen: set[tuple[int, ...]] = set()
    same = (tuple(size for _ in keys) for size in LADDER)
    top = len(LADDER) - 1
    mixed = (tuple(LADDER[i] for i in steps) for total in range(top * len(keys) + 1)
             for steps in _steps(len(keys), total, top))
    for sizes in itertools.chain(same, mixed):
        if sizes in seen:
            continue
        seen.add(sizes)
        yield dict(zip(keys, sizes, strict=True))
        if len(seen) >= limit:
            return


def _steps(count: int, total: int, top: int) -> Iterator[tuple[int, ...]]:
    """Every `count` ladder steps (0 to `top`) that add up to `total`, in lexicographic order."""
    if count == 1:
        if total <= top:
            yield (total,)
        return
    for first in range(min(total, top) + 1):
        for rest in _steps(count - 1, total - first, top):
            yield (first, *rest)


def shapes_for(inputs: Sequence[api.TensorSpec], dims: Mapping[tuple[str, int], str],
               sizes: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Each input's shape with the dynamic dimensions at `sizes` and any other -1 (the batch) as 1."""
    return {t.name: tuple(sizes[dims[(t.name, axis)]] if (t.name, axis) in dims else 1 if d == -1 else d
                          for axis, d in enumerate(t.shape)) for t in inputs}


def probe(inputs: Sequence[api.TensorSpec], symbols: Mapping[str, Sequence[str | None]],
          run: Callable[[dict[str, np.ndarray]], object]) -> Probed | None:
    """The first shapes up the ladder that `run` (the model) accepts, with made-up values as a worker makes them;
    None when the inputs have no dynamic non-batch dimension (the made-up warm-up's shapes are the only ones)."""
    dims = dynamic_dims(inputs, symbols)
    if not dims:
        return None
    keys = list(dict.fromkeys(dims.values()))
    dynamic = ", ".join(f"input {t.name!r} {_text(t.shape)}" for t in inputs if any(n == t.name for n, _ in dims))
    tried, error = 0, ""
    for sizes in ladder(keys):
        shapes = shapes_for(inputs, dims, sizes)
        if any(math.prod(shape) > MAX_ELEMENTS for shape in shapes.values()):
            continue
        decls = tuple(contract.TensorDecl(t.name, t.dtype.value, shapes[t.name]) for t in inputs)
        tried += 1
        try:
            run(contract.sample_inputs(decls))
        except Exception as exc:  # the model refused these sizes (whatever its framework raises): the next ones
            error = " ".join(f"{type(exc).__name__}: {exc}".split())
            continue
        return Probed(shapes, dynamic, tried)
    return Probed(None, dynamic, tried, error)


def onnx_symbols(path: pathlib.Path) -> dict[str, tuple[str | None, ...]]:
    """Each graph input's dimension symbols (dim_param; None for a fixed or unnamed dimension)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return {v.name: tuple(d.dim_param or None for d in v.type.tensor_type.shape.dim) for v in graph.input}


def for_inspect(path: pathlib.Path, inputs: Sequence[api.TensorSpec]) -> Probed | None:
    """`probe` on an ONNX file, with onnxruntime on the CPU; None when there is nothing to probe."""
    symbols = onnx_symbols(path)
    dims = dynamic_dims(inputs, symbols)
    if not dims:
        return None
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # refusals are expected here: no error line for each size tried, only fatal ones
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # custom operators, external data it cannot read: no warm-up to write
        dynamic = ", ".join(dict.fromkeys(f"input {name!r}" for name, _ in dims))
        return Probed(None, dynamic, 0, " ".join(f"onnxruntime cannot load it: {exc}".split()))
    return probe(inputs, symbols, lambda feed: session.run(None, feed))


def annotate(text: str, probed: Probed | None) -> str:
    """`volga inspect`'s YAML with the probe's comment: above the spec's runtime section, or at the end without one."""
    if probed is None:
        return text
    comment = [f"  # {line}" for line in textwrap.wrap(" ".join(probed.comment), COMMENT_WIDTH, break_long_words=False,
                                                          break_on_hyphens=False)]
    lines = text.splitlines()
    at = next((i for i, line in enumerate(lines) if line == "  runtime:"), len(lines))
    return "\n".join([*lines[:at], *comment, *lines[at:]]) + "\n"


@dataclasses.dataclass(frozen=True)
class Trial:
    """`run_once`'s outcome: the warm-up report, or why the model did not load or refused a declared sample."""

    report: contract.WarmupReport | None
    error: str = ""

    @property
    def findings(self) -> list[str]:
        """What a user should hear of a run that went: a skipped warm-up, answers contradicting the declaration."""
        if self.report is None:
            return []
        return [f for f in (self.report.skipped and f"warm-up skipped: {self.report.skipped}",
                            self.report.mismatch) if f]


def run_once(spec: api.ModelSpecSpec, timeout: float = TRIAL_TIMEOUT_SEC) -> Trial:
    """Load the model on the CPU and run each of its warm-up samples once, as a worker would, in a process of its
    own (`python -m volga_agent.worker.trial`)."""
    with tempfile.TemporaryDirectory(prefix="volga-trial-") as folder:
        config = instance.worker_config(spec, pathlib.Path(folder), "cpu", worker_user=(0, 0))
        written = pathlib.Path(folder) / "config.json"
        written.write_text(config.to_json())
        try:
            done = subprocess.run([sys.executable, "-m", "volga_agent.worker.trial", str(written)],
                                  capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return Trial(None, f"the model did not load and warm up within {timeout:.0f} s")
    said: dict[str, Any] = {}
    for line in reversed(done.stdout.splitlines()):
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            said = parsed
            break
    if "report" in said:
        return Trial(contract.WarmupReport.from_wire(said["report"]))
    why = said.get("error") or (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return Trial(None, str(why))
