"""A real worker process serving the default ONNX model on the CPU."""

from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np
import pytest
from procs import wait_for

from volga_agent.app import defaultmodel
from volga_agent.host import process
from volga_agent.node import instance
from volga_agent.worker import contract, protocol
from volga_core import api

Tier = api.Tier


def request(inst: instance.Instance, batch: int = 4) -> dict[str, np.ndarray]:
    return contract.sample_inputs(inst.config.inputs, batch=batch, seed=11)


def test_serves_and_is_deterministic(hot: instance.Instance) -> None:
    x = request(hot)
    first = hot.infer(x)["probability"]
    assert first.shape == (4, 1) and first.dtype == np.float32
    assert np.all((first > 0) & (first < 1))
    assert np.array_equal(hot.infer(x)["probability"], first)
    meta = hot.client().call("metadata").header
    assert meta["model_id"] == "ctr-default" and [i["name"] for i in meta["inputs"]] == ["dense", "sparse"]


def test_cold_start_is_recorded(hot: instance.Instance) -> None:
    assert [(t.source, t.target) for t in hot.history] == [(Tier.COLD, Tier.HOT)]
    assert hot.history[0].seconds > 0


@pytest.mark.parametrize("mutate, message", [
    (lambda x: {**x, "dense": x["dense"][:, :12].copy()}, "input 'dense': shape [4, 12] given, [-1, 13] expected"),
    (lambda x: {**x, "sparse": x["sparse"].astype(np.int32)}, "input 'sparse': dtype INT32 given, INT64 expected"),
    (lambda x: {"dense": x["dense"]}, "inputs missing ['sparse'], unexpected []"),
    (lambda x: {**x, "extra": x["dense"]}, "unexpected ['extra']"),
    (lambda x: {**x, "dense": x["dense"][:, :, None].copy()}, "input 'dense': shape [4, 13, 1]"),
])
def test_bad_tensors_are_rejected_and_worker_keeps_serving(hot: instance.Instance, mutate, message: str) -> None:
    x = request(hot)
    good = hot.infer(x)["probability"]
    with pytest.raises(protocol.WorkerError) as err:
        hot.infer(mutate(x))
    assert err.value.code == "INVALID_ARGUMENT"
    assert message in err.value.message
    assert np.array_equal(hot.infer(x)["probability"], good)


def test_batch_over_the_limit(hot: instance.Instance) -> None:
    with pytest.raises(protocol.WorkerError, match="over maxBatchSize 256"):
        hot.infer(request(hot, batch=257))


def test_garbled_frame_drops_only_that_connection(hot: instance.Instance) -> None:
    x = request(hot)
    good = hot.infer(x)["probability"]
    with protocol.WorkerClient(hot.config.socket) as rogue:
        rogue.sock.sendall(protocol.PREFIX.pack(5, 0) + b"nope!")
        assert rogue.sock.recv(1) == b""  # the worker hung up on it
    with protocol.WorkerClient(hot.config.socket) as other, pytest.raises(protocol.WorkerError, match="UNIMPLEMENTED"):
        other.call("explode")
    assert np.array_equal(hot.infer(x)["probability"], good)


def test_in_place_swap_to_another_version(hot: instance.Instance, tmp_path: pathlib.Path) -> None:
    x = request(hot)
    before = hot.infer(x)["probability"]
    pid = hot.pid
    # The worker runs as its own user: the new version lies where that user may read it.
    with tempfile.TemporaryDirectory(dir="/tmp") as readable:
        os.chmod(readable, 0o755)
        v2 = defaultmodel.build_onnx(pathlib.Path(readable) / "v2.onnx", rows=1000)  # same architecture, other weights
        hot.client().call("swap", path=str(v2))
    after = hot.infer(x)["probability"]
    assert hot.pid == pid
    assert not np.array_equal(before, after)
    with pytest.raises(protocol.WorkerError, match="does not exist"):
        hot.client().call("swap", path=str(tmp_path / "none.onnx"))
    assert np.array_equal(hot.infer(x)["probability"], after)


def test_model_that_fails_to_load(default_spec: api.ModelSpecSpec, rundir: pathlib.Path) -> None:
    broken = rundir / "broken.onnx"
    broken.write_bytes(b"this is not onnx")
    inst = instance.Instance("b", default_spec.model_copy(update={"source": str(broken)}), rundir / "i", None)
    with pytest.raises(process.WorkerStartError, match="worker failed"):
        inst.to(Tier.HOT)
    inst.close()


def test_killed_worker_gives_an_error_and_can_restart(hot: instance.Instance) -> None:
    import os
    import signal

    x = request(hot)
    good = hot.infer(x)["probability"]
    assert hot.pid is not None
    os.kill(hot.pid, signal.SIGKILL)
    with pytest.raises(protocol.WorkerError) as err:
        hot.infer(x)
    assert err.value.code == "UNAVAILABLE"
    assert hot.tier is Tier.COLD
    hot.to(Tier.HOT)
    assert np.array_equal(hot.infer(x)["probability"], good)


