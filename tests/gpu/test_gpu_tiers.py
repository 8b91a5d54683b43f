"""GPU tiers on a real NVIDIA GPU: run on the GPU machine with `make test-gpu`.

WARM (weights in pinned host memory), SUSPENDED (driver checkpoint), FROZEN (driver checkpoint + CRIU),
in-place weight swap, and outputs compared bit for bit after every wake.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from volga_agent.host import gpus
from volga_agent.node import instance
from volga_agent.snapshot import criu, cuda
from volga_agent.worker import contract, protocol
from volga_bench import tiers
from volga_core import api

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

Tier = api.Tier


@pytest.fixture(scope="module")
def mlp_spec(tmp_path_factory: pytest.TempPathFactory) -> api.ModelSpecSpec:
    return tiers.build_torch_mlp(tmp_path_factory.mktemp("m") / "model.pt", 0.25)


def on_gpu(name: str, spec: api.ModelSpecSpec, folder: pathlib.Path, engine: criu.CriuEngine,
           **options: Any) -> instance.Instance:
    """An instance of `spec` on cuda:0, with the driver's checkpoint API, in `folder`."""
    return instance.Instance(name, spec, folder, engine, cuda.DriverCheckpoint(), "cuda:0", **options)


@pytest.fixture
def gpu_inst(mlp_spec: api.ModelSpecSpec, rundir: pathlib.Path,
             criu_engine: criu.CriuEngine) -> Iterator[instance.Instance]:
    inst = on_gpu("mlp", mlp_spec, rundir, criu_engine)
    inst.to(Tier.HOT)
    yield inst
    inst.close()


def used_mib() -> float:
    value = tiers.gpu_memory_used_mib(0)
    assert value is not None
    return value


def handed_back(inst: instance.Instance, x: dict[str, np.ndarray], tier: str) -> None:
    """A request sent straight to the worker (as a gateway does) while it sleeps comes back unrun."""
    with protocol.WorkerClient(inst.config.socket, timeout=10.0) as direct, \
            pytest.raises(protocol.NotRun, match=tier):
        direct.infer(x)


def test_warm_offloads_weights_and_restores_them(gpu_inst: instance.Instance) -> None:
    x = contract.sample_inputs(gpu_inst.config.inputs, batch=8, seed=2)
    reference = gpu_inst.infer(x)["y"]
    hot = gpu_inst.client().call("stats").header
    assert hot["gpu_allocated_bytes"] >= hot["weights_bytes"] > 0.2 * 2**30
    for _ in range(3):
        gpu_inst.to(Tier.WARM)
        warm = gpu_inst.client().call("stats").header
        assert warm["offloaded"]
        handed_back(gpu_inst, x, "WARM")
        assert warm["gpu_allocated_bytes"] <= hot["gpu_allocated_bytes"] - hot["weights_bytes"]
        gpu_inst.wake()
        assert np.array_equal(gpu_inst.infer(x)["y"], reference)


def test_nvml_sees_a_warm_worker_give_back_its_weights(gpu_inst: instance.Instance) -> None:
    """What one worker holds on the device, as NVML reports it per process (the tiers bench's
    worker_gpu_mib_in_tier): less by at least its weights while WARM, 0 while SUSPENDED."""
    assert gpu_inst.pid is not None
    hot = gpus.process_memory_bytes(0, gpu_inst.pid)
    if hot is None:
        pytest.skip("NVML reports no per-process memory here")
    weights = int(gpu_inst.client().call("stats").header["weights_bytes"])
    assert hot > weights
    gpu_inst.to(Tier.WARM)
    warm = gpus.process_memory_bytes(0, gpu_inst.pid)
    assert warm is not None and warm <= hot - weights, (hot, warm, weights)
    gpu_inst.wake()
    gpu_inst.to(Tier.SUSPENDED)
    assert gpus.process_memory_bytes(0, gpu_inst.pid) == 0
    gpu_inst.wake()


def test_suspended_holds_no_gpu_memory(gpu_inst: instance.Instance) -> None:
    x = contract.sample_inputs(gpu_inst.config.inputs, batch=8, seed=2)
    reference = gpu_inst.infer(x)["y"]
    driver = gpu_inst.driver
    assert driver is not None and gpu_inst.pid is not None
    before = used_mib()
    for _ in range(3):
        gpu_inst.to(Tier.SUSPENDED)
        assert driver.state(gpu_inst.pid) is cuda.ProcessState.CHECKPOINTED
        assert used_mib() < before - 200
        handed_back(gpu_inst, x, "SUSPENDED")  # answered at once, not left waiting on the driver's lock
        gpu_inst.wake()
        assert driver.state(gpu_inst.pid) is cuda.ProcessState.RUNNING
        assert np.array_equal(gpu_inst.infer(x)["y"], reference)


