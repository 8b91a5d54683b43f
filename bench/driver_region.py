"""What a CUDA driver checkpoint saves, step by step: where a SUSPENDED worker's host memory and restore time go.

One child process per stage, each adding one thing a Volga GPU worker has: a bare CUDA context (PyTorch's), a
cuBLAS matmul, 128 MiB of weights and a forward pass, CUDA graphs for batch 1 and 8, and the same after
torch.cuda.empty_cache(). For each, the parent checkpoints the child with the driver API (lock + checkpoint),
reads how much the child's resident memory grew (what the driver copied out of the GPU) and GPU memory used,
then restores it (restore + unlock), three times; after the restores the child runs its model once more, to
show it still works. Variants repeat chosen stages with the context's limits changed right after it is made
(`stack=N`, `heap=N`, `fifo=N` bytes, cuCtxSetLimit) or with environment variables (`VAR=value` in upper case,
e.g. CUDA_MODULE_LOADING=EAGER). On the GPU machine:
    python3 bench/driver_region.py [--out FILE.json] [--variant NAME:KNOB,KNOB ...] [--stages 0,3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import benchio  # bench/, beside this script

from volga_agent.snapshot import cuda

CHILD = r'''
import os, signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
stage = int(sys.argv[1])
env = sys.argv[2]
import ctypes
import torch
torch.empty(1, device="cuda")
cuda = ctypes.CDLL("libcuda.so.1")
# env: comma-separated knobs applied once the context exists: stack=N, heap=N, fifo=N (cuCtxSetLimit bytes).
LIMITS = {"stack": 0, "fifo": 1, "heap": 2}
for knob in filter(None, env.split(",")):
    key, _, value = knob.partition("=")
    if key in LIMITS:
        assert cuda.cuCtxSetLimit(LIMITS[key], ctypes.c_size_t(int(value))) == 0, knob
# models=M: M weight matrices of 64 MiB (4096 x 4096 fp32) in this one context, as M small models sharing it;
# their sums are checked after the restores.
shared = [torch.randn(4096, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(k))
          for k in range(int(dict(knob.partition("=")[::2] for knob in env.split(",") if knob).get("models", 0)))]
sums = [float(m.sum()) for m in shared]
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
limits = []
for key, code in LIMITS.items():
    value = ctypes.c_size_t()
    cuda.cuCtxGetLimit(ctypes.byref(value), code)
    limits.append(f"{key}={value.value}")
print(torch.cuda.memory_reserved(), torch.cuda.memory_allocated(), ",".join(limits), flush=True)
signal.sigwaitinfo([signal.SIGUSR1])
probe = torch.randn(256, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
if stage >= 3:
    for g, _, _ in graphs:
        g.replay()
if stage >= 2:
    with torch.no_grad():
        probe = layers(torch.ones(8, 4096, device="cuda"))
assert [float(m.sum()) for m in shared] == sums, "a shared model's weights changed across the restores"
print(float((probe @ probe.T).float().sum() if stage < 2 else probe.sum()), flush=True)
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


def measure(driver: cuda.DriverCheckpoint, stage: int, knobs: str, repeat: int, base: float) -> dict[str, object]:
    env = dict(os.environ)
    env.update(k.split("=", 1) for k in knobs.split(",") if k and k.split("=", 1)[0].isupper())
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(stage), knobs], stdout=subprocess.PIPE, text=True,
                             env=env)
    assert child.stdout is not None
    reserved, allocated, limits = child.stdout.readline().split()
    used = gpu_used_mib() - base
    rss0 = rss_kib(child.pid)
    rows = []
    for _ in range(repeat):
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
    answer = child.stdout.readline().strip()
    child.wait(30)
    return {"gpu_used_mib": used, "torch_reserved_mib": round(int(reserved) / 2**20, 1),
            "torch_allocated_mib": round(int(allocated) / 2**20, 1), "limits": limits, "answer_after": answer,
            "exit": child.returncode, "runs": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--stages", default=",".join(str(i) for i in range(len(STAGES))))
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KNOBS",
                        help="e.g. small-stack:stack=256 or eager:CUDA_MODULE_LOADING=EAGER")
    args = parser.parse_args()
    driver = cuda.DriverCheckpoint()
    report: dict[str, object] = {}
    base = gpu_used_mib()
    stages = [int(s) for s in args.stages.split(",")]
    for variant in ["default:", *args.variant]:
        name, _, knobs = variant.partition(":")
        for stage in stages:
            key = STAGES[stage] if name == "default" else f"{STAGES[stage]}/{name}"
            report[key] = measure(driver, stage, knobs, args.repeat, base)
            print(key, json.dumps(report[key]), file=sys.stderr)
    benchio.emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
