"""What the threads of a process do while the CUDA driver restores it, SUSPENDED beside FROZEN.

`volga bench server --gpu --hooks level2-parked` wakes the LLM server from SUSPENDED and from FROZEN; the driver's
restore of the same context takes longer in the FROZEN wake. This runs that bench with `DriverCheckpoint.restore`
wrapped: during each restore, a thread samples every thread of the restored process (its state from
/proc/PID/task/TID/stat and, while running or in uninterruptible sleep, its kernel stack), and after it each
thread's CPU ticks (user, system), minor faults, time on a CPU and time runnable but waiting for one over the restore
are kept. The report's own lazy-page fault times
say how many faults the agent's page server answered during the driver's phase. Root only (kernel stacks).
Each thread's time on a CPU and waiting for one come from /proc/PID/task/TID/schedstat.

On the GPU machine: python3 bench/driver_restore_threads.py --out FILE.json [-n 4] [--models /dev/shm/llm]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from volga_agent.snapshot import cuda
from volga_bench import llmserver

FRAMES = 7  # the innermost kernel frames kept per sample


Thread = tuple[str, str, int, int, int, int, int]


def _thread(pid: int, tid: str) -> Thread:
    """Name, state, user and system ticks, minor faults, and from schedstat the nanoseconds on a CPU and waiting for
    one (runnable, not running) of one thread of `pid`."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        stat = f.read()
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        on_cpu, waiting, _ = (int(x) for x in f.read().split())
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat.rsplit(")", 1)[1].split()
    return name, fields[0], int(fields[11]), int(fields[12]), int(fields[7]), on_cpu, waiting


def _threads(pid: int) -> dict[str, Thread]:
    got = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # gone meanwhile
            got[tid] = _thread(pid, tid)
    return got


def _stack(pid: int, tid: str) -> str:
    with open(f"/proc/{pid}/task/{tid}/stack") as f:
        frames = [line.split(" ", 1)[1].split("+")[0] for line in f.read().splitlines() if " " in line]
    return "<".join(frames[:FRAMES])


class Sampler:
    """Samples the threads of `pid` until `stop`: state counts, kernel stacks of running and blocked threads."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.states: collections.Counter[str] = collections.Counter()
        self.stacks: collections.Counter[str] = collections.Counter()
        self.sweeps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for tid, (name, state, *_) in _threads(self.pid).items():
                self.states[f"{name}:{state}"] += 1
                if state in "RD":
                    with contextlib.suppress(OSError):
                        self.stacks[f"{name}:{state}:{_stack(self.pid, tid)}"] += 1
            self.sweeps += 1
            time.sleep(0.0005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("-n", type=int, default=4, help="SUSPENDED and FROZEN wakes")
    p.add_argument("--models", default="/dev/shm/llm")
    args = p.parse_args(argv)
    records: list[dict[str, Any]] = []
    restore = cuda.DriverCheckpoint.restore

    def sampled(self: cuda.DriverCheckpoint, pid: int, gpu_pairs: Sequence[cuda.GpuPair] = ()) -> None:
        before = _threads(pid)
        sampler = Sampler(pid)
        began = time.perf_counter()
        try:
            restore(self, pid, gpu_pairs)
        finally:
            ms = (time.perf_counter() - began) * 1e3
            sampler.stop()
            threads = {}
            for tid, now in _threads(pid).items():
                b = before.get(tid, (now[0], "", 0, 0, 0, 0, 0))
                moved: list[float] = [now[2] - b[2], now[3] - b[3], now[4] - b[4],
                                      round((now[5] - b[5]) / 1e6, 1), round((now[6] - b[6]) / 1e6, 1)]
                if any(moved):
                    threads[f"{now[0]}/{tid}"] = dict(zip(("user_ticks", "system_ticks", "minflt", "on_cpu_ms",
                                                           "runnable_ms"), moved, strict=True))
            records.append({"pid": pid, "restore_ms": round(ms, 1), "sweeps": sampler.sweeps, "threads": threads,
                            "states": dict(sampler.states.most_common()),
                            "stacks": sampler.stacks.most_common(40)})

    cuda.DriverCheckpoint.restore = sampled  # type: ignore[method-assign]
    report = llmserver.bench(args.n, 0, ["level2-parked"], 32768, args.models,
                             lambda line: print(line, file=sys.stderr))
    n = args.n
    for i, r in enumerate(records):  # the bench wakes from SUSPENDED n times, then from FROZEN n times
        r["tier"] = "SUSPENDED" if i < n else "FROZEN"
    with open(args.out, "w") as f:
        json.dump({"ticks_per_second": os.sysconf("SC_CLK_TCK"), "restores": records, "report": report}, f, indent=1)
    for r in records:
        busiest = max(r["threads"].items(), key=lambda kv: kv[1]["on_cpu_ms"])
        print(f"{r['tier']:9} restore {r['restore_ms']:6.1f} ms; {busiest[0]}: {busiest[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
