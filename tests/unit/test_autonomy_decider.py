"""The autonomy decider, window by window: hysteresis, each state's actions, piecewise tolerance, recovery deadlines."""

from __future__ import annotations

import dataclasses
from typing import Any

import pydantic
import pytest
from autonomy_stubs import STEP, Run

from volga_agent.autonomy import decider, window
from volga_agent.node.settings import Settings
from volga_core import api

State = decider.State


def slo(**fields: Any) -> api.Slo:
    return api.Slo.model_validate(fields)


def view(model: str, tolerance: float = 20.0, awake: bool = True, baselines: dict[int, float] | None = None,
         gpu: bool = False, **slo_fields: Any) -> decider.ModelView:
    contract = slo(interferenceTolerancePct=tolerance, **slo_fields)
    return decider.ModelView(model, contract, tuple(sorted((baselines or {}).items())), awake, gpu, 256)


def load(arrivals: int = 0, p99: float | None = None, completed: int | None = None) -> window.ModelWindow:
    done = arrivals if completed is None else completed
    return window.ModelWindow(arrivals, done, 0, 0, p99)


def test_a_state_changes_only_after_three_agreeing_windows() -> None:
    run = Run([view("a")])
    first = run.windows(2, memory=90.0)
    assert [d.state for d in first] == [State.ACCEPT, State.ACCEPT]
    assert [d.candidate for d in first] == [State.EMERGENCY, State.EMERGENCY]
    third = run.window(memory=90.0)
    assert third.state is State.EMERGENCY and third.changed
    assert not run.window(memory=90.0).changed
    # Two windows that disagree with the state, then one that agrees: the count starts again.
    run.windows(2, memory=50.0)
    assert run.window(memory=90.0).state is State.EMERGENCY
    assert [d.state for d in run.windows(2, memory=50.0)] == [State.EMERGENCY, State.EMERGENCY]
    assert run.window(memory=50.0).state is State.ACCEPT


def test_the_number_of_agreeing_windows_is_a_setting() -> None:
    run = Run([view("a")], autonomy_hysteresis_windows=1)
    assert run.window(memory=10.0).state is State.PRELOAD


def test_memory_watermarks_pick_the_candidate() -> None:
    run = Run([view("a")])
    assert [run.window(memory=m).candidate for m in (10.0, 39.9, 40.0, 69.9, 70.0, 84.9, 85.0)] == [
        State.PRELOAD, State.PRELOAD, State.ACCEPT, State.ACCEPT, State.OPTIMIZE, State.OPTIMIZE, State.EMERGENCY]


def test_accept_does_nothing() -> None:
    run = Run([view("a", awake=False)])
    decisions = run.windows(6, memory=50.0, a=load(5))
    assert all(d.state is State.ACCEPT and not d.actions for d in decisions)


def test_preload_wakes_a_model_whose_arrivals_accelerate() -> None:
    run = Run([view("rising", awake=False), view("linear", awake=False), view("awake", awake=True),
               view("trickle", awake=False)])
    # rising: flat, then faster and faster; linear: a constant slope; awake: already HOT; trickle: nothing.
    arrivals = [(2, 1, 1, 0), (2, 2, 2, 0), (2, 3, 4, 0), (2, 4, 8, 0), (3, 5, 16, 0), (6, 6, 32, 0)]
    decisions = [run.window(memory=10.0, rising=load(r), linear=load(li), awake=load(a), trickle=load(t))
                 for r, li, a, t in arrivals]
    assert decisions[2].state is State.PRELOAD
    assert [d.actions for d in decisions] == [(), (), (), (), (decider.Preload("rising"),),
                                              (decider.Preload("rising"),)]


def test_preload_needs_the_preload_state_and_the_minimum_rate() -> None:
    run = Run([view("m", awake=False)], autonomy_preload_min_rate=100.0)
    run.windows(3, memory=10.0)
    assert [run.window(memory=10.0, m=load(n)).actions for n in (1, 3, 7)] == [(), (), ()]  # 70/s < 100/s
    other = Run([view("m", awake=False)])
    assert [other.window(memory=50.0, m=load(n)).actions for n in (1, 3, 7)] == [(), (), ()]  # ACCEPT


