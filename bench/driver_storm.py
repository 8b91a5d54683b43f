"""How many CUDA driver restores overlap: N processes checkpointed by the driver, then restored with at most K at
a time, for several K, in one run.

Each child is `driver_region.py`'s PyTorch process at one stage (default 1: a context with cuBLAS initialised, the
least a Volga GPU worker holds once its weights are out) with the 64-byte CUDA stack floor Volga workers set.
For every K the parent checkpoints all N (lock + checkpoint, one after another), then restores them from a pool of
K threads (restore + unlock; the driver API calls let go of Python's lock) and reports when the first and the last
were back. K = 1 is one after another, K = N all at once. Afterwards every child computes once more and must exit
cleanly. `--models-per-process M` gives each child M weight matrices of 64 MiB (small models sharing one
context): 16 models as 16 processes against 1 process of 16 or 4 of 4 shows what sharing a context saves a storm.
On the GPU machine:
    python3 bench/driver_storm.py [--n 16] [--at-once 1,2,4,8,16] [--stage 1] [--rounds 2] [--models-per-process 0]
                                  [--out FILE.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import statistics
import subprocess
import sys
import time

import driver_region  # bench/, beside this script

from volga_agent.snapshot import cuda


def _restore(driver: cuda.DriverCheckpoint, pid: int, start: float) -> tuple[float, float]:
    """Restore one process; when it began and ended, in seconds after `start`."""
    began = time.perf_counter()
    driver.resume(pid)
    return began - start, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--at-once", default="1,2,4,8,16")
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models-per-process", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    driver = cuda.DriverCheckpoint()
    knobs = f"stack=64,models={args.models_per_process}"
    children = [subprocess.Popen([sys.executable, "-c", driver_region.CHILD, str(args.stage), knobs],
                                 stdout=subprocess.PIPE, text=True) for _ in range(args.n)]
    for child in children:
        assert child.stdout is not None
        child.stdout.readline()  # loaded: its context exists
    rows = []
    try:
        for at_once in [int(k) for k in args.at_once.split(",")]:
            for _ in range(args.rounds):
                for child in children:
                    driver.suspend(child.pid)
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
                    pids = [c.pid for c in children]
                    spans = list(pool.map(_restore, [driver] * len(pids), pids, [start] * len(pids)))
                rows.append({"at_once": at_once, "all_ms": round(max(e for _, e in spans) * 1e3, 1),
                             "first_ms": round(min(e for _, e in spans) * 1e3, 1),
                             "each_p50_ms": round(statistics.median(e - b for b, e in spans) * 1e3, 1)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        exits = []
        for child in children:
            child.send_signal(10)
            assert child.stdout is not None
            child.stdout.readline()
            child.wait(60)
            exits.append(child.returncode)
    report = {"n": args.n, "stage": driver_region.STAGES[args.stage], "models_per_process": args.models_per_process,
              "rows": rows, "exits": exits,
              "summary": {str(k): min(r["all_ms"] for r in rows if r["at_once"] == k)
                          for k in sorted({int(r["at_once"]) for r in rows})}}
    print(json.dumps(report["summary"]))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(code == 0 for code in exits) else 1


if __name__ == "__main__":
    sys.exit(main())
