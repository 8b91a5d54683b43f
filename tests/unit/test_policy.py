"""The local tier policy: idle thresholds, floors, budgets, eviction order and the snapshot circuit breaker."""

from __future__ import annotations

import threading

import pydantic
import pytest

from volga_agent.node import policy
from volga_agent.node.settings import Settings
from volga_core import api

Tier = api.Tier
GiB = 1 << 30
NOW = 10_000.0


def view(name: str, tier: Tier = Tier.HOT, *, gpu: bool = True, idle: float = 0.0, host: int = 0, gpu_bytes: int = 0,
         snapshot: int = 0, floor: Tier | None = None, busy: bool = False) -> policy.InstanceView:
    return policy.InstanceView(name=name, model_id="m", tier=tier, gpu=gpu, last_used=NOW - idle, host_bytes=host,
                               gpu_bytes=gpu_bytes, snapshot_bytes=snapshot, floor_tier=floor, busy=busy)


def plan(instances: list[policy.InstanceView], usage: policy.Usage | None = None,
         **settings: object) -> list[tuple[str, Tier, str]]:
    moves = policy.plan_demotions(instances, Settings.from_mapping(settings), NOW, usage or policy.Usage())
    return [(move.instance, move.target, move.reason) for move in moves]


# --- ladders -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("tier", "gpu", "expected"), [
    (Tier.HOT, True, Tier.WARM),
    (Tier.WARM, True, Tier.SUSPENDED),
    (Tier.SUSPENDED, True, Tier.FROZEN),
    (Tier.FROZEN, True, Tier.COLD),
    (Tier.COLD, True, None),
    (Tier.HOT, False, Tier.FROZEN),
    (Tier.FROZEN, False, Tier.COLD),
    (Tier.COLD, False, None),
    (Tier.WARM, False, Tier.FROZEN),  # off the CPU ladder: the next tier that is on it
])
def test_next_tier_down(tier: Tier, gpu: bool, expected: Tier | None) -> None:
    assert policy.next_tier_down(tier, gpu) == expected


# --- idle demotions ------------------------------------------------------------------------------------------------

def test_idle_thresholds_are_keyed_by_the_tier_entered() -> None:
    instances = [
        view("hot-fresh", idle=59.9),
        view("hot-idle", idle=60.0),
        view("warm-fresh", Tier.WARM, idle=299.0),
        view("warm-idle", Tier.WARM, idle=301.0),
        view("susp-fresh", Tier.SUSPENDED, idle=899.0),
        view("susp-idle", Tier.SUSPENDED, idle=901.0),
        view("frozen-ancient", Tier.FROZEN, idle=1e9),  # idleness never makes anything COLD
        view("cold", Tier.COLD, idle=1e9),
    ]
    assert plan(instances) == [
        ("hot-idle", Tier.WARM, "Idle"),
        ("susp-idle", Tier.FROZEN, "Idle"),
        ("warm-idle", Tier.SUSPENDED, "Idle"),
    ]


H200 = 141 * GiB


def test_idle_warm_instances_stay_warm_while_gpu_memory_is_plentiful() -> None:
    warm = [view(f"warm-{k:02}", Tier.WARM, idle=1e6) for k in range(16)]
    hot = view("hot-idle", idle=60.0)
    # 16 contexts (8 GiB) and 40 GiB of HOT weights: under half of an H200. HOT still goes WARM.
    assert plan([*warm, hot], policy.Usage(gpu_bytes=40 * GiB, gpu_total_bytes=H200)) == [
        ("hot-idle", Tier.WARM, "Idle")]
    # Past half, or with the hold off, or on a node whose GPU memory is unknown, WARM goes SUSPENDED after warm_sec.
    suspended = [(v.name, Tier.SUSPENDED, "Idle") for v in warm]
    assert plan([*warm, hot], policy.Usage(gpu_bytes=64 * GiB, gpu_total_bytes=H200)) == [
        ("hot-idle", Tier.WARM, "Idle"), *suspended]
    assert plan(warm, policy.Usage(gpu_bytes=40 * GiB, gpu_total_bytes=H200), keep_warm_below_gpu_pct=0) == suspended
    assert plan(warm, policy.Usage(gpu_bytes=40 * GiB)) == suspended
    # The threshold is the setting's: 10 % of an H200 is 14.1 GiB, and 16 contexts and 8 GiB of weights pass it.
    assert plan(warm, policy.Usage(gpu_bytes=8 * GiB, gpu_total_bytes=H200), keep_warm_below_gpu_pct=10) == suspended
    assert plan(warm, policy.Usage(gpu_bytes=4 * GiB, gpu_total_bytes=H200), keep_warm_below_gpu_pct=10) == []


