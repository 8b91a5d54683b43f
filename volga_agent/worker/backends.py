"""The model frameworks a worker can serve: ONNX through onnxruntime, TorchScript and PyTorch through torch.

A backend is one loaded model. It runs inference and does what a tier move needs inside the process (WARM:
weights to pinned host memory and back; before a CRIU dump: drop host-side copies, or park the weights in a
file mapping that the image records by reference). torch is imported only for torch models, so an ONNX worker
stays small and starts fast.
"""

from __future__ import annotations

import abc
import concurrent.futures
import importlib
import mmap
import os
import pathlib
import re
import sys
import time
from typing import Any

import numpy as np

from volga_agent.worker import contract, pinning, protocol, staging

# How onnxruntime words a file it may not read: "SystemError : 13" (EACCES) for external data, else the OS's text.
_DENIED = re.compile(r"SystemError : 13\b|Permission denied")


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

    def park(self, path: str) -> bool:
        """Before a checkpoint: move the weights into a new shared mapping of the file `path`, out of the
        process's own memory, so a CRIU image records them by reference. False when this backend cannot."""
        return False

    def unpark(self) -> None:  # noqa: B027 (a hook: only backends that park need it)
        """After a restore (or an abandoned dump): bring parked weights back and drop the file mapping."""

    def sleep(self) -> dict[str, Any]:
        """Before the CUDA driver checkpoints this process (SUSPENDED): make what it copies smaller. What this
        does, `awake` undoes; the default backend does nothing."""
        return {}

    def awake(self) -> None:  # noqa: B027 (a hook: only backends that sleep need it)
        """After the driver's restore (or a checkpoint that did not happen): serve as before `sleep`."""

    def stats(self) -> dict[str, Any]:
        return {}


def _ort_message(exc: BaseException) -> str:
    """onnxruntime's message without its "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : " prefix, on one line."""
    text = str(exc).split(" : ", 3)[-1]
    return " ".join(text.split())[:500]


