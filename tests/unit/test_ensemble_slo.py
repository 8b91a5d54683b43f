"""A chain's end-to-end SLO in the autonomy loop: the loop's views hold an ensemble to its head's contract, and the
decider judges it on its own load without acting on the ensemble itself (its models act, on their own load)."""

from __future__ import annotations

import pathlib
from typing import Any

from autonomy_stubs import Run

from volga_agent.autonomy import decider, loop, window
from volga_agent.node import instance, pool
from volga_bench import chain
from volga_core import api

State = decider.State
MEMBERS = ("a", "b")


def slo(tolerance: float = 20.0, **fields: Any) -> api.Slo:
    return api.Slo.model_validate({"interferenceTolerancePct": tolerance, **fields})


def view(model: str, tolerance: float = 20.0, awake: bool = True, baselines: dict[int, float] | None = None,
         members: tuple[str, ...] = (), **fields: Any) -> decider.ModelView:
    return decider.ModelView(model, slo(tolerance, **fields), tuple(sorted((baselines or {}).items())), awake, False,
                             8, members)


def ensemble(tolerance: float = 20.0, baseline: float = 10.0, **fields: Any) -> decider.ModelView:
    return view("e", tolerance, False, {1: baseline}, MEMBERS, **fields)


def load(arrivals: int = 0, p99: float | None = None, completed: int | None = None) -> window.ModelWindow:
    return window.ModelWindow(arrivals, arrivals if completed is None else completed, 0, 0, p99)



def test_an_ensemble_over_its_heads_limit_violates_and_its_models_do_not_give_way() -> None:
    # The chain's models meet their own baselines; the pipeline misses the head's end to end (10 ms + 20 %).
    run = Run([view("a", 5.0, baselines={1: 5.0}), view("b", 50.0, baselines={1: 5.0}), ensemble(),
               view("c", 30.0, baselines={1: 5.0})])
    models = {"a": load(4, 5.0), "b": load(4, 5.0), "e": load(4, 12.5), "c": load(4, 5.0)}
    decisions = [run.window(**models) for _ in range(3)]
    assert [(v.model, v.p99_ms, v.limit_ms) for v in decisions[0].violations] == [("e", 12.5, 12.0)]
    assert decisions[0].candidate is State.OPTIMIZE and decisions[-1].state is State.OPTIMIZE
    # "b" is the most tolerant awake model but part of the chain: "c" gives way.
    assert decisions[-1].actions == (decider.LowerBatchCap("c", 4),)
    # Within its limit, it does not violate.
    assert run.window(**{**models, "e": load(4, 12.0)}).violations == ()


def test_an_ensemble_past_its_recovery_deadline_is_an_emergency_in_which_it_is_not_shed() -> None:
    run = Run([view("a", 5.0), view("b", 50.0), ensemble(80.0, recoveryDeadlineMs=250), view("c", 30.0)])
    models = {"a": load(4), "b": load(4), "e": load(4, 100.0), "c": load(4)}
    decisions = [run.window(**models) for _ in range(8)]
    assert decisions[2].violations[0].past_deadline and decisions[2].candidate is State.EMERGENCY
    assert decisions[-1].state is State.EMERGENCY
    shed = [a.model for d in decisions for a in d.actions if isinstance(a, decider.Shed)]
    assert shed == ["b", "c"]  # the most tolerant models with traffic; never the ensemble, never the least tolerant


def test_an_accelerating_ensemble_preloads_its_models_through_their_own_load() -> None:
    run = Run([view("a", awake=False), view("b", awake=False), ensemble()], autonomy_preload_min_rate=1.0,
              autonomy_hysteresis_windows=1)
    decisions = [run.window(memory=10.0, a=load(n), b=load(n), e=load(n)) for n in (1, 2, 4)]
    assert decisions[-1].actions == (decider.Preload("a"), decider.Preload("b"))


def test_an_ensembles_requests_do_not_count_again_in_the_nodes_completed_requests() -> None:
    """Piecewise tolerance reads the other models' share of the node's completed requests: with the ensemble's
    own count left out, "x" (20 of 30) sees other load 60 % x 1/3 = 20 %, below 30 %: tolerance 50 %."""
    piecewise = {"interferenceTolerance": [{"belowLoadPct": 30, "pct": 50}, {"pct": 5}]}
    run = Run([decider.ModelView("x", api.Slo.model_validate(piecewise), ((1, 10.0),), True, False, 8),
               view("a"), view("b", awake=False), ensemble()])
    decision = run.window(util=60.0, x=load(20, 14.0), a=load(10), b=load(0), e=load(10))
    assert decision.violations == ()
    assert run.window(util=60.0, x=load(20, 15.5), a=load(10), b=load(0), e=load(10)).violations[0].limit_ms == 15.0


def test_the_loops_views_hold_an_ensemble_to_its_heads_own_contract(rundir: pathlib.Path) -> None:
    files = {name: rundir / f"{name}.onnx" for name, *_ in chain.STAGES}
    for path in files.values():
        path.touch()  # no worker starts here
    head, middle, last = (s.spec for s in chain.model_specs(files, "v", True))
    head = head.model_copy(update={"slo": slo(15.0, baselineLatencyMs={"1": 40.0, "8": 90.0})})
    middle = middle.model_copy(update={"runtime": middle.runtime.model_copy(update={"max_batch_size": 4})})
    node_pool = pool.Pool("n1", rundir, None)
    for spec in (head, middle, last):
        node_pool.slots[spec.model_id] = pool.Slot(
            instance.Instance(spec.model_id, spec, rundir / spec.model_id, None, None, "cpu"), api.Tier.FROZEN)
    calibrated = api.Calibration(device="cpu", version=head.version, input_hash=head.input_hash(), batches=[
        api.BatchProfile(batch_size=1, p50_ms=1.0, p99_ms=2.0, memory_bytes=1, throughput_per_sec=1.0)])
    measured = {"v-detect": (calibrated,)}
    views = loop.Views(node_pool, lambda: measured)
    try:
        first = views()
        e = first["v-pipeline"]
        assert e.members == ("v-detect", "v-recognize", "v-extract") and not e.awake
        assert e.slo is head.slo and e.baselines == ((1, 40.0), (8, 90.0))
        assert e.max_batch == 4 and e.uncapped == 40.0  # the smallest batch limit of its models
        assert first["v-detect"].members == ()
        assert views() is first
        # Baselines measured on the cluster time the head alone: they do not speak for the chain.
        node_pool.slots["v-detect"].inst.spec = head.model_copy(update={"slo": slo(15.0)})
        second = views()
        assert second["v-detect"].baselines == ((1, 2.0),) and second["v-pipeline"].baselines == ()
        del node_pool.slots["v-detect"]
        assert "v-pipeline" not in views()
    finally:
        node_pool.close()