def test_gpu_in_use_counts_a_context_per_warm_instance() -> None:
    views = [view("a", Tier.WARM), view("b", Tier.WARM), view("c"), view("d", Tier.SUSPENDED)]
    assert policy.gpu_in_use(views, policy.Usage(gpu_bytes=GiB)) == GiB + 2 * policy.WARM_CONTEXT_BYTES


def test_keep_warm_below_gpu_pct_is_a_percentage() -> None:
    with pytest.raises(ValueError, match="keep_warm_below_gpu_pct: must be <= 100"):
        Settings.from_mapping({"keep_warm_below_gpu_pct": 150})


def test_idle_demotion_is_one_step_per_plan() -> None:
    assert plan([view("a", idle=5000.0)]) == [("a", Tier.WARM, "Idle")]


def test_cpu_instance_skips_warm_and_suspended_and_freezes_after_suspended_idle() -> None:
    assert plan([view("cpu", gpu=False, idle=899.0)]) == []
    assert plan([view("cpu", gpu=False, idle=900.0)]) == [("cpu", Tier.FROZEN, "Idle")]


def test_thresholds_come_from_settings() -> None:
    assert plan([view("a", idle=10.0)], hot_idle_sec=5) == [("a", Tier.WARM, "Idle")]
    assert plan([view("a", idle=10.0)], hotIdleSec=20) == []


@pytest.mark.parametrize(("floor", "expected"), [
    (Tier.HOT, []),
    (Tier.WARM, [("a", Tier.WARM, "Idle")]),
    (Tier.FROZEN, [("a", Tier.WARM, "Idle")]),
    (None, [("a", Tier.WARM, "Idle")]),
])
def test_floor_limits_idle_demotion(floor: Tier | None, expected: list[tuple[str, Tier, str]]) -> None:
    assert plan([view("a", idle=100.0, floor=floor)]) == expected


def test_floor_stops_cpu_instance_that_would_skip_past_it() -> None:
    # On a CPU path HOT -> FROZEN would be colder than a SUSPENDED floor.
    assert plan([view("a", gpu=False, idle=5000.0, floor=Tier.SUSPENDED)]) == []


def test_busy_instance_is_never_touched() -> None:
    instances = [view("busy", idle=5000.0, host=8 * GiB, gpu_bytes=8 * GiB, busy=True)]
    usage = policy.Usage(host_bytes=8 * GiB, gpu_bytes=8 * GiB)
    assert plan(instances, usage, gpu_memory_budget_bytes=GiB, host_memory_budget_bytes=GiB) == []


def test_duplicate_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="unique: a"):
        plan([view("a"), view("a", Tier.WARM)])


# --- budget evictions ----------------------------------------------------------------------------------------------

def test_no_budget_means_no_evictions() -> None:
    instances = [view("a", gpu_bytes=100 * GiB, host=100 * GiB, snapshot=100 * GiB)]
    assert plan(instances, policy.Usage(100 * GiB, 100 * GiB, 100 * GiB)) == []


def test_gpu_budget_moves_least_recently_used_one_step_until_within_budget() -> None:
    instances = [
        view("new", idle=1.0, gpu_bytes=4 * GiB),
        view("old", idle=30.0, gpu_bytes=4 * GiB),
        view("mid", idle=10.0, gpu_bytes=4 * GiB),
    ]
    usage = policy.Usage(gpu_bytes=12 * GiB)
    assert plan(instances, usage, gpu_memory_budget_bytes=8 * GiB) == [("old", Tier.WARM, "GpuMemoryBudget")]
    assert plan(instances, usage, gpu_memory_budget_bytes=4 * GiB) == [
        ("old", Tier.WARM, "GpuMemoryBudget"),
        ("mid", Tier.WARM, "GpuMemoryBudget"),
    ]


