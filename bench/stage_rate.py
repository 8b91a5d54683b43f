"""How fast a staged weight copy runs, and where its threads' time goes, for each way of queueing the copies.

`worker.staging.copy` reads each piece of the weights into a small pinned buffer and queues its copy to the GPU,
from several threads. Each thread's time splits into reading (a memcpy or pread, the GIL let go), waiting for a
buffer's earlier copy, and queueing (Python calls, holding the GIL). Per size, from an anonymous host copy (huge
pages, as a SUSPENDED worker's) and from a file in /dev/shm (a parked file after a restore), side by side: the
copy limit (all of it pinned beforehand), then the staged copy with torch's calls or the driver's (`engine`),
N threads x M MiB buffers, buffers allocated by the copy or kept from before. Every copy is compared with the
source bit for bit.

On the GPU machine: python3 bench/stage_rate.py --gib 2,8 --out FILE.json
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import pathlib
import statistics
import sys
import tempfile
import time

import benchio  # bench/, beside this script
import torch

from volga_agent.worker import staging

MADV_HUGEPAGE = 14
Way = tuple[str, int, int]  # engine, threads, MiB per buffer
WAYS: list[Way] = [("torch", 16, 8), ("driver", 16, 8), ("driver", 8, 8), ("driver", 8, 16), ("driver", 16, 16),
                   ("driver", 4, 32)]
SOURCES = ("memory", "file")
KEPT = (False, True)
MADV_POPULATE_READ = 22


def now() -> float:
    torch.cuda.synchronize()
    return time.perf_counter() * 1e3


def populated_reader(source: int) -> staging.Reader:
    """A memory copy from a file mapping whose piece is faulted in first in one call (MADV_POPULATE_READ)."""
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    copy = staging.memory_reader(source)

    def read(buffer: memoryview, address: int, offset: int, size: int) -> None:
        libc.madvise(source + offset, size, MADV_POPULATE_READ)
        copy(buffer, address, offset, size)
    return read


def alloc_costs(ways: list[Way], repeat: int) -> dict[str, float]:
    """Pinning and freeing a way's staging buffers (threads x 2 x chunk), ms, median."""
    out = {}
    for _, threads, mib in ways:
        runs = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            staging.Buffers(torch, threads * staging.DEPTH, mib * 2**20).close()
            runs.append((time.perf_counter() - t0) * 1e3)
        out[f"{threads}x{mib}m"] = round(statistics.median(runs), 2)
    return out


def measure(gib: float, folder: pathlib.Path, repeat: int, ways: list[Way], sources: tuple[str, ...],
            kept_ways: tuple[bool, ...]) -> dict[str, object]:
    nbytes = int(gib * 2**30) // 2**21 * 2**21
    ref = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ref.random_(0, 255)
    target = torch.empty_like(ref)
    rows: dict[str, dict[str, list[float]]] = {}
    identical: dict[str, bool] = {}

    def record(name: str, **values: float) -> None:
        row = rows.setdefault(name, {})
        for key, value in values.items():
            row.setdefault(key, []).append(round(value, 2))

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(ref)
    for _ in range(repeat):
        t0 = now()
        target.copy_(pinned, non_blocking=True)
        record("limit_pinned", ms=now() - t0)
    del pinned
    getattr(torch._C, "_host_emptyCache", lambda: None)()

    host = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(host))
    ctypes.CDLL(None).madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    torch.frombuffer(host, dtype=torch.uint8).copy_(ref)
    path = folder / "weights.bin"
    with open(path, "wb") as f:
        f.write(host)

    for source in sources:
        for engine, threads, mib in ways:
            for kept in kept_ways:
                name = f"{source}_{engine}_{threads}x{mib}m" + ("_kept" if kept else "")
                for _ in range(repeat):
                    buffers = staging.Buffers(torch, threads * staging.DEPTH, mib * 2**20) if kept else None
                    fd = os.open(path, os.O_RDONLY) if source == "file" else -1
                    mapped = benchio.fresh(path, nbytes) if source.startswith("mapped") else None
                    if mapped is not None:
                        at = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
                        read = populated_reader(at) if source == "mapped_populate" else staging.memory_reader(at)
                    else:
                        read = staging.file_reader(fd) if source == "file" else staging.memory_reader(address)
                    t0 = now()
                    info = staging.copy(torch, target, read, nbytes, buffers=buffers, threads=threads,
                                        chunk=mib * 2**20, engine=engine)
                    ms = now() - t0
                    if fd >= 0:
                        os.close(fd)
                    if mapped is not None:
                        del read
                        mapped.close()
                    if buffers is not None:
                        buffers.close()
                    record(name, ms=ms, gbps=nbytes / ms / 1e6, alloc_ms=info["staging_alloc_s"] * 1e3,
                           read_ms_per_thread=info["read_s"] * 1e3 / threads,
                           wait_ms_per_thread=info["wait_s"] * 1e3 / threads,
                           queue_ms_per_thread=info["queue_s"] * 1e3 / threads)
                    identical[name] = identical.get(name, True) and bool(torch.equal(target, ref))
                    target.zero_()
                print(name, {k: statistics.median(v) for k, v in rows[name].items()}, file=sys.stderr, flush=True)
    path.unlink()
    host.close()
    return {"bytes": nbytes, "identical": identical,
            "rows": {name: {k: {"median": statistics.median(v), "all": v} for k, v in row.items()}
                     for name, row in rows.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", default="2,8")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ways", help="engine:threads:MiB,... (default: the comparison above)")
    parser.add_argument("--sources", default=",".join(SOURCES),
                        help="memory, file (pread), mapped (a fresh file mapping), mapped_populate")
    parser.add_argument("--kept-only", action="store_true", help="only buffers kept from before")
    parser.add_argument("--out")
    args = parser.parse_args()
    ways = ([(e, int(t), int(m)) for e, t, m in (w.split(":") for w in args.ways.split(","))] if args.ways
            else WAYS)
    sources = tuple(args.sources.split(","))
    kept_ways = (True,) if args.kept_only else KEPT
    report: dict[str, object] = {"cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
                                 "gpu": torch.cuda.get_device_name()}
    report["alloc_close_ms"] = alloc_costs(ways, args.repeat)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        for gib in (float(g) for g in args.gib.split(",")):
            report[f"{gib:g}"] = measure(gib, pathlib.Path(tmp), args.repeat, ways, sources, kept_ways)
    benchio.emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
