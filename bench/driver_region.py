"""What a CUDA driver checkpoint saves, step by step: where a SUSPENDED worker's host memory and restore time go.

One child process per stage, each adding one thing a Volga GPU worker has: a bare CUDA context (PyTorch's), a
cuBLAS matmul, 128 MiB of weights and a forward pass, CUDA graphs for batch 1 and 8, and the same after
torch.cuda.empty_cache(). For each, the parent checkpoints the child with the driver API (lock + checkpoint),
reads how much the child's resident memory grew (what the driver copied out of the GPU) and GPU memory used,
then restores it (restore + unlock), three times. On the GPU machine:
    python3 bench/driver_region.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from volga_agent.snapshot import cuda

CHILD = r'''
import os, signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
stage = int(sys.argv[1])
env = sys.argv[2]
import torch
torch.empty(1, device="cuda")
if stage >= 1:
    a = torch.randn(512, 512, device="cuda")
    (a @ a).sum().item()
if stage >= 2:
    layers = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(2)]).cuda().eval()
    x = torch.randn(8, 4096, device="cuda")
    with torch.no_grad():
        layers(x)
if stage >= 3:
    graphs = []
    for batch in (1, 8):
        static = torch.zeros(batch, 4096, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(3):
                layers(static)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            out = layers(static)
        graphs.append((g, static, out))
if stage >= 4:
    torch.cuda.empty_cache()
torch.cuda.synchronize()
print(torch.cuda.memory_reserved(), torch.cuda.memory_allocated(), flush=True)
signal.sigwaitinfo([signal.SIGUSR1])
'''
STAGES = ["context", "cublas", "weights_128mib", "cuda_graphs", "empty_cache"]


def rss_kib(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def gpu_used_mib() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.split()[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    driver = cuda.DriverCheckpoint()
    report = {}
    base = gpu_used_mib()
    for stage, name in enumerate(STAGES):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(stage), ""], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        reserved, allocated = (int(v) for v in child.stdout.readline().split())
        used = gpu_used_mib() - base
        rss0 = rss_kib(child.pid)
        rows = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            driver.suspend(child.pid)
            t1 = time.perf_counter()
            grown = rss_kib(child.pid) - rss0
            t2 = time.perf_counter()
            driver.resume(child.pid)
            t3 = time.perf_counter()
            rows.append({"checkpoint_ms": round((t1 - t0) * 1e3, 1), "restore_ms": round((t3 - t2) * 1e3, 1),
                         "host_growth_mib": round(grown / 1024, 1)})
        child.send_signal(10)
        child.wait(30)
        report[name] = {"gpu_used_mib": used, "torch_reserved_mib": round(reserved / 2**20, 1),
                        "torch_allocated_mib": round(allocated / 2**20, 1), "runs": rows}
        print(name, json.dumps(report[name]), file=sys.stderr)
    text = json.dumps(report, indent=1)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