def test_optimize_lowers_the_most_tolerant_co_runners_cap_then_restores_it() -> None:
    run = Run([view("strict", 10.0, baselines={1: 1.0, 8: 4.0}), view("mid", 50.0), view("loose", 100.0),
               view("asleep", 500.0, awake=False)])
    # strict's p99 5 ms > 4 ms x 1.1 (batch 8 is the largest baseline within its cap of 256).
    violating = {"strict": load(10, p99=5.0), "loose": load(10, p99=1.0), "mid": load(3)}
    first = run.windows(3, **violating)
    assert [d.candidate for d in first] == [State.OPTIMIZE] * 3
    assert first[-1].state is State.OPTIMIZE and first[-1].actions == (decider.LowerBatchCap("loose", 128),)
    assert run.window(**violating).actions == (decider.LowerBatchCap("loose", 64),)
    calm = {"strict": load(10, p99=4.0), "mid": load(3), "loose": load(3)}
    decisions = run.windows(3, **calm)
    assert decisions[-1].state is State.ACCEPT
    assert decisions[-1].actions == (decider.RestoreBatchCap("loose"),)
    assert run.decider.caps == {}


def test_optimize_protects_the_violator_and_skips_co_runners_less_tolerant_than_it() -> None:
    run = Run([view("a", 50.0, baselines={1: 1.0}), view("b", 10.0)], autonomy_hysteresis_windows=1)
    assert run.window(a=load(10, p99=2.0)).actions == ()  # b is less tolerant than a: not a's to pay for


def test_optimize_demotes_idle_tolerant_models_not_the_least_tolerant() -> None:
    run = Run([view("strict", 10.0), view("loose", 100.0), view("gpu", 50.0, gpu=True), view("busy", 200.0)])
    decisions = run.windows(3, memory=75.0, busy=load(5))
    assert decisions[-1].state is State.OPTIMIZE
    assert decisions[-1].actions == (decider.Demote("loose", api.Tier.FROZEN), decider.Demote("gpu", api.Tier.WARM))


def test_emergency_sheds_the_most_tolerant_first_never_the_least_and_unsheds_on_leaving() -> None:
    run = Run([view("strict", 10.0), view("mid", 50.0), view("loose", 100.0, awake=False),
               view("idle", 300.0, awake=False)], autonomy_shed_retry_after_ms=250)
    traffic = {"strict": load(5), "mid": load(5), "loose": load(5)}
    decisions = run.windows(3, memory=90.0, **traffic)
    assert decisions[-1].state is State.EMERGENCY
    assert decisions[-1].actions == (decider.Shed("loose", 250),)  # not awake: nothing to demote
    assert run.window(memory=90.0, **traffic).actions == (decider.Shed("mid", 250),
                                                           decider.Demote("mid", api.Tier.FROZEN))
    assert run.window(memory=90.0, **traffic).actions == ()  # strict is the least tolerant: protected
    leaving = run.windows(3, memory=50.0, **traffic)
    assert leaving[-1].state is State.ACCEPT
    assert leaving[-1].actions == (decider.Unshed("loose"), decider.Unshed("mid"))
    assert run.decider.shed == set()


def test_piecewise_tolerance_follows_the_other_models_load() -> None:
    steps = [{"belowLoadPct": 50, "pct": 15}, {"pct": 50}]
    contract = slo(interferenceTolerance=steps, baselineLatencyMs={"1": 10.0})
    assert [contract.tolerance_pct(x) for x in (0, 49.9, 50, 100)] == [15, 15, 50, 50]
    m = decider.ModelView("m", contract, ((1, 10.0),))
    run = Run([m, view("other")], autonomy_hysteresis_windows=1)
    # p99 13 ms: within 50 % (15 ms), not within 15 % (11.5 ms).
    low = run.window(util=30.0, m=load(10, p99=13.0), other=load(10))
    assert [(v.model, v.limit_ms) for v in low.violations] == [("m", pytest.approx(11.5))]
    assert low.violations[0].other_load_pct == pytest.approx(15.0)  # half of the 30 % is m's own
    high = run.window(util=100.0, m=load(10, p99=13.0), other=load(10))
    assert high.violations == ()  # the others load the node by 50 %: tolerance 50 %
    alone = run.window(util=100.0, m=load(10, p99=13.0))  # all the load is m's own: other load 0
    assert [v.limit_ms for v in alone.violations] == [pytest.approx(11.5)]


