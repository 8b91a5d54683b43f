"""Copy weights to the GPU through small pinned staging buffers, from several threads at once.

A weights copy from pageable memory (a parked file's mapping after a CRIU restore, or a host copy that is not
pinned) runs at the pageable rate (6.6-8.8 GB/s on an H200); pinning the whole source in place first runs at the
driver's pinning rate (about 16-20 GB/s from several threads: the driver serialises it) and unpinning it again
costs a third of that (2 GiB: 44 ms, 8 GiB: 166-185 ms). Here each of `threads` threads owns `depth` pinned buffers
of `chunk` bytes and a CUDA stream: it reads the next piece of the source into a free buffer (`pread` from a file,
or a memory copy), and queues the copy of that buffer to the device on its stream; a buffer is reused once its
copy has finished (an event). The reads run on the CPU's cores at once (ctypes and os.preadv release the GIL), and
the copies are queued through the driver's own calls (`Driver`): torch's calls cost each thread a round trip through
the GIL per call, which the other threads wait on.

On the H200 (`bench/stage_rate.py`, bench/results/stage-rate/): 12 threads of two 4 MiB buffers, pinned beforehand,
bring 2 GiB in 49-50 ms and 8 GiB in 170-171 ms from memory or from a tmpfs file (the pinned copy limit: 39 and 156
ms); larger buffers or more threads read slower, the host's memory bandwidth being shared with the copy engine.
Pinning fresh buffers costs about 1 ms per 4 MiB, so a worker keeps its buffers from one staged copy to the next
(`Kept`). Pinned host memory a process holds at the driver's checkpoint is pinned again by the driver's restore
(2 GiB of huge pages +36 ms, 8 GiB +213 ms; 4 KiB pages twice that; the 96 MiB of buffers a few ms), and a FROZEN
image's lazy restore failed in the driver whenever the process held some: kept buffers go before a CRIU dump.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

CHUNK_BYTES = 4 * 2**20
THREADS = 12
DEPTH = 2
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14


class StagingError(RuntimeError):
    pass


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    libc.memcpy.restype = ctypes.c_void_p
    return libc


class Buffers:
    """`count` pinned host buffers of `chunk` bytes in one anonymous mapping (huge pages where the kernel gives
    them, which pin faster), registered with CUDA (cudaHostRegister) so that `close` really frees them."""

    def __init__(self, torch: Any, count: int, chunk: int) -> None:
        self.torch, self.count, self.chunk = torch, count, chunk
        self.nbytes = count * chunk
        self.map = mmap.mmap(-1, self.nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        libc = _libc()
        began = time.perf_counter()
        libc.madvise(self.address, self.nbytes, MADV_HUGEPAGE)
        libc.madvise(self.address, self.nbytes, MADV_POPULATE_WRITE)  # fault in before pinning: cheaper
        populated = time.perf_counter()
        code = int(torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, 0))
        # Where the time of pinning them went: faulting the memory in, and the driver's registration.
        self.populate_s, self.register_s = populated - began, time.perf_counter() - populated
        if code != 0:
            self.map.close()
            raise StagingError(f"cudaHostRegister of {self.nbytes} bytes of staging buffers failed ({code})")
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        self.views = [whole[i * chunk:(i + 1) * chunk] for i in range(count)]
        self.memoryviews = [memoryview(self.map)[i * chunk:(i + 1) * chunk] for i in range(count)]
        del whole

    def close(self) -> None:
        if self.map.closed:
            return
        self.torch.cuda.cudart().cudaHostUnregister(self.address)
        self.views.clear()
        for view in self.memoryviews:
            view.release()
        self.memoryviews.clear()
        with contextlib.suppress(BufferError):  # a tensor view still exports it: it goes with the last view
            self.map.close()


class Kept:
    """Staging buffers kept from one staged copy to the next: each thread of the first copy pins its own and
    leaves them here instead of freeing them. Pinning fresh buffers costs about 1 ms per 4 MiB on an H200
    (bench/stage_rate.py), on the wake's path; pinned memory held at the driver's checkpoint costs its restore
    little at this size, but must be gone before a CRIU dump (`close`)."""

    def __init__(self) -> None:
        self.sets: dict[int, Buffers] = {}
        self.chunk = 0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.sets.values())

    def close(self) -> None:
        for buffers in self.sets.values():
            buffers.close()
        self.sets.clear()


# The ways of readying a freshly written parked file's pages before its first staged read (`ready_file`).
READY_WAYS = ("none", "read", "populate")
MADV_POPULATE_READ = 22  # Linux 5.14


def ready_file(path: str, nbytes: int, way: str, threads: int = THREADS) -> None:
    """Ready the pages of a tmpfs file just written through a shared mapping (a parked weights file) for the staged
    reads of a later wake, from `threads` threads: "read" reads it once, "populate" faults it into a fresh
    mapping that is only read (MADV_POPULATE_READ), "none" leaves it. The first read of pages written through a mapping
    ran at half the rate of every later one on an H200 (bench/parked_read.py, docs/measurements.md "The first read
    of a parked file"); readying them moves that cost to the freeze."""
    if way not in READY_WAYS:
        raise StagingError(f"unknown way of readying a parked file {way!r}: {', '.join(READY_WAYS)}")
    if way == "none" or nbytes <= 0:
        return
    threads = max(1, threads)
    step = -(-nbytes // threads // CHUNK_BYTES) * CHUNK_BYTES
    fd = os.open(path, os.O_RDWR if way == "populate" else os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED) if way == "populate" else None  # only read
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) if mapping is not None else 0
        libc = _libc()

        def part(start: int) -> None:
            end = min(nbytes, start + step)
            if mapping is not None:
                if libc.madvise(address + start, end - start, MADV_POPULATE_READ) != 0:
                    raise StagingError(f"readying {path}: madvise failed ({os.strerror(ctypes.get_errno())})")
                return
            buffer = memoryview(bytearray(CHUNK_BYTES))
            for offset in range(start, end, CHUNK_BYTES):
                os.preadv(fd, [buffer[:min(CHUNK_BYTES, end - offset)]], offset)

        try:
            with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ready") as pool:
                list(pool.map(part, range(0, nbytes, step)))
        finally:
            if mapping is not None:
                mapping.close()
    finally:
        os.close(fd)


# A reader fills `buffer` (a memoryview) with `size` bytes of the source at `offset`.
Reader = Callable[[memoryview, int, int, int], None]


def file_reader(fd: int, base: int = 0) -> Reader:
    def read(buffer: memoryview, address: int, offset: int, size: int) -> None:
        done = 0
        while done < size:
            got = os.preadv(fd, [buffer[done:size]], base + offset + done)
            if got <= 0:
                raise StagingError(f"short read at {base + offset + done}: the parked file ends early")
            done += got
    return read


def memory_reader(source: int) -> Reader:
    libc = _libc()

    def read(buffer: memoryview, address: int, offset: int, size: int) -> None:
        libc.memcpy(address, source + offset, size)
    return read


def threads_for(limit: int = THREADS) -> int:
    """Threads for a staged copy: `limit`, or fewer where the worker may run on fewer CPUs."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(limit, cpus))


class Driver:
    """The CUDA driver calls a staged copy makes for each piece, through ctypes. The calls that return at once
    (queueing a copy, recording an event) keep the GIL: with a dozen threads wanting it, letting it go and taking
    it back costs more than the call itself; the call that waits (an event's synchronize) lets it go. Torch's own
    copy makes several Python-level calls per piece, each a round trip through the GIL."""

    CU_STREAM_NON_BLOCKING = 1
    CU_EVENT_DISABLE_TIMING = 2

    def __init__(self, library: str = "libcuda.so.1") -> None:
        waits = ctypes.CDLL(library)  # lets go of the GIL around each call
        quick = ctypes.PyDLL(library)  # keeps it
        handle = ctypes.c_void_p
        for lib in (waits, quick):
            for name, args in (("cuCtxGetCurrent", (ctypes.POINTER(handle),)), ("cuCtxSetCurrent", (handle,)),
                               ("cuStreamCreate", (ctypes.POINTER(handle), ctypes.c_uint)),
                               ("cuStreamDestroy_v2", (handle,)), ("cuStreamSynchronize", (handle,)),
                               ("cuEventCreate", (ctypes.POINTER(handle), ctypes.c_uint)),
                               ("cuEventDestroy_v2", (handle,)), ("cuEventRecord", (handle, handle)),
                               ("cuEventSynchronize", (handle,)),
                               ("cuMemcpyHtoDAsync_v2", (ctypes.c_uint64, handle, ctypes.c_size_t, handle))):
                function = getattr(lib, name)
                function.argtypes, function.restype = args, ctypes.c_int
        self.waits, self.quick = waits, quick

    def check(self, call: str, code: int) -> None:
        if code != 0:
            raise StagingError(f"{call} failed (CUresult {code})")

    def current(self) -> int:
        context = ctypes.c_void_p()
        self.check("cuCtxGetCurrent", self.quick.cuCtxGetCurrent(ctypes.byref(context)))
        if not context.value:
            raise StagingError("no current CUDA context in the thread that starts a staged copy")
        return context.value

    def handles(self, context: int, depth: int) -> tuple[int, list[int]]:
        """Make `context` current in this thread; a stream of its own and `depth` events."""
        self.check("cuCtxSetCurrent", self.quick.cuCtxSetCurrent(context))
        stream = ctypes.c_void_p()
        self.check("cuStreamCreate", self.quick.cuStreamCreate(ctypes.byref(stream), self.CU_STREAM_NON_BLOCKING))
        events = []
        for _ in range(depth):
            event = ctypes.c_void_p()
            self.check("cuEventCreate", self.quick.cuEventCreate(ctypes.byref(event), self.CU_EVENT_DISABLE_TIMING))
            events.append(int(event.value or 0))
        return int(stream.value or 0), events

    def close(self, stream: int, events: list[int]) -> None:
        for event in events:
            self.quick.cuEventDestroy_v2(event)
        self.quick.cuStreamDestroy_v2(stream)


def copy(torch: Any, target: Any, read: Reader, nbytes: int, buffers: Buffers | None = None,
         threads: int = THREADS, chunk: int = CHUNK_BYTES, depth: int = DEPTH,
         ready: Iterable[tuple[int, int]] | None = None, engine: str = "driver",
         kept: Kept | None = None) -> dict[str, float]:
    """Fill `target` (a uint8 device tensor of at least `nbytes`) from `read`. `ready` yields (offset, size)
    ranges of the target as they become writable (mapped), in order; by default all of it at once. `engine`
    queues each piece's copy through torch ("torch") or the driver's calls straight ("driver", `Driver`).

    Staging buffers come from `buffers` (`depth` for each thread), or each thread allocates its own when it
    starts (faulting them in runs on all threads at once) and frees them when its last copy is done, or leaves
    them in `kept` for the next copy, which uses them instead of allocating. Returns
    the longest time a thread spent allocating its buffers (`staging_alloc_s`; of that thread's, faulting them in,
    `staging_populate_s`, and the driver's registration, `staging_register_s`), the seconds until every piece
    was queued, and the threads' summed seconds reading pieces (`read_s`), waiting for a buffer's copy to finish
    (`wait_s`) and queueing copies (`queue_s`)."""
    if engine not in ("torch", "driver"):
        raise StagingError(f"unknown staging engine {engine!r}: torch or driver")
    start = time.perf_counter()
    if buffers is not None:
        threads = max(1, min(threads, buffers.count // depth))
        chunk = buffers.chunk
    if kept is not None and kept.chunk != chunk:
        kept.close()
        kept.chunk = chunk
    work: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
    errors: list[BaseException] = []
    allocating: list[tuple[float, float, float]] = []  # each thread's whole, faulting in, registering
    spent = {"read_s": 0.0, "wait_s": 0.0, "queue_s": 0.0}
    lock = threading.Lock()
    device = target.device
    driver = Driver() if engine == "driver" else None
    context = 0
    base = int(target.data_ptr())
    if driver is not None:
        torch.cuda.set_device(device)  # the device's context current in this thread too (a pool's thread)
        torch.cuda.current_stream(device).synchronize()  # what torch queued on the target comes first
        context = driver.current()

    def worker(index: int) -> None:
        own = None
        finished = False
        handles: tuple[int, list[int]] | None = None
        torch_stream: Any = None
        read_s = wait_s = queue_s = 0.0
        clock = time.perf_counter
        try:
            torch.cuda.set_device(device)
            if buffers is None and kept is not None and index in kept.sets:
                mine, views = list(range(depth)), kept.sets[index]
            elif buffers is None:
                began = clock()
                own = Buffers(torch, depth, chunk)
                allocating.append((clock() - began, own.populate_s, own.register_s))
                mine, views = list(range(depth)), own
                if kept is not None:
                    kept.sets[index], own = own, None
            else:
                mine, views = list(range(index * depth, (index + 1) * depth)), buffers
            pointers = [int(views.views[b].data_ptr()) for b in mine]
            if driver is not None:
                handles = driver.handles(context, depth)
                stream, driver_events = handles
                copy_async, record = driver.quick.cuMemcpyHtoDAsync_v2, driver.quick.cuEventRecord
                wait = driver.waits.cuEventSynchronize
                waiting = [False] * depth
            else:
                torch_stream = torch.cuda.Stream(device)
                events: list[Any] = [None] * depth
            turn = 0
            while True:
                item = work.get()
                if item is None:
                    finished = True
                    break
                if errors:
                    continue
                offset, size = item
                slot = turn % depth
                turn += 1
                t0 = clock()
                if driver is not None:
                    if waiting[slot]:
                        driver.check("cuEventSynchronize", wait(driver_events[slot]))
                elif events[slot] is not None:
                    events[slot].synchronize()
                t1 = clock()
                buffer = mine[slot]
                read(views.memoryviews[buffer], pointers[slot], offset, size)
                t2 = clock()
                if driver is not None:
                    driver.check("cuMemcpyHtoDAsync", copy_async(base + offset, pointers[slot], size, stream))
                    driver.check("cuEventRecord", record(driver_events[slot], stream))
                    waiting[slot] = True
                else:
                    with torch.cuda.stream(torch_stream):
                        target[offset:offset + size].copy_(views.views[buffer][:size], non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(torch_stream)
                        events[slot] = event
                t3 = clock()
                wait_s += t1 - t0
                read_s += t2 - t1
                queue_s += t3 - t2
            t0 = clock()
            if driver is not None:
                driver.check("cuStreamSynchronize", driver.waits.cuStreamSynchronize(stream))
            else:
                torch_stream.synchronize()
            wait_s += clock() - t0
        except BaseException as exc:  # handed to the caller
            errors.append(exc)
            while not finished and work.get() is not None:  # let the producer finish; the others stop too
                pass
        finally:
            if handles is not None and driver is not None:
                driver.waits.cuStreamSynchronize(handles[0])  # no copy still reads a buffer that goes
                driver.close(*handles)
            elif torch_stream is not None:
                torch_stream.synchronize()
            if own is not None:
                own.close()
            with lock:
                spent["read_s"] += read_s
                spent["wait_s"] += wait_s
                spent["queue_s"] += queue_s

    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    try:
        for offset, size in ready if ready is not None else [(0, nbytes)]:
            end = min(offset + size, nbytes)
            for piece in range(offset, end, chunk):
                work.put((piece, min(chunk, end - piece)))
    finally:
        queued = time.perf_counter() - start
        for _ in pool:
            work.put(None)
        for t in pool:
            t.join()
    if errors:
        raise StagingError(f"staged copy failed: {errors[0]}") from errors[0]
    whole, populate, register = max(allocating, default=(0.0, 0.0, 0.0))
    return {"staging_alloc_s": whole, "staging_populate_s": populate, "staging_register_s": register,
            "queued_s": queued, **spent}
