"""Shared snapshots on a real NVIDIA GPU: run on the GPU machine with `make test-gpu`.

One worker process writes and publishes its image (driver checkpoint + CRIU, weights inside the image); a second
instance, with its own snapshot folder and nothing running, restores it from the shared folder into a fresh
process instead of cold-starting, and answers bit for bit like the writer.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import numpy as np
import pytest

from volga_agent import gpus, instance
from volga_agent.snapshot import criu, cuda, shared
from volga_agent.worker import contract
from volga_bench import tiers
from volga_operator import api

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

Tier = api.Tier


def test_a_gpu_image_published_by_one_worker_is_restored_into_a_fresh_process(
        tmp_path: pathlib.Path, rundir: pathlib.Path) -> None:
    spec = tiers.build_torch_mlp(tmp_path / "m" / "model.pt", 0.25)
    gpu = next(g for g in gpus.discover() if g.index == 0)
    store = shared.Store(tmp_path / "shared")
    engines = [criu.CriuEngine(tempfile.mkdtemp(prefix=f"vsg{i}-", dir="/dev/shm"), checksums=True) for i in (0, 1)]
    facts = shared.NodeFacts(engines[0].version(), gpu.product, gpu.driver)
    writer = instance.Instance("mlp", spec, rundir, engines[0], cuda.DriverCheckpoint(), "cuda:0",
                               park_weights=False, shared_store=shared.Context(store, "node-a", facts))
    reader = None
    try:
        writer.to(Tier.HOT)
        x = contract.sample_inputs(writer.config.inputs, batch=8, seed=2)
        reference = writer.infer(x)["y"]
        writer.to(Tier.FROZEN)
        assert writer.shared_publishes == 1 and store.entries()[0].manifest.key["gpu_product"] == gpu.product
        reader = instance.Instance("mlp", spec, rundir, engines[1], cuda.DriverCheckpoint(), "cuda:0",
                                   park_weights=False, shared_store=shared.Context(store, "node-b", facts))
        woke = reader.to(Tier.HOT)
        assert woke.detail.startswith("restored from shared image") and reader.shared_restores == 1
        assert reader.verifies_restores  # checked against the canary answer the writer recorded
        assert np.array_equal(reader.infer(x)["y"], reference)
    finally:
        if reader is not None:
            reader.close()
        writer.close()
        for engine in engines:
            engine.close()
            shutil.rmtree(engine.root, ignore_errors=True)
