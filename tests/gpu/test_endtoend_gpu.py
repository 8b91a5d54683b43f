"""`volga bench endtoend` on the GPU: real architectures' first answers from every GPU tier through `volga up`'s
gateway, compared across tiers. The CPU tiers: tests/integration/test_endtoend.py."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from volga_bench import endtoend


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
