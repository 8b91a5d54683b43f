"""`volga bench endtoend`: each tier's first answer through `volga up`'s gateway, answers compared across tiers."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from volga_bench import endtoend
from volga_core import api

Tier = api.Tier


def test_the_default_model_answers_the_same_from_every_cpu_tier() -> None:
    report = asyncio.run(endtoend.run([endtoend.default_case()], [Tier.FROZEN, Tier.COLD], n=2))
    row = report["models"]["ctr-default"]
    assert row["mismatches"] == 0 and row["restore_failures"] == 0
    assert row["frozen"]["first_answer"]["n"] == 2 and row["cold"]["first_answer"]["n"] == 1
    assert row["frozen"]["agent_wake"]["p50_ms"] > 0


@pytest.mark.gpu
def test_real_architectures_answer_the_same_from_every_gpu_tier(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("torchvision")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cases = endtoend.architectures(tmp_path, ["resnet50"], ["fp32", "fp16"])
    report = asyncio.run(endtoend.run(cases, endtoend.GPU_TIERS, n=1))
    for model, row in report["models"].items():
        assert row["mismatches"] == 0 and row["restore_failures"] == 0, model
        assert all(row[tier.value.lower()]["first_answer"]["n"] == 1 for tier in endtoend.GPU_TIERS), model


def test_a_wake_storm_answers_every_model_from_its_own_image() -> None:
    cases = endtoend.storm_cases(pathlib.Path("unused"), 2, gpu=False)
    report = asyncio.run(endtoend.storm(cases, [Tier.FROZEN], rounds=1))
    frozen = report["tiers"]["frozen"]
    assert report["models"] == 2 and report["restore_failures"] == 0 and frozen["mismatches"] == 0
    assert frozen["each"]["n"] == 2
    assert frozen["first_answered"]["p50_ms"] <= frozen["all_answered"]["p50_ms"]