class OnnxBackend(Backend):
    def __init__(self, config: contract.WorkerConfig) -> None:
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
        try:
            session = self._ort.InferenceSession(path, options, providers=self.providers)
        except Exception as exc:
            if os.geteuid() != 0 and _DENIED.search(str(exc)):
                raise RuntimeError(f"{exc}: the worker runs as uid {os.geteuid()} (settings.worker_user), and every "
                                   "file of the model, its external data beside it included, must be readable by "
                                   "that user") from exc
            raise
        have = {i.name for i in session.get_inputs()}
        want = {t.name for t in self.config.inputs}
        if have != want:
            raise RuntimeError(f"model {path} has inputs {sorted(have)}, the ModelSpec declares {sorted(want)}")
        return session

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [t.name for t in self.config.outputs]
        try:
            results = self.session.run(names, inputs)
        except self._ort.capi.onnxruntime_pybind11_state.InvalidArgument as exc:
            # Inputs the declaration allows but the model refuses (a window shorter than a convolution, an image
            # too small for a concat): the client's error, not the server's.
            raise protocol.WorkerError("INVALID_ARGUMENT", f"the model refused the input: {_ort_message(exc)}"
                                       ) from None
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

    def __init__(self, config: contract.WorkerConfig) -> None:
        import torch

        self.torch = torch
        self.config = config
        self.device = torch.device(config.device)
        if config.framework == "torchscript":
            module = torch.jit.load(config.path, map_location="cpu")
        elif os.path.realpath(config.path).endswith(".py"):  # the path may name the file through /proc/self/fd
            namespace: dict[str, Any] = {"__file__": config.path, "__name__": "volga_user_model"}
            exec(compile(pathlib.Path(config.path).read_text(), config.path, "exec"), namespace)
            module = namespace["build_model"]()
        else:
            module = torch.load(config.path, map_location="cpu", weights_only=False)
        # hardware.precision: the weights in that dtype; floating inputs and outputs converted at the edges.
        self.dtype: Any = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.precision)
        self.module = module.eval() if self.dtype is None else module.eval().to(self.dtype)
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
        self._host_registered = False  # the host copy is pinned (registered with CUDA) now
        self._parked_path = ""  # the parked file `park` wrote, which a staged `unpark` reads
        # Staging buffers kept pinned between staged copies (`staging_keep_buffers`), freed before a CRIU dump.
        self._kept = staging.Kept()
        self.last_wake: dict[str, Any] = {}  # how the last weights copy to the GPU went (`stats`)
        self.offloaded = False
        self._parked: mmap.mmap | None = None  # the file mapping the weights are parked in, until unpark()
        self.vmm: Any = None
        if self.device.type == "cuda":
            from volga_agent.worker import vmm

            torch.cuda.set_device(self.device)
            torch.cuda.init()
            torch.empty(1, device=self.device)  # make the primary context current on this thread
            if config.cuda_stack_bytes:
                _set_stack_limit(config.cuda_stack_bytes)
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
        self._released_graphs: tuple[int, ...] = ()  # captured again on `unpark` or `awake`
        self._slept_offloaded = False  # `sleep` moved the weights to host memory: `awake` brings them back
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

    def _capture(self, batch: int, thread_local: bool = False) -> None:
        """Capture the forward pass for one batch size; replays read inputs from static buffers."""
        torch = self.torch
        static = []
        for decl in self.config.inputs:
            if any(d == -1 for d in decl.shape[1:]):
                return  # only the batch dimension may vary in a captured graph
            shape = (batch, *decl.shape[1:]) if decl.shape and decl.shape[0] == -1 else decl.shape
            static.append(torch.zeros(shape, dtype=self._input_dtype(decl), device=self.device))
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(3):
                self.module(*static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if thread_local:
            # Beside a staged copy (`staging_overlap_graphs`): captured on the side stream without the device-wide
            # synchronize torch.cuda.graph begins with, which would wait for the copies queued so far; other
            # threads go on calling CUDA meanwhile (thread_local). Replays come after the copies are done.
            with torch.no_grad(), torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = self.module(*static)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            with torch.no_grad(), torch.cuda.graph(graph, capture_error_mode="global"):
                out = self.module(*static)
        self.graphs[batch] = (graph, static, out)

    def _input_dtype(self, decl: contract.TensorDecl) -> Any:
        declared = self.torch.from_numpy(np.zeros(0, protocol.NP_DTYPES[decl.dtype])).dtype
        return self.dtype if self.dtype is not None and declared.is_floating_point else declared

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
        out = {}
        for decl, value in zip(self.config.outputs, values, strict=True):
            if self.dtype is not None and value.is_floating_point():
                value = value.to(self.torch.from_numpy(np.zeros(0, protocol.NP_DTYPES[decl.dtype])).dtype)
            out[decl.name] = value.detach().cpu().numpy()
        return out

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self.torch
        if self.offloaded:
            raise protocol.WorkerError("FAILED_PRECONDITION", "weights are offloaded (WARM): reload first")
        arrays = [protocol.contiguous(inputs[t.name]) for t in self.config.inputs]
        batch = arrays[0].shape[0] if arrays and arrays[0].ndim else -1
        captured = self.graphs.get(batch)
        if captured is not None and all(a.shape == s.shape for a, s in zip(arrays, captured[1], strict=True)):
            graph, static, out = captured
            for array, buffer in zip(arrays, static, strict=True):
                buffer.copy_(torch.from_numpy(array), non_blocking=True)
            graph.replay()
            return self._outputs(out)
        args = [torch.from_numpy(a).to(self.device, non_blocking=True) for a in arrays]
        if self.dtype is not None:
            args = [a.to(self.dtype) if a.is_floating_point() else a for a in args]
        with torch.inference_mode():
            return self._outputs(self.module(*args))

    @property
    def _staged(self) -> bool:
        """Whether a SUSPENDED host copy goes unpinned into the driver's checkpoint and comes back staged."""
        if self.device.type != "cuda":
            return False
        return self.config.wake_copy == "staged" or (
            self.config.wake_copy == "auto" and self.nbytes >= self.config.staging_min_mib * 2**20)

    @property
    def _stages_parked(self) -> bool:
        """Whether parked weights come back staged from their file (else pinned in place)."""
        return self.device.type == "cuda" and self.config.wake_copy in ("staged", "auto")

    def _pinned(self) -> Any:
        """Host memory for the weights, pinned by registration so that freeing it really frees it (a host copy
        left unpinned by a staged `sleep` is pinned again)."""
        torch = self.torch
        if self.host is None:
            self._host_buffer = np.empty(self.nbytes, dtype=np.uint8)
            self.host = torch.from_numpy(self._host_buffer)
        if self.device.type == "cuda" and not self._host_registered:
            code = torch.cuda.cudart().cudaHostRegister(self._host_buffer.ctypes.data, self.nbytes, 0)
            if int(code) != 0:
                raise protocol.WorkerError("RESOURCE_EXHAUSTED", f"cudaHostRegister failed ({code})")
            self._host_registered = True
        return self.host

    def _unpin_host(self) -> None:
        """Unregister the host copy but keep it (a staged `sleep`): pinned memory the process holds at the
        driver's checkpoint is pinned again by the driver's restore, on the wake's path."""
        if self._host_registered and self._host_buffer is not None:
            self.torch.cuda.cudart().cudaHostUnregister(self._host_buffer.ctypes.data)
        self._host_registered = False

    def _fill_arena(self, read: staging.Reader, source: str) -> None:
        """Back the arena with device memory again (VMM chunk by chunk, the copies of a chunk starting once it
        is mapped) and fill it through staging buffers (`worker.staging`)."""
        torch = self.torch
        start = time.perf_counter()
        ready = None
        overlap = self.config.staging_overlap_graphs and bool(self._released_graphs)
        if self.vmm is not None:
            ready = (self.vmm.map_chunk(i) for i in range(len(self.vmm.chunks)) if i not in self.vmm.handles)
            # Partly mapped already (an earlier failure), or graphs captured meanwhile, which need it all mapped.
            if self.vmm.handles or self.config.staging_premap or overlap:
                self.vmm.map()
                ready = None
        else:
            self.arena = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            self._bind(self.arena, copy=False)
        mapped = time.perf_counter()
        threads = staging.threads_for(self.config.staging_threads)

        def fill() -> dict[str, float]:
            return staging.copy(torch, self.arena, read, self.nbytes, threads=threads,
                                chunk=self.config.staging_chunk_mib * 2**20, ready=ready,
                                engine=self.config.staging_engine,
                                kept=self._kept if self.config.staging_keep_buffers else None)

        graphs: dict[str, Any] = {}
        if overlap:
            # The graphs' warm-up passes read weights still arriving (their results are thrown away); replays
            # come after the copies, which `staging.copy` has synchronised before it returns.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                copying = pool.submit(fill)
                try:
                    self._capture_released(thread_local=True)
                    graphs = dict(self.last_wake)
                finally:
                    info = copying.result()
        else:
            info = fill()
        self.last_wake = {"copy": f"staged:{source}", "threads": threads, "bytes": self.nbytes,
                          "copy_ms": round((time.perf_counter() - start) * 1e3, 2),
                          "map_ms": round((mapped - start) * 1e3, 2),
                          **{f"staging_{k}_ms": round(info[f"staging_{k}_s"] * 1e3, 2)
                             for k in ("alloc", "populate", "register")},
                          "engine": self.config.staging_engine,
                          **{f"staging_{k[:-2]}_ms_per_thread": round(info[k] * 1e3 / threads, 2)
                             for k in ("read_s", "wait_s", "queue_s")}}
        if "graphs_ms" in graphs:
            self.last_wake["graphs_overlapped_ms"] = graphs["graphs_ms"]

    def drop_host_copy(self) -> None:
        """Free the host copy (before a CRIU dump, whose image would otherwise carry the weights twice) and the
        kept staging buffers (pinned memory held at a dump made the driver's lazy restore fail). Offloaded (WARM,
        or asleep with the driver holding the context, where no CUDA call may be made) both stay, and the image
        is restored eagerly (`sleep` counts them in `pinned_bytes`)."""
        if self.offloaded:
            return
        self._kept.close()
        if self.host is not None:
            self._unregister_host()

    def offload(self) -> dict[str, Any]:
        if self.offloaded:
            return {"nbytes": self.nbytes, "already": True}
        start = time.perf_counter()
        self._pinned().copy_(self.arena)
        self._release_device()
        return {"nbytes": self.nbytes, "seconds": time.perf_counter() - start}

    def _release_device(self) -> None:
        """Free the weights' device memory once a host copy holds them."""
        torch = self.torch
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

    def park(self, path: str) -> bool:
        """On a GPU, copy the weights into a new MAP_SHARED mapping of `path` and free them on the device.

        The driver's checkpoint then holds only the context, and CRIU records the file mapping by reference
        (its pages stay in the file, not in the image); `unpark` copies them back after the restore.
        """
        if self.device.type != "cuda" or self._parked is not None:
            return False
        torch = self.torch
        self._kept.close()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._parked_path = path
        try:
            os.ftruncate(fd, self.nbytes)
            mapping = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        parked = torch.frombuffer(mapping, dtype=torch.uint8)
        parked.copy_(self.host if self.offloaded else self.arena)
        if self._stages_parked:  # its wake reads the file: the first read of what a mapping wrote runs at half rate
            try:
                staging.ready_file(path, self.nbytes, self.config.park_ready,
                                   staging.threads_for(self.config.staging_threads))
            except (OSError, staging.StagingError) as exc:
                print(f"parked weights: not readied for the wake's read: {exc}", file=sys.stderr)
        if not self.offloaded:
            self._release_device()
        self._unregister_host()
        self.host, self._parked = parked, mapping
        if not self.config.graphs_in_images:
            self._release_graphs()
        self._empty_caches()
        return True

    def _empty_caches(self) -> None:
        """Cached device blocks would go into the driver's checkpoint; cached pinned host blocks would be pinned
        again by its restore."""
        torch = self.torch
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()

    def _release_graphs(self) -> None:
        """Drop the captured graphs, their memory pool and cuBLAS's workspaces before a driver checkpoint.

        They are device memory the driver's checkpoint copies (graphs for batch 1 and 8 of a 0.13 GiB MLP on
        an H200: 176 MiB of a 1 GiB FROZEN image, about 120 ms of its restore at the page-fault rate);
        capturing them again afterwards (`_capture_released`) takes a few milliseconds a batch size.
        """
        self._released_graphs = tuple(sorted({*self._released_graphs, *self.graphs}))
        self.graphs.clear()
        clear_workspaces = getattr(self.torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()

    def _capture_released(self, thread_local: bool = False) -> None:
        batches, self._released_graphs = self._released_graphs, ()
        start = time.perf_counter()
        for batch in batches:
            self._capture(batch, thread_local)
        if batches:
            self.last_wake["graphs_ms"] = round((time.perf_counter() - start) * 1e3, 2)

    def sleep(self) -> dict[str, Any]:
        """Before the driver's checkpoint (SUSPENDED): unless `graphs_in_images`, the graphs and workspaces go,
        and with `suspend_copies_weights` the weights go to pinned host memory by the worker's own copy, so that
        the driver copies little more than the context. The driver copies device memory at a few GB/s each way
        (about 3.5 GB/s on an H200: ~70 ms per 250 MiB of a restore), the copy engine from and to pinned memory
        at tens of GB/s. The host copy stays after `awake`, as after a WARM wake: the next checkpoint reuses
        it. With `wake_copy` "staged" it is unpinned before the checkpoint (the driver's restore would pin it
        again: 2 GiB +36 ms, 8 GiB +213 ms on an H200 with huge pages, twice that without, bench/copy_paths.py)
        and `awake` copies it back through staging buffers."""
        if self.device.type != "cuda":
            return {}
        out: dict[str, Any] = {}
        if not self.offloaded and self.config.suspend_copies_weights:
            try:
                out = self.offload()
                self._slept_offloaded = True
            except protocol.WorkerError as exc:  # no pinned memory to be had: the driver's copy takes them
                print(f"sleep: weights stay on the GPU for the driver's checkpoint: {exc.message}", file=sys.stderr)
        if not self._staged:
            self._kept.close()  # this wake copies from the pinned host copy: they would only be pinned again
        else:
            self._unpin_host()
            if self.config.staging_keep_buffers and not self._kept.sets:
                # Pinned now rather than on the wake's path; the driver's restore pins them again (a few ms).
                chunk = self.config.staging_chunk_mib * 2**20
                self._kept.chunk = chunk
                for index in range(staging.threads_for(self.config.staging_threads)):
                    self._kept.sets[index] = staging.Buffers(self.torch, staging.DEPTH, chunk)
        if not self.config.graphs_in_images:
            self._release_graphs()
        self._empty_caches()
        out["pinned_bytes"] = (self.nbytes if self._host_registered else 0) + self._kept.nbytes
        return out

    def awake(self) -> None:
        if self._slept_offloaded:
            self.reload()
            self._slept_offloaded = False
        self._capture_released()

    def unpark(self) -> None:
        if self._parked is None:
            return
        mapping, self._parked = self._parked, None
        staged = False
        if self._stages_parked and self._parked_path:
            try:
                fd = os.open(self._parked_path, os.O_RDONLY)
            except OSError as exc:  # the mapping still holds the weights: copy from it instead
                print(f"parked weights: {exc}; pinning the mapping instead", file=sys.stderr)
            else:
                try:
                    self._fill_arena(staging.file_reader(fd), "file")
                    staged = True
                except staging.StagingError as exc:  # the mapping still holds them: pin it instead
                    print(f"parked weights: {exc}; pinning the mapping instead", file=sys.stderr)
                finally:
                    os.close(fd)
        if not staged:
            self._unpark_pinned()
        self.offloaded = False
        self.host = None  # the last view: the mapping can close
        try:
            mapping.close()
        except BufferError:  # a view outlived the copy: the mapping stays until it goes (and a dump carries it)
            print("parked weights: a view still holds the file mapping", file=sys.stderr)
        self._capture_released()

    def _unpark_pinned(self) -> None:
        """Copy parked weights back by pinning their mapping in place, chunk by chunk (`worker.pinning`)."""
        torch = self.torch
        start = time.perf_counter()
        if self.vmm is not None:
            self.vmm.map()
        else:
            self.arena = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            self._bind(self.arena, copy=False)
        self.last_wake = {"copy": "pinned:file", "bytes": self.nbytes}
        try:
            with pinning.Pinned(int(self.host.data_ptr()), self.nbytes) as pinned:
                for offset, size in pinned.chunks():
                    self.arena[offset:offset + size].copy_(self.host[offset:offset + size], non_blocking=True)
                torch.cuda.synchronize(self.device)
        except pinning.PinError as exc:  # pageable, slower: the copy faults the mapping in itself
            print(f"parked weights: {exc}; copying from pageable memory", file=sys.stderr)
            self.arena.copy_(self.host)
            torch.cuda.synchronize(self.device)
        self.last_wake["copy_ms"] = round((time.perf_counter() - start) * 1e3, 2)  # unpinning included

    def _unregister_host(self) -> None:
        if self.device.type == "cuda":
            self._unpin_host()
        self.host = None
        self._host_buffer = None
        self._host_registered = False

    def reload(self) -> dict[str, Any]:
        torch = self.torch
        if not self.offloaded:
            return {"nbytes": self.nbytes, "already": True}
        start = time.perf_counter()
        if self.device.type == "cuda" and self._host_buffer is not None and not self._host_registered:
            # Left unpinned by a staged `sleep`: through staging buffers rather than pinning it all again.
            self._fill_arena(staging.memory_reader(int(self._host_buffer.ctypes.data)), "memory")
            self.offloaded = False
            return {"nbytes": self.nbytes, "seconds": time.perf_counter() - start}
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
        self.last_wake = {"copy": "pinned:memory", "bytes": self.nbytes,
                          "copy_ms": round((time.perf_counter() - start) * 1e3, 2)}
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
                               "host_copy_bytes": self.nbytes if self.host is not None else 0,
                               "parked": self._parked is not None, "wake_copy": self.config.wake_copy,
                               "host_pinned": self._host_registered, "last_wake": self.last_wake}
        if self.device.type == "cuda":
            mapped = self.vmm.size if self.vmm is not None and self.vmm.mapped else 0
            out["gpu_allocated_bytes"] = int(self.torch.cuda.memory_allocated(self.device)) + mapped
        return out


def _set_stack_limit(nbytes: int) -> None:
    """CU_LIMIT_STACK_SIZE of the current CUDA context (contract.DEFAULT_CUDA_STACK_BYTES says why)."""
    import ctypes

    libcuda = ctypes.CDLL("libcuda.so.1")
    code = libcuda.cuCtxSetLimit(0, ctypes.c_size_t(nbytes))  # CU_LIMIT_STACK_SIZE
    if code != 0:
        print(f"cuCtxSetLimit(CU_LIMIT_STACK_SIZE, {nbytes}) failed ({code}); the driver's stack size stays",
              file=sys.stderr)


def preload(framework: str) -> None:
    """Import the framework before the worker drops to its own user, who may not read the folders it lives in."""
    if framework == "onnx":
        importlib.import_module("onnxruntime")
    elif framework in ("torchscript", "pytorch"):
        importlib.import_module("torch")


def load_backend(config: contract.WorkerConfig) -> Backend:
    if config.framework == "onnx":
        return OnnxBackend(config)
    if config.framework in ("torchscript", "pytorch"):
        return TorchBackend(config)
    raise ValueError(f"framework {config.framework!r} is not one of onnx, torchscript, pytorch")

