"""A ModelSpec's warm-up declaration (runtime.warmup, runtime.warmupFile) in the worker's terms.

The worker does not read ModelSpecs (`worker.contract`); the agent hands it the declared samples and the
warm-up file in its configuration, and the worker runs them (`worker.warmup`).
"""

from __future__ import annotations

import dataclasses

from volga_agent.worker import contract
from volga_core import api


def samples(runtime: api.Runtime) -> tuple[contract.WarmupSample, ...]:
    return tuple(contract.WarmupSample(tuple(
        contract.WarmupTensor(name, tuple(given.resolved_shape), given.fill,
                              given.value_range[0] if given.value_range else None,
                              given.value_range[1] if given.value_range else None,
                              tuple(given.values) if given.values is not None else None)
        for name, given in sample.inputs.items())) for sample in runtime.warmup)


def configure(config: contract.WorkerConfig, spec: api.ModelSpecSpec) -> contract.WorkerConfig:
    """`config` with the spec's warm-up samples and warm-up file."""
    path = spec.runtime.warmup_path
    return dataclasses.replace(config, warmup=samples(spec.runtime), warmup_file=str(path) if path else "")