def test_gpu_budget_suspends_warm_instances_and_skips_those_without_gpu_memory() -> None:
    instances = [
        view("warm", Tier.WARM, idle=50.0, gpu_bytes=GiB, host=4 * GiB),
        view("suspended", Tier.SUSPENDED, idle=80.0, gpu_bytes=0, host=4 * GiB),
        view("hot", idle=10.0, gpu_bytes=4 * GiB),
    ]
    usage = policy.Usage(gpu_bytes=5 * GiB)
    assert plan(instances, usage, gpu_memory_budget_bytes=2 * GiB) == [
        ("warm", Tier.SUSPENDED, "GpuMemoryBudget"),
        ("hot", Tier.WARM, "GpuMemoryBudget"),
    ]


def test_gpu_budget_on_cpu_path_freezes() -> None:
    instances = [view("a", gpu=False, gpu_bytes=4 * GiB, host=GiB)]
    assert plan(instances, policy.Usage(host_bytes=GiB, gpu_bytes=4 * GiB), gpu_memory_budget_bytes=GiB) == [
        ("a", Tier.FROZEN, "GpuMemoryBudget"),
    ]


def test_host_budget_freezes_straight_from_any_live_tier() -> None:
    instances = [
        view("hot", idle=40.0, host=2 * GiB, gpu_bytes=4 * GiB),
        view("warm", Tier.WARM, idle=50.0, host=4 * GiB, gpu_bytes=GiB),
        view("susp", Tier.SUSPENDED, idle=55.0, host=6 * GiB),
        view("frozen", Tier.FROZEN, idle=90.0, snapshot=6 * GiB),  # holds no host memory: not a victim
    ]
    usage = policy.Usage(host_bytes=12 * GiB)
    assert plan(instances, usage, host_memory_budget_bytes=7 * GiB) == [("susp", Tier.FROZEN, "HostMemoryBudget")]
    assert plan(instances, usage, host_memory_budget_bytes=3 * GiB) == [
        ("susp", Tier.FROZEN, "HostMemoryBudget"),
        ("warm", Tier.FROZEN, "HostMemoryBudget"),
    ]


def test_snapshot_disk_budget_discards_frozen_images_only() -> None:
    instances = [
        view("hot-with-snapshot", idle=500.0, snapshot=10 * GiB, floor=Tier.HOT),
        view("frozen-old", Tier.FROZEN, idle=400.0, snapshot=3 * GiB),
        view("frozen-new", Tier.FROZEN, idle=100.0, snapshot=3 * GiB),
        view("frozen-newest", Tier.FROZEN, idle=50.0, snapshot=3 * GiB),
    ]
    usage = policy.Usage(snapshot_bytes=19 * GiB)
    assert plan(instances, usage, snapshot_disk_budget_bytes=14 * GiB) == [
        ("frozen-old", Tier.COLD, "SnapshotDiskBudget"),
        ("frozen-new", Tier.COLD, "SnapshotDiskBudget"),
    ]


def test_budget_eviction_honours_floors() -> None:
    instances = [
        view("pinned", idle=100.0, gpu_bytes=8 * GiB, floor=Tier.HOT),
        view("free", idle=5.0, gpu_bytes=8 * GiB),
    ]
    assert plan(instances, policy.Usage(gpu_bytes=16 * GiB), gpu_memory_budget_bytes=10 * GiB, hot_idle_sec=300) == [
        ("free", Tier.WARM, "GpuMemoryBudget"),
    ]


def test_budget_that_cannot_be_met_plans_what_it_can() -> None:
    instances = [view("a", idle=5.0, gpu_bytes=8 * GiB), view("b", idle=3.0, gpu_bytes=8 * GiB, floor=Tier.HOT)]
    assert plan(instances, policy.Usage(gpu_bytes=16 * GiB), gpu_memory_budget_bytes=GiB) == [
        ("a", Tier.WARM, "GpuMemoryBudget"),
    ]


def test_idle_moves_count_towards_the_budget_and_are_not_moved_twice() -> None:
    instances = [
        view("idle", Tier.SUSPENDED, idle=1000.0, host=6 * GiB),  # goes FROZEN for idleness
        view("recent", idle=1.0, host=6 * GiB),
    ]
    usage = policy.Usage(host_bytes=12 * GiB)
    assert plan(instances, usage, host_memory_budget_bytes=8 * GiB) == [("idle", Tier.FROZEN, "Idle")]
    assert plan(instances, usage, host_memory_budget_bytes=4 * GiB) == [
        ("idle", Tier.FROZEN, "Idle"),
        ("recent", Tier.FROZEN, "HostMemoryBudget"),
    ]


