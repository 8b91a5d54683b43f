"""What each mapping of a process costs criu's restore of it.

A GPU worker holds about 2,000 mappings (its shared libraries, the CUDA driver's reservations, thread stacks), and
criu's part of its FROZEN wake spends most of its log in per-mapping steps. This freezes a process shaped like a GPU
worker's tree for criu (`criu_last_stop.TREE`: 17 threads, 1 GiB of private memory, no GPU) with `--mappings` small
mappings of its own besides the interpreter's, restores it lazily with the agent's lazy-pages server (as a FROZEN wake
does), `-n` times per count, the counts alternating, criu logging at -v4. Per count: the process's mappings as
/proc/PID/maps lists them, criu's whole restore as the engine times it, its log's span, when the tree was rebuilt
("Unlock network"), and the log's time summed over the per-mapping steps (each step's time is from the line before it
to its own line): premapping each mapping, registering it with userfaultfd for the lazy pages, and remapping it into
place; then the restore's growth per 1,000 mappings (least squares over the p50s). `--verbosity 2` restores as the
engine does (criu's log at -v2, no line per mapping), timing only the whole restore.

python3 bench/criu_mappings.py -n 8 --out FILE.json
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import tempfile
import time
from typing import Any

import benchio  # bench/, beside this script
import criu_last_stop

from volga_agent.snapshot import criu

STEPS = {"premap": "\tpremap ", "uffd_register": "lazy-pages: register", "remap": ": Remap "}


def steps(log: pathlib.Path) -> dict[str, float]:
    """ms of the log summed per step in `STEPS`: each line's time since the line before it, by the line's step."""
    spent = dict.fromkeys(STEPS, 0.0)
    before = None
    for line in log.read_text(errors="replace").splitlines():
        m = benchio.CRIU_STAMP.match(line)
        if not m:
            continue
        at = int(m.group(1)) + int(m.group(2)) / 1e6
        for step, marker in STEPS.items():
            if before is not None and marker in m.group(3):
                spent[step] += (at - before) * 1e3
        before = at
    return {step: round(ms, 2) for step, ms in spent.items()}


def one(engine: criu.CriuEngine, name: str, count: int) -> dict[str, float]:
    with criu_last_stop.woken(engine, name, mappings=count) as wake:
        row = {"mappings": wake.mappings, "criu_restore_ms": round(wake.restored.seconds * 1e3, 2)}
        if engine.log_level == 4:
            log = benchio.criu_log(wake.image.path / "restore.log")
            row.update({"log_span_ms": log["span_ms"], "unlock_ms": log["unlock_ms"],
                        **{f"{step}_ms": ms for step, ms in steps(wake.image.path / "restore.log").items()}})
        return row


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares growth of y per unit of x."""
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=8, help="restores per count")
    parser.add_argument("--mappings", default="250,1000,2000,4000", help="the process's own mappings, comma-separated")
    parser.add_argument("--verbosity", type=int, choices=(2, 4), default=4, help="criu's log level")
    parser.add_argument("--out")
    args = parser.parse_args()
    counts = [int(c) for c in args.mappings.split(",")]
    root = pathlib.Path(tempfile.mkdtemp(prefix="volga-criu-mappings-", dir="/dev/shm"))
    engine = criu.CriuEngine(root, log_level=args.verbosity)
    rows: dict[int, list[dict[str, float]]] = {count: [] for count in counts}
    try:
        for i in range(args.n):
            for count in counts:
                rows[count].append(one(engine, f"m{count}-{i}", count))
                print(count, rows[count][-1], flush=True)
                time.sleep(0.3)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report: dict[str, Any] = {"bench": "criu-mappings", "criu": engine.version(), "cpus": os.cpu_count(),
                              "criu_log": f"-v{engine.log_level}",
                              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "counts": {}}
    keys = [key for key in rows[counts[0]][0] if key != "mappings"]
    for count, restores in rows.items():
        report["counts"][str(count)] = {"mappings": restores[0]["mappings"],
                                        **{f"{key}_p50": round(statistics.median(r[key] for r in restores), 2)
                                           for key in keys},
                                        "restores": restores}
    per = report["counts"].values()
    report["per_1000_mappings_ms"] = {key: round(1000 * slope([(c["mappings"], c[f"{key}_p50"]) for c in per]), 2)
                                      for key in keys}
    benchio.emit(report, args.out)


if __name__ == "__main__":
    main()
