"""`volga bench endtoend`: each CPU tier's first answer through `volga up`'s gateway, answers compared across tiers;
a wake storm answered from each model's own image. The GPU tiers: tests/gpu/test_endtoend_gpu.py."""

from __future__ import annotations

import asyncio
import pathlib

from volga_bench import endtoend
from volga_core import api

Tier = api.Tier


def test_the_default_model_answers_the_same_from_every_cpu_tier() -> None:
    report = asyncio.run(endtoend.run([endtoend.default_case()], [Tier.FROZEN, Tier.COLD], n=2))
    row = report["models"]["ctr-default"]
    assert row["mismatches"] == 0 and row["restore_failures"] == 0
    assert row["frozen"]["first_answer"]["n"] == 2 and row["cold"]["first_answer"]["n"] == 1
    assert row["frozen"]["agent_wake"]["p50_ms"] > 0


def test_a_wake_storm_answers_every_model_from_its_own_image() -> None:
    cases = endtoend.storm_cases(pathlib.Path("unused"), 2, gpu=False)
    report = asyncio.run(endtoend.storm(cases, [Tier.FROZEN], rounds=1))
    frozen = report["tiers"]["frozen"]
    assert report["models"] == 2 and report["restore_failures"] == 0 and frozen["mismatches"] == 0
    assert frozen["each"]["n"] == 2
    assert frozen["first_answered"]["p50_ms"] <= frozen["all_answered"]["p50_ms"]
