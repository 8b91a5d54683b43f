"""What tini as the init of a server's PID namespace costs a FROZEN wake.

A model server runs in a PID namespace of its own with tini as the namespace's init and the server its child
(`worker.nsinit --init`; docs/servers.md, Freezing and waking): criu's dump of the namespace needs the init's working
folder writable, and a server's own folder may be read-only. The image holds one process more. This runs KServe's
ModelServer (`volga_bench.servers.kserve_scorer`, from this checkout, a writable folder) both ways, two instances
side by side, and wakes each from FROZEN `-n` times, alternating: under tini (`tini`), and as the init itself, the
way before (`server-as-init`). Every wake must be a restore (no fallback) answering its canary as before.

python3 bench/server_init.py -n 12 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import benchio

from volga_agent.node import server
from volga_agent.snapshot import criu
from volga_core import api

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = {"instances": [[float(i * j % 7) for i in range(16)] for j in range(1, 4)]}


class ServerAsInit(server.ServerInstance):
    """The way before: the server itself the namespace's init, working in its own folder."""

    def _namespace(self) -> list[str]:
        return []


def spec(name: str) -> api.ModelSpecSpec:
    return api.ModelSpecSpec.model_validate({"modelId": name, "framework": "server", "source": str(ROOT), "server": {
        "command": [sys.executable, "-m", "volga_bench.servers.kserve_scorer", "--http_port", "{port}",
                    "--enable_grpc", "false", "--model_name", name, "--configure_logging", "false"],
        "env": {"UV_USE_IO_URING": "0"}, "readiness": {"path": "/v2/health/ready"},
        "canary": {"path": f"/v1/models/{name}:predict", "body": json.dumps(ROWS)}}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=12, help="FROZEN wakes each way")
    parser.add_argument("--out", help="write the JSON report here too")
    args = parser.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(prefix="volga-server-init-", dir="/dev/shm"))
    engine = criu.CriuEngine(root / "images", criu=criu.find_criu())
    sides = {"tini": server.ServerInstance(spec("under-tini"), root / "tini", engine),
             "server-as-init": ServerAsInit(spec("as-init"), root / "as-init", engine)}
    wakes: dict[str, list[float]] = {way: [] for way in sides}
    restores: dict[str, list[float]] = {way: [] for way in sides}
    report: dict[str, Any] = {"bench": "server_init", "n": args.n, "server": "kserve",
                              "kernel": os.uname().release, "criu": engine.version().split()[-1],
                              "load_average_before": [round(x, 2) for x in os.getloadavg()],
                              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        for inst in sides.values():
            inst.start()
            inst.freeze()
        for _ in range(args.n):
            for way, inst in sides.items():
                inst.wake()
                woke = inst.transitions[-1]
                if woke.fallback or woke.source is not api.Tier.FROZEN:
                    raise SystemExit(f"{way}: the wake was no restore: {woke.detail}")
                wakes[way].append(woke.seconds * 1e3)
                restores[way].append(woke.phases.get("restore", 0.0) * 1e3)
                inst.freeze()
        report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        report["results"] = [{"way": way, "frozen_wake_ms": round(statistics.median(wakes[way]), 1),
                              "criu_restore_ms": round(statistics.median(restores[way]), 1),
                              "image_bytes": inst.image.size_bytes if inst.image else None,
                              "frozen_wake_ms_all": [round(ms, 1) for ms in wakes[way]]}
                             for way, inst in sides.items()]
    finally:
        for inst in sides.values():
            inst.close()
        shutil.rmtree(root, ignore_errors=True)
    benchio.emit(report, args.out)


if __name__ == "__main__":
    main()
