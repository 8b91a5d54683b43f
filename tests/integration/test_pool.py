"""A node's pool with real workers and real CRIU: convergence, activation, local policy, failures."""

from __future__ import annotations

import os
import pathlib
import signal
import time
from collections.abc import Iterator

import pytest
from pools import desired

from volga_agent.node import instance, policy, pool
from volga_agent.node.settings import Settings
from volga_agent.snapshot import criu
from volga_core import api

Tier = api.Tier


@pytest.fixture
def node_pool(rundir: pathlib.Path, criu_engine) -> Iterator[pool.Pool]:
    settings = Settings(hot_idle_sec=0.3, warm_idle_sec=0.3, suspended_idle_sec=0.3, max_failures=2)
    p = pool.Pool("n1", rundir / "work", criu_engine.root, settings)
    yield p
    p.close()
    # Only what failed restores left, kept for inspection on purpose.
    assert {p.name for p in criu_engine.root.iterdir()} <= {criu.FAILED}, "snapshots left behind"


def test_converge_activate_and_idle_demotion(node_pool: pool.Pool, default_spec: api.ModelSpecSpec) -> None:
    node_pool.apply([desired("ms-0", "ms", default_spec.model_id, Tier.FROZEN),
                     desired("elsewhere-0", "ms", default_spec.model_id, Tier.HOT, node="n2")], {"ms": default_spec})
    node_pool.wait_converged(120)
    [info] = node_pool.instances()
    assert info.name == "ms-0" and info.tier is Tier.FROZEN and info.snapshot_bytes > 0
    act = node_pool.activate(default_spec.model_id)
    assert act.woke_from is Tier.FROZEN and act.instance.tier is Tier.HOT and not act.fallback
    assert pathlib.Path(act.instance.socket).exists()
    assert node_pool.activate(default_spec.model_id).woke_from is Tier.HOT  # already awake: no wake
    assert node_pool.activations == 1
    time.sleep(0.4)
    moves = node_pool.tick()
    assert [(m.instance, m.target, m.reason) for m in moves] == [("ms-0", Tier.FROZEN, policy.Reason.IDLE)]
    deadline = time.monotonic() + 30
    while node_pool.instances()[0].tier is not Tier.FROZEN and time.monotonic() < deadline:
        time.sleep(0.05)
    assert node_pool.instances()[0].tier is Tier.FROZEN
    samples = node_pool.metrics.registry.get_sample_value(
        "volga_snapshot_restore_latency_ms_count", {"tier": "FROZEN", "model": default_spec.model_id})
    assert samples == 1
    # Where that wake went: criu's restore, the worker's own wake and the agent's steps between, each timed once (no
    # driver on the CPU).
    phases = {phase: node_pool.metrics.registry.get_sample_value(
        "volga_wake_phase_latency_ms_count", {"tier": "FROZEN", "phase": phase, "model": default_spec.model_id})
        for phase in ("restore", "adopt", "driver", "resume", "wake", "release")}
    assert phases == {"restore": 1, "adopt": 1, "driver": None, "resume": 1, "wake": 1, "release": 1}


def test_the_same_plan_again_leaves_a_woken_instance_to_the_idle_policy(node_pool: pool.Pool,
                                                                        default_spec: api.ModelSpecSpec) -> None:
    """In a cluster the plan is applied again on every watch event (the agent's own status reports among them):
    that must not send an instance a request just woke back to its resting tier; the idle policy does, in time.
    A plan that asks for more (a warmer floor) is acted on at once."""
    plan = [desired("ms-0", "ms", default_spec.model_id, Tier.FROZEN)]
    node_pool.apply(plan, {"ms": default_spec})
    node_pool.wait_converged(120)
    assert node_pool.activate(default_spec.model_id).woke_from is Tier.FROZEN
    node_pool.apply(plan, {"ms": default_spec})
    node_pool.wait_converged(120)
    assert node_pool.instances()[0].tier is Tier.HOT
    node_pool.apply([desired("ms-0", "ms", default_spec.model_id, Tier.COLD)], {"ms": default_spec})
    node_pool.wait_converged(120)
    assert node_pool.instances()[0].tier is Tier.HOT  # a lower floor: the idle policy takes it down
    time.sleep(0.4)
    assert [(m.instance, m.target) for m in node_pool.tick()] == [("ms-0", Tier.FROZEN)]


def test_dead_worker_is_noticed_and_restarted(node_pool: pool.Pool, default_spec: api.ModelSpecSpec) -> None:
    node_pool.apply([desired("ms-0", "ms", default_spec.model_id, Tier.HOT)], {"ms": default_spec})
    node_pool.wait_converged(120)
    slot = node_pool.slots["ms-0"]
    old = slot.inst.pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    time.sleep(0.1)
    node_pool.tick()
    node_pool.wait_converged(120)
    assert slot.inst.tier is Tier.HOT and slot.inst.pid not in (None, old)
    assert node_pool.metrics.registry.get_sample_value(
        "volga_worker_deaths_total", {"model": default_spec.model_id}) == 1