def test_scalar_tolerance_applies_without_steps() -> None:
    contract = slo(interferenceTolerancePct=30)
    assert contract.tolerance_pct(0) == contract.tolerance_pct(99) == 30


def test_recovery_deadline_is_tracked_per_model() -> None:
    run = Run([view("m", 10.0, baselines={1: 1.0}, recoveryDeadlineMs=250), view("n", 10.0, baselines={1: 1.0})])
    bad, good = load(10, p99=3.0), load(10, p99=1.0)
    decisions = [run.window(m=bad, n=good) for _ in range(3)]
    assert [(v.windows, round(v.violating_ms), v.past_deadline) for d in decisions for v in d.violations] == [
        (1, 100, False), (2, 200, False), (3, 300, True)]
    assert decisions[-1].candidate is State.EMERGENCY
    # A window within the SLO ends the violation; the next one starts counting again.
    assert run.window(m=good, n=good).violations == ()
    again = run.window(m=bad, n=good)
    assert [(v.windows, round(v.violating_ms)) for v in again.violations] == [(1, 100)]
    # A window with nothing completed has nothing to judge: the violation ends too.
    run.window(n=good)
    assert [v.windows for v in run.window(m=bad).violations] == [1]


def test_baselines_of_another_version_or_input_hash_do_not_count(default_spec: api.ModelSpecSpec) -> None:
    tagged = default_spec.slo.model_copy(update={
        "baseline_latency_ms": {"1": 1.0},
        "baseline_for": api.BaselineTag(version=default_spec.version, input_hash=default_spec.input_hash())})
    spec = default_spec.model_copy(update={"slo": tagged})
    assert decider.ModelView.of(spec, True, False).baselines == ((1, 1.0),)
    newer = spec.model_copy(update={"version": "2"})
    assert decider.ModelView.of(newer, True, False).baselines == ()
    untagged = default_spec.model_copy(update={"slo": default_spec.slo.model_copy(
        update={"baseline_latency_ms": {"8": 3.0}})})
    assert decider.ModelView.of(untagged, True, False).baselines == ((8, 3.0),)
    run = Run([decider.ModelView.of(newer, True, False)], autonomy_hysteresis_windows=1)
    assert run.window(**{newer.model_id: load(10, p99=50.0)}).violations == ()


def test_the_baseline_is_the_largest_batch_within_the_cap() -> None:
    steps = ((1, 1.0), (8, 4.0), (32, 9.0))
    assert [decider.baseline(steps, cap) for cap in (1, 7, 8, 31, 256)] == [1.0, 1.0, 4.0, 4.0, 9.0]
    assert decider.baseline(((4, 2.0),), 1) == 2.0


def test_explain_gives_the_path() -> None:
    run = Run([view("m", 10.0, baselines={1: 1.0})])
    decision = run.window(memory=72.0, m=load(3, p99=2.0))
    text = " | ".join(decision.path)
    assert "m: p99 2.000 ms > 1.100 ms" in text and "candidate OPTIMIZE" in text and "1/3 windows" in text
    quiet = decider.Decider().decide(window.Window(0, STEP, 50.0, 0.0, False, {}), {})
    assert quiet.path == ()


def test_models_that_leave_are_forgotten() -> None:
    run = Run([view("m", awake=False)])
    run.windows(2, m=load(1))
    del run.views["m"]
    run.window()
    assert "m" not in run.decider._tracks