def test_freeing_gpu_memory_can_push_host_memory_over_budget() -> None:
    # Warming "big" moves its weights into pinned host memory; the host budget then freezes "other".
    instances = [
        view("big", idle=30.0, host=GiB, gpu_bytes=8 * GiB),
        view("other", Tier.SUSPENDED, idle=20.0, host=4 * GiB),
    ]
    usage = policy.Usage(host_bytes=5 * GiB, gpu_bytes=8 * GiB)
    moves = plan(instances, usage, gpu_memory_budget_bytes=4 * GiB, host_memory_budget_bytes=10 * GiB)
    assert moves == [("big", Tier.WARM, "GpuMemoryBudget"), ("other", Tier.FROZEN, "HostMemoryBudget")]


def test_plan_does_not_depend_on_input_order() -> None:
    instances = [view(f"i{n}", idle=float(n * 37 % 11), gpu_bytes=GiB, host=GiB) for n in range(8)]
    usage = policy.Usage(host_bytes=8 * GiB, gpu_bytes=8 * GiB)
    forward = plan(instances, usage, gpu_memory_budget_bytes=5 * GiB, host_memory_budget_bytes=9 * GiB)
    backward = plan(instances[::-1], usage, gpu_memory_budget_bytes=5 * GiB, host_memory_budget_bytes=9 * GiB)
    assert forward == backward
    assert len(forward) == len({name for name, _, _ in forward}) >= 3


@pytest.mark.parametrize(("target", "expected"), [
    (Tier.WARM, policy.Usage(host_bytes=14, gpu_bytes=96, snapshot_bytes=50)),
    (Tier.SUSPENDED, policy.Usage(host_bytes=14, gpu_bytes=96, snapshot_bytes=50)),
    (Tier.FROZEN, policy.Usage(host_bytes=8, gpu_bytes=96, snapshot_bytes=54)),
    (Tier.COLD, policy.Usage(host_bytes=8, gpu_bytes=96, snapshot_bytes=48)),
    (Tier.HOT, policy.Usage(host_bytes=10, gpu_bytes=100, snapshot_bytes=50)),
])
def test_usage_after(target: Tier, expected: policy.Usage) -> None:
    usage = policy.Usage(host_bytes=10, gpu_bytes=100, snapshot_bytes=50)
    assert policy.usage_after(usage, view("a", host=2, gpu_bytes=4, snapshot=2), target) == expected


# --- eviction order ------------------------------------------------------------------------------------------------

def test_lru_and_hybrid_differ_when_a_younger_instance_has_a_much_larger_snapshot() -> None:
    small_old = view("small-old", idle=900.0, snapshot=GiB)
    large_young = view("large-young", idle=600.0, snapshot=7 * GiB)
    # mean snapshot 4 GiB: small-old 900 * 1.25 = 1125, large-young 600 * 2.75 = 1650
    assert [v.name for v in policy.eviction_order([small_old, large_young], "lru", NOW)] == ["small-old",
                                                                                             "large-young"]
    assert [v.name for v in policy.eviction_order([small_old, large_young], "hybrid", NOW)] == ["large-young",
                                                                                                "small-old"]


def test_hybrid_policy_changes_the_plan() -> None:
    instances = [
        view("small-old", Tier.FROZEN, idle=900.0, snapshot=GiB),
        view("large-young", Tier.FROZEN, idle=600.0, snapshot=7 * GiB),
    ]
    usage = policy.Usage(snapshot_bytes=8 * GiB)
    assert plan(instances, usage, snapshot_disk_budget_bytes=6 * GiB) == [
        ("small-old", Tier.COLD, "SnapshotDiskBudget"),
        ("large-young", Tier.COLD, "SnapshotDiskBudget"),
    ]
    assert plan(instances, usage, snapshot_disk_budget_bytes=6 * GiB, scheduler_eviction_policy="hybrid") == [
        ("large-young", Tier.COLD, "SnapshotDiskBudget"),
    ]


