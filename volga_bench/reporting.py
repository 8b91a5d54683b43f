"""What every bench report has: latency percentiles, the device it ran on, and the JSON file it goes to."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import platform
from collections.abc import Sequence
from typing import Any

import numpy as np

from volga_agent.host import gpus, tmpfs


def summarize(samples_s: Sequence[float]) -> dict[str, float | int]:
    ms = np.asarray(samples_s) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "min_ms": round(float(ms.min()), 3), "max_ms": round(float(ms.max()), 3), "n": len(ms)}


def device_description(device: str) -> str:
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        gpu = next((g for g in gpus.discover() if g.index == index), None)
        return device if gpu is None else f"{device} {gpu.product} (driver {gpu.driver})"
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {cpu} x{os.cpu_count()}"


def write_json(report: dict[str, Any], path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def parked_huge_pages(folder: pathlib.Path) -> contextlib.AbstractContextManager[bool]:
    """A GPU bench's parked folder on a tmpfs of huge pages for the block, as the agent has it
    (`settings.parked_huge_pages`); `VOLGA_PARKED_HUGE_PAGES=0` leaves it on the snapshot root's pages, for a
    bench beside it. Yields whether the folder is on huge pages."""
    return tmpfs.huge_while(folder, os.environ.get("VOLGA_PARKED_HUGE_PAGES", "1") != "0")