def test_breaker_opens_after_repeated_restore_failures(node_pool: pool.Pool, default_spec: api.ModelSpecSpec) -> None:
    node_pool.apply([desired("ms-0", "ms", default_spec.model_id, Tier.FROZEN)], {"ms": default_spec})
    node_pool.wait_converged(120)
    inst = node_pool.slots["ms-0"].inst
    for _ in range(2):
        node_pool.move_to("ms-0", Tier.FROZEN)
        assert inst.image is not None
        (inst.image.path / "pstree.img").write_bytes(b"broken")
        act = node_pool.activate(default_spec.model_id)
        assert act.fallback and act.instance.tier is Tier.HOT
    status = node_pool.status()
    assert status.restore_failures == 2 and status.open_circuits == (default_spec.model_id,)
    # While open, the pool keeps the model out of the snapshot tiers.
    assert node_pool._allowed(node_pool.slots["ms-0"], Tier.FROZEN) is Tier.HOT
    assert node_pool.metrics.registry.get_sample_value(
        "volga_snapshot_restore_failures_total", {"tier": "FROZEN", "model": default_spec.model_id}) == 2


def test_half_open_breaker_keeps_its_attempt_for_a_real_restore(rundir: pathlib.Path, criu_engine,
                                                                default_spec: api.ModelSpecSpec) -> None:
    """Watch events converge instances all the time; only a wake may take the one half-open attempt."""
    settings = Settings(max_failures=2, backoff_duration_sec=0.3)
    p = pool.Pool("n1", rundir / "work", criu_engine.root, settings)
    try:
        plan = [desired("ms-0", "ms", default_spec.model_id, Tier.FROZEN)]
        p.apply(plan, {"ms": default_spec})
        p.wait_converged(120)
        for _ in range(2):
            p.breaker.record_failure(default_spec.model_id, time.monotonic())
        time.sleep(0.4)
        assert p.breaker.state(default_spec.model_id, time.monotonic()) is policy.BreakerState.HALF_OPEN
        for _ in range(3):  # events about the instance, nothing to do
            p.converge_async("ms-0").result(60)
        act = p.activate(default_spec.model_id)
        last = p.slots["ms-0"].inst.history[-1]
        assert (last.source, last.target, act.fallback) == (Tier.FROZEN, Tier.HOT, False)
        assert p.breaker.state(default_spec.model_id, time.monotonic()) is policy.BreakerState.CLOSED
    finally:
        p.close()


def test_instances_of_one_model_get_their_own_slots_and_a_freed_slot_is_reused(
        node_pool: pool.Pool, default_spec: api.ModelSpecSpec, criu_engine: criu.CriuEngine) -> None:
    """Work folders are named by model and slot, not by instance: the same paths for any replica in a slot."""
    other = default_spec.model_copy(update={"version": "2/../x"})  # a version that is no path component
    specs = {"ms": default_spec, "other": other}
    plan = [desired(n, "ms", default_spec.model_id, Tier.COLD) for n in ("ms-0", "ms-1")]
    node_pool.apply([*plan, desired("other-0", "other", other.model_id, Tier.COLD)], specs)
    node_pool.wait_converged(30)
    folders = {name: slot.inst.workdir for name, slot in node_pool.slots.items()}
    prefix = f"{default_spec.model_id}-v{default_spec.version}"
    assert folders == {"ms-0": node_pool.workroot / f"{prefix}-0", "ms-1": node_pool.workroot / f"{prefix}-1",
                       "other-0": node_pool.workroot / f"{default_spec.model_id}-v2_.._x-0"}
    assert node_pool.slots["ms-1"].inst.parked_dir == criu_engine.root / instance.PARKED / f"{prefix}-1"
    # ms-0 goes: the next replica takes its slot, and ms-1 keeps its own.
    node_pool.apply([plan[1], desired("ms-2", "ms", default_spec.model_id, Tier.COLD)], specs)
    node_pool.wait_converged(30)
    assert node_pool.slots["ms-2"].inst.workdir == folders["ms-0"]
    assert node_pool.slots["ms-1"].inst.workdir == folders["ms-1"]
    assert pool.work_folder("m" * 200, "1", 3).endswith("-3") and len(pool.work_folder("m" * 200, "1", 3)) == 66
    assert pool.work_folder("m" * 200, "1", 0) != pool.work_folder("m" * 199 + "n", "1", 0)
