"""Wake storms on the GPU: the idle tier chosen by GPU memory headroom in a real pool, and the storm bench's ways
(WARM, the driver's restores all at once, one at a time, the first alone), every answer compared with the HOT one.
The storm's times are the bench's (`volga bench endtoend --gpu --storm 16`), not asserted here."""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Callable

import numpy as np
import pytest

from volga_agent.host import gpus
from volga_agent.node import policy, pool
from volga_agent.node.settings import IdleSettings, Settings
from volga_agent.worker import contract
from volga_bench import endtoend, tiers
from volga_core import api, planner

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

Tier = api.Tier


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.05)


@pytest.mark.parametrize(("pct", "rests_in"), [(50.0, Tier.WARM), (0.0, Tier.SUSPENDED)])
def test_an_idle_warm_instance_stays_warm_while_gpu_memory_is_plentiful(
        tmp_path: pathlib.Path, pct: float, rests_in: api.Tier) -> None:
    spec = tiers.build_torch_mlp(tmp_path / "model.pt", 0.06)
    settings = Settings(allow_model_code=True, idle=IdleSettings(hot_sec=0.0, warm_sec=0.0, suspended_sec=3600.0,
                                          keep_warm_below_gpu_pct=pct))
    node = pool.Pool("gpu-node", tmp_path / "work", tmp_path / "snapshots", settings, gpus=gpus.discover())
    try:
        node.apply([planner.Desired("mlp-0", "mlp", spec.model_id, "gpu-node", Tier.COLD, gpu_index=0)],
                   {"mlp": spec})
        node.wait_converged()
        node.activate(spec.model_id)
        inst = node.slots["mlp-0"].inst
        x = contract.sample_inputs(inst.config.inputs, batch=4, seed=3)
        hot = inst.infer(x)
        node.release("mlp-0")
        # A tick's `now` a second ahead: the request above counts as a use when the tick first looks at the worker.
        assert [(m.target, m.reason) for m in node.tick(time.monotonic() + 1)] == [(Tier.WARM, policy.Reason.IDLE)]
        wait_for(lambda: inst.tier == Tier.WARM and not node.slots["mlp-0"].lock.locked(), "WARM")
        usage = node.usage()
        assert usage.gpu_total_bytes == sum(g.memory_total_bytes for g in node.gpus) > 0
        moves = node.tick(time.monotonic() + 1)
        if rests_in == Tier.WARM:
            assert moves == [] and inst.tier == Tier.WARM
        else:
            assert [(m.target, m.reason) for m in moves] == [(Tier.SUSPENDED, policy.Reason.IDLE)]
            wait_for(lambda: inst.tier == Tier.SUSPENDED and not node.slots["mlp-0"].lock.locked(), "SUSPENDED")
        activation = node.activate(spec.model_id)
        assert activation.woke_from == rests_in and not activation.fallback
        after = inst.infer(x)
        assert all(np.array_equal(after[k], hot[k]) for k in hot)
    finally:
        node.close()


def test_every_way_of_a_storm_answers_as_hot(tmp_path: pathlib.Path) -> None:
    cases = endtoend.storm_cases(tmp_path, 4, gpu=True, width=1024)
    report = asyncio.run(endtoend.storm(cases, [Tier.WARM, Tier.SUSPENDED], rounds=1,
                                        restores_at_once=[None, 0, 1, "lead"]))
    assert sorted(report["tiers"]) == ["suspended", "suspended_all", "suspended_k1", "suspended_lead", "warm"]
    for way, row in report["tiers"].items():
        assert row["mismatches"] == 0 and row["each"]["n"] == 4, way
    assert report["restore_failures"] == 0
