from __future__ import annotations

import dataclasses
import random

import pytest

from volga_core import api, nodes, planner

Tier = api.Tier


def spec(gpu: bool = False, product: str | None = None, min_gib: float = 0, numa: bool = False,
         **pool: int) -> api.ModelSpecSpec:
    return api.ModelSpecSpec.model_validate({
        "modelId": "m", "framework": "onnx", "source": "/m.onnx",
        "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, 1]}],
        "hardware": {"gpu": gpu, "gpuProduct": product, "minMemoryGiB": min_gib, "numaAffinity": numa},
        "pool": {"hot": 0, "warm": 0, "suspended": 0, "frozen": 0, **pool}})


H200 = nodes.NodeProfile("gpu-a", 8, "NVIDIA H200", 141 * 2**30, (0, 1))
A10 = nodes.NodeProfile("gpu-b", 1, "NVIDIA A10", 24 * 2**30, (0,))
CPU = nodes.NodeProfile("cpu-a")


def test_floors_become_one_emi_per_slot() -> None:
    result = planner.plan({"ms": spec(gpu=True, hot=1, warm=1, frozen=2)}, [H200])
    assert [(d.name, d.target_tier) for d in result.desired] == [
        ("ms-0", Tier.HOT), ("ms-1", Tier.WARM), ("ms-2", Tier.FROZEN), ("ms-3", Tier.FROZEN)]
    assert [d.gpu_index for d in result.desired] == [0, 1, 2, 3]


def test_all_zero_floors_still_get_a_cold_instance() -> None:
    result = planner.plan({"ms": spec()}, [CPU])
    assert [(d.name, d.target_tier) for d in result.desired] == [("ms-0", Tier.COLD)]


def test_cpu_nodes_have_no_warm_or_suspended() -> None:
    result = planner.plan({"ms": spec(warm=1, suspended=1)}, [CPU])
    assert {d.target_tier for d in result.desired} == {Tier.FROZEN}


@pytest.mark.parametrize("kwargs, reason", [
    ({"gpu": True}, "no GPU"),
    ({"gpu": True, "product": "H100"}, "not H100"),
    ({"gpu": True, "min_gib": 200}, "< 200 GiB"),
])
def test_hardware_filter(kwargs: dict, reason: str) -> None:
    result = planner.plan({"ms": spec(**kwargs, frozen=1)}, [CPU] + ([H200] if "product" in kwargs or
                                                                        "min_gib" in kwargs else []))
    assert result.desired == ()
    assert reason in result.unplaced["ms"]


def test_other_specs_count_into_load() -> None:
    profiles = [nodes.NodeProfile("n0"), nodes.NodeProfile("n1")]
    busy = [planner.Observed(f"other-{i}", "other", "n0") for i in range(3)]
    assert planner.plan({"ms": spec(frozen=1)}, profiles, busy).desired[0].node == "n1"


def test_a_thousand_specs_on_two_hundred_nodes_spread_evenly() -> None:
    profiles = [nodes.NodeProfile(f"n{i:03d}", 8, "NVIDIA H200", 141 * 2**30, (0, 1)) for i in range(200)]
    specs = {f"ms{i:04d}": spec(gpu=True, frozen=1, warm=1) for i in range(1000)}
    result = planner.plan(specs, profiles)
    assert len(result.desired) == 2000
    counts: dict[str, int] = {}
    for d in result.desired:
        counts[d.node] = counts.get(d.node, 0) + 1
    assert max(counts.values()) - min(counts.values()) <= 1


def test_profile_match_wins_over_load() -> None:
    busy_h200 = [planner.Observed(f"other-{i}", "other", "gpu-a") for i in range(5)]
    result = planner.plan({"ms": spec(gpu=True, product="NVIDIA H200", frozen=1)}, [A10, H200], busy_h200)
    assert result.desired[0].node == "gpu-a"


def test_instances_spread_over_equal_nodes() -> None:
    profiles = [nodes.NodeProfile(f"n{i}") for i in range(3)]
    result = planner.plan({"ms": spec(frozen=3)}, profiles)
    assert sorted(d.node for d in result.desired) == ["n0", "n1", "n2"]


def test_existing_placements_are_kept_and_lost_nodes_replaced() -> None:
    profiles = [nodes.NodeProfile(f"n{i}") for i in range(3)]
    observed = [planner.Observed("ms-0", "ms", "n2"), planner.Observed("ms-1", "ms", "gone")]
    result = planner.plan({"ms": spec(frozen=2)}, profiles, observed)
    placed = {d.name: d.node for d in result.desired}
    assert placed["ms-0"] == "n2"
    assert placed["ms-1"] in {"n0", "n1"}


