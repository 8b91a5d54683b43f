"""ONNX models whose weights live beside them (external data): workers map the weights rather than copy them, so
FROZEN images leave them out; what the weights' file may be, and a file changed under an image, are checked."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

from volga_agent.app import defaultmodel
from volga_agent.host import process
from volga_agent.node import instance
from volga_agent.snapshot import criu
from volga_agent.worker import contract
from volga_core import api

Tier = api.Tier


@pytest.fixture
def models() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="vx-", dir="/tmp") as path:
        root = pathlib.Path(path)
        root.chmod(0o755)  # workers that drop to nobody reach the models
        defaultmodel.build_onnx(root / "embedded" / "model.onnx")
        defaultmodel.build_onnx(root / "external" / "model.onnx", external_data=True)
        yield root


def spec_for(model: pathlib.Path) -> api.ModelSpecSpec:
    return api.ModelSpec.model_validate(defaultmodel.spec_document(model)).spec


def test_external_weights_stay_out_of_frozen_images(models: pathlib.Path, rundir: pathlib.Path,
                                                    criu_engine: criu.CriuEngine) -> None:
    x = contract.sample_inputs(instance.decls(spec_for(models / "embedded" / "model.onnx").inputs), batch=16, seed=3)
    sizes, answers = {}, {}
    for layout in ("embedded", "external"):
        inst = instance.Instance(f"x-{layout}", spec_for(models / layout / "model.onnx"), rundir / layout,
                                 criu_engine, model_roots=[str(models)])
        try:
            inst.to(Tier.HOT)
            answers[layout] = inst.infer(x)["probability"]
            for _ in range(2):
                inst.to(Tier.FROZEN)
                assert inst.image is not None
                sizes[layout] = inst.image.size_bytes
                woke = inst.wake()
                assert not woke.fallback, woke.detail
                assert np.array_equal(inst.infer(x)["probability"], answers[layout])
        finally:
            inst.close()
    assert np.array_equal(answers["embedded"], answers["external"])
    weights = (models / "external" / "model.onnx.data").stat().st_size
    assert sizes["embedded"] - sizes["external"] > 0.8 * weights, (sizes, weights)


def test_weights_changed_under_a_frozen_image_cost_a_cold_start_not_a_mixed_model(
        models: pathlib.Path, rundir: pathlib.Path, criu_engine: criu.CriuEngine) -> None:
    folder = models / "external"
    inst = instance.Instance("x-changed", spec_for(folder / "model.onnx"), rundir / "changed", criu_engine)
    try:
        inst.to(Tier.HOT)
        x = contract.sample_inputs(inst.config.inputs, batch=16, seed=4)
        inst.to(Tier.FROZEN)
        # New weights of the same size, written into a new file put in place (as a deployment would).
        data = folder / "model.onnx.data"
        weights = np.fromfile(data, dtype=np.float32)
        fresh = folder / "model.onnx.data.new"
        (weights * 0.5).tofile(fresh)
        fresh.replace(data)
        woke = inst.wake()
        assert woke.fallback and "changed since the snapshot" in woke.detail, woke.detail
        assert inst.restore_failures == 1
        again = instance.Instance("x-fresh", spec_for(folder / "model.onnx"), rundir / "fresh", None)
        try:
            again.to(Tier.HOT)
            assert np.array_equal(inst.infer(x)["probability"], again.infer(x)["probability"])
        finally:
            again.close()
    finally:
        inst.close()


def test_external_data_leading_out_of_the_model_roots_is_refused(models: pathlib.Path, rundir: pathlib.Path) -> None:
    root = models / "roots"
    shutil.copytree(models / "external", root / "m")
    outside = models / "elsewhere.data"
    (root / "m" / "model.onnx.data").rename(outside)
    os.symlink(outside, root / "m" / "model.onnx.data")
    inst = instance.Instance("x-outside", spec_for(root / "m" / "model.onnx"), rundir / "outside", None,
                             model_roots=[str(root)])
    try:
        # Recent onnxruntime releases refuse it themselves; the worker's own check (serve.mapped_outside) before that.
        with pytest.raises(process.WorkerStartError, match=r"outside the model roots|escapes model directory"):
            inst.to(Tier.HOT)
    finally:
        inst.close()
    # The same files inside the roots load.
    os.unlink(root / "m" / "model.onnx.data")
    shutil.copy(outside, root / "m" / "model.onnx.data")
    inst = instance.Instance("x-inside", spec_for(root / "m" / "model.onnx"), rundir / "inside", None,
                             model_roots=[str(root)])
    try:
        inst.to(Tier.HOT)
    finally:
        inst.close()


def test_a_file_mapped_from_outside_the_roots_is_named(models: pathlib.Path) -> None:
    """The worker's own check after loading (for onnxruntime releases that follow external data anywhere)."""
    import mmap

    from volga_agent.worker import serve

    before = contract.mapped_files()
    inside, outside = models / "external" / "model.onnx.data", models / "elsewhere.bin"
    outside.write_bytes(b"x" * 4096)
    with open(inside, "rb") as a, open(outside, "rb") as b, \
            mmap.mmap(a.fileno(), 4096, prot=mmap.PROT_READ), mmap.mmap(b.fileno(), 4096, prot=mmap.PROT_READ):
        assert serve.mapped_outside((str(models / "external"),), before) == [str(outside)]
        assert serve.mapped_outside((str(models),), before) == []
        assert serve.mapped_outside((), before) == []


def test_weights_the_worker_user_may_not_read_are_named_as_such(models: pathlib.Path, rundir: pathlib.Path) -> None:
    """A worker that dropped to its own user (no snapshots: it may) and cannot read the external data says which
    user it runs as and what it must read, not onnxruntime's bare "SystemError : 13"."""
    (models / "external" / "model.onnx.data").chmod(0o600)  # the agent's (root's) only
    inst = instance.Instance("x-denied", spec_for(models / "external" / "model.onnx"), rundir, None,
                             model_roots=[str(models)])
    try:
        assert inst.config.uid != 0
        with pytest.raises(process.WorkerStartError, match=r"the worker runs as uid .* must be readable by that user"):
            inst.to(Tier.HOT)
    finally:
        inst.close()