def test_warm_keeps_addresses_so_cuda_graphs_replay(gpu_inst: instance.Instance) -> None:
    graph_batch = contract.sample_inputs(gpu_inst.config.inputs, batch=8, seed=4)  # captured at load
    eager_batch = contract.sample_inputs(gpu_inst.config.inputs, batch=3, seed=4)
    hot = gpu_inst.client().call("stats").header
    assert hot["stable_addresses"] and hot["cuda_graphs"] == [8]
    want_graph, want_eager = gpu_inst.infer(graph_batch)["y"], gpu_inst.infer(eager_batch)["y"]
    # The graph computes what eager PyTorch computes (same leading rows; other kernels, so not bit-equal).
    assert np.allclose(want_graph[:3], want_eager, rtol=1e-3, atol=1e-4)
    for _ in range(3):
        gpu_inst.to(Tier.WARM)
        gpu_inst.wake()
        after = gpu_inst.client().call("stats").header
        assert after["weights_ptr"] == hot["weights_ptr"]
        assert np.array_equal(gpu_inst.infer(graph_batch)["y"], want_graph)
        assert np.array_equal(gpu_inst.infer(eager_batch)["y"], want_eager)


def test_frozen_gpu_worker_thaws_with_identical_outputs(gpu_inst: instance.Instance) -> None:
    x = contract.sample_inputs(gpu_inst.config.inputs, batch=8, seed=2)
    reference = gpu_inst.infer(x)["y"]
    gpu_inst.to(Tier.WARM)  # leaves a pinned host copy of the weights behind
    gpu_inst.wake()
    assert gpu_inst.client().call("stats").header["host_copy_bytes"] > 0
    for _ in range(3):
        gpu_inst.to(Tier.FROZEN)
        assert gpu_inst.pid is None
        woke = gpu_inst.wake()
        assert not woke.fallback, woke.detail
        assert np.array_equal(gpu_inst.infer(x)["y"], reference)
        # The host copy was freed before the dump: the image does not carry the weights twice.
        assert gpu_inst.client().call("stats").header["host_copy_bytes"] == 0
    # Through SUSPENDED on the way up, too.
    gpu_inst.to(Tier.SUSPENDED)
    gpu_inst.to(Tier.FROZEN)
    gpu_inst.to(Tier.SUSPENDED)
    gpu_inst.to(Tier.HOT)
    assert np.array_equal(gpu_inst.infer(x)["y"], reference)


def test_in_place_swap_keeps_the_process(gpu_inst: instance.Instance, tmp_path: pathlib.Path) -> None:
    x = contract.sample_inputs(gpu_inst.config.inputs, batch=4, seed=3)
    before = gpu_inst.infer(x)["y"]
    module = torch.load(gpu_inst.spec.source_path, weights_only=False)
    state = {k: v * 0.5 for k, v in module.state_dict().items()}
    torch.save(state, tmp_path / "v2.pt")
    pid = gpu_inst.pid
    gpu_inst.client().call("swap", path=str(tmp_path / "v2.pt"))
    after = gpu_inst.infer(x)["y"]
    assert gpu_inst.pid == pid and not np.array_equal(before, after)
    bad = {k: v[:1] for k, v in state.items()}
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(Exception, match="do not fit the loaded architecture"):
        gpu_inst.client().call("swap", path=str(tmp_path / "bad.pt"))
    assert np.array_equal(gpu_inst.infer(x)["y"], after)


def test_restores_are_verified_by_the_canary(gpu_inst: instance.Instance) -> None:
    """On the GPU the model's canary answer is reproducible, so every SUSPENDED and FROZEN wake (eager and lazy)
    is checked against it, and none fails."""
    assert gpu_inst.verifies_restores
    x = contract.sample_inputs(gpu_inst.config.inputs, batch=8, seed=6)
    reference = gpu_inst.infer(x)["y"]
    for tier, lazy in ((Tier.SUSPENDED, False), (Tier.FROZEN, False), (Tier.FROZEN, True), (Tier.FROZEN, True)):
        gpu_inst.lazy_restore = lazy
        gpu_inst.to(tier)
        woke = gpu_inst.wake()
        assert not woke.fallback and not woke.detail, (tier, lazy, woke.detail)
        assert np.array_equal(gpu_inst.infer(x)["y"], reference)
    assert gpu_inst.restore_failures == 0 and gpu_inst.lazy_restore_failures == 0