def test_eviction_order_ties_break_by_name() -> None:
    instances = [view("b", idle=10.0), view("c", idle=10.0), view("a", idle=10.0)]
    assert [v.name for v in policy.eviction_order(instances, "lru", NOW)] == ["a", "b", "c"]
    assert [v.name for v in policy.eviction_order(instances, "hybrid", NOW)] == ["a", "b", "c"]


def test_hybrid_without_snapshot_sizes_is_lru() -> None:
    instances = [view("x", idle=5.0), view("y", idle=50.0), view("z", idle=20.0)]
    assert [v.name for v in policy.eviction_order(instances, "hybrid", NOW)] == ["y", "z", "x"]
    assert policy.eviction_order([], "hybrid", NOW) == []


def test_eviction_order_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match=r"scheduler_eviction_policy.*'fifo'"):
        policy.eviction_order([view("a")], "fifo", NOW)


# --- settings ------------------------------------------------------------------------------------------------------

def test_settings_defaults_follow_the_design() -> None:
    settings = Settings()
    assert (settings.snapshot_interval_sec, settings.warmup_cache_ratio, settings.gateway_cache_ttl_sec) == (30, 0, 60)
    assert settings.scheduler_eviction_policy == "lru"
    assert (settings.breaker.max_failures, settings.breaker.backoff_duration_sec) == (5, 600)
    assert settings.api_writes_per_sec == 200
    assert (settings.idle.hot_sec, settings.idle.warm_sec, settings.idle.suspended_sec) == (60, 300, 900)
    assert settings.reset_rng_on_restore is True and settings.numa_affinity is False


def test_settings_from_mapping_accepts_snake_and_camel_case() -> None:
    settings = Settings.from_mapping({
        "schedulerEvictionPolicy": "hybrid", "max_failures": 3, "backoffDurationSec": 60,
        "gpuMemoryBudgetBytes": 1024, "numa_affinity": True, "warmupCacheRatio": 0.5,
    })
    assert settings == Settings(scheduler_eviction_policy="hybrid", max_failures=3, backoff_duration_sec=60.0,
                                gpu_memory_budget_bytes=1024, numa_affinity=True, warmup_cache_ratio=0.5)
    assert isinstance(settings.breaker.backoff_duration_sec, float)


