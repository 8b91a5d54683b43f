"""The worker: the model-server process that Volga keeps in tiers and checkpoints.

It loads one model (ONNX through onnxruntime, or TorchScript / PyTorch through torch), warms it up, and
serves inference over an AF_UNIX socket with the frames of `protocol`. It is the process CRIU freezes, so:

- it holds no INET socket, ever (kernels >= 6.16 refuse the socket options CRIU reads on INET sockets);
- before a CRIU dump it closes every connection (telling each peer, with a goodbye frame, that a request
  it had just sent was not run), writes `ready-for-checkpoint` in its signal folder and
  waits for `restore-complete` (the pause/resume hooks of Dynamo Snapshot); the process resumes inside
  that wait after a restore, re-seeds its RNGs when asked to, and goes back to serving;
- it imports nothing of the agent, and torch only for torch models, to stay small and start fast.

Run as `python -m volga_agent.worker.runtime CONFIG.json`; the agent starts it through `nsinit` so that it
is the init of its own PID namespace, which CRIU restores with it and so never collides with other PIDs.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import hashlib
import json
import mmap
import os
import pathlib
import random
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from volga_agent.worker import nsinit, protocol

READY = "ready"
READY_FOR_CHECKPOINT = "ready-for-checkpoint"
RESTORE_COMPLETE = "restore-complete"
# The canary: a fixed input whose answer the agent records before a snapshot and compares after each restore,
# so that a damaged image is caught before it answers a request.
CANARY_SEED = 0x5EED
WAKE_SIGNAL = nsinit.WAKE_SIGNAL


@dataclasses.dataclass(frozen=True)
class TensorDecl:
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to know, written by the agent as JSON (the worker does not parse ModelSpecs)."""

    model_id: str
    framework: str
    path: str
    inputs: tuple[TensorDecl, ...]
    outputs: tuple[TensorDecl, ...]
    socket: str
    signal_dir: str
    device: str = "cpu"
    warmup_iterations: int = 3
    reset_rng_on_restore: bool = True
    intra_op_threads: int = 0
    max_batch_size: int = 256
    cuda_graph_batches: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()  # CPUs the launcher pinned the worker to (nsinit --cpus); () leaves it free
    restore_warmups: int = 0  # warmup iterations run again after each restore (warmupCacheRatio)

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        raw = json.loads(text)
        raw["cuda_graph_batches"] = tuple(raw.get("cuda_graph_batches", ()))
        raw["cpus"] = tuple(raw.get("cpus", ()))
        raw["inputs"] = tuple(TensorDecl(t["name"], t["dtype"], tuple(t["shape"])) for t in raw["inputs"])
        raw["outputs"] = tuple(TensorDecl(t["name"], t["dtype"], tuple(t["shape"])) for t in raw["outputs"])
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


