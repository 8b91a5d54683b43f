"""Where a GPU wake's weight copy and the driver's restore go, and what each way of copying costs, side by side.

Part 1, per size: the copy limit (memory pinned beforehand); from a resident anonymous host copy (SUSPENDED's
weights once unpinned), with 4 KiB pages and with transparent huge pages: pinned whole in place
(cudaHostRegister, copy, unregister), pinned chunk by chunk from 4 threads (`worker.pinning`, what a wake does
today), and staged through small pinned buffers from T threads (`worker.staging`, memcpy); from a parked file in
/dev/shm freshly mapped (FROZEN's weights after a CRIU restore): `worker.pinning` in place, and staged reads
(pread) from T threads; the same from a tmpfs mounted with huge=always where the machine allows one.

Part 2: the driver's restore of a PyTorch process holding nothing, or 2 / 8 GiB of host memory that is pinned
(registered, 4 KiB or huge pages; cudaHostAlloc) or pageable: what holding pinned memory across a checkpoint costs.

On the GPU machine: python3 bench/copy_paths.py --gib 2,8 --out FILE.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import benchio  # bench/, beside this script
import torch

from volga_agent.worker import pinning, staging

MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15


def now() -> float:
    torch.cuda.synchronize()
    return time.perf_counter() * 1e3


def anon(nbytes: int, huge: bool) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None)
    libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    return m, address


def huge_kib(address: int) -> int:
    """AnonHugePages of the mapping at `address` (smaps)."""
    text = pathlib.Path("/proc/self/smaps").read_text()
    inside = False
    for line in text.splitlines():
        if "-" in line.split(" ")[0] and not line.startswith(("Anon", "Size")):
            lo, _, hi = line.split(" ")[0].partition("-")
            with contextlib.suppress(ValueError):
                inside = int(lo, 16) <= address < int(hi, 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def measure(gib: float, folders: dict[str, pathlib.Path], repeat: int) -> dict[str, object]:
    nbytes = int(gib * 2**30) // 2**21 * 2**21
    ref = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ref.random_(0, 255)
    target = torch.empty_like(ref)
    out: dict[str, list[float]] = {}
    checks: dict[str, bool] = {}
    cudart = torch.cuda.cudart()

    def record(name: str, ms: float) -> None:
        out.setdefault(name, []).append(round(ms, 2))

    def check(name: str) -> None:
        checks[name] = bool(torch.equal(target, ref))
        target.zero_()

    page_locked = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    page_locked.copy_(ref)
    for _ in range(repeat):
        t0 = now()
        target.copy_(page_locked, non_blocking=True)
        record("limit_pinned_copy_ms", now() - t0)
    del page_locked
    getattr(torch._C, "_host_emptyCache", lambda: None)()

    sources = {}
    for huge in (False, True):
        kind = "thp" if huge else "4k"
        m, address = anon(nbytes, huge)
        host = torch.frombuffer(m, dtype=torch.uint8)
        t0 = now()
        assert int(cudart.cudaHostRegister(address, nbytes, 0)) == 0
        t1 = now()
        host.copy_(ref)
        t2 = now()
        cudart.cudaHostUnregister(address)
        t3 = now()
        record(f"anon{kind}_first_register_ms", t1 - t0)
        record(f"anon{kind}_d2h_ms", t2 - t1)
        record(f"anon{kind}_first_unregister_ms", t3 - t2)
        out[f"anon{kind}_huge_kib"] = [huge_kib(address)]
        sources[kind] = (m, address, host)
        for _ in range(repeat):
            t0 = now()
            cudart.cudaHostRegister(address, nbytes, 0)
            t1 = now()
            target.copy_(host, non_blocking=True)
            t2 = now()
            cudart.cudaHostUnregister(address)
            t3 = now()
            record(f"anon{kind}_register_ms", t1 - t0)
            record(f"anon{kind}_registered_copy_ms", t2 - t1)
            record(f"anon{kind}_unregister_ms", t3 - t2)
            check(f"anon{kind}_register")
            t0 = now()
            with pinning.Pinned(address, nbytes, threads=4) as pinned:
                for offset, size in pinned.chunks():
                    target[offset:offset + size].copy_(host[offset:offset + size], non_blocking=True)
                t1 = now()
            record(f"anon{kind}_chunks4_copy_ms", t1 - t0)
            record(f"anon{kind}_chunks4_unpin_ms", now() - t1)
            check(f"anon{kind}_chunks4")
            for threads, chunk in ((8, 16), (16, 16), (16, 32)):
                t0 = now()
                info = staging.copy(torch, target, staging.memory_reader(address), nbytes, threads=threads,
                                    chunk=chunk * 2**20)
                record(f"anon{kind}_staged{threads}x{chunk}m_ms", now() - t0)
                record(f"anon{kind}_staged{threads}x{chunk}m_alloc_ms", info["staging_alloc_s"] * 1e3)
                check(f"anon{kind}_staged{threads}x{chunk}m")
            # buffers kept between copies (allocated before, as a worker that keeps them while HOT would)
            buffers = staging.Buffers(torch, 32, 16 * 2**20)
            t0 = now()
            staging.copy(torch, target, staging.memory_reader(address), nbytes, buffers=buffers, threads=16)
            record(f"anon{kind}_staged16x16m_kept_ms", now() - t0)
            buffers.close()
            check(f"anon{kind}_staged16x16m_kept")

    m, address, host = sources["thp"]
    for name, folder in folders.items():
        path = folder / "weights.bin"
        with open(path, "wb") as f:
            f.write(m)
        for _ in range(repeat):
            fm = benchio.fresh(path, nbytes)
            fhost = torch.frombuffer(fm, dtype=torch.uint8)
            t0 = now()
            with pinning.Pinned(fhost.data_ptr(), nbytes, threads=4) as pinned:
                for offset, size in pinned.chunks():
                    target[offset:offset + size].copy_(fhost[offset:offset + size], non_blocking=True)
                t1 = now()
            record(f"{name}_chunks4_copy_ms", t1 - t0)
            record(f"{name}_chunks4_unpin_ms", now() - t1)
            check(f"{name}_chunks4")
            del fhost
            fm.close()
            for threads, chunk in ((8, 16), (12, 16), (16, 16), (16, 32)):
                fd = os.open(path, os.O_RDONLY)
                t0 = now()
                info = staging.copy(torch, target, staging.file_reader(fd), nbytes, threads=threads,
                                    chunk=chunk * 2**20)
                record(f"{name}_staged{threads}x{chunk}m_ms", now() - t0)
                record(f"{name}_staged{threads}x{chunk}m_alloc_ms", info["staging_alloc_s"] * 1e3)
                os.close(fd)
                check(f"{name}_staged{threads}x{chunk}m")
        path.unlink()
    sources.clear()
    summary: dict[str, object] = {k: {"median": statistics.median(v), "all": v} for k, v in out.items()}
    summary["identical"] = checks
    summary["bytes"] = nbytes
    return summary


CHILD = r'''
import ctypes, mmap, sys, torch
kind, gib = sys.argv[1], float(sys.argv[2])
keep = torch.ones(64 * 2**20, dtype=torch.uint8, device="cuda")
n = int(gib * 2**30)
libc = ctypes.CDLL(None)
held = None
if kind == "hostalloc":
    held = torch.ones(n, dtype=torch.uint8, pin_memory=True)
elif kind != "none":
    m = mmap.mmap(-1, n, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(n), 14 if "thp" in kind else 15)
    torch.frombuffer(m, dtype=torch.uint8).fill_(1)
    if kind.startswith("reg"):
        assert int(torch.cuda.cudart().cudaHostRegister(a, n, 0)) == 0
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
print(int(keep.sum().item()) == 64 * 2**20, flush=True)
'''


def driver_restores(repeat: int, sizes: list[float]) -> dict[str, object]:
    from volga_agent.snapshot import cuda

    driver = cuda.DriverCheckpoint()
    configs = [("none", 0.0)] + [(k, g) for g in sizes for k in ("reg4k", "regthp", "pageable", "hostalloc")]
    out: dict[str, object] = {}
    for kind, gib in configs:
        child = subprocess.Popen([sys.executable, "-c", CHILD, kind, str(gib)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == "ready"
            runs = []
            for _ in range(repeat):
                driver.suspend(child.pid)
                driver.resume(child.pid)
                runs.append({k: round(v, 1) for k, v in driver.timings[child.pid].items()})
            child.stdin.write("\n")
            child.stdin.flush()
            works = child.stdout.readline().strip()
        finally:
            child.kill()
            child.wait()
        label = f"{kind}_{gib:g}gib" if gib else kind
        out[label] = {"restore_ms": statistics.median(r["restore_ms"] for r in runs),
                      "checkpoint_ms": statistics.median(r["checkpoint_ms"] for r in runs), "runs": runs,
                      "works_after": works}
        print(label, json.dumps(out[label]), file=sys.stderr, flush=True)
    return out


def machine() -> dict[str, str]:
    info = {}
    for name in ("enabled", "defrag", "shmem_enabled"):
        p = pathlib.Path("/sys/kernel/mm/transparent_hugepage") / name
        info[f"thp_{name}"] = p.read_text().strip() if p.exists() else "absent"
    info["dev_shm"] = next((line for line in pathlib.Path("/proc/mounts").read_text().splitlines()
                            if " /dev/shm " in line), "")
    info["cpus"] = str(os.cpu_count())
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", default="2,8")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--restore-repeat", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    sizes = [float(g) for g in args.gib.split(",")]
    report: dict[str, object] = {"machine": machine()}
    print(json.dumps(report["machine"]), file=sys.stderr, flush=True)
    report["driver_restore"] = driver_restores(args.restore_repeat, sizes)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        folders = {"devshm": pathlib.Path(tmp)}
        huge = pathlib.Path(tempfile.mkdtemp(prefix="hugetmpfs-"))
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,size=24g", "hugetmpfs", str(huge)],
                                 capture_output=True, text=True)
        report["huge_tmpfs"] = mounted.returncode == 0 or mounted.stderr.strip()
        if mounted.returncode == 0:
            folders["hugetmpfs"] = huge
        try:
            for gib in sizes:
                report[f"{gib:g}"] = measure(gib, folders, args.repeat)
                row = report[f"{gib:g}"]
                assert isinstance(row, dict)
                print(f"{gib:g} GiB", json.dumps({k: v["median"] if isinstance(v, dict) and "median" in v else v
                                                  for k, v in row.items()}), file=sys.stderr, flush=True)
                if args.out:
                    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
        finally:
            if mounted.returncode == 0:
                subprocess.run(["umount", str(huge)], check=False)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
