"""What starting criu costs a restore: through the relocatable install's wrapper script, or through its loader.

scripts/install-criu.sh installs criu with its libraries in a private root and a wrapper script that runs a shell,
which runs `readlink` and `dirname` to find that root, then starts criu through the root's own loader; the engine
starts the loader straight (`criu.command`). This freezes a process shaped like a GPU worker's tree for criu
(`criu_last_stop.TREE`: 17 threads, 2,000 mappings, 1 GiB of private memory; no GPU), restores it lazily with the
agent's lazy-pages server `-n` times each way, the ways alternating, criu logging at -v4, and reports per way criu's
whole restore as the engine times it and the part of it outside criu's own log (starting criu until its first line,
its last line until the engine sees it exit).

python3 bench/criu_start.py -n 12 --out FILE.json
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import benchio  # bench/, beside this script
import criu_last_stop

from volga_agent.snapshot import criu

WAYS = ("wrapper", "loader")


def one(engine: criu.CriuEngine, name: str) -> dict[str, float]:
    with criu_last_stop.woken(engine, name) as wake:
        log = benchio.criu_log(wake.image.path / "restore.log")
        whole = wake.restored.seconds * 1e3
        return {"criu_restore_ms": round(whole, 2), "log_span_ms": log["span_ms"],
                "outside_log_ms": round(whole - log["span_ms"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=12, help="restores each way")
    parser.add_argument("--out")
    args = parser.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(prefix="volga-criu-start-", dir="/dev/shm"))
    engine = criu.CriuEngine(root, log_level=4)
    if engine.argv == (engine.criu,):
        sys.exit(f"{engine.criu} is not the relocatable install's wrapper (scripts/install-criu.sh): one way only")
    through_loader = criu.command
    ways: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    try:
        for i in range(args.n):
            for way, rows in ways.items():
                criu.command = through_loader if way == "loader" else lambda path: (path,)  # type: ignore[assignment]
                rows.append(one(engine, f"{way}-{i}"))
                print(way, rows[-1], flush=True)
                time.sleep(0.3)
    finally:
        criu.command = through_loader  # type: ignore[assignment]
        shutil.rmtree(root, ignore_errors=True)
    report: dict[str, Any] = {"bench": "criu-start", "criu": engine.version(), "argv": list(engine.argv),
                              "cpus": os.cpu_count(),
                              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ways": {}}
    for way, rows in ways.items():
        report["ways"][way] = {f"{key}_p50": round(statistics.median(r[key] for r in rows), 2)
                               for key in ("criu_restore_ms", "log_span_ms", "outside_log_ms")}
        report["ways"][way]["restores"] = rows
    benchio.emit(report, args.out)


if __name__ == "__main__":
    main()
