"""What a worker's memory holds, region by region, in each state a snapshot is taken from.

A CRIU image holds a process's private pages that are present (anonymous memory, written private file
pages); shared file mappings are recorded by reference. This script starts one worker, reads
/proc/PID/smaps while it is HOT and again after the CUDA driver has checkpointed it (the state CRIU dumps
on a GPU node), freezes it, and prints the largest regions beside the image size, so that what the worker
adds to an image over its weights can be found and dropped.

    python3 bench/image_breakdown.py [--gib 0.1] [--device cuda:0] [--out FILE.json]

It also lists the mappings the driver's checkpoint filled (`driver_checkpoint_grew`: new or grown, with their
VmFlags), the memory a FROZEN image carries for the driver.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import tempfile

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.snapshot import criu, cuda
from volga_agent.worker import regions
from volga_bench import tiers
from volga_core import api


def by_name(found: list[regions.Mapping]) -> dict[str, int]:
    """Private present bytes by mapping name (anonymous regions named by their size class)."""
    sizes: collections.Counter[str] = collections.Counter()
    for m in found:
        sizes[m.path or f"[anon {_size_class(m.end - m.start)}]"] += m.private_bytes
    return dict(sizes)


def grown(before: list[regions.Mapping], after: list[regions.Mapping], least: int = 2**20) -> list[dict[str, object]]:
    """The mappings whose private present bytes grew by `least` or more (or that are new), largest first."""
    then = {(m.start, m.end): m.private_bytes for m in before}
    rows = []
    for m in after:
        gain = m.private_bytes - then.get((m.start, m.end), 0)
        if gain >= least:
            rows.append({"start": hex(m.start), "size_mib": round((m.end - m.start) / 2**20, 1),
                         "new": (m.start, m.end) not in then, "grew_mib": round(gain / 2**20, 1), "name": m.path,
                         "perms": m.perms, "flags": m.flags})
    return sorted(rows, key=lambda r: -float(r["grew_mib"]))  # type: ignore[arg-type]


def _size_class(size: int) -> str:
    for limit, label in ((2**20, "<1M"), (16 * 2**20, "1-16M"), (128 * 2**20, "16-128M"), (2**30, "128M-1G")):
        if size < limit:
            return label
    return ">=1G"


def top(sizes: dict[str, int], n: int = 12) -> list[tuple[str, float]]:
    return [(name, round(size / 2**20, 1)) for name, size in sorted(sizes.items(), key=lambda kv: -kv[1])[:n]]


def private_at(inst: instance.Instance, tier: api.Tier, report: dict[str, object]) -> list[regions.Mapping]:
    """Move the instance to `tier` and report the worker's private memory there (`<tier>_private_mib`, and by
    mapping name `<tier>_top`); the worker's mappings."""
    inst.to(tier)
    assert inst.pid is not None
    mappings = regions.mappings(inst.pid)
    named = by_name(mappings)
    report[f"{tier.value.lower()}_private_mib"] = round(sum(named.values()) / 2**20, 1)
    report[f"{tier.value.lower()}_top"] = top(named)
    return mappings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=0.1)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    work = pathlib.Path(tempfile.mkdtemp(prefix="vib-", dir="/tmp"))
    gpu = args.device.startswith("cuda")
    spec: api.ModelSpecSpec = (tiers.build_torch_mlp(work / "model.pt", args.gib) if gpu
                               else defaultmodel.ensure().spec)
    shm = "/dev/shm" if pathlib.Path("/dev/shm").is_dir() else None
    engine = criu.CriuEngine(tempfile.mkdtemp(prefix="vib-", dir=shm))
    driver = cuda.DriverCheckpoint() if gpu else None
    inst = instance.Instance("breakdown", spec, work / "run", engine, driver, args.device)
    report: dict[str, object] = {"model": spec.model_id, "device": args.device, "weights_gib": args.gib}
    try:
        hot_mappings = private_at(inst, api.Tier.HOT, report)
        if gpu:
            suspended_mappings = private_at(inst, api.Tier.SUSPENDED, report)
            report["driver_checkpoint_grew"] = grown(hot_mappings, suspended_mappings)
        inst.to(api.Tier.FROZEN)
        assert inst.image is not None
        report["image_mib"] = round(inst.image.size_bytes / 2**20, 1)
        report["image_files_mib"] = top({p.name: p.stat().st_size for p in inst.image.path.iterdir()}, 6)
        woke = inst.wake()
        report["wake_ms"] = round(woke.seconds * 1e3, 1)
        report["wake_fallback"] = woke.fallback
    finally:
        inst.close()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
