"""How fast parked weights come back: a tmpfs file, freshly mapped (as after a CRIU restore), copied to the GPU.

The restored worker's mapping has no page tables; the first reader faults every page. This compares, per size:
the copy limit (pinned host memory), a pageable copy straight from the fresh mapping, the same after faulting the
mapping in from 1, 8 or 16 threads (madvise MADV_POPULATE_READ), registering the mapping with CUDA (pinning)
before the copy, and what a parked worker does (`volga_agent.worker.pinning`: chunks pinned from several threads,
each copied once pinned). On the GPU machine:
    python3 bench/park_reload.py --gib 0.1,2 [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import benchio  # bench/, beside this script
import torch

from volga_agent.worker import pinning


def now() -> float:
    torch.cuda.synchronize()
    return time.perf_counter() * 1e3


def measure(gib: float, folder: pathlib.Path, repeat: int) -> dict[str, object]:
    nbytes = int(gib * 2**30) // 4096 * 4096
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.random_(0, 255)
    path = folder / "weights.bin"
    with open(path, "wb") as f:
        f.truncate(nbytes)
    m = benchio.fresh(path, nbytes)
    host = torch.frombuffer(m, dtype=torch.uint8)
    host.copy_(device)
    del host
    m.close()
    target = torch.empty_like(device)
    page_locked = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    page_locked.copy_(device)
    out: dict[str, list[float]] = {}

    def record(name: str, ms: float) -> None:
        out.setdefault(name, []).append(round(ms, 2))

    for _ in range(repeat):
        t0 = now()
        target.copy_(page_locked, non_blocking=True)
        record("pinned_copy_ms", now() - t0)
        for threads in (0, 1, 8, 16):
            m = benchio.fresh(path, nbytes)
            host = torch.frombuffer(m, dtype=torch.uint8)
            t0 = now()
            if threads:
                pinning.populate(host.data_ptr(), nbytes, threads)
            t1 = now()
            target.copy_(host, non_blocking=True)
            t2 = now()
            record(f"populate{threads}_ms", t1 - t0)
            record(f"populate{threads}_copy_ms", t2 - t1)
            record(f"populate{threads}_total_ms", t2 - t0)
            del host
            m.close()
        m = benchio.fresh(path, nbytes)
        host = torch.frombuffer(m, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        t0 = now()
        pinning.populate(host.data_ptr(), nbytes, 8)
        t1 = now()
        cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
        t2 = now()
        target.copy_(host, non_blocking=True)
        t3 = now()
        cudart.cudaHostUnregister(host.data_ptr())
        record("populate8_register_copy_ms", t3 - t0)
        record("register_ms", t2 - t1)
        record("registered_copy_ms", t3 - t2)
        del host
        m.close()
        for threads in (4, 8, 16):  # what a parked worker's wake does: pin chunks from threads, copy each when pinned
            m = benchio.fresh(path, nbytes)
            host = torch.frombuffer(m, dtype=torch.uint8)
            target.zero_()
            t0 = now()
            with pinning.Pinned(host.data_ptr(), nbytes, threads=threads) as pinned:
                for offset, size in pinned.chunks():
                    target[offset:offset + size].copy_(host[offset:offset + size], non_blocking=True)
                t1 = now()
            record(f"chunks{threads}_copy_ms", t1 - t0)
            record(f"chunks{threads}_unpin_ms", now() - t1)
            same = bool(torch.equal(target, device))
            del host
            m.close()
    path.unlink()
    summary: dict[str, object] = {k: {"median": sorted(v)[len(v) // 2], "all": v} for k, v in out.items()}
    summary["identical"] = same
    summary["bytes"] = nbytes
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", default="0.1,2")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    report = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        for gib in (float(g) for g in args.gib.split(",")):
            report[f"{gib:g}"] = measure(gib, pathlib.Path(tmp), args.repeat)
            print(f"{gib:g} GiB", json.dumps({k: v["median"] if isinstance(v, dict) else v
                                              for k, v in report[f"{gib:g}"].items()}), file=sys.stderr)
    benchio.emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
