"""A chain served as one model, as Triton serves an ensemble: one request in, each model in turn, one answer out.

A head ModelSpec that lists `chain` and names an `ensemble` id declares it. The ensemble takes the head's inputs;
each model of the chain takes its inputs by name from the ensemble's inputs and the outputs of the models before
it; the last model's outputs are the answer. `volga_core.api.ensemble_problems` holds the declarations to
that (names, dtypes, shapes), here the catalog serves only ensembles that pass it, and the dataplane runs the steps
through its usual path for each model (wake, batch, forward). Metadata and configuration describe it as Triton
does (platform "ensemble", `ensemble_scheduling` steps with input and output maps), so tritonclient reads it as
an ensemble. See docs/models.md ("Chains").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Iterable, Mapping

import numpy as np

from volga_core import api

PLATFORM = "ensemble"


@dataclasses.dataclass(frozen=True)
class Step:
    """One model of the ensemble and the tensors it takes and gives (its names are the ensemble's)."""

    model_id: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def input_map(self) -> dict[str, str]:
        """Triton's input_map: the model's input name -> the ensemble tensor it reads (by name, the same)."""
        return {name: name for name in self.inputs}

    @property
    def output_map(self) -> dict[str, str]:
        return {name: name for name in self.outputs}


@dataclasses.dataclass(frozen=True)
class Ensemble:
    model_id: str
    version: str  # the head's
    head: str
    steps: tuple[Step, ...]
    inputs: tuple[api.TensorSpec, ...]
    outputs: tuple[api.TensorSpec, ...]
    max_batch_size: int  # > 0 when every model batches: the smallest of their runtime.maxBatchSize

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(step.model_id for step in self.steps)


def declared(specs: Iterable[api.ModelSpecSpec]) -> dict[str, Ensemble]:
    """Ensemble id -> its ensemble, for each head whose chain and ensemble pass the declaration checks and whose
    models' signatures are known."""
    by_id = {spec.model_id: spec for spec in specs}
    refused = api.chain_problems(by_id)
    found = {}
    for head in by_id.values():
        if head.ensemble is None or head.model_id in refused:
            continue
        models = [head, *(by_id[m] for m in head.chain)]
        if not all(m.has_signature for m in models):
            continue
        batched = all(m.batches for m in models)
        found[head.ensemble] = Ensemble(
            head.ensemble, head.version, head.model_id,
            tuple(Step(m.model_id, tuple(t.name for t in m.inputs), tuple(t.name for t in m.outputs))
                  for m in models),
            tuple(head.inputs), tuple(models[-1].outputs),
            min(m.runtime.max_batch_size for m in models) if batched else 0)
    return found


async def run(ensemble: Ensemble, inputs: Mapping[str, np.ndarray],
              call: Callable[[str, dict[str, np.ndarray]], Awaitable[dict[str, np.ndarray]]]
              ) -> dict[str, np.ndarray]:
    """Each step in turn through `call(model_id, inputs)`; the last model's outputs."""
    tensors = dict(inputs)
    for step in ensemble.steps:
        tensors.update(await call(step.model_id, {name: tensors[name] for name in step.inputs}))
    return {t.name: tensors[t.name] for t in ensemble.outputs}