def test_worker_pinned_to_the_given_cpus(default_spec: api.ModelSpecSpec, rundir: pathlib.Path) -> None:
    """numaAffinity: the worker and every thread it starts stay on the CPUs of the GPU's NUMA node."""
    # Two intra-op threads so onnxruntime starts a pool thread of its own: that thread must inherit the pinning.
    spec = default_spec.model_copy(update={"runtime": default_spec.runtime.model_copy(update={"intra_op_threads": 2})})
    cpu = min(os.sched_getaffinity(0))
    inst = instance.Instance("pinned", spec, rundir, None, cpus=(cpu,))
    try:
        inst.to(Tier.HOT)
        assert inst.infer(request(inst))["probability"].shape == (4, 1)
        assert inst.pid is not None
        threads = list(pathlib.Path(f"/proc/{inst.pid}/task").iterdir())
        assert len(threads) > 1, threads  # onnxruntime's pool thread too
        for task in threads:
            allowed = next(line for line in (task / "status").read_text().splitlines()
                           if line.startswith("Cpus_allowed_list:"))
            assert allowed.split()[-1] == str(cpu), (task.name, allowed)
    finally:
        inst.close()


async def wait_stopped(pid: int, timeout: float = 30.0) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
        assert time.monotonic() < deadline, f"worker {pid} did not stop"
        await asyncio.sleep(0.005)


def test_request_caught_by_a_checkpoint_is_handed_back_unrun(hot: instance.Instance) -> None:
    """A gateway request that reaches a worker just as it pauses for a checkpoint is not lost as 'died'.

    The worker is stopped while the agent's prepare_checkpoint (first connection) and a gateway request
    (second connection) both wait in its sockets; on SIGCONT it serves the first, pauses, and must tell the
    second that its request was never run (WorkerGone: the gateway wakes the model again and retries).
    """
    import asyncio
    import signal

    from volga_agent.gateway import workers

    x = request(hot)
    good = hot.infer(x)["probability"]  # the agent's connection is the worker's first
    assert hot.pid is not None

    async def scenario() -> None:
        conn = await workers.Connection.open(hot.config.socket, shm_bytes=0)
        meta, parts = protocol.pack_tensors(x)
        reply, body = await conn.call({"op": "infer", "tensors": meta}, parts)
        assert np.array_equal(protocol.unpack_tensors(reply["tensors"], body)["probability"], good)
        agent = hot.client()
        os.kill(hot.pid, signal.SIGSTOP)
        try:
            # Stopped for sure before the frames arrive: a worker still on its way to the stop would find only
            # the first frame ready in its poll, and serve it after SIGCONT.
            await wait_stopped(hot.pid)
            caught = asyncio.create_task(conn.call({"op": "infer", "tensors": meta}, parts))
            await asyncio.sleep(0.1)  # the task has written its frame
            protocol.send_frame(agent.sock, {"op": "prepare_checkpoint"})
        finally:
            os.kill(hot.pid, signal.SIGCONT)
        with pytest.raises(workers.WorkerGone, match="checkpoint"):
            await caught
        assert protocol.recv_frame(agent.sock).header["ok"]
        assert not conn.usable()

    asyncio.run(scenario())
    hot.disconnect()
    wait_for("ready-for-checkpoint", (hot.signals / contract.READY_FOR_CHECKPOINT).exists, timeout=10, every=0.01)
    hot._resume_worker(hot.pid)
    hot.client().call("ping")
    assert np.array_equal(hot.infer(x)["probability"], good)


def test_a_sleeping_worker_hands_requests_back_unrun(hot: instance.Instance) -> None:
    """Before the agent checkpoints a worker's GPU state (SUSPENDED) it tells the worker to sleep: a request
    that reaches it directly then is handed back (the gateway wakes the model and retries) instead of
    waiting on the driver's lock. Here on the CPU: the same frames, without the driver."""
    import asyncio

    from volga_agent.gateway import workers

    x = request(hot)
    good = hot.infer(x)["probability"]
    hot.client().call("sleep", tier="SUSPENDED")
    with pytest.raises(protocol.NotRun, match="SUSPENDED") as err:
        hot.infer(x)
    assert err.value.code == "UNAVAILABLE"

    async def through_gateway_connection() -> None:
        clients = workers.WorkerClients(shm_bytes=2**20)
        try:
            with pytest.raises(workers.WorkerGone, match="SUSPENDED; wake it first"):
                await clients.infer(hot.config.socket, x)
            hot.client().call("wake")
            assert np.array_equal((await clients.infer(hot.config.socket, x))["probability"], good)
        finally:
            clients.close()

    asyncio.run(through_gateway_connection())
    assert hot.client().call("stats").header["requests"] == 2  # the unrun requests were not counted