def test_recency_and_snapshot_size_break_ties() -> None:
    profiles = [nodes.NodeProfile("n0"), nodes.NodeProfile("n1")]
    observed = [planner.Observed("x-9", "ms", "n1", last_used_age_s=5, snapshot_bytes=100)]
    result = planner.plan({"ms": spec(frozen=1)}, profiles, observed)
    assert result.desired[0].node == "n1"
    score_n1 = planner.score(spec(), profiles[1], 0, 1, observed, 100)
    score_n0 = planner.score(spec(), profiles[0], 0, 1, [], 100)
    assert score_n1 - score_n0 == pytest.approx(30 * (1 - 5 / 600) + 10)


def test_deterministic() -> None:
    specs = {f"ms{i}": spec(frozen=2) for i in range(5)}
    profiles = [nodes.NodeProfile(f"n{i}") for i in range(4)]
    assert planner.plan(specs, profiles) == planner.plan(dict(reversed(specs.items())), list(reversed(profiles)))


def test_annotations_round_trip() -> None:
    back = nodes.NodeProfile.from_annotations("gpu-a", H200.annotations())
    assert back == H200
    assert nodes.NodeProfile.from_annotations("x", {"volga.dev/gpu-count": "lots"}).gpu_count == 0


def test_not_ready_nodes_are_skipped() -> None:
    down = nodes.NodeProfile("n0", ready=False)
    result = planner.plan({"ms": spec(frozen=1)}, [down])
    assert "not ready" in result.unplaced["ms"]


def random_cluster(rng: random.Random) -> tuple[dict[str, api.ModelSpecSpec], list[nodes.NodeProfile],
                                                list[planner.Observed], dict[str, list[planner.SharedImage]],
                                                frozenset[str]]:
    """Nodes of a few kinds (so the index's groups hold many profiles each), specs asking for them, and EMIs already
    placed, some of the planned specs' own (recency, snapshot sizes) and many of others (load)."""
    kinds = [nodes.NodeProfile("", 8, "NVIDIA H200", 141 * 2**30, (0, 1), gpu_driver="570"),
             nodes.NodeProfile("", 8, "NVIDIA H200", 141 * 2**30, (0, 1), gpu_driver="580"),
             nodes.NodeProfile("", 1, "NVIDIA A10", 24 * 2**30, ()),
             nodes.NodeProfile("", 4, "NVIDIA L4", 24 * 2**30, (0,), ready=False),
             nodes.NodeProfile("")]
    profiles = [dataclasses.replace(rng.choice(kinds), name=f"n{i:03d}") for i in range(rng.randint(0, 60))]
    specs = {}
    for i in range(rng.randint(1, 25)):
        gpu = rng.random() < 0.7
        specs[f"ms{i:02d}"] = spec(gpu=gpu, product=rng.choice([None, "NVIDIA H200", "A10", "H100"]) if gpu else None,
                                   min_gib=rng.choice([0, 0, 20, 100]) if gpu else 0, numa=rng.random() < 0.2,
                                   hot=rng.randint(0, 2), warm=rng.randint(0, 2), frozen=rng.randint(0, 3))
    names = [n.name for n in profiles] + ["gone"]
    observed = [planner.Observed(f"other-{i}", f"other{i % 7}", rng.choice(names)) for i in range(rng.randint(0, 300))]
    for name in rng.sample(sorted(specs), k=len(specs) // 2):
        for k in range(rng.randint(0, 3)):
            observed.append(planner.Observed(f"{name}-{k}", name, rng.choice(names),
                                             last_used_age_s=rng.choice([None, 5.0, 300.0, 5000.0]),
                                             snapshot_bytes=rng.choice([0, 100, 400])))
    shared = {name: [planner.SharedImage("NVIDIA H200", rng.choice(["", "570"]))]
              for name in rng.sample(sorted(specs), k=len(specs) // 3)}
    avoid = frozenset(rng.sample(names, k=min(len(names), rng.randint(0, 5))))
    return specs, profiles, observed, shared, avoid


def test_the_node_index_places_as_scoring_every_node_does() -> None:
    rng = random.Random(20)
    for _ in range(300):
        specs, profiles, observed, shared, avoid = random_cluster(rng)
        fast = planner.plan(specs, profiles, observed, shared, avoid)
        assert fast == planner.plan(specs, profiles, observed, shared, avoid, exhaustive=True)


def test_base_load_counts_as_observed_emis_of_other_specs() -> None:
    profiles = [nodes.NodeProfile(f"n{i}") for i in range(4)]
    busy = [planner.Observed(f"other-{i}", "other", f"n{i % 2}") for i in range(5)]
    specs = {f"ms{i}": spec(frozen=2) for i in range(3)}
    assert planner.plan(specs, profiles, busy) == planner.plan(specs, profiles, base_load={"n0": 3, "n1": 2})


def test_the_placement_bench_times_both_ways_to_the_same_placements() -> None:
    from volga_bench import scale

    report = scale.placement(nodes=50, modelspecs=300, batch=20, rounds=1)
    assert report["same_placements"] is True
    assert report["index_ms_per_placement"] > 0 and report["exhaustive_ms_per_placement"] > 0
    assert report["instances_placed_before"] == 280 * 2
