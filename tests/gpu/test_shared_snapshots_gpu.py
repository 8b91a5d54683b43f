"""Shared snapshots on a real NVIDIA GPU: run on the GPU machine with `make test-gpu`.

One worker process writes and publishes its image (driver checkpoint + CRIU, weights inside the image); a second
instance, with its own snapshot folder and nothing running, restores it from the shared folder into a fresh
process instead of cold-starting, and answers bit for bit like the writer. With parked weights (the default for a
GPU worker frozen from HOT: the weights wait in a file the image maps by path), the image is published with the
file, and a restore on a node that never had it gets it back at that path from the store.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import numpy as np
import pytest

from volga_agent.host import gpus
from volga_agent.node import instance
from volga_agent.snapshot import criu, cuda, shared
from volga_agent.worker import contract
from volga_bench import tiers
from volga_core import api

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


def test_a_gpu_image_with_parked_weights_is_published_with_them_and_restored_elsewhere(
        tmp_path: pathlib.Path, rundir: pathlib.Path) -> None:
    """The writer parks its weights (the default), publishes, and goes with its images and parked file; a new
    instance at the same paths (another node's agent sees the same snapshot root path) restores the image, its
    parked weights brought back from the store, verified by their checksums and the canary answer."""
    spec = tiers.build_torch_mlp(tmp_path / "m" / "model.pt", 0.25)
    gpu = next(g for g in gpus.discover() if g.index == 0)
    store = shared.Store(tmp_path / "shared")
    root = pathlib.Path(tempfile.mkdtemp(prefix="vsgp-", dir="/dev/shm"))
    engine = criu.CriuEngine(root, checksums=True)
    facts = shared.NodeFacts(engine.version(), gpu.product, gpu.driver)
    writer = instance.Instance("mlp", spec, rundir, engine, cuda.DriverCheckpoint(), "cuda:0",
                               shared_store=shared.Context(store, "node-a", facts))
    reader = None
    try:
        writer.to(Tier.HOT)
        x = contract.sample_inputs(writer.config.inputs, batch=8, seed=3)
        reference = writer.infer(x)["y"]
        weights = int(writer.client().call("stats").header["weights_bytes"])
        writer.to(Tier.FROZEN)
        parked = writer.parking.current
        # Parked outside the image: the weights, and after them the driver's copy of the device memory.
        parked_bytes = writer.parked_bytes
        assert "error" not in writer.driver_copy, writer.driver_copy
        assert parked is not None and parked_bytes >= weights + int(writer.driver_copy["bytes"])  # type: ignore[call-overload]
        assert writer.shared_publishes == 1
        [entry] = store.entries()
        assert entry.manifest.parked is not None and entry.manifest.parked.path == str(parked.resolve())
        assert entry.manifest.parked.size_bytes == parked_bytes
        assert entry.size_bytes == entry.manifest.size_bytes + parked_bytes
        assert entry.manifest.key["parked_dir"] == str(writer.parked_dir)
        writer.close()  # its images and its parked file go: the reader's node never had them
        engine.close()
        shutil.rmtree(root)
        assert not parked.exists()

        engine = criu.CriuEngine(root, checksums=True)
        reader = instance.Instance("mlp", spec, rundir, engine, cuda.DriverCheckpoint(), "cuda:0",
                                   shared_store=shared.Context(store, "node-b", facts))
        woke = reader.to(Tier.HOT)
        assert woke.detail == f"restored from shared image {entry.digest} of node node-a" and not woke.fallback
        assert reader.shared_restores == 1 and reader.shared_restore_failures == 0
        assert reader.verifies_restores  # checked against the canary answer the writer recorded
        assert parked.exists() and reader.parking.current == parked  # brought back where the image maps it
        stats = reader.client().call("stats").header
        assert not stats["parked"] and not stats["offloaded"]  # the weights are back on the GPU
        assert np.array_equal(reader.infer(x)["y"], reference)
        # Frozen again, the reader parks into a file of its own; the one from the store is dropped.
        reader.to(Tier.FROZEN)
        assert reader.parking.current is not None and reader.parking.current != parked and not parked.exists()
        assert reader.shared_publishes == 0  # the key has its image already
        assert not reader.to(Tier.HOT).fallback
        assert np.array_equal(reader.infer(x)["y"], reference)
    finally:
        if reader is not None:
            reader.close()
        writer.close()
        engine.close()
        shutil.rmtree(root, ignore_errors=True)