@pytest.mark.parametrize(("data", "message"), [
    ({"scheduler_eviction_policy": "fifo"}, r"settings\.scheduler_eviction_policy: must be one of lru, hybrid"),
    ({"snapshotIntervalSeconds": 5}, r"settings\.snapshotIntervalSeconds: unknown setting \(did you mean "
                                     r"'snapshotIntervalSec'\?\)"),
    ({"bogus": 1}, r"settings\.bogus: unknown setting$"),
    ({"max_failures": 0}, r"settings\.max_failures: must be >= 1, got 0"),
    ({"max_failures": True}, r"settings\.max_failures: must be an integer, got True"),
    ({"max_failures": 2.5}, r"settings\.max_failures: must be"),
    ({"hot_idle_sec": "60"}, r"settings\.hot_idle_sec: must be a finite number, got '60'"),
    ({"hot_idle_sec": float("nan")}, r"settings\.hot_idle_sec: must be a finite number"),
    ({"warm_idle_sec": 30}, r"settings\.warm_idle_sec: must be >= hot_idle_sec \(60\), got 30"),
    ({"suspended_idle_sec": 100}, r"settings\.suspended_idle_sec: must be >= warm_idle_sec"),
    ({"warmup_cache_ratio": 1.5}, r"settings\.warmup_cache_ratio: must be <= 1"),
    ({"snapshot_interval_sec": 0}, r"settings\.snapshot_interval_sec: must be > 0"),
    ({"api_writes_per_sec": 0}, r"settings\.api_writes_per_sec: must be > 0"),
    ({"gpu_memory_budget_bytes": -1}, r"settings\.gpu_memory_budget_bytes: must be >= 0"),
    ({"numa_affinity": "yes"}, r"settings\.numa_affinity: must be a boolean"),
    ({"max_failures": 3, "maxFailures": 4}, r"settings\.max_failures: given twice"),
])
def test_settings_errors_name_the_field(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings.from_mapping(data)


def test_settings_are_frozen() -> None:
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        Settings().breaker.max_failures = 1  # type: ignore[misc]


# --- circuit breaker -----------------------------------------------------------------------------------------------

def test_breaker_opens_after_max_consecutive_failures() -> None:
    breaker = policy.CircuitBreaker(max_failures=3, backoff_duration_sec=600)
    for _ in range(2):
        breaker.record_failure("m", 0.0)
    assert not breaker.is_open("m", 0.0)
    assert breaker.state("m", 0.0) is policy.BreakerState.CLOSED
    breaker.record_failure("m", 1.0)
    assert breaker.is_open("m", 1.0)
    assert breaker.is_open("m", 600.9)
    assert breaker.state("m", 2.0) is policy.BreakerState.OPEN
    assert breaker.open_keys(2.0) == ["m"]
    assert not breaker.is_open("other", 2.0)


def test_success_resets_the_failure_count() -> None:
    breaker = policy.CircuitBreaker(max_failures=2, backoff_duration_sec=10)
    breaker.record_failure("m", 0.0)
    breaker.record_success("m")
    breaker.record_failure("m", 1.0)
    assert not breaker.is_open("m", 1.0)


def test_half_open_lets_one_attempt_through_and_success_closes() -> None:
    breaker = policy.CircuitBreaker(max_failures=1, backoff_duration_sec=100)
    breaker.record_failure("m", 0.0)
    assert breaker.is_open("m", 99.0)
    assert breaker.state("m", 100.0) is policy.BreakerState.HALF_OPEN
    assert breaker.state("m", 100.0) is policy.BreakerState.HALF_OPEN  # state() does not claim the attempt
    assert not breaker.is_open("m", 100.0)  # the one trial
    assert breaker.is_open("m", 101.0)  # everyone else waits for its result
    assert breaker.open_keys(101.0) == ["m"]
    breaker.record_success("m")
    assert not breaker.is_open("m", 102.0)
    assert breaker.state("m", 102.0) is policy.BreakerState.CLOSED
    assert breaker.open_keys(102.0) == []


def test_half_open_failure_reopens_for_another_backoff() -> None:
    breaker = policy.CircuitBreaker(max_failures=2, backoff_duration_sec=100)
    breaker.record_failure("m", 0.0)
    breaker.record_failure("m", 0.0)
    assert not breaker.is_open("m", 150.0)
    breaker.record_failure("m", 160.0)
    assert breaker.is_open("m", 161.0)
    assert breaker.is_open("m", 259.0)
    assert not breaker.is_open("m", 260.0)


def test_lost_trial_is_given_up_after_one_backoff() -> None:
    breaker = policy.CircuitBreaker(max_failures=1, backoff_duration_sec=100)
    breaker.record_failure("m", 0.0)
    assert not breaker.is_open("m", 100.0)
    assert breaker.is_open("m", 199.0)
    assert not breaker.is_open("m", 200.0)


def test_breaker_keys_are_independent_and_sorted() -> None:
    breaker = policy.CircuitBreaker.from_settings(Settings(max_failures=1, backoff_duration_sec=10))
    breaker.record_failure("zeta", 0.0)
    breaker.record_failure("alpha", 5.0)
    assert breaker.open_keys(6.0) == ["alpha", "zeta"]
    assert breaker.open_keys(20.0) == ["alpha", "zeta"]  # half-open still counts until a success closes it
    breaker.record_success("zeta")
    assert breaker.open_keys(20.0) == ["alpha"]


def test_breaker_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="max_failures"):
        policy.CircuitBreaker(max_failures=0)
    with pytest.raises(ValueError, match="backoff_duration_sec"):
        policy.CircuitBreaker(backoff_duration_sec=-1)


def test_breaker_gives_the_half_open_attempt_to_exactly_one_thread() -> None:
    breaker = policy.CircuitBreaker(max_failures=1, backoff_duration_sec=10)
    breaker.record_failure("m", 0.0)
    allowed: list[bool] = []
    barrier = threading.Barrier(16)

    def attempt() -> None:
        barrier.wait()
        allowed.append(not breaker.is_open("m", 10.0))

    threads = [threading.Thread(target=attempt) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert allowed.count(True) == 1


def test_lazy_restores_are_the_default() -> None:
    assert Settings().lazy_restores and Settings(lazy_restore=True).lazy_restores
    assert not Settings.from_mapping({"lazyRestore": False}).lazy_restores