class Backend(abc.ABC):
    """One loaded model. Subclasses implement run(); tier moves the framework cannot do raise WorkerError."""

    @abc.abstractmethod
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs by name for inputs that `check_inputs` accepted."""

    def offload(self) -> dict[str, Any]:
        raise protocol.WorkerError("FAILED_PRECONDITION", "this framework has no WARM tier (weights on GPU)")

    def reload(self) -> dict[str, Any]:
        raise protocol.WorkerError("FAILED_PRECONDITION", "this framework has no WARM tier (weights on GPU)")

    def swap(self, path: str) -> None:
        raise protocol.WorkerError("UNIMPLEMENTED", "this framework cannot swap weights in place")

    def drop_host_copy(self) -> None:  # noqa: B027 (a hook: backends without host caches need nothing)
        """Free host-side caches before a checkpoint; the default backend keeps none."""

    def stats(self) -> dict[str, Any]:
        return {}


class OnnxBackend(Backend):
    def __init__(self, config: WorkerConfig) -> None:
        import onnxruntime as ort

        self._ort = ort
        self.config = config
        self.providers: list[Any] = ["CPUExecutionProvider"]
        if config.device.startswith("cuda"):
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise RuntimeError("device is cuda but this onnxruntime has no CUDAExecutionProvider "
                                   "(install onnxruntime-gpu)")
            index = int(config.device.partition(":")[2] or 0)
            self.providers = [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
        self.session = self._open(config.path)

    def _open(self, path: str) -> Any:
        options = self._ort.SessionOptions()
        if self.config.intra_op_threads:
            options.intra_op_num_threads = self.config.intra_op_threads
        # Spinning intra-op threads burn a core each between requests; on a node shared by many models the
        # core is worth more than the microseconds spinning saves.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = self._ort.InferenceSession(path, options, providers=self.providers)
        have = {i.name for i in session.get_inputs()}
        want = {t.name for t in self.config.inputs}
        if have != want:
            raise RuntimeError(f"model {path} has inputs {sorted(have)}, the ModelSpec declares {sorted(want)}")
        return session

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [t.name for t in self.config.outputs]
        results = self.session.run(names, inputs)
        return dict(zip(names, results, strict=True))

    def swap(self, path: str) -> None:
        self.session = self._open(path)


class TorchBackend(Backend):
    """TorchScript or eager PyTorch. Parameters and buffers live in one flat arena, so WARM is one large copy.

    On a GPU the arena is a CUDA virtual-memory range (`vmm.Arena`): going WARM releases its physical pages
    but keeps its addresses, so CUDA graphs captured at load (`hardware.cudaGraphs`) replay after a wake.
    Without the VMM API the arena is an ordinary tensor, re-allocated on wake (graphs are then not used).
    The pinned host copy is registered memory this backend owns, so it can be freed before a CRIU dump.
    """

    ALIGN = 256

    def __init__(self, config: WorkerConfig) -> None:
        import torch

        self.torch = torch
        self.config = config
        self.device = torch.device(config.device)
        if config.framework == "torchscript":
            module = torch.jit.load(config.path, map_location="cpu")
        elif config.path.endswith(".py"):
            namespace: dict[str, Any] = {"__file__": config.path, "__name__": "volga_user_model"}
            exec(compile(pathlib.Path(config.path).read_text(), config.path, "exec"), namespace)
            module = namespace["build_model"]()
        else:
            module = torch.load(config.path, map_location="cpu", weights_only=False)
        self.module = module.eval()
        tensors = [*self.module.parameters(), *self.module.buffers()]
        # (tensor, dtype, shape, offset): fixed at load, since an offloaded tensor no longer has its shape.
        self.layout: list[tuple[Any, Any, tuple[int, ...], int]] = []
        offset = 0
        for t in tensors:
            self.layout.append((t, t.dtype, tuple(t.shape), offset))
            offset += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        self.nbytes = offset
        self.host: Any = None
        self._host_buffer: Any = None
        self.offloaded = False
        self.vmm: Any = None
        if self.device.type == "cuda":
            from volga_agent.worker import vmm

            torch.cuda.set_device(self.device)
            torch.cuda.init()
            torch.empty(1, device=self.device)  # make the primary context current on this thread
        if self.device.type == "cuda" and os.environ.get("VOLGA_VMM", "1") != "0":
            try:
                self.vmm = vmm.Arena(self.nbytes, self.device.index or 0)
            except (OSError, vmm.VmmError) as exc:
                print(f"CUDA VMM unavailable ({exc}); WARM re-allocates weights", file=sys.stderr)
        self.arena: Any = (self.vmm.tensor(torch) if self.vmm is not None else
                           torch.empty(self.nbytes, dtype=torch.uint8, device=self.device))
        self._bind(self.arena, copy=True)  # straight from host memory into the arena: one copy on the GPU
        self.module.to(self.device)  # anything that is neither parameter nor buffer
        self.graphs: dict[int, tuple[Any, list[Any], Any]] = {}
        if self.device.type == "cuda" and self.vmm is not None:
            for batch in config.cuda_graph_batches:
                self._capture(batch)

    def _bind(self, arena: Any, copy: bool) -> None:
        """Point every parameter and buffer at its slice of one flat device buffer."""
        for t, dtype, shape, offset in self.layout:
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            view = arena[offset:offset + size].view(dtype).view(shape)
            if copy:
                view.copy_(t.data)
            t.data = view

    def _capture(self, batch: int) -> None:
        """Capture the forward pass for one batch size; replays read inputs from static buffers."""
        torch = self.torch
        static = []
        for decl in self.config.inputs:
            if any(d == -1 for d in decl.shape[1:]):
                return  # only the batch dimension may vary in a captured graph
            shape = (batch, *decl.shape[1:]) if decl.shape and decl.shape[0] == -1 else decl.shape
            static.append(torch.zeros(shape, dtype=torch.from_numpy(np.zeros(0, protocol.NP_DTYPES[decl.dtype])).dtype,
                                      device=self.device))
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(3):
                self.module(*static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = self.module(*static)
        self.graphs[batch] = (graph, static, out)

    def _outputs(self, result: Any) -> dict[str, np.ndarray]:
        if isinstance(result, dict):
            values = [result[t.name] for t in self.config.outputs]
        elif isinstance(result, (tuple, list)):
            values = list(result)
        else:
            values = [result]
        names = [t.name for t in self.config.outputs]
        if len(values) != len(names):
            raise protocol.WorkerError("INTERNAL", f"model returned {len(values)} outputs, spec has {len(names)}")
        return {n: v.detach().cpu().numpy() for n, v in zip(names, values, strict=True)}

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self.torch
        if self.offloaded:
            raise protocol.WorkerError("FAILED_PRECONDITION", "weights are offloaded (WARM): reload first")
        arrays = [np.ascontiguousarray(inputs[t.name]) for t in self.config.inputs]
        batch = arrays[0].shape[0] if arrays and arrays[0].ndim else -1
        captured = self.graphs.get(batch)
        if captured is not None and all(a.shape == s.shape for a, s in zip(arrays, captured[1], strict=True)):
            graph, static, out = captured
            for array, buffer in zip(arrays, static, strict=True):
                buffer.copy_(torch.from_numpy(array), non_blocking=True)
            graph.replay()
            return self._outputs(out)
        args = [torch.from_numpy(a).to(self.device, non_blocking=True) for a in arrays]
        with torch.inference_mode():
            return self._outputs(self.module(*args))

    def _pinned(self) -> Any:
        """Host memory for the weights, pinned by registration so that freeing it really frees it."""
        torch = self.torch
        if self.host is None:
            buffer = np.empty(self.nbytes, dtype=np.uint8)
            if self.device.type == "cuda":
                code = torch.cuda.cudart().cudaHostRegister(buffer.ctypes.data, self.nbytes, 0)
                if int(code) != 0:
                    raise protocol.WorkerError("RESOURCE_EXHAUSTED", f"cudaHostRegister failed ({code})")
            self._host_buffer = buffer
            self.host = torch.from_numpy(buffer)
        return self.host

    def drop_host_copy(self) -> None:
        """Free the pinned copy (before a CRIU dump, whose image would otherwise carry the weights twice)."""
        if self.host is None or self.offloaded:
            return
        if self.device.type == "cuda":
            self.torch.cuda.cudart().cudaHostUnregister(self._host_buffer.ctypes.data)
        self.host = None
        self._host_buffer = None

    def offload(self) -> dict[str, Any]:
        torch = self.torch
        if self.offloaded:
            return {"nbytes": self.nbytes, "already": True}
        start = time.perf_counter()
        self._pinned().copy_(self.arena)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.vmm is not None:
            self.vmm.unmap()  # physical pages go, the addresses (and the views on them) stay
        else:
            empty = torch.empty(0, device=self.device)
            for t, *_ in self.layout:
                t.data = empty
            self.arena = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.offloaded = True
        return {"nbytes": self.nbytes, "seconds": time.perf_counter() - start}

    def reload(self) -> dict[str, Any]:
        torch = self.torch
        if not self.offloaded:
            return {"nbytes": self.nbytes, "already": True}
        start = time.perf_counter()
        if self.vmm is not None:
            for index in range(len(self.vmm.chunks)):
                # Map chunk i+1 on the CPU while the copy engine fills chunk i.
                offset, size = self.vmm.map_chunk(index)
                end = min(offset + size, self.nbytes)
                if offset < end:
                    self.arena[offset:end].copy_(self.host[offset:end], non_blocking=True)
        else:
            arena = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            arena.copy_(self.host, non_blocking=True)
            self._bind(arena, copy=False)
            self.arena = arena
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.offloaded = False
        return {"nbytes": self.nbytes, "seconds": time.perf_counter() - start}

    def swap(self, path: str) -> None:
        torch = self.torch
        state = torch.load(path, map_location="cpu", weights_only=True)
        current = self.module.state_dict()
        problems = [f"{k}: missing" for k in current if k not in state]
        problems += [f"{k}: unexpected" for k in state if k not in current]
        problems += [f"{k}: shape {tuple(state[k].shape)} != {tuple(v.shape)}"
                     for k, v in current.items() if k in state and state[k].shape != v.shape]
        if problems:
            raise protocol.WorkerError("INVALID_ARGUMENT", "weights do not fit the loaded architecture: "
                                       + "; ".join(problems[:5]))
        if self.offloaded:
            raise protocol.WorkerError("FAILED_PRECONDITION", "weights are offloaded (WARM): reload first")
        with torch.no_grad():
            for key, value in current.items():
                value.copy_(state[key])  # in place: same addresses, so captured graphs see the new weights

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"weights_bytes": self.nbytes, "offloaded": self.offloaded,
                               "cuda_graphs": sorted(self.graphs), "stable_addresses": self.vmm is not None,
                               "weights_ptr": int(self.arena.data_ptr()) if self.arena is not None else 0,
                               "host_copy_bytes": self.nbytes if self.host is not None else 0}
        if self.device.type == "cuda":
            mapped = self.vmm.size if self.vmm is not None and self.vmm.mapped else 0
            out["gpu_allocated_bytes"] = int(self.torch.cuda.memory_allocated(self.device)) + mapped
        return out


def load_backend(config: WorkerConfig) -> Backend:
    if config.framework == "onnx":
        return OnnxBackend(config)
    if config.framework in ("torchscript", "pytorch"):
        return TorchBackend(config)
    raise ValueError(f"framework {config.framework!r} is not one of onnx, torchscript, pytorch")


def sample_inputs(decls: tuple[TensorDecl, ...], batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs of the declared shapes (-1 -> batch); integer inputs are small indices."""
    rng = np.random.default_rng(seed)
    out = {}
    for decl in decls:
        shape = tuple(batch if d == -1 else d for d in decl.shape)
        dtype = protocol.NP_DTYPES[decl.dtype]
        if dtype.kind in "iu":
            out[decl.name] = rng.integers(0, 100, size=shape).astype(dtype)
        elif dtype.kind == "b":
            out[decl.name] = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            out[decl.name] = rng.standard_normal(shape).astype(dtype)
    return out


