"""An LLM server that knows nothing of Volga: a transformers causal LM on the GPU with a preallocated KV cache,
generating greedily and streaming its tokens as server-sent events (an OpenAI-style `POST /v1/completions`).

Its sleep mode follows vLLM's, so that Volga's hooks can call it before a checkpoint and after a restore:

    POST /sleep?level=1   copy the weights to host memory and release the KV cache and the weights' GPU memory
    POST /sleep?level=2   release the KV cache and the weights (read again from the model's file at wake-up)
    POST /wake_up         bring the weights back and allocate the KV cache again
    GET  /stats           the last sleep's level, and its and the wake-up's phases in ms

Asleep, it answers completions with 503 and its health with 200, as vLLM does. The model folder (`LLM_MODEL_DIR`)
holds a transformers `config.json` and `model.safetensors`; `llm_model.make_model` writes one with seeded random
weights. Tokens are bytes of the prompt (ids 3-258) in and ids out: the answers are compared, not read.

The weights live in one GPU buffer laid out as the file's data section, each parameter a view of it, and come in (at
the start, and at every wake-up) as fast model loaders bring them (the Run:ai model streamer, fastsafetensors):
`LLM_LOAD_THREADS` threads (12) each read pieces of the file (or of the level-1 host copy) into two small pinned
buffers of their own (4 MiB each) and queue their copies to the GPU on a stream of their own through the CUDA driver's
calls, so the reads run on several cores while the copies run near the pinned rate. The level-1 host copy is ordinary
(pageable) memory, unlike vLLM's pinned one: pinned memory held at a CUDA driver checkpoint is pinned again by the
driver's restore (2.2 GiB: 462 ms against 278 ms without, on an H200), which costs more than copying back through the
staging buffers. The staging buffers are unpinned and unmapped after each copy, and a sleep gives back cuBLAS's
workspaces and the C heap's free memory, so that none of them lands in a checkpoint.

Run: LLM_MODEL_DIR=DIR uvicorn volga_bench.servers.llm_app:app --port PORT --loop asyncio --no-access-log
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import mmap
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from transformers import StaticCache
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaForCausalLM

from volga_bench.servers.llm_model import WEIGHTS

DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
CHUNK = 4 * 2**20
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14


def _layout(path: pathlib.Path) -> tuple[int, int, dict[str, tuple[torch.dtype, list[int], int, int]]]:
    """A safetensors file's data offset, data size and tensors: name -> (dtype, shape, start, end) in the data."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    tensors = {name: (DTYPES[t["dtype"]], t["shape"], *t["data_offsets"]) for name, t in header.items()}
    return 8 + size, max(end for *_, end in tensors.values()), tensors


