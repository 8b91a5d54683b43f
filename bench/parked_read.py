"""The first read of a parked weights file, and what readies its pages beforehand.

A FROZEN worker's weights wait in a tmpfs file it wrote through a shared mapping (`TorchBackend.park`: the device's
copy into the mapping); its wake reads them back through staging buffers (`worker.staging.copy`, `pread` from 12
threads). The first wake after a park read that file at half the rate of the later ones in `volga bench tiers`
(8 GiB: 331 ms per thread against 135-153). Per size and per way of readying the file after the park's write
(`staging.ready_file`: none; one read of it from the staging threads; its pages faulted into a fresh mapping,
MADV_POPULATE_READ, from as many threads), side by side: the park's write, the readying, then three staged copies
of the file to the GPU as a wake makes them (buffers pinned beforehand), each compared with the weights bit for bit.

On the GPU machine: python3 bench/parked_read.py --gib 2,8 --out FILE.json
"""

from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import tempfile
import time

import benchio  # bench/, beside this script
import torch

from volga_agent.worker import staging


def measure(gib: float, folder: pathlib.Path, repeat: int, threads: int, ways: list[str]) -> dict[str, object]:
    nbytes = int(gib * 2**30) // 2**21 * 2**21
    weights = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    weights.random_(0, 255)
    target = torch.empty_like(weights)
    kept = staging.Kept()
    rows: dict[str, dict[str, object]] = {}
    for turn, way in enumerate(ways):
        path = folder / f"parked-{turn}-{way}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        t0 = time.perf_counter()
        torch.frombuffer(mapping, dtype=torch.uint8).copy_(weights)  # what `park` does
        written = time.perf_counter()
        mapping.close()
        closed = time.perf_counter()
        staging.ready_file(str(path), nbytes, way, threads)
        readied = time.perf_counter()
        copies, per_thread, identical = [], [], True
        fd = os.open(path, os.O_RDONLY)
        try:
            for _ in range(repeat):
                target.zero_()
                torch.cuda.synchronize()
                start = time.perf_counter()
                info = staging.copy(torch, target, staging.file_reader(fd), nbytes, threads=threads, kept=kept)
                copies.append(round((time.perf_counter() - start) * 1e3, 2))
                per_thread.append(round(info["read_s"] * 1e3 / threads, 2))
                identical = identical and bool(torch.equal(target, weights))
        finally:
            os.close(fd)
            path.unlink()
        row = rows[f"{turn}-{way}"] = {
            "park_write_ms": round((written - t0) * 1e3, 1), "ready_ms": round((readied - closed) * 1e3, 1),
            "copies_ms": copies, "read_ms_per_thread": per_thread, "identical": identical}
        print(f"{gib:g} GiB {way:9s} park {row['park_write_ms']} ms, ready {row['ready_ms']} ms, "
              f"copies {copies} ms, read per thread {per_thread} ms", flush=True)
    kept.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", default="2,8")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=staging.THREADS)
    parser.add_argument("--ways", default=",".join(staging.READY_WAYS),
                        help="ways of readying, in this order (a way may come again)")
    parser.add_argument("--folder", default="/dev/shm", help="where the parked files are written (a tmpfs mount)")
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        report = {"device": torch.cuda.get_device_name(), "threads": args.threads, "folder": args.folder,
                  "sizes": {g: measure(float(g), pathlib.Path(tmp), args.repeat, args.threads,
                                            args.ways.split(","))
                            for g in args.gib.split(",")}}
    benchio.emit(report, args.out)


if __name__ == "__main__":
    main()