@dataclasses.dataclass(frozen=True)
class GatewayLoad:
    """A load type of another package with the same fields, as the gateway's data plane defines its own."""

    arrivals: int
    completed: int
    queue_depth: int
    latencies_ms: tuple[float, ...]
    shed: int


def test_windows_reduce_samples_and_accept_any_type_with_the_load_fields() -> None:
    samples = [window.NodeSample(at=t, memory_pct=m, util_pct=u) for t, m, u in ((1.0, 30, 10), (1.01, 50, 30))]
    loads: list[dict[str, window.LoadReading]] = [
        {"a": GatewayLoad(3, 2, 4, (1.0, 9.0), 0)},
        {"a": window.ModelLoad(1, 1, 2, (5.0,), 1), "b": GatewayLoad(1, 0, 1, (), 0)}]
    built = window.build(samples, loads, start=0.99)
    assert (built.start, built.end, built.memory_pct, built.util_pct) == (0.99, 1.01, 50, 20)
    assert built.models["a"] == window.ModelWindow(4, 3, 4, 1, 9.0)
    assert built.models["b"] == window.ModelWindow(1, 0, 1, 0, None)
    assert window.p99([float(x) for x in range(1, 101)]) == 99.0
    with pytest.raises(ValueError, match="at least one sample"):
        window.build([], [], 0.0)


def test_watermarks_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="autonomy_emergency_above_pct: must be >= autonomy_optimize_above_pct"):
        Settings.from_mapping({"autonomyEmergencyAbovePct": 60})
    with pytest.raises(ValueError, match="autonomy_sample_ms: must be > 0"):
        Settings.from_mapping({"autonomy_sample_ms": 0.0})


@pytest.mark.parametrize(("steps", "path", "reason"), [
    ([{"belowLoadPct": 50, "pct": 15}, {"belowLoadPct": 70, "pct": 50}], "interferenceTolerance[1].belowLoadPct",
     "leave belowLoadPct out"),
    ([{"pct": 15}, {"pct": 50}], "interferenceTolerance[0].belowLoadPct", "required on every step but the last"),
    ([{"belowLoadPct": 50, "pct": 15}, {"belowLoadPct": 50, "pct": 20}, {"pct": 50}],
     "interferenceTolerance[1].belowLoadPct", "must be above the previous step's 50"),
    ([{"belowLoadPct": 0, "pct": 15}, {"pct": 50}], "interferenceTolerance[0].belowLoadPct", "greater than 0"),
    ([{"pct": -1}], "interferenceTolerance[0].pct", "greater than or equal to 0"),
    ([{"pct": 5, "below": 3}], "interferenceTolerance[0].below", "unknown field"),
])
def test_bad_tolerance_steps_name_their_field(steps: list[dict[str, Any]], path: str, reason: str) -> None:
    document = {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": "m"},
                "spec": {"modelId": "m", "framework": "onnx", "source": "/m.onnx",
                         "slo": {"interferenceTolerance": steps}}}
    with pytest.raises(api.SpecError) as caught:
        api.parse_model_spec(document)
    found = dict(caught.value.problems)
    assert reason in found[f"spec.slo.{path}"], found
    with pytest.raises(pydantic.ValidationError):
        api.Slo.model_validate({"interferenceTolerance": steps})