def test_worker_holds_no_file_that_other_processes_write(hot: instance.Instance, rundir: pathlib.Path) -> None:
    """CRIU restores an open file only if it is unchanged since the dump: a worker must not keep a file open
    that other processes grow, such as onnxruntime's per-user telemetry store under ~/.cache."""
    assert hot.pid is not None
    held = [os.readlink(fd) for fd in pathlib.Path(f"/proc/{hot.pid}/fd").iterdir()]
    files = [p for p in held if p.startswith("/") and p != "/dev/null"]
    assert files and all(pathlib.Path(p).is_relative_to(rundir) for p in files), held


@pytest.mark.parametrize("pid_namespace", [True, False], ids=["pidns", "no-pidns"])
def test_every_worker_thread_blocks_the_wake_signal(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                                    pid_namespace: bool) -> None:
    """The wake signal must reach the main thread's sigtimedwait. A thread that does not block it (numpy's BLAS
    threads start at import, before the worker's code runs) takes it instead: outside a PID namespace (GPU
    workers) the worker dies of it; as a namespace's init it is dropped. A stray wake signal is harmless."""
    spec = default_spec.model_copy(update={"runtime": default_spec.runtime.model_copy(update={"intra_op_threads": 2})})
    inst = instance.Instance("sigmask", spec, rundir, None, pid_namespace=pid_namespace)
    try:
        inst.to(Tier.HOT)
        assert inst.pid is not None
        bit = 1 << (contract.WAKE_SIGNAL - 1)
        threads = list(pathlib.Path(f"/proc/{inst.pid}/task").iterdir())
        assert len(threads) > 1
        for task in threads:
            blocked = next(line for line in (task / "status").read_text().splitlines() if line.startswith("SigBlk:"))
            assert int(blocked.split()[1], 16) & bit, (task.name, blocked)
        for _ in range(20):
            os.kill(inst.pid, contract.WAKE_SIGNAL)
        x = request(inst)
        assert inst.infer(x)["probability"].shape == (4, 1)
        assert not inst.worker_gone()
    finally:
        inst.close()


def _zombie_children() -> list[int]:
    children = []
    for task in pathlib.Path(f"/proc/{os.getpid()}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    return [pid for pid in children
            if pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")]


def test_a_worker_that_fails_to_start_is_reaped(default_spec: api.ModelSpecSpec, rundir: pathlib.Path) -> None:
    """A model that cannot load: the start fails with the worker's reason, and no <defunct> child stays behind."""
    broken = rundir / "broken.onnx"
    broken.write_bytes(b"not a model")
    spec = default_spec.model_copy(update={"source": f"file://{broken}"})
    inst = instance.Instance("broken", spec, rundir / "w", None)
    before = set(_zombie_children())
    for _ in range(3):
        with pytest.raises(process.WorkerStartError, match="worker failed"):
            inst.to(Tier.HOT)
        assert inst.tier is Tier.COLD and inst.pid is None
    assert set(_zombie_children()) <= before
    inst.close()


def test_rank_0_tensors_keep_their_shape(rundir: pathlib.Path) -> None:
    """A scalar input (shape []) reaches the model as a scalar, and a scalar output comes back as one: the frame
    packing used to turn them into shape [1], which the worker's own input check then refused."""
    import onnx
    from onnx import TensorProto, helper

    path = rundir / "scaled.onnx"
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "scale"], ["y"]), helper.make_node("ReduceSum", ["y"], ["total"], keepdims=0)],
        "scaled", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
                   helper.make_tensor_value_info("scale", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("total", TensorProto.FLOAT, [])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    spec = api.ModelSpecSpec.model_validate({
        "modelId": "scaled", "framework": "onnx", "source": f"file://{path}",
        "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, 4]}, {"name": "scale", "dtype": "FP32", "shape": []}],
        "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, 4]}, {"name": "total", "dtype": "FP32", "shape": []}],
        "runtime": {"warmupIterations": 1}})
    meta, parts = protocol.pack_tensors({"scale": np.array(2.5, dtype=np.float32)})
    assert meta[0]["shape"] == [] and protocol.unpack_tensors(meta, b"".join(parts))["scale"].shape == ()
    inst = instance.Instance("scaled", spec, rundir / "w", None)
    try:
        inst.to(Tier.HOT)
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        out = inst.infer({"x": x, "scale": np.array(2.5, dtype=np.float32)})
        assert np.array_equal(out["y"], x * 2.5)
        assert out["total"].shape == () and out["total"] == np.float32((x * 2.5).sum())
    finally:
        inst.close()