class _Pinned:
    """A thread's two staging buffers: one anonymous mapping (huge pages where the kernel gives them, faulted in
    before it is pinned: cheaper than `cudaHostAlloc`), pinned with `cudaHostRegister`, unpinned and unmapped after
    the copy so that nothing pinned is held at a checkpoint."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.map = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        libc = ctypes.CDLL(None)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise(self.address, nbytes, MADV_HUGEPAGE)
        libc.madvise(self.address, nbytes, MADV_POPULATE_WRITE)
        code = int(torch.cuda.cudart().cudaHostRegister(self.address, nbytes, 0))
        if code:
            self.map.close()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed ({code})")
        self.view = memoryview(self.map)

    def close(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.address)
        self.view.release()
        with contextlib.suppress(BufferError):  # a tensor still exports it: unmapped with the last one
            self.map.close()


def _cuda(library: ctypes.CDLL) -> ctypes.CDLL:
    handle, pointer = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
    for name, args in (("cuCtxGetCurrent", (pointer,)), ("cuCtxSetCurrent", (handle,)),
                       ("cuStreamCreate", (pointer, ctypes.c_uint)), ("cuStreamDestroy_v2", (handle,)),
                       ("cuStreamSynchronize", (handle,)), ("cuEventCreate", (pointer, ctypes.c_uint)),
                       ("cuEventDestroy_v2", (handle,)), ("cuEventRecord", (handle, handle)),
                       ("cuEventSynchronize", (handle,)),
                       ("cuMemcpyHtoDAsync_v2", (ctypes.c_uint64, handle, ctypes.c_size_t, handle))):
        function = getattr(library, name)
        function.argtypes, function.restype = args, ctypes.c_int
    return library


# The loading threads queue their copies through the CUDA driver's own calls: torch's copy_ and events make several
# round trips through the GIL a piece, which a dozen threads wait on (on an H200, 2 GiB staged from memory: 18 GB/s
# queued by torch, 44-46 by the driver's calls; Volga's bench/stage_rate.py). Calls that return at once keep the GIL
# (PyDLL), the one that waits lets it go (CDLL).
_WAITS = _cuda(ctypes.CDLL("libcuda.so.1"))
_QUICK = _cuda(ctypes.PyDLL("libcuda.so.1"))


def _check(call: str, code: int) -> None:
    if code:
        raise RuntimeError(f"{call} failed (CUresult {code})")


def _stage(destination: torch.Tensor, read: Callable[[memoryview, int], None], threads: int) -> float:
    """Fill the GPU byte tensor `destination`: each thread reads its pieces (`read(into, offset)`) into its own two
    pinned buffers in turn and copies each to the GPU on its own stream, a buffer reused once its copy is done.
    Returns the longest time a thread took to pin its buffers, in ms."""
    size = destination.numel()
    base = destination.data_ptr()
    errors: list[BaseException] = []
    pinning: list[float] = []
    torch.cuda.current_stream().synchronize()
    context = ctypes.c_void_p()
    _check("cuCtxGetCurrent", _QUICK.cuCtxGetCurrent(ctypes.byref(context)))

    def run(first: int) -> None:
        pinned = None
        stream, events = ctypes.c_void_p(), [ctypes.c_void_p(), ctypes.c_void_p()]
        try:
            _check("cuCtxSetCurrent", _QUICK.cuCtxSetCurrent(context))
            began = time.perf_counter()
            pinned = _Pinned(2 * CHUNK)
            pinning.append((time.perf_counter() - began) * 1000)
            _check("cuStreamCreate", _QUICK.cuStreamCreate(ctypes.byref(stream), 1))  # non-blocking
            for event in events:
                _check("cuEventCreate", _QUICK.cuEventCreate(ctypes.byref(event), 2))  # no timing
            pending = [False, False]
            for i, offset in enumerate(range(first * CHUNK, size, threads * CHUNK)):
                slot, n = i % 2, min(CHUNK, size - offset)
                if pending[slot]:
                    _check("cuEventSynchronize", _WAITS.cuEventSynchronize(events[slot]))
                read(pinned.view[slot * CHUNK:slot * CHUNK + n], offset)
                _check("cuMemcpyHtoDAsync",
                       _QUICK.cuMemcpyHtoDAsync_v2(base + offset, pinned.address + slot * CHUNK, n, stream))
                _check("cuEventRecord", _QUICK.cuEventRecord(events[slot], stream))
                pending[slot] = True
            _check("cuStreamSynchronize", _WAITS.cuStreamSynchronize(stream))
        except BaseException as exc:  # raised in the calling thread below
            errors.append(exc)
        finally:
            if stream.value:
                _WAITS.cuStreamSynchronize(stream)  # no copy still reads a buffer that goes
            for event in events:
                if event.value:
                    _QUICK.cuEventDestroy_v2(event)
            if stream.value:
                _QUICK.cuStreamDestroy_v2(stream)
            if pinned is not None:
                pinned.close()

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return max(pinning, default=0.0)


def _release_host_memory() -> None:
    """The C heap's free pages back to the system."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Engine:
    """The model, its KV cache and the sleep levels; one generation at a time (one cache)."""

    def __init__(self, folder: pathlib.Path, cache_tokens: int, threads: int) -> None:
        self.folder, self.cache_tokens, self.threads = folder, cache_tokens, threads
        self.config = LlamaConfig.from_pretrained(folder)
        self.data_offset, self.size, self.tensors = _layout(folder / WEIGHTS)
        with torch.device("cuda"):  # made on the GPU (its random start is replaced by the file's weights)
            self.model = LlamaForCausalLM(self.config).half().eval()
        self.model.requires_grad_(False)
        self.params = dict(self.model.named_parameters())
        missing = set(self.params) ^ set(self.tensors)
        if missing:
            raise ValueError(f"{folder / WEIGHTS}: tensors and the model's parameters differ: {sorted(missing)[:5]}")
        self.weights: torch.Tensor | None = None  # the GPU buffer the parameters are views of
        self.host: torch.Tensor | None = None  # the weights' level-1 copy in host memory
        self.cache: StaticCache | None = None
        self.level = 0
        self.stats: dict[str, float] = {}
        self.lock = threading.Lock()
        self._load(self._read_file)
        self._allocate_cache()

    def _read_file(self, into: memoryview, offset: int) -> None:
        fd = os.open(self.folder / WEIGHTS, os.O_RDONLY)
        try:
            done = 0
            while done < len(into):
                got = os.preadv(fd, [into[done:]], self.data_offset + offset + done)
                if got <= 0:
                    raise OSError(f"{self.folder / WEIGHTS}: ends {len(into) - done} bytes short")
                done += got
        finally:
            os.close(fd)

    def _read_host(self, into: memoryview, offset: int) -> None:
        assert self.host is not None
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(into)), self.host.data_ptr() + offset, len(into))

    def _load(self, read: Callable[[memoryview, int], None]) -> None:
        """The weights into a fresh GPU buffer through the staging threads; the parameters made views of it."""
        began = time.perf_counter()
        self.weights = torch.empty(self.size, dtype=torch.uint8, device="cuda")
        self.stats["allocate_ms"] = (time.perf_counter() - began) * 1000
        self.stats["pin_ms"] = _stage(self.weights, read, self.threads)
        for name, (dtype, shape, start, end) in self.tensors.items():
            self.params[name].data = self.weights[start:end].view(dtype).view(shape)
        torch.cuda.synchronize()
        self.stats["weights_ms"] = (time.perf_counter() - began) * 1000

    def new_cache(self) -> StaticCache:
        """A KV cache for `cache_tokens`, its memory not yet taken where transformers allocates it lazily."""
        try:
            return StaticCache(config=self.config, max_cache_len=self.cache_tokens)
        except TypeError:  # transformers < 4.56: the cache's shape and place given up front
            return StaticCache(config=self.config, max_batch_size=1, max_cache_len=self.cache_tokens, device="cuda",
                               dtype=torch.float16)

    def _allocate_cache(self) -> None:
        """The KV cache, allocated whole now (a one-token prefill makes a lazily allocated cache take its memory)."""
        began = time.perf_counter()
        self.cache = self.new_cache()
        with torch.inference_mode():
            self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device="cuda"), past_key_values=self.cache,
                       cache_position=torch.zeros(1, dtype=torch.long, device="cuda"), use_cache=True)
        torch.cuda.synchronize()
        self.stats["cache_ms"] = (time.perf_counter() - began) * 1000

    def sleep(self, level: int) -> None:
        with self.lock:
            if self.level:
                return
            began = time.perf_counter()
            self.cache = None
            if level == 1:
                if self.host is None:
                    self.host = torch.empty(self.size, dtype=torch.uint8)
                assert self.weights is not None
                self.host.copy_(self.weights)
            else:
                self.host = None  # level 2 keeps nothing, a level-1 copy from an earlier sleep neither
            for param in self.params.values():
                param.data = torch.empty(0, dtype=param.dtype, device="cuda")
            self.weights = None
            gc.collect()
            torch.cuda.empty_cache()
            getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
            _release_host_memory()
            self.level = level
            self.stats = {"sleep_ms": (time.perf_counter() - began) * 1000, "sleep_level": level}

    def wake_up(self) -> None:
        with self.lock:
            if not self.level:
                return
            began = time.perf_counter()
            self._load(self._read_host if self.level == 1 else self._read_file)
            self._allocate_cache()
            self.level = 0
            self.stats["wake_up_ms"] = (time.perf_counter() - began) * 1000

    def generate(self, prompt: str, max_tokens: int) -> Iterator[int]:
        """Greedy tokens, one by one. A streamed answer's steps run on whichever thread the web framework picks,
        so each step enters inference mode (thread-local) itself; the lock is held from the first step to the last."""
        ids = [3 + b for b in prompt.encode()][: self.cache_tokens - max_tokens] or [3]
        self.lock.acquire()
        try:
            if self.level or self.cache is None:
                raise HTTPException(503, "asleep: POST /wake_up first")
            with torch.inference_mode():  # the cache's tensors were made in it
                self.cache.reset()
            tokens = torch.tensor([ids], device="cuda")
            position = torch.arange(len(ids), device="cuda")
            for _ in range(max_tokens):
                with torch.inference_mode():
                    logits = self.model(input_ids=tokens, past_key_values=self.cache, cache_position=position,
                                        use_cache=True).logits
                    token = int(logits[0, -1].argmax())
                yield token
                tokens = torch.tensor([[token]], device="cuda")
                position = position[-1:] + 1
        finally:
            self.lock.release()