def test_a_latency_emergency_comes_at_a_share_of_the_deadline_sheds_without_demoting_and_holds_while_calm() -> None:
    run = Run([view("strict", 15.0, baselines={1: 1.0}, recoveryDeadlineMs=400), view("loose", 300.0)],
              autonomy_emergency_windows=1, autonomy_calm_windows=5, autonomy_deadline_share_pct=50.0,
              autonomy_shed_retry_after_ms=900)
    bad = {"strict": load(10, p99=3.0), "loose": load(10, p99=1.0)}
    first = run.windows(3, **bad)
    # 300 ms of violation > 50 % of 400 ms: EMERGENCY at once, the tolerant model shed but left awake (memory
    # is not the trouble, and a checkpoint would cost the CPU the protected model needs).
    assert [d.candidate for d in first] == [State.OPTIMIZE, State.OPTIMIZE, State.EMERGENCY]
    assert first[-1].state is State.EMERGENCY and first[-1].actions == (decider.Shed("loose", 900),)
    assert not any(v.past_deadline for v in first[-1].violations)  # the deadline itself is still ahead
    calm = {"strict": load(10, p99=1.0), "loose": load(0)}
    held = run.windows(4, **calm)
    assert [d.state for d in held] == [State.EMERGENCY] * 4 and all(d.actions == () for d in held)
    assert run.window(**calm).actions == (decider.Unshed("loose"),)
    assert run.decider.state is State.ACCEPT


def test_the_decider_rereads_views_that_change_and_keeps_the_same_ones() -> None:
    run = Run([view("m", 10.0, baselines={1: 1.0})], autonomy_hysteresis_windows=1)
    assert [v.limit_ms for v in run.window(m=load(5, p99=2.0)).violations] == [pytest.approx(1.1)]
    run.views["m"] = view("m", 10.0, baselines={1: 3.0})  # a new baseline: a new view object
    assert run.window(m=load(5, p99=2.0)).violations == ()
    run.views["n"] = view("n", 10.0, baselines={1: 1.0})
    assert [v.model for v in run.window(m=load(5, p99=2.0), n=load(5, p99=2.0)).violations] == ["n"]


def test_a_violation_makes_much_more_tolerant_co_runners_yield_at_once_until_a_calm_accept() -> None:
    run = Run([view("strict", 10.0, baselines={1: 1.0}), view("near", 15.0), view("loose", 300.0),
               view("asleep", 500.0, awake=False)], autonomy_yield_nice=19, autonomy_yield_calm_windows=4)
    bad = {"strict": load(5, p99=2.0), "loose": load(5, p99=1.0)}
    first = run.window(**bad)
    # At the first violating window, before the state moves: only co-runners at least twice as tolerant (near is
    # not; asleep has no worker to lower).
    assert first.state is State.ACCEPT and first.actions == (decider.LowerPriority("loose", 19),)
    assert run.window(**bad).actions == ()  # once
    decisions = run.windows(5, strict=load(5, p99=1.0), loose=load(5, p99=1.0))
    # Four windows after strict's last violation, the state being ACCEPT, the priority comes back.
    assert all(d.state is State.ACCEPT for d in decisions)
    assert [d.actions for d in decisions] == [(), (), (), (decider.RestorePriority("loose"),), ()]
    assert run.decider.yielding == set()


def test_yielding_holds_through_optimize_and_is_off_by_default() -> None:
    run = Run([view("strict", 10.0, baselines={1: 1.0}), view("loose", 300.0, baselines={1: 1.0})],
              autonomy_yield_nice=10, autonomy_yield_calm_windows=2)
    assert decider.LowerPriority("loose", 10) in run.windows(3, strict=load(5, p99=2.0))[0].actions
    assert run.decider.state is State.OPTIMIZE
    # The yielding model's own violations (9 ms > 4 ms) hold the state at OPTIMIZE, and so the yield; strict's
    # calm windows count all the same.
    held = run.windows(4, strict=load(5, p99=1.0), loose=load(5, p99=9.0))
    assert all(d.state is State.OPTIMIZE and not any(isinstance(a, decider.RestorePriority) for a in d.actions)
               for d in held)
    leaving = run.windows(3, strict=load(5, p99=1.0), loose=load(5, p99=1.0))
    assert leaving[-1].state is State.ACCEPT
    assert decider.RestorePriority("loose") in leaving[-1].actions and run.decider.yielding == set()
    off = Run([view("strict", 10.0, baselines={1: 1.0}), view("loose", 300.0)])
    assert not any(isinstance(a, (decider.LowerPriority, decider.RestorePriority))
                   for d in off.windows(10, strict=load(5, p99=2.0)) + off.windows(10) for a in d.actions)


