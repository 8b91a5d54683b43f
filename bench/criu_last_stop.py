"""How long criu restore waits for the restored threads' last stop, with hardware breakpoints and without.

criu restore stops every restored thread at its last step (rt_sigreturn) before it lets the tree go: by default with
a hardware breakpoint set through ptrace, or (`criu.NO_BREAKPOINTS`, the engine's default) by tracing each thread's
system calls to it. This freezes a process shaped like a GPU worker's tree for criu (17 threads, 2,000 mappings,
1 GiB of memory; no GPU) and restores it lazily with the agent's lazy-pages server, `-n` times each way, the ways
alternating. criu logs at -v4; per restore the report has criu's whole restore (ms), the time in its log until
"Unlock network" (the tree rebuilt), and the wait from the last thread's final step before the stop (its seccomp
line) to criu seeing the first thread stopped ("was trapped"). With `--memory shared` the memory is shared, which
criu copies in during the restore instead of serving it lazily: the restore then runs with the kernel busy.

python3 bench/criu_last_stop.py -n 12 [--memory shared] --out FILE.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import benchio  # bench/, beside this script

from volga_agent.host import process
from volga_agent.snapshot import criu

TREE = r"""
import mmap, sys, threading, time
flags = mmap.MAP_SHARED if sys.argv[1] == "shared" else mmap.MAP_PRIVATE
stop = threading.Event()
for _ in range(16):
    threading.Thread(target=stop.wait, daemon=True).start()
memory = mmap.mmap(-1, 1 << 30, flags=flags | mmap.MAP_ANONYMOUS)
for at in range(0, 1 << 30, 4096):
    memory[at] = 1
count = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
mappings = [mmap.mmap(-1, 8192, flags=flags | mmap.MAP_ANONYMOUS,
                      prot=mmap.PROT_READ | (mmap.PROT_WRITE if i % 2 else 0)) for i in range(count)]
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""


@dataclasses.dataclass(frozen=True)
class Wake:
    image: criu.Image
    restored: criu.Restored
    mappings: int  # the tree's, as /proc/PID/maps listed them before the dump


@contextlib.contextmanager
def woken(engine: criu.CriuEngine, name: str, memory: str = "private", mappings: int = 2000) -> Iterator[Wake]:
    """`TREE` (its memory private or shared, `mappings` small mappings of its own) frozen into an image of `name` and
    restored lazily with the agent's lazy-pages server, as a wake is; the lazy pages it held back come once the block
    is left, then the tree is killed and its image removed."""
    tree = subprocess.Popen([sys.executable, "-c", TREE, memory, str(mappings)], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    assert tree.stdout is not None
    tree.stdout.readline()
    count = len(pathlib.Path(f"/proc/{tree.pid}/maps").read_text().splitlines())
    image = engine.dump(tree.pid, name)
    tree.wait()
    restored = engine.restore(image, lazy=True, wake=True)
    try:
        yield Wake(image, restored, count)
        restored.release()
    finally:
        process.kill_tree(restored.pid)
        engine.remove(image)


def one(engine: criu.CriuEngine, name: str, memory: str) -> dict[str, float]:
    with woken(engine, name, memory) as wake:
        log = benchio.criu_log(wake.image.path / "restore.log")
        return {"criu_restore_ms": round(wake.restored.seconds * 1e3, 1), "unlock_ms": round(log["unlock_ms"], 1),
                "last_stop_wait_ms": round(log["last_stop_wait_ms"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=12, help="restores each way")
    parser.add_argument("--memory", choices=("private", "shared"), default="private",
                        help="the process's memory private (restored lazily) or shared (which criu restores eagerly, "
                        "copying 1 GiB during the restore)")
    parser.add_argument("--out")
    args = parser.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(prefix="volga-last-stop-", dir="/dev/shm"))
    engine = criu.CriuEngine(root, log_level=4)
    ways: dict[str, list[dict[str, float]]] = {"breakpoints": [], "traced": []}
    try:
        for i in range(args.n):
            for way, rows in ways.items():
                engine.breakpoints = way == "breakpoints"
                rows.append(one(engine, f"{way}-{i}", args.memory))
                print(way, rows[-1], flush=True)
                time.sleep(0.3)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report: dict[str, Any] = {"bench": "criu-last-stop", "memory": args.memory, "criu": engine.version(),
                              "cpus": os.cpu_count(),
                              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ways": {}}
    for way, rows in ways.items():
        waits = [r["last_stop_wait_ms"] for r in rows]
        report["ways"][way] = {"last_stop_wait_ms_p50": statistics.median(waits), "last_stop_wait_ms_max": max(waits),
                               "over_5_ms": sum(w > 5 for w in waits),
                               "criu_restore_ms_p50": statistics.median(r["criu_restore_ms"] for r in rows),
                               "restores": rows}
    benchio.emit(report, args.out)


if __name__ == "__main__":
    main()
