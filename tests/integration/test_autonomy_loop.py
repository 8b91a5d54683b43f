"""The autonomy loop with the real sampler and a real pool: a model whose arrivals accelerate is woken from FROZEN
(a real worker, real CRIU) before its next request. The loop stepped without workers is in
tests/unit/test_autonomy_steps.py."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from autonomy_stubs import RecordingGateway
from procs import wait_for

from volga_agent.autonomy import decider, loop, sampler, window
from volga_agent.node import instance, pool
from volga_agent.node.settings import Settings
from volga_agent.worker import contract, protocol
from volga_core import api, planner

Tier = api.Tier


@pytest.fixture
def frozen_pool(rundir: pathlib.Path, criu_engine, default_spec: api.ModelSpecSpec) -> Iterator[pool.Pool]:
    # Watermarks at 100 %: this node's real memory reading is below them, so the loop may preload.
    settings = Settings(autonomy_preload_below_pct=100, autonomy_optimize_above_pct=100,
                        autonomy_emergency_above_pct=100)
    p = pool.Pool("n1", rundir / "work", criu_engine.root, settings)
    p.apply([planner.Desired("ms-0", "ms", default_spec.model_id, "n1", Tier.FROZEN)], {"ms": default_spec})
    p.wait_converged(120)
    assert p.instances()[0].tier is Tier.FROZEN
    yield p
    p.close()


def test_accelerating_arrivals_wake_a_frozen_model_before_its_next_request(frozen_pool: pool.Pool,
                                                                           default_spec: api.ModelSpecSpec) -> None:
    model = default_spec.model_id
    gateway = RecordingGateway()
    steady = [{model: window.ModelLoad(arrivals=1)} if i % 10 == 0 else {} for i in range(60)]
    gateway.script = list(steady)  # six windows of 1 request each: a flat rate wakes nothing
    autonomy = loop.Loop(frozen_pool, gateway, probe=sampler.CpuProbe())
    autonomy.start()
    try:
        wait_for("six flat windows", lambda: len(autonomy.decisions) >= 6, timeout=60, every=0.02)
        assert autonomy.decider.state is decider.State.PRELOAD
        assert frozen_pool.instances()[0].tier is Tier.FROZEN
        assert not any(d.actions for d in autonomy.decisions)
        # Then 2, 4, 8 requests per window: the rate rises faster and faster.
        with gateway.lock:
            gateway.script = [{model: window.ModelLoad(arrivals=n)} if i == 0 else {}
                              for n in (2, 4, 8) for i in range(10)]
        wait_for("the loop to wake the model", lambda: frozen_pool.instances()[0].tier is Tier.HOT, timeout=120,
                 every=0.02)
    finally:
        autonomy.stop()
    assert any(decider.Preload(model) in d.actions for d in autonomy.decisions)
    assert frozen_pool.activations == 1
    registry = frozen_pool.metrics.registry
    assert registry.get_sample_value("volga_autonomy_decisions_total", {"action": "Preload"}) >= 1
    assert registry.get_sample_value("volga_autonomy_state", {"state": "PRELOAD"}) == 1
    assert registry.get_sample_value("volga_autonomy_sample_jitter_ms_count") >= 60
    assert gateway.drains >= 60
    # The next request finds the worker answering: no wake on its way.
    info = frozen_pool.instances()[0]
    with protocol.WorkerClient(info.socket) as client:
        out = client.infer(contract.sample_inputs(instance.decls(default_spec.inputs)))
    assert out["probability"].shape == (1, 1)
    assert frozen_pool.activate(model).woke_from is Tier.HOT
    assert frozen_pool.activations == 1