def test_a_violation_throttles_much_more_tolerant_co_runners_at_once_by_what_their_tolerance_allows() -> None:
    run = Run([view("strict", 10.0, baselines={1: 1.0}), view("near", 15.0), view("loose", 300.0),
               view("lax", 50.0), view("asleep", 500.0, awake=False)],
              autonomy_throttle_share=0.9, autonomy_yield_calm_windows=3)
    bad = {"strict": load(5, p99=2.0), "loose": load(5, p99=1.0)}
    first = run.window(**bad)
    # At the first violating window, before the state moves; no yield (its nice is off). loose may be stopped
    # 300 / 400 of each period, not the 0.9 asked for; lax (50 %) only a third; near is not twice as tolerant.
    assert first.state is State.ACCEPT
    assert first.actions == (decider.Throttle("loose", 0.75), decider.Throttle("lax", 50.0 / 150.0))
    assert run.decider.throttled == {"loose": 0.75, "lax": 50.0 / 150.0}
    assert "Throttle(model='loose', share=0.75)" in first.path[-1]
    assert run.window(**bad).actions == ()  # once
    calm = run.windows(4, strict=load(5, p99=1.0), loose=load(5, p99=1.0))
    assert [d.actions for d in calm] == [(), (), (decider.Unthrottle("lax"), decider.Unthrottle("loose")), ()]
    assert run.decider.throttled == {} and run.decider.yielding == set()
    # Entered again by the next violation.
    assert decider.Throttle("loose", 0.75) in run.window(**bad).actions


def test_throttling_and_yielding_go_together_hold_through_optimize_and_are_off_by_default() -> None:
    run = Run([view("strict", 10.0, baselines={1: 1.0}), view("loose", 300.0, baselines={1: 1.0})],
              autonomy_yield_nice=10, autonomy_throttle_share=0.5, autonomy_yield_calm_windows=2)
    first = run.windows(3, strict=load(5, p99=2.0))
    assert first[0].actions == (decider.LowerPriority("loose", 10), decider.Throttle("loose", 0.5))
    assert run.decider.state is State.OPTIMIZE
    # The throttled model's own violations (9 ms > 4 ms) hold the state at OPTIMIZE, and so the throttle.
    held = run.windows(4, strict=load(5, p99=1.0), loose=load(5, p99=9.0))
    assert not any(isinstance(a, decider.Unthrottle) for d in held for a in d.actions)
    leaving = run.windows(3, strict=load(5, p99=1.0), loose=load(5, p99=1.0))
    assert leaving[-1].state is State.ACCEPT
    assert leaving[-1].actions[-2:] == (decider.RestorePriority("loose"), decider.Unthrottle("loose"))
    assert sum(isinstance(a, decider.Unthrottle) for d in leaving for a in d.actions) == 1
    off = Run([view("strict", 10.0, baselines={1: 1.0}), view("loose", 300.0)], autonomy_yield_nice=19)
    assert not any(isinstance(a, (decider.Throttle, decider.Unthrottle))
                   for d in off.windows(10, strict=load(5, p99=2.0)) + off.windows(20) for a in d.actions)


def test_a_co_runner_whose_tolerance_allows_no_stop_is_not_throttled() -> None:
    run = Run([view("strict", 0.0, baselines={1: 1.0}), view("rigid", 0.0)], autonomy_throttle_share=0.5)
    assert run.window(strict=load(5, p99=2.0)).actions == ()
    assert run.decider.throttled == {}


@pytest.mark.parametrize(("setting", "value", "reason"), [
    ("autonomy_throttle_share", 1.0, "less than 1"), ("autonomy_throttle_share", -0.1, "must be >= 0"),
    ("autonomy_throttle_period_ms", 1.0, "must be >= 2")])
def test_throttle_settings_out_of_range_name_their_field(setting: str, value: float, reason: str) -> None:
    with pytest.raises(ValueError, match=f"settings.{setting}: .*{reason}"):
        Settings.from_mapping({setting: value})
