"""Copy weights to the GPU through small pinned staging buffers, from several threads at once.

A weights copy from pageable memory (a parked file's mapping after a CRIU restore, or a host copy that is not
pinned) runs at the pageable rate (6.6-8.8 GB/s on an H200); pinning the whole source in place first runs at the
driver's pinning rate (about 16-20 GB/s from several threads: the driver serialises it) and unpinning it again
costs a third of that (2 GiB: 44 ms, 8 GiB: 166-185 ms). Here each of `threads` threads owns `depth` pinned buffers
of `chunk` bytes and a CUDA stream: it reads the next piece of the source into a free buffer (`pread` from a file,
or a memory copy), and queues the copy of that buffer to the device on its stream; a buffer is reused once its
copy has finished (an event). The reads run on the CPU's cores at once (ctypes and os.preadv release the GIL).

On the H200 (`bench/copy_paths.py`, bench/results/copy-paths/): 16 threads with buffers already pinned bring
2 GiB from memory in 52-54 ms and 8 GiB in 179-199 ms (the pinned copy limit: 39 and 165 ms); from a tmpfs file
in about 78 and 244 ms, the kernel's copies out of the page cache being the limit. Pinning fresh buffers costs
their first touch (a few tens of ms for 256-512 MiB), so each thread pins its own as it starts.

The staging buffers are the only pinned memory, and they are freed after the copy: pinned host memory a process
holds at the driver's checkpoint is pinned again by the driver's restore (2 GiB of huge pages +36 ms, 8 GiB +213
ms; 4 KiB pages twice that), and a FROZEN image's lazy restore failed in the driver whenever the process held some.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

CHUNK_BYTES = 8 * 2**20
THREADS = 16
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
        libc.madvise(self.address, self.nbytes, MADV_HUGEPAGE)
        libc.madvise(self.address, self.nbytes, MADV_POPULATE_WRITE)  # fault in before pinning: cheaper
        code = int(torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, 0))
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


def copy(torch: Any, target: Any, read: Reader, nbytes: int, buffers: Buffers | None = None,
         threads: int = THREADS, chunk: int = CHUNK_BYTES, depth: int = DEPTH,
         ready: Iterable[tuple[int, int]] | None = None) -> dict[str, float]:
    """Fill `target` (a uint8 device tensor of at least `nbytes`) from `read`. `ready` yields (offset, size)
    ranges of the target as they become writable (mapped), in order; by default all of it at once.

    Staging buffers come from `buffers` (`depth` for each thread), or each thread allocates its own when it
    starts (faulting them in runs on all threads at once) and frees them when its last copy is done. Returns
    the longest time a thread spent allocating its buffers and the seconds until every piece was queued."""
    start = time.perf_counter()
    if buffers is not None:
        threads = max(1, min(threads, buffers.count // depth))
        chunk = buffers.chunk
    work: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
    errors: list[BaseException] = []
    allocating: list[float] = []
    device = target.device

    def worker(index: int) -> None:
        own = None
        finished = False
        try:
            torch.cuda.set_device(device)
            if buffers is None:
                began = time.perf_counter()
                own = Buffers(torch, depth, chunk)
                allocating.append(time.perf_counter() - began)
                mine, views = list(range(depth)), own
            else:
                mine, views = list(range(index * depth, (index + 1) * depth)), buffers
            stream = torch.cuda.Stream(device)
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
                if events[slot] is not None:
                    events[slot].synchronize()
                buffer = mine[slot]
                read(views.memoryviews[buffer], int(views.views[buffer].data_ptr()), offset, size)
                with torch.cuda.stream(stream):
                    target[offset:offset + size].copy_(views.views[buffer][:size], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                    events[slot] = event
            stream.synchronize()
        except BaseException as exc:  # handed to the caller
            errors.append(exc)
            while not finished and work.get() is not None:  # let the producer finish; the others stop too
                pass
        finally:
            if own is not None:
                own.close()

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
    return {"staging_alloc_s": max(allocating, default=0.0), "queued_s": queued}
