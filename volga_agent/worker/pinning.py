"""Pin a large host range for the GPU from several threads, chunk by chunk, so copies start before it is all pinned.

Weights parked in a file mapping come back after a CRIU restore as a mapping with no page tables. A copy to the
GPU from such (pageable) memory runs at a fraction of the copy engine's speed; pinning it first
(`cuMemHostRegister`) lets the copy engine read it directly, but pinning faults in and locks every page, which
one thread does at the machine's page-fault rate. Here each chunk is faulted in (madvise MADV_POPULATE_READ) and
registered by one of a few threads (4: more contend in the driver), and the caller copies each chunk as soon as
it is pinned. `bench/park_reload.py` measures the alternatives on a GPU machine; on the H200 a 2 GiB mapping
comes back in 131-153 ms this way, against 338-457 ms pageable and 39 ms from memory pinned beforehand.

ctypes calls release the GIL, so the threads really run at once. The driver API needs the caller's CUDA context
current in each thread; the process must have one (PyTorch makes it on first use).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
from collections.abc import Iterator

MADV_POPULATE_READ = 22  # Linux 5.14
CHUNK_BYTES = 64 * 2**20


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def populate(address: int, nbytes: int, threads: int = 8, chunk: int = CHUNK_BYTES) -> None:
    """Fault in a mapping's pages from several threads; a kernel without MADV_POPULATE_READ leaves the faults
    to the first reader."""
    libc = _libc()
    start, end = address - address % mmap.PAGESIZE, address + nbytes

    def one(offset: int) -> int:
        return int(libc.madvise(offset, min(chunk, end - offset), MADV_POPULATE_READ))

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(start, end, chunk)))


class PinError(RuntimeError):
    pass


class Pinned:
    """`with Pinned(address, nbytes) as pinned: for offset, size in pinned.chunks(): copy...` pins the range
    in chunks from `threads` threads, yields each chunk (in order) once pinned, and unpins all on exit."""

    def __init__(self, address: int, nbytes: int, threads: int = 4, chunk: int = CHUNK_BYTES,
                 library: str = "libcuda.so.1") -> None:
        self.lib = ctypes.CDLL(library)
        self.address, self.nbytes, self.threads, self.chunk = address, nbytes, threads, chunk
        self.context = ctypes.c_void_p()
        self._check("cuCtxGetCurrent", self.lib.cuCtxGetCurrent(ctypes.byref(self.context)))
        if not self.context.value:
            raise PinError("no current CUDA context in this thread")
        self.libc = _libc()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads)
        self._pinned: list[int] = []
        self._futures: list[concurrent.futures.Future[tuple[int, int]]] = []

    def _check(self, call: str, code: int) -> None:
        if code != 0:
            raise PinError(f"{call} failed ({code})")

    def _pin(self, offset: int, size: int) -> tuple[int, int]:
        self._check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self.context))
        address = self.address + offset
        self.libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), MADV_POPULATE_READ)
        self._check("cuMemHostRegister", self.lib.cuMemHostRegister_v2(
            ctypes.c_void_p(address), ctypes.c_size_t(size), ctypes.c_uint(0)))
        self._pinned.append(address)
        return offset, size

    def __enter__(self) -> Pinned:
        self._futures = [self._pool.submit(self._pin, offset, min(self.chunk, self.nbytes - offset))
                         for offset in range(0, self.nbytes, self.chunk)]
        return self

    def chunks(self) -> Iterator[tuple[int, int]]:
        for future in self._futures:
            yield future.result()

    def __exit__(self, *exc: object) -> None:
        concurrent.futures.wait(self._futures)

        def unpin(address: int) -> None:
            self.lib.cuCtxSetCurrent(self.context)
            self.lib.cuMemHostUnregister(ctypes.c_void_p(address))

        list(self._pool.map(unpin, self._pinned))
        self._pool.shutdown()
