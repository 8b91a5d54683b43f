"""Where each FROZEN wake's CRIU restore spends its time, wake by wake.

`volga bench tiers --gpu` times a FROZEN wake's restore as one phase (`criu_restore_ms`: from starting criu, or its
lazy-pages daemon first, to criu's exit). On an H200 that phase alternated from wake to wake at 2 GiB, about 50 and
80 ms (runs 9 and 10). This runs the same bench with criu's restore and its lazy-pages daemon logging at -v4
(every line timestamped from each one's start) and keeps their logs, then sets side by side, per wake: the phase as
the bench took it, the time criu's own log spans, what lies outside it (starting the daemon and criu, waiting for
their exit), and the largest gaps between consecutive lines of each log, with the line each gap ends at; and the
CPU time the machine's cgroup was throttled meanwhile (cpu.stat), where it has a CPU limit; and the bench process's
own garbage collections that overlapped each restore. Per restore also when criu had rebuilt the tree and how long
it then waited for the restored threads' last stop (`last_stop_wait_ms`; `VOLGA_CRIU_BREAKPOINTS=1` for criu's
breakpoints there). With `--tiers suspended,frozen` SUSPENDED is woken first, as the tiers bench does;
`--no-gc-freeze` leaves out the bench's `gc.freeze` once it serves (`process.settled`); `--lazy-pages-server volga`
serves the lazy pages as the agent does (no daemon log then).

On the GPU machine: python3 bench/restore_timeline.py --sizes 2 -n 12 --out FILE.json [--logs FILE.tar.gz]
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import shutil
import tarfile
import tempfile
import time
from typing import Any

import benchio  # bench/, beside this script

from volga_agent.host import process
from volga_agent.snapshot import criu
from volga_bench import tiers
from volga_core import api

SUMMARY = ("p50_ms", "p99_ms", "mismatches", "fallbacks", "phases_p50_ms")  # of each tier, as the tiers bench has it


def _cpu_stat() -> dict[str, int]:
    """This cgroup's CPU accounting (cgroup v2), where it is readable."""
    try:
        text = pathlib.Path("/sys/fs/cgroup/cpu.stat").read_text()
    except OSError:
        return {}
    return {key: int(value) for key, value in (line.split() for line in text.splitlines() if line.count(" ") == 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2", help="model sizes in GiB, comma-separated")
    parser.add_argument("-n", type=int, default=12, help="FROZEN wakes per size")
    parser.add_argument("--gaps", type=int, default=6, help="the largest gaps kept per restore")
    parser.add_argument("--settle-ms", type=float, default=tiers.GPU_SETTLE_S * 1e3,
                        help="how long FROZEN is left alone before each wake (default: %(default)g)")
    parser.add_argument("--logs", help="also keep every restore's log in this .tar.gz")
    parser.add_argument("--tiers", default="frozen", help="frozen, or suspended,frozen")
    parser.add_argument("--no-gc-freeze", action="store_true", help="the bench process's heap left in the collector's "
                        "view, as before `process.settled`")
    parser.add_argument("--lazy-pages-server", choices=("criu", "volga"), default="criu",
                        help="who serves the lazy pages: criu's daemon, whose -v4 log is kept too (default), or the "
                        "agent's own server, as the agent runs")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ["VOLGA_LAZY_PAGES_SERVER"] = args.lazy_pages_server
    os.environ["VOLGA_CRIU_LOG_LEVEL"] = "4"  # criu's and its daemon's logs timestamp every step

    kept = pathlib.Path(tempfile.mkdtemp(prefix="restore-logs-"))
    restores: list[dict[str, Any]] = []
    run, lazy_pages = criu.CriuEngine._run, criu.CriuEngine._lazy_pages
    collections: list[tuple[float, float, int]] = []  # (start, end, generation) of each of this process's
    collecting: list[float] = []

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting[:] = [time.perf_counter()]
        elif collecting:
            collections.append((collecting[0], time.perf_counter(), int(info["generation"])))

    gc.callbacks.append(timed)
    if args.no_gc_freeze:
        process.settled = lambda: None  # type: ignore[assignment]
    daemons: list[pathlib.Path] = []  # the image folder of each lazy restore, whose daemon log is kept

    def keep_daemon_log() -> None:
        if daemons and (daemons[-1] / "lazy-pages.log").exists():
            shutil.copyfile(daemons[-1] / "lazy-pages.log", kept / f"lazy-pages-{len(daemons) - 1:03d}.log")

    def started(self: criu.CriuEngine, image: criu.Image, *how: Any) -> Any:
        keep_daemon_log()  # the last one is done: its wake waited for every page
        daemons.append(image.path)
        return lazy_pages(self, image, *how)

    def logged(self: criu.CriuEngine, argv: list[str], *rest: Any, **named: Any) -> Any:
        if argv[:1] != ["restore"]:
            return run(self, argv, *rest, **named)
        began = time.perf_counter()
        try:
            return run(self, argv, *rest, **named)
        finally:
            ended = time.perf_counter()
            ran_ms = (ended - began) * 1e3
            overlapping = [(a, b, g) for a, b, g in collections if a < ended and b > began - 0.1]
            log = pathlib.Path(argv[argv.index("-D") + 1]) / "restore.log"
            copy = kept / f"restore-{len(restores):03d}.log"
            if log.exists():
                shutil.copyfile(log, copy)
            restores.append({"log": copy.name, "criu_run_ms": round(ran_ms, 2),
                             "gc_near_ms": [[g, round((b - a) * 1e3, 2)] for a, b, g in overlapping],
                             **(benchio.criu_log(copy, args.gaps) if copy.exists() else {})})

    criu.CriuEngine._run = logged  # type: ignore[method-assign]
    criu.CriuEngine._lazy_pages = started  # type: ignore[method-assign]
    root = pathlib.Path(tempfile.mkdtemp(prefix="restore-timeline-", dir="/dev/shm"))
    cpu_before = _cpu_stat()
    try:
        report = tiers.gpu_suite(root / "models", root / "run", root / "snapshots",
                                 [float(s) for s in args.sizes.split(",")],
                                 [api.Tier(t.upper()) for t in args.tiers.split(",")], args.n, cold_n=1,
                                 lazy=True, eager=False, progress=lambda line: print("..", line, flush=True),
                                 settle_s=args.settle_ms / 1e3)
        keep_daemon_log()
    finally:
        criu.CriuEngine._run = run  # type: ignore[method-assign]
        criu.CriuEngine._lazy_pages = lazy_pages  # type: ignore[method-assign]
        shutil.rmtree(root, ignore_errors=True)
    cpu_after = _cpu_stat()
    wakes = []
    for size, part in report["sizes"].items():
        phases = part["tiers"]["frozen_lazy"]["phases_ms"]
        wakes += [{"size": size, "wake_ms": w, "criu_restore_ms": c, "driver_resume_ms": d}
                  for w, c, d in zip(part["tiers"]["frozen_lazy"]["wakes_ms"], phases["criu_restore_ms"],
                                     phases["driver_resume_ms"], strict=True)]
    # The bench's first restore of each size may be a cold start's; the last n are the FROZEN wakes, in order.
    timed = restores[-len(wakes):] if wakes else []
    for i, (wake, restore) in enumerate(zip(wakes, timed, strict=True)):
        wake.update(restore)
        daemon_log = kept / f"lazy-pages-{len(daemons) - len(wakes) + i:03d}.log"
        if daemon_log.exists():
            wake["lazy_pages_log"] = {"log": daemon_log.name, **benchio.criu_log(daemon_log, args.gaps)}
        span = restore.get("span_ms")
        wake["outside_criu_log_ms"] = round(wake["criu_restore_ms"] - span, 2) if span is not None else None
    if args.logs:
        with tarfile.open(args.logs, "w:gz") as tar:
            tar.add(kept, arcname="restore-logs")
    shutil.rmtree(kept, ignore_errors=True)
    benchio.emit({"bench": "restore-timeline", "device": report["device"], "criu": report["sizes"][
        next(iter(report["sizes"]))]["criu"], "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settle_ms": args.settle_ms, "restores": len(restores), "lazy_pages_server": args.lazy_pages_server,
        "criu_breakpoints": os.environ.get("VOLGA_CRIU_BREAKPOINTS", "0") == "1",
        "tiers": {size: {tier: {k: v for k, v in got.items() if k in SUMMARY} for tier, got in part["tiers"].items()}
                  for size, part in report["sizes"].items()},
        "cgroup_cpu": {key: cpu_after[key] - cpu_before.get(key, 0) for key in cpu_after},
        "gc_freeze": not args.no_gc_freeze,
        "gc_full_collections_ms": [round((b - a) * 1e3, 2) for a, b, g in collections if g == 2],
        "wakes": wakes}, args.out)


if __name__ == "__main__":
    main()