engine = Engine(pathlib.Path(os.environ["LLM_MODEL_DIR"]), int(os.environ.get("LLM_CACHE_TOKENS", "32768")),
                int(os.environ.get("LLM_LOAD_THREADS", str(min(12, os.cpu_count() or 1)))))
app = FastAPI()


class Completion(BaseModel):
    prompt: str
    max_tokens: int = 16
    stream: bool = False


@app.get("/health")
def health() -> dict[str, Any]:
    return {"status": "ok", "asleep": bool(engine.level)}


@app.get("/stats")
def stats() -> dict[str, float]:
    return {k: round(v, 1) for k, v in engine.stats.items()}


@app.post("/sleep")
def sleep(level: int = 1) -> dict[str, int]:
    if level not in (1, 2):
        raise HTTPException(400, f"level: 1 or 2, not {level}")
    engine.sleep(level)
    return {"level": level}


@app.post("/wake_up")
def wake_up() -> dict[str, bool]:
    engine.wake_up()
    return {"awake": True}


@app.post("/v1/completions")
def completions(request: Completion) -> Any:
    if not 1 <= request.max_tokens <= 1024:
        raise HTTPException(400, "max_tokens: 1 to 1024")
    if engine.level:
        raise HTTPException(503, "asleep: POST /wake_up first")
    tokens = engine.generate(request.prompt, request.max_tokens)
    if not request.stream:
        return {"choices": [{"text": " ".join(str(t) for t in tokens)}]}

    def events() -> Iterator[str]:
        for token in tokens:
            yield f"data: {json.dumps({'choices': [{'text': f'{token} '}]})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
