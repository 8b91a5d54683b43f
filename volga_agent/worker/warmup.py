"""The worker's warm-up: the inputs it runs after loading, before the first snapshot, and the canary input.

A ModelSpec may declare warm-up samples (runtime.warmup: shapes with a fill value, a range or literal values)
and an .npz file of real inputs (runtime.warmupFile); without either, one sample of made-up values is run
(-1 dimensions as 1, integers 0-99), as `contract.sample_inputs` makes them. Every sample is checked against
the declared inputs and runs under a label that names it, so that a model which refuses its warm-up says
which sample and which shapes (`warm-up sample 1 (input 'x' shape [1, 1]): ...`) in its start failure.

A model that refuses the MADE-UP inputs (a convolution wider than a dimension made 1, feature maps of sizes that
no longer concatenate) still serves: nobody asked for those inputs, so `warm_up` records the warm-up as skipped,
with the reason, instead of failing the start. Samples the spec declares stay an error when refused. The warm-up
also records the shapes each declared output answered with (`contract.WarmupReport`): a model whose answers
contradict its declared outputs is reported, and the gateway's metadata says what it answers.

Like everything under `volga_agent.worker`, this imports nothing of the agent (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from volga_agent.worker import contract, protocol


class WarmupError(RuntimeError):
    """A warm-up sample the worker could not build or the model could not run; the message names the sample."""


@dataclasses.dataclass(frozen=True)
class Sample:
    label: str
    inputs: dict[str, np.ndarray]
    made_up: bool = False  # the default sample of made-up values (no runtime.warmup, no warm-up file)


def _describe(inputs: dict[str, np.ndarray]) -> str:
    return ", ".join(f"input {name!r} shape [{', '.join(map(str, a.shape))}]" for name, a in inputs.items())


def _tensor(decl: contract.TensorDecl, given: contract.WarmupTensor, rng: np.random.Generator) -> np.ndarray:
    dtype = protocol.NP_DTYPES[decl.dtype]
    if given.values is not None:
        return np.asarray(given.values, dtype=np.float64).astype(dtype).reshape(given.shape)
    if given.fill is not None:
        return np.full(given.shape, given.fill, dtype=np.float64).astype(dtype)
    if given.low is not None and given.high is not None:
        if dtype.kind in "iu":
            return rng.integers(int(given.low), int(given.high), size=given.shape).astype(dtype)
        return rng.uniform(given.low, given.high, size=given.shape).astype(dtype)
    return contract.sample_inputs((dataclasses.replace(decl, shape=given.shape),), seed=int(rng.integers(2**31)))[
        decl.name]


def declared(config: contract.WorkerConfig, index: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The inputs of declared sample `index`; inputs it leaves out get made-up values of their declared shape."""
    rng = np.random.default_rng(seed + index)
    given = {t.name: t for t in config.warmup[index].tensors}
    unknown = sorted(set(given) - {d.name for d in config.inputs})
    if unknown:
        raise WarmupError(f"warm-up sample {index}: the model has no input {unknown[0]!r}")
    made_up = contract.sample_inputs(config.inputs, seed=seed)
    return {d.name: _tensor(d, given[d.name], rng) if d.name in given else made_up[d.name] for d in config.inputs}


def from_file(config: contract.WorkerConfig) -> list[dict[str, np.ndarray]]:
    """The samples of the .npz warm-up file: arrays named as the inputs (one sample) or 'K/NAME' (sample K); an
    input a sample leaves out gets made-up values of its declared shape."""
    try:
        with np.load(config.warmup_file, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as exc:
        raise WarmupError(f"warm-up file {config.warmup_file}: cannot read it as an .npz of arrays: {exc}") from None
    samples: dict[int, dict[str, np.ndarray]] = {}
    for key, array in arrays.items():
        index, _, name = key.partition("/")
        number, name = (int(index), name) if index.isdigit() and name else (0, key)
        samples.setdefault(number, {})[name] = array
    made_up = contract.sample_inputs(config.inputs)
    return [{**{d.name: made_up[d.name] for d in config.inputs}, **samples[k]} for k in sorted(samples)]


def samples(config: contract.WorkerConfig, seed: int = 0) -> list[Sample]:
    """Every warm-up sample, labelled, each checked against the declared inputs (WarmupError otherwise)."""
    out: list[Sample] = []
    if not config.warmup and not config.warmup_file:
        inputs = contract.sample_inputs(config.inputs, seed=seed)
        out.append(Sample("warm-up with made-up inputs (declare runtime.warmup to give real ones; "
                          f"{_describe(inputs)})", inputs, made_up=True))
    for index in range(len(config.warmup)):
        inputs = declared(config, index, seed)
        out.append(Sample(f"warm-up sample {index} ({_describe(inputs)})", inputs))
    if config.warmup_file:
        for index, inputs in enumerate(from_file(config)):
            out.append(Sample(f"warm-up file {config.warmup_file} sample {index} ({_describe(inputs)})", inputs))
    for sample in out:
        try:
            contract.check_inputs(config.inputs, sample.inputs, config.max_batch_size)
        except protocol.WorkerError as exc:
            raise WarmupError(f"{sample.label}: {exc.message}") from None
    return out


def run(model: Callable[[dict[str, np.ndarray]], object], warm: list[Sample], iterations: int
        ) -> dict[str, list[tuple[int, ...]]]:
    """Each sample `iterations` times; a failure names its sample and the framework's error. The shapes of the
    answers, by output name, one per sample (its first run), for models that answer a mapping of arrays."""
    seen: dict[str, list[tuple[int, ...]]] = {}
    for sample in warm:
        for iteration in range(iterations):
            try:
                answer = model(sample.inputs)
            except Exception as exc:
                raise WarmupError(f"{sample.label}: {type(exc).__name__}: {exc}") from exc
            if iteration == 0 and isinstance(answer, dict):
                for name, array in answer.items():
                    seen.setdefault(str(name), []).append(tuple(int(d) for d in np.shape(array)))
    return seen


def warm_up(model: Callable[[dict[str, np.ndarray]], object], config: contract.WorkerConfig
            ) -> tuple[list[Sample], contract.WarmupReport]:
    """Run the warm-up: the samples to run again after restores, and what it found. A refused MADE-UP sample is
    skipped (the report says why, and the model serves unwarmed: no samples to run again); a refused declared
    sample raises WarmupError."""
    warm = samples(config)
    try:
        seen = run(model, warm, config.warmup_iterations)
    except WarmupError as exc:
        if not all(sample.made_up for sample in warm):
            raise
        return [], contract.WarmupReport(skipped=(
            f"the model refused the made-up warm-up inputs, so it serves without a warm-up ({exc}); declare "
            "runtime.warmup with the input sizes your clients send (`volga inspect` probes one)"))
    outputs = tuple(contract.OutputSeen(decl.name, decl.shape, tuple(seen[decl.name]))
                    for decl in config.outputs if seen.get(decl.name))
    return warm, contract.WarmupReport(outputs=outputs)


def canary(config: contract.WorkerConfig) -> dict[str, np.ndarray]:
    """The canary input: the first warm-up sample, made with the canary's seed (so a model that refuses made-up
    inputs answers a canary it can run)."""
    return samples(config, seed=contract.CANARY_SEED)[0].inputs
