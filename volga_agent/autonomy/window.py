"""The values the sampler hands the decider: node samples, per-model load, and the windows built from them.

`ModelLoad` (`volga_agent.load`) is what a gateway reports per model since its previous report; the loop reads
any `load.LoadReading` (the autonomy package does not import the gateway). A `Window`
is a fixed number of consecutive samples reduced to what a decision reads, the per-model p99 included, so
that the decider does no sorting of its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

from volga_agent import load

LoadReading = load.LoadReading


class LoadSource(Protocol):
    """Per-model load since the previous call (the gateway's `drain_load`)."""

    def __call__(self) -> Mapping[str, LoadReading]: ...


ModelLoad = load.ModelLoad


@dataclasses.dataclass(frozen=True)
class NodeSample:
    """One reading of the node. Percentages are 0-100; PCIe in bytes/s (0 where unknown, and on CPU nodes)."""

    at: float  # monotonic seconds
    memory_pct: float
    util_pct: float
    gpu: bool = False
    pcie_rx_bytes_per_s: float = 0.0
    pcie_tx_bytes_per_s: float = 0.0
    # Pressure stall information (share of the interval some task stalled), CPU nodes.
    cpu_pressure_pct: float = 0.0
    memory_pressure_pct: float = 0.0
    io_pressure_pct: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class ModelWindow:
    arrivals: int
    completed: int
    queue_depth: int  # the largest seen in the window
    shed: int
    p99_ms: float | None  # None: nothing completed, nothing to judge


@dataclasses.dataclass(frozen=True)
class Window:
    start: float
    end: float
    memory_pct: float  # the highest of the window
    util_pct: float  # the mean of the window
    gpu: bool
    models: Mapping[str, ModelWindow]
    pcie_rx_bytes_per_s: float = 0.0
    pcie_tx_bytes_per_s: float = 0.0
    cpu_pressure_pct: float = 0.0
    memory_pressure_pct: float = 0.0
    io_pressure_pct: float = 0.0
    completed: int = -1  # requests completed over all models (-1: not counted; the decider counts them)

    @property
    def seconds(self) -> float:
        return self.end - self.start


def p99(values: Sequence[float]) -> float | None:
    """The nearest-rank p99 (of a window's few latencies, interpolation would invent a value)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def build(samples: Sequence[NodeSample], loads: Sequence[Mapping[str, LoadReading]], start: float) -> Window:
    """A window from consecutive samples and the load read with each; it starts where the previous one ended."""
    if not samples:
        raise ValueError("a window needs at least one sample")
    arrivals: dict[str, int] = {}
    completed: dict[str, int] = {}
    queue: dict[str, int] = {}
    shed: dict[str, int] = {}
    latencies: dict[str, list[float]] = {}
    for reading in loads:
        for model, got in reading.items():
            arrivals[model] = arrivals.get(model, 0) + got.arrivals
            completed[model] = completed.get(model, 0) + got.completed
            queue[model] = max(queue.get(model, 0), got.queue_depth)
            shed[model] = shed.get(model, 0) + got.shed
            latencies.setdefault(model, []).extend(got.latencies_ms)
    n = len(samples)
    return Window(
        start=start, end=samples[-1].at, memory_pct=max(s.memory_pct for s in samples),
        util_pct=sum(s.util_pct for s in samples) / n, gpu=samples[-1].gpu,
        models={m: ModelWindow(arrivals[m], completed[m], queue[m], shed[m], p99(latencies[m])) for m in arrivals},
        pcie_rx_bytes_per_s=sum(s.pcie_rx_bytes_per_s for s in samples) / n,
        pcie_tx_bytes_per_s=sum(s.pcie_tx_bytes_per_s for s in samples) / n,
        cpu_pressure_pct=sum(s.cpu_pressure_pct for s in samples) / n,
        memory_pressure_pct=sum(s.memory_pressure_pct for s in samples) / n,
        io_pressure_pct=sum(s.io_pressure_pct for s in samples) / n, completed=sum(completed.values()))