def test_gpu_worker_threads_block_the_wake_signal(gpu_inst: instance.Instance) -> None:
    """A GPU worker has no PID namespace of its own: a thread that did not block the wake signal would die of it."""
    assert gpu_inst.pid is not None and not gpu_inst.pid_namespace
    bit = 1 << (contract.WAKE_SIGNAL - 1)
    for task in pathlib.Path(f"/proc/{gpu_inst.pid}/task").iterdir():
        blocked = next(line for line in (task / "status").read_text().splitlines() if line.startswith("SigBlk:"))
        assert int(blocked.split()[1], 16) & bit, (task.name, blocked)


def hot_with_reference(inst: instance.Instance, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
    """Start the instance HOT: a batch-8 input, its answer there, and the worker's weight bytes."""
    inst.to(Tier.HOT)
    x = contract.sample_inputs(inst.config.inputs, batch=8, seed=seed)
    return x, inst.infer(x)["y"], int(inst.client().call("stats").header["weights_bytes"])


def _maps(pid: int, path: pathlib.Path) -> bool:
    return str(path) in pathlib.Path(f"/proc/{pid}/maps").read_text()


def test_frozen_weights_wait_outside_the_image(mlp_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                               criu_engine: criu.CriuEngine) -> None:
    """Frozen from HOT, a GPU worker parks its weights in a file beside the images: the image is smaller by about
    the weights than the same worker's image without parking, the answers after each wake (eager, lazy, through
    SUSPENDED) are the same, the woken worker no longer maps the file, and the file goes with the instance."""
    sizes = {}
    for park in (False, True):
        inst = on_gpu(f"mlp-park-{int(park)}", mlp_spec, rundir / str(park), criu_engine, park_weights=park)
        try:
            x, reference, weights = hot_with_reference(inst, seed=7)
            inst.to(Tier.FROZEN)
            assert inst.image is not None
            sizes[park] = inst.image.size_bytes
            assert (inst.parked_bytes >= weights) if park else inst.parked_bytes == 0  # with the driver's copy
            for lazy in (False, True):
                inst.lazy_restore = lazy
                woke = inst.wake()
                assert not woke.fallback, woke.detail
                assert np.array_equal(inst.infer(x)["y"], reference)
                stats = inst.client().call("stats").header
                assert not stats["parked"] and not stats["offloaded"]
                if park:
                    assert inst.pid is not None and inst.parking.current is not None
                    assert not _maps(inst.pid, inst.parking.current)
                inst.reuse_image_sec = float("inf")  # the second freeze keeps the image (and its parked file)
                inst.to(Tier.FROZEN)
            inst.to(Tier.SUSPENDED)  # restored into SUSPENDED: the worker maps the parked file until it wakes
            if park:
                parked = inst.parking.current
                assert inst.pid is not None and parked is not None and _maps(inst.pid, parked)
            inst.to(Tier.HOT)
            assert np.array_equal(inst.infer(x)["y"], reference)
            folder = inst.parked_dir
        finally:
            inst.close()
        assert folder is not None and not folder.exists()
    assert sizes[False] - sizes[True] > 0.9 * weights, sizes


def driver_copy_parked(inst: instance.Instance, weights: int) -> int:
    """The bytes of the driver's copy that the last freeze moved into the parked file, after the weights."""
    assert "error" not in inst.driver_copy, inst.driver_copy
    copied = int(inst.driver_copy["bytes"])  # type: ignore[call-overload]
    assert copied > 64 * 2**20, inst.driver_copy
    assert inst.parked_bytes >= weights + copied
    return copied


def test_the_drivers_copy_waits_outside_the_image_too(mlp_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                                      criu_engine: criu.CriuEngine) -> None:
    """Frozen from HOT, the worker also maps the driver's copy of its device memory from its parked file
    (`worker.regions`): the image is smaller by about that copy than the same worker's image with the copy in it,
    and the answers after each wake (eager, lazy, and again eager) are the same; each freeze after the first is
    of a restored worker, whose earlier parked file goes."""
    sizes: dict[bool, int] = {}
    copied = 0
    for moved in (False, True):
        inst = on_gpu(f"mlp-driver-{int(moved)}", mlp_spec, rundir / str(moved), criu_engine,
                      park_driver_copy=moved)
        try:
            x, reference, weights = hot_with_reference(inst, seed=9)
            for lazy in (False, True, False):
                inst.to(Tier.FROZEN)
                sizes.setdefault(moved, image_bytes(inst))
                if moved:
                    copied = driver_copy_parked(inst, weights)
                else:
                    assert inst.driver_copy == {}
                inst.lazy_restore = lazy
                woke = inst.wake()
                assert not woke.fallback, woke.detail
                # the parked copy was faulted into the restored worker's page tables beside the driver's restore
                read = sum(p.read for p in inst.parking.premapped if p.wait(10))
                assert read >= 0.9 * copied if moved else not inst.parking.premapped, (read, copied)
                assert np.array_equal(inst.infer(x)["y"], reference)
        finally:
            inst.close()
    assert sizes[False] - sizes[True] > 0.9 * copied, (sizes, copied)


def test_a_suspended_worker_is_frozen_into_the_small_image_too(mlp_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                                                criu_engine: criu.CriuEngine) -> None:
    """Frozen from SUSPENDED (the way idle instances go down), a live worker gets its context back from the driver
    for the freeze and parks its weights and the driver's copy as one frozen from HOT does: the image is smaller
    than the same worker's without parking by more than the weights, the worker stays asleep throughout (a request
    sent to it straight is handed back), every wake (eager, lazy) answers the same with no lazy restore failing (the
    unparked image, taken while the worker held pinned memory, is restored eagerly), and a freeze of an unchanged
    worker within `reuse_image_sec` keeps the image it has (also one restored into SUSPENDED, which is otherwise
    dumped as it is)."""
    sizes: dict[bool, int] = {}
    weights = 0
    for park in (False, True):
        inst = on_gpu(f"mlp-from-suspended-{int(park)}", mlp_spec, rundir / str(park), criu_engine,
                      park_weights=park)
        try:
            x, reference, weights = hot_with_reference(inst, seed=11)
            for lazy in (False, True):
                inst.to(Tier.SUSPENDED)
                handed_back(inst, x, "SUSPENDED")
                entered = inst.to(Tier.FROZEN)
                assert entered.target == Tier.FROZEN and not entered.detail, entered
                sizes.setdefault(park, image_bytes(inst))
                if park:
                    assert "driver" in entered.phases, entered
                    driver_copy_parked(inst, weights)
                else:
                    assert inst.parked_bytes == 0 and "driver" not in entered.phases
                # Unparked, a worker that kept its weights pinned at the driver's checkpoint (wake_copy "pinned") is
                # restored eagerly; a staged one unpins them before the checkpoint.
                assert inst.image is not None
                assert inst.image.lazy_restorable is (park or inst.config.wake_copy == "staged")
                inst.lazy_restore = lazy
                woke = inst.wake()
                assert not woke.fallback, woke.detail
                assert inst.lazy_restore_failures == 0, woke.detail
                assert np.array_equal(inst.infer(x)["y"], reference)
            inst.reuse_image_sec = float("inf")
            inst.to(Tier.SUSPENDED)
            assert inst.to(Tier.FROZEN).detail == "image reused"
            inst.to(Tier.SUSPENDED)  # restored into SUSPENDED and still paused: in the state of its image
            assert inst.to(Tier.FROZEN).detail == "image reused"
            inst.reuse_image_sec = 0.0
            inst.to(Tier.SUSPENDED)
            assert not inst.to(Tier.FROZEN).detail  # dumped as it is
            assert not inst.wake().fallback
            assert np.array_equal(inst.infer(x)["y"], reference)
        finally:
            inst.close()
    assert sizes[False] - sizes[True] > weights + 64 * 2**20, (sizes, weights)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_precision_casts_the_weights_and_keeps_the_declared_dtypes(mlp_spec: api.ModelSpecSpec, precision: str,
                                                                   rundir: pathlib.Path,
                                                                   criu_engine: criu.CriuEngine) -> None:
    """hardware.precision fp16/bf16: half the weight bytes on the GPU, answers close to fp32 in the declared FP32,
    and the same answer after a FROZEN wake."""
    half = mlp_spec.model_copy(update={"hardware": mlp_spec.hardware.model_copy(
        update={"precision": api.Precision(precision)})})
    full = on_gpu("mlp-fp32", mlp_spec, rundir / "fp32", criu_engine)
    inst = on_gpu(f"mlp-{precision}", half, rundir / precision, criu_engine)
    try:
        full.to(Tier.HOT)
        inst.to(Tier.HOT)
        x = contract.sample_inputs(inst.config.inputs, batch=8, seed=11)
        reference, answer = full.infer(x)["y"], inst.infer(x)["y"]
        assert answer.dtype == np.float32 and answer.shape == reference.shape
        assert not np.array_equal(answer, reference)  # it really ran in the lower precision
        np.testing.assert_allclose(answer, reference, rtol=0.05, atol=0.05)
        weights = int(inst.client().call("stats").header["weights_bytes"])
        assert weights * 2 == int(full.client().call("stats").header["weights_bytes"])
        inst.to(Tier.FROZEN)
        assert not inst.wake().fallback
        assert np.array_equal(inst.infer(x)["y"], answer)
    finally:
        inst.close()
        full.close()


def test_a_small_cuda_stack_floor_shrinks_images_and_keeps_the_answers(mlp_spec: api.ModelSpecSpec,
                                                                       rundir: pathlib.Path,
                                                                       criu_engine: criu.CriuEngine) -> None:
    """The same worker with the driver's 1 KiB stack and with Volga's small floor: the same answers before and
    after a FROZEN wake (the driver grows the stack for kernels that need more), and a smaller snapshot (the
    stack is in the driver's copy, which the parked file holds)."""
    sizes, answers = {}, {}
    x = contract.sample_inputs(instance.decls(mlp_spec.inputs), batch=8, seed=5)
    for stack in (0, contract.DEFAULT_CUDA_STACK_BYTES):
        inst = on_gpu(f"mlp-stack-{stack}", mlp_spec, rundir / str(stack), criu_engine, cuda_stack_bytes=stack)
        try:
            inst.to(Tier.HOT)
            answers[stack] = inst.infer(x)["y"]
            inst.to(Tier.FROZEN)
            sizes[stack] = snapshot_bytes(inst)
            woke = inst.wake()
            assert not woke.fallback, woke.detail
            assert np.array_equal(inst.infer(x)["y"], answers[stack])
        finally:
            inst.close()
    assert np.array_equal(answers[0], answers[contract.DEFAULT_CUDA_STACK_BYTES])
    assert sizes[0] - sizes[contract.DEFAULT_CUDA_STACK_BYTES] > 100 * 2**20, sizes


def wakes_with_graphs_kept_and_dropped(spec: api.ModelSpecSpec, rundir: pathlib.Path, engine: criu.CriuEngine,
                                       tier: api.Tier, measure: Callable[[instance.Instance], int],
                                       copy_weights: bool = False,
                                       after: Callable[[instance.Instance, bool], None] = lambda inst, kept: None
                                       ) -> dict[bool, int]:
    """The same worker with its CUDA graphs kept in its snapshots and dropped before them (with `copy_weights`,
    the one that drops them also copies its weights to pinned memory before a SUSPENDED checkpoint), woken twice
    from `tier` each: the same answers before and after every wake and both ways, and the graphs listed again
    after each wake. `measure` is taken in the tier; `after(inst, kept)` checks each wake further."""
    measured, answers = {}, {}
    x = contract.sample_inputs(instance.decls(spec.inputs), batch=8, seed=6)
    for kept in (True, False):
        inst = on_gpu(f"mlp-graphs-{kept}", spec, rundir / str(kept), engine, graphs_in_images=kept)
        inst.config = dataclasses.replace(inst.config, suspend_copies_weights=copy_weights and not kept)
        try:
            inst.to(Tier.HOT)
            graphs = inst.client().call("stats").header["cuda_graphs"]
            assert graphs, "the model captures graphs"
            answers[kept] = inst.infer(x)["y"]
            for _ in range(2):
                inst.to(tier)
                measured[kept] = measure(inst)
                woke = inst.wake()
                assert not woke.fallback, woke.detail
                assert inst.client().call("stats").header["cuda_graphs"] == graphs
                assert np.array_equal(inst.infer(x)["y"], answers[kept])
                after(inst, kept)
        finally:
            inst.close()
    assert np.array_equal(answers[True], answers[False])
    return measured


def image_bytes(inst: instance.Instance) -> int:
    assert inst.image is not None
    return inst.image.size_bytes


def rss_anon_bytes(inst: instance.Instance) -> int:
    """The worker's anonymous memory, the driver's copy of its device memory included while it is SUSPENDED."""
    for line in pathlib.Path(f"/proc/{inst.pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon in /proc/{inst.pid}/status")


def snapshot_bytes(inst: instance.Instance) -> int:
    """What a FROZEN instance keeps on the snapshot disk: its image and its parked file (weights, driver's copy)."""
    return image_bytes(inst) + inst.parked_bytes


def test_graphs_are_captured_again_after_a_frozen_wake_and_kept_out_of_the_snapshot(
        mlp_spec: api.ModelSpecSpec, rundir: pathlib.Path, criu_engine: criu.CriuEngine) -> None:
    sizes = wakes_with_graphs_kept_and_dropped(mlp_spec, rundir, criu_engine, Tier.FROZEN, snapshot_bytes)
    assert sizes[True] - sizes[False] > 64 * 2**20, sizes


def test_a_suspended_worker_hands_the_driver_little_more_than_its_context(
        mlp_spec: api.ModelSpecSpec, rundir: pathlib.Path, criu_engine: criu.CriuEngine) -> None:
    """Before the driver's SUSPENDED checkpoint the worker drops its graphs and copies its weights to pinned
    memory itself (`TorchBackend.sleep`): the driver's copy in the process is smaller by the graphs, the weights
    came back through the worker's own copy (which it keeps for the next checkpoint), and an image taken from
    SUSPENDED, which then carries that copy, wakes with the same answers."""
    def after(inst: instance.Instance, kept: bool) -> None:
        stats = inst.client().call("stats").header
        assert not stats["offloaded"]
        assert stats["host_copy_bytes"] == (0 if kept else stats["weights_bytes"])
        if not kept:
            before = inst.infer(x)["y"]
            inst.to(Tier.SUSPENDED)
            inst.to(Tier.FROZEN)
            inst.to(Tier.HOT)
            assert np.array_equal(inst.infer(x)["y"], before)

    x = contract.sample_inputs(instance.decls(mlp_spec.inputs), batch=4, seed=7)
    rss = wakes_with_graphs_kept_and_dropped(mlp_spec, rundir, criu_engine, Tier.SUSPENDED, rss_anon_bytes,
                                             copy_weights=True, after=after)
    assert rss[True] - rss[False] > 64 * 2**20, rss


@pytest.mark.parametrize("wake_copy", ["staged", "pinned", "auto", "auto-serial", "auto-torch", "staged-fresh",
                                       "auto-readynone", "auto-readypopulate"])
def test_every_wake_copy_brings_the_weights_back_bit_for_bit(mlp_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                                             criu_engine: criu.CriuEngine, wake_copy: str) -> None:
    """Each way of copying weights back on a wake (`WorkerConfig.wake_copy`) answers as HOT did after SUSPENDED,
    FROZEN (lazy) and WARM wakes and says which copy it made; a worker that stages its SUSPENDED copy holds no
    pinned memory at the driver's checkpoint. "auto" stages parked files and, below `staging_min_mib`, keeps a
    SUSPENDED copy pinned; the graphs are captured while the copies run (with "-serial" after them), the copies
    queued through the driver's calls (with "-torch" through torch's) from buffers kept between wakes (with
    "-fresh" pinned for each), the parked file read once at the freeze (with "-readynone" not readied, with
    "-readypopulate" faulted into a mapping instead)."""
    inst = on_gpu(f"mlp-copy-{wake_copy}", mlp_spec, rundir, criu_engine)
    inst.config = tiers.copy_config(inst.config, wake_copy)
    name = wake_copy.partition("-")[0]
    suspended = "staged:memory" if name == "staged" else "pinned:memory"
    parked = "pinned:file" if name == "pinned" else "staged:file"
    try:
        x, reference, _ = hot_with_reference(inst, seed=13)
        inst.lazy_restore = True
        for tier, copied in ((Tier.SUSPENDED, suspended), (Tier.FROZEN, parked), (Tier.SUSPENDED, suspended),
                             (Tier.WARM, "pinned:memory"), (Tier.FROZEN, parked)):
            inst.to(tier)
            assert not inst.wake().fallback
            assert np.array_equal(inst.infer(x)["y"], reference), (tier, wake_copy)
            stats = inst.client().call("stats").header
            assert stats["last_wake"]["copy"] == copied, stats["last_wake"]
            pinned = tier == Tier.WARM or (tier == Tier.SUSPENDED and name != "staged")
            assert stats["host_pinned"] is pinned, (tier, stats)
            assert sorted(stats["cuda_graphs"]) == sorted(inst.config.cuda_graph_batches), stats
    finally:
        inst.close()
