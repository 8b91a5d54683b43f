"""Where the SUSPENDED and FROZEN (eager and lazy) wakes of a 0.125 GiB MLP go: criu's restore, the CUDA
driver's restore, the worker's own wake (instance.Transition.phases), with criu's restore log and stats kept.

On the GPU machine: OUT=/some/folder python3 bench/wake_phases.py (rows in $OUT/phases.json).
"""

import json
import os
import pathlib
import shutil
import tempfile
import time

from volga_agent import instance
from volga_agent.snapshot import criu, cuda
from volga_agent.worker import contract
from volga_bench import tiers
from volga_operator.api import Tier

PASSES = [("suspended", Tier.SUSPENDED, None), ("frozen_eager", Tier.FROZEN, False), ("frozen_lazy", Tier.FROZEN, True)]
WAKES = 6


def main() -> None:
    out = pathlib.Path(os.environ["OUT"])
    base = pathlib.Path(tempfile.mkdtemp(dir="/dev/shm"))
    spec = tiers.build_torch_mlp(base / "models" / "model.pt", 0.125)
    driver = cuda.DriverCheckpoint()
    inst = instance.Instance("phases", spec, base / "w", criu.CriuEngine(base / "snap"), driver, "cuda:0",
                             reuse_image_sec=float("inf"))
    inputs = contract.sample_inputs(inst.config.inputs, batch=8, seed=1)
    rows = []
    try:
        inst.to(Tier.HOT)
        inst.infer(inputs)
        for label, tier, lazy in PASSES:
            for i in range(WAKES):
                inst.lazy_restore = lazy
                start = time.perf_counter()
                inst.to(tier)
                enter = time.perf_counter() - start
                pid = inst.pid
                start = time.perf_counter()
                woke = inst.wake()
                inst.infer(inputs)
                total = time.perf_counter() - start
                row = {"tier": label, "i": i, "enter_ms": enter * 1e3, "wake_ms": total * 1e3,
                       "fallback": woke.fallback, "phases_ms": {k: v * 1e3 for k, v in woke.phases.items()},
                       "driver": driver.timings.get(pid, {})}
                if tier == Tier.FROZEN and inst.image is not None:
                    row["image_bytes"] = inst.image.size_bytes
                    for name in ("restore.log", "lazy-pages.log", "stats-restore") if i == 1 else ():
                        if (inst.image.path / name).exists():
                            shutil.copy(inst.image.path / name, out / f"{label}-{name}")
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        inst.close()
        shutil.rmtree(base, ignore_errors=True)
    (out / "phases.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
