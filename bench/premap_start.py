"""What starting a premap costs the wake that starts it.

A FROZEN GPU wake starts `regions.premap` on the restored process's parked mappings just before the driver's
restore, whose page faults it takes off that restore's path. The premap's threads do their reading beside the
driver's restore; only starting them is on the wake's path. A `threading.Thread.start` waits until the new thread
has taken the GIL, so starting each thread from the caller waits behind the threads started before it (reading
already, a Python step between each read) and behind any other busy thread of the agent (up to its switch interval,
5 ms, each time). `regions.Premap` starts one thread, which starts the others.

This maps a 256 MiB file in a child process and times the call that starts an 8-thread premap of it, `-n` times each
way, alternating: as `regions.premap` starts it (`launcher`), and the way before, each thread started by the caller
(`caller`); with the bench process otherwise idle (`idle`), then with a thread of it spinning in Python (`busy`).

python3 bench/premap_start.py -n 30 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from volga_agent.worker import regions

SIZE = 256 << 20
THREADS = 8


class CallerStarted(regions.Premap):
    """The way before: each reading thread started by the caller."""

    def _start(self) -> None:
        for _ in range(self._left):
            threading.Thread(target=self._read, daemon=True).start()


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=30, help="premaps started each way and load")
    parser.add_argument("--out")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="premap-start-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(folder, "parked")
    with open(path, "wb") as f:
        f.truncate(SIZE)
    child = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
        "print('mapped', flush=True); sys.stdin.read()"), path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    report: dict[str, Any] = {"bench": "premap-start", "threads": THREADS, "bytes": SIZE, "cpus": os.cpu_count(),
                              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loads": {}}
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "mapped"
        with open(f"/proc/{child.pid}/maps") as maps:
            line = next(line for line in maps if line.rstrip().endswith(path))
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        ranges = [regions.Region(lo, hi, mmap.PROT_READ)]
        for load in ("idle", "busy"):
            stop = threading.Event()
            if load == "busy":
                threading.Thread(target=_spin, args=(stop,), daemon=True).start()
            calls: dict[str, list[float]] = {"launcher": [], "caller": []}
            for i in range(2 * args.n):
                way = ("launcher", "caller")[i % 2]
                began = time.perf_counter()
                started = regions.premap(child.pid, ranges, THREADS) if way == "launcher" else \
                    CallerStarted(child.pid, ranges, THREADS)
                calls[way].append((time.perf_counter() - began) * 1e3)
                assert started is not None and started.wait(30) and not started.error, started
            stop.set()
            report["loads"][load] = {way: {"call_ms_p50": round(statistics.median(v), 2),
                                           "call_ms_max": round(max(v), 2), "calls_ms": [round(x, 2) for x in v]}
                                     for way, v in calls.items()}
            print(f"{load}: the call that starts it, p50 / max ms: " + ", ".join(
                f"{way} {statistics.median(v):.2f} / {max(v):.2f}" for way, v in calls.items()), flush=True)
    finally:
        child.kill()
        child.wait()
        os.unlink(path)
        os.rmdir(folder)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
