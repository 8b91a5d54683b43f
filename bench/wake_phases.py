"""Where the SUSPENDED and FROZEN (eager and lazy) wakes of a 0.125 GiB MLP go: criu's restore, the CUDA
driver's restore, the worker's own wake (instance.Transition.phases), with criu's restore log and stats kept.
FROZEN with the driver's copy of the device memory mapped from the parked file (the default, `worker.regions`)
and left in the image, and with the CUDA graphs kept in the image; SUSPENDED the default way (the worker drops
its graphs and copies its weights to pinned memory before the driver's checkpoint, `TorchBackend.sleep`) and with
graphs and weights left to the driver's checkpoint (`gpu_graphs_in_images`, `suspend_copies_weights` off).
FROZEN from SUSPENDED too, the way idle instances go down: by default the driver gives the context back for the
freeze and the image is the one a freeze from HOT makes; with weights not parked the image carries the pinned
weights and the driver's copy (`park_weights` off), and is restored eagerly (a lazy restore of a worker that held
pinned memory at the driver's checkpoint fails in the driver's restore); with `suspend_copies_weights` off as well
the worker holds no pinned memory, and the image is restored lazily. Those passes take a new image at every freeze,
and report the freeze's own time (SUSPENDED -> FROZEN) as `enter_ms`; the other FROZEN passes reuse their image.

On the GPU machine: OUT=/some/folder python3 bench/wake_phases.py (rows in $OUT/phases.json; WAKES=8 wakes a
pass; ONLY=text runs only the passes whose label holds it; KEEP_LOGS=1 keeps criu's logs of the second wake of each).
"""

import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import tempfile
import time

from volga_agent.node import instance
from volga_agent.snapshot import criu, cuda
from volga_agent.worker import contract
from volga_bench import tiers
from volga_core.api import Tier

# (label, tier, lazy restore, variant, frozen from SUSPENDED): variants "default", "in_image" (the driver's copy
# left in the FROZEN image), "kept" (graphs and weights left in the driver's checkpoint and the image), "unparked"
# (weights not parked), "unpinned" (weights not parked, nor copied to pinned memory before the driver's checkpoint)
PASSES = [("suspended", Tier.SUSPENDED, None, "default", False),
          ("suspended_driver_copies_all", Tier.SUSPENDED, None, "kept", False),
          ("frozen_eager", Tier.FROZEN, False, "default", False), ("frozen_lazy", Tier.FROZEN, True, "default", False),
          ("frozen_eager_driver_copy_in_image", Tier.FROZEN, False, "in_image", False),
          ("frozen_lazy_driver_copy_in_image", Tier.FROZEN, True, "in_image", False),
          ("frozen_lazy_graphs_kept", Tier.FROZEN, True, "kept", False),
          ("frozen_lazy_from_suspended", Tier.FROZEN, True, "default", True),
          ("frozen_lazy_from_suspended_unparked", Tier.FROZEN, True, "unparked", True),
          ("frozen_lazy_from_suspended_unpinned", Tier.FROZEN, True, "unpinned", True)]
PASSES = [p for p in PASSES if os.environ.get("ONLY", "") in p[0]]
WAKES = int(os.environ.get("WAKES", "8"))


def main() -> None:
    out = pathlib.Path(os.environ["OUT"])
    base = pathlib.Path(tempfile.mkdtemp(dir="/dev/shm"))
    spec = tiers.build_torch_mlp(base / "models" / "model.pt", 0.125)
    driver = cuda.DriverCheckpoint()
    engine = criu.CriuEngine(base / "snap")
    insts = {variant: instance.Instance(f"phases-{variant}", spec, base / variant, engine, driver, "cuda:0",
                                        reuse_image_sec=float("inf"), graphs_in_images=variant == "kept",
                                        park_driver_copy=variant != "in_image",
                                        park_weights=variant not in ("unparked", "unpinned"))
             for variant in ("default", "in_image", "kept", "unparked", "unpinned")}
    for variant in ("kept", "unpinned"):
        insts[variant].config = dataclasses.replace(insts[variant].config, suspend_copies_weights=False)
    inputs = contract.sample_inputs(insts["default"].config.inputs, batch=8, seed=1)
    rows = []
    try:
        reference = {}
        for variant, inst in insts.items():
            inst.to(Tier.HOT)
            reference[variant] = inst.infer(inputs)["y"]
        for label, tier, lazy, variant, from_suspended in PASSES:
            inst = insts[variant]
            inst.reuse_image_sec = 0.0 if from_suspended else float("inf")
            for i in range(WAKES):
                inst.lazy_restore = lazy
                if from_suspended:
                    inst.to(Tier.SUSPENDED)
                start = time.perf_counter()
                entered = inst.to(tier)
                enter = time.perf_counter() - start
                pid, lazy_failures = inst.pid, inst.lazy_restore_failures
                start = time.perf_counter()
                woke = inst.wake()
                answer = inst.infer(inputs)["y"]
                total = time.perf_counter() - start
                row = {"tier": label, "i": i, "enter_ms": enter * 1e3, "wake_ms": total * 1e3,
                       "fallback": woke.fallback, "lazy_failed": inst.lazy_restore_failures > lazy_failures,
                       "restored_lazily": bool(lazy) and inst.image is not None and inst.image.lazy_restorable,
                       "same_answer": bool((answer == reference[variant]).all()),
                       "phases_ms": {k: v * 1e3 for k, v in woke.phases.items()},
                       "enter_phases_ms": {k: v * 1e3 for k, v in entered.phases.items()},
                       "driver": driver.timings.get(pid, {})}
                if tier == Tier.FROZEN and inst.image is not None:
                    row["image_bytes"] = inst.image.size_bytes
                    row["parked_bytes"] = inst.parked_bytes
                    row["driver_copy"] = dict(inst.driver_copy)
                    keep = i == 1 and os.environ.get("KEEP_LOGS") == "1"
                    for name in ("restore.log", "lazy-pages.log", "stats-restore") if keep else ():
                        if (inst.image.path / name).exists():
                            shutil.copy(inst.image.path / name, out / f"{label}-{name}")
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for inst in insts.values():
            inst.close()
        shutil.rmtree(base, ignore_errors=True)
    (out / "phases.json").write_text(json.dumps(rows, indent=1))
    for label, *_ in PASSES:
        mine = [r for r in rows if r["tier"] == label]
        wakes = sorted(r["wake_ms"] for r in mine)
        print(json.dumps({"tier": label, "wake_p50_ms": round(statistics.median(wakes), 1),
                          "wake_max_ms": round(wakes[-1], 1),
                          "enter_p50_ms": round(statistics.median(r["enter_ms"] for r in mine), 1),
                          "image_mib": round(mine[-1].get("image_bytes", 0) / 2**20, 1),
                          "parked_mib": round(mine[-1].get("parked_bytes", 0) / 2**20, 1),
                          "driver_copy_mib": round(int(mine[-1].get("driver_copy", {}).get("bytes", 0)) / 2**20, 1),
                          "phases_p50_ms": {k: round(statistics.median(r["phases_ms"].get(k, 0) for r in mine), 1)
                                            for k in mine[-1]["phases_ms"]},
                          "fallbacks": sum(r["fallback"] for r in mine),
                          "lazy_failures": sum(r["lazy_failed"] for r in mine),
                          "different_answers": sum(not r["same_answer"] for r in mine)}), flush=True)


if __name__ == "__main__":
    main()