def check_inputs(decls: tuple[TensorDecl, ...], inputs: dict[str, np.ndarray], max_batch: int) -> None:
    """Reject inputs that do not match the ModelSpec before they reach the framework."""
    want = {d.name for d in decls}
    if set(inputs) != want:
        missing, extra = sorted(want - set(inputs)), sorted(set(inputs) - want)
        raise protocol.WorkerError("INVALID_ARGUMENT", f"inputs missing {missing}, unexpected {extra}")
    for decl in decls:
        array = inputs[decl.name]
        dtype = protocol.DTYPE_NAMES.get(array.dtype)
        if dtype != decl.dtype:
            raise protocol.WorkerError("INVALID_ARGUMENT",
                                       f"input {decl.name!r}: dtype {dtype} given, {decl.dtype} expected")
        if len(array.shape) != len(decl.shape) or any(
                d != -1 and d != s for d, s in zip(decl.shape, array.shape, strict=True)):
            raise protocol.WorkerError("INVALID_ARGUMENT", f"input {decl.name!r}: shape {list(array.shape)} "
                                       f"given, [{', '.join(map(str, decl.shape))}] expected")
        if decl.shape and decl.shape[0] == -1 and array.shape[0] > max_batch:
            raise protocol.WorkerError("INVALID_ARGUMENT", f"input {decl.name!r}: batch {array.shape[0]} is "
                                       f"over maxBatchSize {max_batch}")


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.signal_dir = pathlib.Path(config.signal_dir)
        self.started = time.time()
        self.load_seconds = 0.0
        self.backend = self._load()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        pathlib.Path(config.socket).unlink(missing_ok=True)
        self.listener.bind(config.socket)
        self.listener.listen(64)
        self.conns: list[socket.socket] = []
        self.selector = selectors.PollSelector()
        # Shared-memory segments attached by co-located gateways, one per connection; dropped with it.
        self.shm: dict[socket.socket, mmap.mmap] = {}
        self._conn: socket.socket | None = None
        self.requests = 0
        self.restores = 0
        self.restore_warmups_done = 0
        self.generation = 0  # bumped when the process state changes in a way a snapshot must capture (swap)
        # The tier the agent put this worker in while its process stays up ("" when serving): requests that
        # reach it then are handed back unrun (NotRun), never half-run against offloaded or locked GPU state.
        self.asleep = ""
        self.ops: dict[str, Callable[[protocol.Frame], tuple[dict[str, Any], list[memoryview]]]] = {
            "infer": self._op_infer,
            "ping": self._op_ping,
            "metadata": self._op_metadata,
            "stats": self._op_stats,
            "offload": self._op_offload,
            "reload": self._op_reload,
            "sleep": self._op_sleep,
            "wake": self._op_wake,
            "canary": self._op_canary,
            "swap": self._op_swap,
            "attach_shm": self._op_attach_shm,
            "rng": lambda f: ({"python": random.random(), "numpy": float(np.random.random())}, []),
        }

    def _load(self) -> Any:
        start = time.perf_counter()
        backend = load_backend(self.config)
        warm = sample_inputs(self.config.inputs)
        for _ in range(self.config.warmup_iterations):
            backend.run(warm)
        self.load_seconds = time.perf_counter() - start
        return backend

    def _op_offload(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        result = self.backend.offload()
        self.asleep = "WARM"
        return result, []

    def _op_reload(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        result = self.backend.reload()
        self.asleep = ""
        return result, []

    def _op_sleep(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        """Sent before the agent checkpoints the GPU state (SUSPENDED), so no request then waits on a lock."""
        self.asleep = str(frame.header.get("tier") or "asleep")
        return {}, []

    def _op_wake(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        """Serve again; with `canary`, answer the canary first (the agent compares it before any request)."""
        self.asleep = ""
        header, _ = self._op_ping(frame)
        if frame.header.get("canary"):
            header["canary"] = self.canary()
        return header, []

    def _op_canary(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        return {"canary": self.canary(), "generation": self.generation}, []

    def canary(self) -> str:
        """A digest of the model's answer to the canary input: equal digests, equal model state."""
        outputs = self.backend.run(sample_inputs(self.config.inputs, seed=CANARY_SEED))
        digest = hashlib.sha256()
        for name in sorted(outputs):
            array = np.ascontiguousarray(outputs[name])
            digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()

    def _op_ping(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        return {"pid": os.getpid(), "restores": self.restores, "generation": self.generation}, []

    def _op_infer(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        if self.asleep:
            raise protocol.NotRun(message=f"the instance is {self.asleep}; wake it first")
        segment = self.shm.get(self._conn) if frame.header.get("shm") and self._conn else None
        if frame.header.get("shm") and segment is None:
            raise protocol.WorkerError("FAILED_PRECONDITION", "no shared memory attached to this connection")
        if segment is not None:
            inputs = protocol.unpack_shm_tensors(frame.header.get("tensors", []), segment)
        else:
            inputs = protocol.unpack_tensors(frame.header.get("tensors", []), frame.payload)
        check_inputs(self.config.inputs, inputs, self.config.max_batch_size)
        outputs = self.backend.run(inputs)
        del inputs
        self.requests += 1
        if segment is not None:
            meta = protocol.write_shm_tensors(outputs, segment, int(frame.header.get("out_offset", 0)))
            if meta is not None:
                return {"tensors": meta, "shm": True}, []
        meta, parts = protocol.pack_tensors(outputs)
        return {"tensors": meta}, parts

    def _op_attach_shm(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        path, size = frame.header.get("path"), frame.header.get("size")
        if not isinstance(path, str) or not isinstance(size, int) or size <= 0:
            raise protocol.WorkerError("INVALID_ARGUMENT", "attach_shm needs a path and a positive size")
        if self._conn is None:
            raise protocol.WorkerError("INTERNAL", "no connection")
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise protocol.WorkerError("INVALID_ARGUMENT", f"attach_shm: {path}: {exc.strerror}") from None
        try:
            self._detach(self._conn)
            self.shm[self._conn] = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return {"size": size}, []

    def _detach(self, conn: socket.socket) -> None:
        segment = self.shm.pop(conn, None)
        if segment is not None:
            with contextlib.suppress(BufferError):  # a view is still alive; the mapping goes with the process
                segment.close()

    def close_conn(self, conn: socket.socket) -> None:
        self._detach(conn)
        if conn in self.conns:
            self.conns.remove(conn)
            self.selector.unregister(conn)
        conn.close()

    def _op_metadata(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        decl = [dataclasses.asdict(t) for t in self.config.inputs], [dataclasses.asdict(t) for t in self.config.outputs]
        return {"model_id": self.config.model_id, "framework": self.config.framework,
                "inputs": decl[0], "outputs": decl[1], "device": self.config.device}, []

    def _op_stats(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        return {"requests": self.requests, "restores": self.restores, "load_seconds": self.load_seconds,
                "restore_warmups": self.restore_warmups_done,
                **self.backend.stats()}, []

    def _op_swap(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        path = frame.header.get("path")
        if not isinstance(path, str) or not os.path.exists(path):
            raise protocol.WorkerError("INVALID_ARGUMENT", f"swap: path {path!r} does not exist")
        start = time.perf_counter()
        self.backend.swap(path)
        self.generation += 1
        return {"seconds": time.perf_counter() - start, "generation": self.generation}, []

    def handle(self, conn: socket.socket) -> bool:
        """Serve one frame; False when the connection is gone or the worker paused for a checkpoint."""
        try:
            frame = protocol.recv_frame(conn)
        except (protocol.ProtocolError, OSError):
            return False
        op = frame.header.get("op")
        if op == "prepare_checkpoint":
            protocol.send_frame(conn, {"ok": True})
            self.pause_for_checkpoint()
            return False
        handler = self.ops.get(str(op))
        self._conn = conn
        try:
            if handler is None:
                raise protocol.WorkerError("UNIMPLEMENTED", f"unknown op {op!r}")
            header, parts = handler(frame)
            header = {"ok": True, **header}
        except protocol.WorkerError as exc:
            header, parts = exc.reply(), []
        except Exception as exc:  # the framework failed on this request: report it, keep serving
            header, parts = {"ok": False, "code": "INTERNAL", "message": f"{type(exc).__name__}: {exc}"}, []
        try:
            protocol.send_frame(conn, header, parts)
        except OSError:
            return False
        return True

    def pause_for_checkpoint(self) -> None:
        """Close every connection, say we are ready, and wait for the agent's restore-complete signal.

        A CRIU dump taken now holds only the listener and files. After a restore the process continues
        here; when the dump was abandoned the agent sends the same signal and nothing else happens.
        """
        for conn in list(self.conns):
            protocol.say_goodbye(conn)
            self.close_conn(conn)
        self.backend.drop_host_copy()
        done = self.signal_dir / RESTORE_COMPLETE
        (self.signal_dir / READY_FOR_CHECKPOINT).write_text(str(os.getpid()))
        while not done.exists():
            signal.sigtimedwait([WAKE_SIGNAL], 0.05)
        done.unlink(missing_ok=True)
        (self.signal_dir / READY_FOR_CHECKPOINT).unlink(missing_ok=True)
        self.restores += 1
        if self.config.reset_rng_on_restore:
            reseed_rngs()
        if self.config.restore_warmups:
            warm = sample_inputs(self.config.inputs)
            for _ in range(self.config.restore_warmups):
                self.backend.run(warm)
            self.restore_warmups_done += self.config.restore_warmups

    def serve(self) -> None:
        (self.signal_dir / READY).write_text(json.dumps({"pid": os.getpid(), "load_seconds": self.load_seconds}))
        # poll(2), not epoll: the selector holds no kernel object, so a checkpoint has none to carry.
        self.selector.register(self.listener, selectors.EVENT_READ)
        while True:
            for key, _ in self.selector.select():
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    conn, _ = self.listener.accept()
                    self.conns.append(conn)
                    self.selector.register(conn, selectors.EVENT_READ)
                elif sock in self.conns and not self.handle(sock):
                    self.close_conn(sock)


def reseed_rngs() -> None:
    """A restored process would replay the RNG stream it was frozen with; give every copy its own."""
    seed = int.from_bytes(os.urandom(8), "little")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m volga_agent.worker.runtime CONFIG.json", file=sys.stderr)
        return 2
    # Block the wake signal before any framework thread exists, so every thread inherits the mask and
    # sigtimedwait in the main thread receives it.
    signal.pthread_sigmask(signal.SIG_BLOCK, [WAKE_SIGNAL])
    # As the init of its PID namespace the worker ignores SIGTERM unless it handles it.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    config = WorkerConfig.from_json(pathlib.Path(argv[0]).read_text())
    try:
        worker = Worker(config)
    except Exception as exc:
        (pathlib.Path(config.signal_dir) / "failed").write_text(f"{type(exc).__name__}: {exc}")
        raise
    worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
