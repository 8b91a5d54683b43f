"""Reads the node and the gateway's per-model load every few milliseconds, and hands windows on.

A `Sampler` runs on its own thread: every `period_ms` it takes one `window.NodeSample` from its probe and one
reading of the load source, and every `window_samples` samples it reduces them to a `window.Window` and puts it
in a bounded queue. It never waits for the consumer: when the queue is full the oldest window is dropped (and
counted), so a slow decision costs a stale window, never a late sample. How late each sample came against its
schedule (the jitter) is kept for the bench and reported to a callback (the loop's metric).

Probes: `GpuProbe` reads NVML (pynvml; utilisation and memory of every GPU, the busiest counting; PCIe
throughput on a thread of its own, since NVML samples it over 20 ms); `CpuProbe` reads /proc/stat,
/proc/meminfo and /proc/pressure/*. `probe_for_node` picks the GPU one where NVML finds a device.
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from volga_agent.autonomy import window as windows

log = logging.getLogger(__name__)
PROC = pathlib.Path("/proc")


class Probe(Protocol):
    def sample(self, now: float) -> windows.NodeSample: ...

    def close(self) -> None: ...


class CpuProbe:
    """CPU utilisation (/proc/stat), memory in use (/proc/meminfo) and stall shares (/proc/pressure) since the
    previous sample. The files stay open and each sample reads only their first lines again (pread at offset 0):
    on a two-core node a hundred samples a second are CPU the models need."""

    def __init__(self, proc: pathlib.Path = PROC) -> None:
        self.proc = proc
        self._fds: dict[str, int | None] = {}
        for name in ("stat", "meminfo", "pressure/cpu", "pressure/memory", "pressure/io"):
            try:
                self._fds[name] = os.open(proc / name, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._fds[name] = None  # no PSI (old kernels, some containers)
        self._cpu = self._cpu_times()
        self._stalls = {kind: self._stall(kind) for kind in ("cpu", "memory", "io")}
        self._at = time.monotonic()

    def _head(self, name: str, size: int = 256) -> bytes | None:
        fd = self._fds.get(name)
        if fd is None:
            return None
        try:
            return os.pread(fd, size, 0)
        except OSError:
            return None

    def _cpu_times(self) -> tuple[int, int]:
        head = self._head("stat")
        if head is None:
            raise OSError(f"{self.proc / 'stat'}: cannot read")
        fields = [int(x) for x in head.split(b"\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    def _stall(self, kind: str) -> int | None:
        """Microseconds some task stalled on `kind`, cumulative; None without PSI (old kernels, containers)."""
        head = self._head(f"pressure/{kind}")
        if head is None:
            return None
        return int(head.split(b"\n", 1)[0].rsplit(b"total=", 1)[1])

    def _memory_pct(self) -> float:
        info: dict[bytes, int] = {}
        for line in (self._head("meminfo", 512) or b"").splitlines():
            key, _, rest = line.partition(b":")
            if key in (b"MemTotal", b"MemAvailable"):
                info[key] = int(rest.split()[0])
                if len(info) == 2:
                    break
        total = info.get(b"MemTotal", 0)
        return 100.0 * (total - info.get(b"MemAvailable", total)) / total if total else 0.0

    def sample(self, now: float) -> windows.NodeSample:
        total, idle = self._cpu_times()
        spent, rested = total - self._cpu[0], idle - self._cpu[1]
        self._cpu = (total, idle)
        elapsed_us = max(1.0, (now - self._at) * 1e6)
        self._at = now
        pressure = {}
        for kind, before in self._stalls.items():
            after = self._stall(kind)
            pressure[kind] = 0.0 if after is None or before is None else min(100.0, 100.0 * (after - before)
                                                                              / elapsed_us)
            self._stalls[kind] = after
        return windows.NodeSample(
            at=now, memory_pct=self._memory_pct(), util_pct=100.0 * (spent - rested) / spent if spent > 0 else 0.0,
            cpu_pressure_pct=pressure["cpu"], memory_pressure_pct=pressure["memory"],
            io_pressure_pct=pressure["io"])

    def close(self) -> None:
        for name, fd in self._fds.items():
            if fd is not None:
                os.close(fd)
                self._fds[name] = None


class GpuProbe:
    """NVML: the busiest GPU's utilisation and memory, and PCIe throughput summed over the node's GPUs."""

    def __init__(self, nvml: Any, pcie_period_s: float = 0.1) -> None:
        self.nvml = nvml
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        if not self.handles:
            raise RuntimeError("NVML finds no GPU")
        self._pcie = (0.0, 0.0)
        self._stop = threading.Event()
        self._pcie_thread = threading.Thread(target=self._read_pcie, args=(pcie_period_s,), name="autonomy-pcie",
                                             daemon=True)
        self._pcie_thread.start()

    def _read_pcie(self, period: float) -> None:
        nvml = self.nvml
        while not self._stop.is_set():
            try:
                rx = sum(nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES) for h in self.handles)
                tx = sum(nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES) for h in self.handles)
                self._pcie = (rx * 1024.0, tx * 1024.0)  # NVML reports KB/s
            except nvml.NVMLError as exc:
                log.debug("PCIe throughput unavailable: %s", exc)
                return
            self._stop.wait(period)

    def sample(self, now: float) -> windows.NodeSample:
        memory = util = 0.0
        for handle in self.handles:
            info = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            memory = max(memory, 100.0 * info.used / info.total if info.total else 0.0)
            util = max(util, float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        rx, tx = self._pcie
        return windows.NodeSample(at=now, memory_pct=memory, util_pct=util, gpu=True, pcie_rx_bytes_per_s=rx,
                                  pcie_tx_bytes_per_s=tx)

    def close(self) -> None:
        self._stop.set()
        self._pcie_thread.join(timeout=1)


def probe_for_node() -> Probe:
    """NVML's probe where pynvml finds a GPU, the /proc one otherwise."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return GpuProbe(pynvml)
    except Exception as exc:  # no pynvml, no driver, no GPU: a CPU node
        log.debug("no GPU probe (%s): sampling /proc", exc)
        return CpuProbe()


def no_load() -> Mapping[str, windows.LoadReading]:
    return {}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Sampler:
    def __init__(self, probe: Probe, load: windows.LoadSource = no_load, period_ms: float = 10.0,
                 window_samples: int = 10, queue_size: int = 8,
                 on_jitter: Callable[[float], None] = lambda _: None) -> None:
        self.probe = probe
        self.load = load
        self.period = period_ms / 1e3
        self.window_samples = window_samples
        self.windows: queue.Queue[windows.Window] = queue.Queue(maxsize=queue_size)
        self.on_jitter = on_jitter
        self.jitter_ms: collections.deque[float] = collections.deque(maxlen=100_000)
        self.dropped = 0  # windows the consumer did not take in time
        self.missed = 0  # sample slots skipped because a sample came more than a period late
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="autonomy-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.probe.close()

    def jitter(self) -> tuple[float, float]:
        """p50 and p99 of how late samples came, in milliseconds."""
        values = list(self.jitter_ms)
        return percentile(values, 0.5), percentile(values, 0.99)

    def _read_load(self) -> Mapping[str, windows.LoadReading]:
        try:
            return self.load()
        except Exception:  # the gateway's trouble must not stop the node's sampling
            log.exception("reading the per-model load failed")
            return {}

    def _run(self) -> None:
        samples: list[windows.NodeSample] = []
        loads: list[Mapping[str, windows.LoadReading]] = []
        start = due = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
                now = time.monotonic()
            late_ms = (now - due) * 1e3
            self.jitter_ms.append(late_ms)
            self.on_jitter(late_ms)
            try:
                samples.append(self.probe.sample(now))
            except Exception:
                log.exception("sampling the node failed")
            loads.append(self._read_load())
            due += self.period
            if now - due > self.period:  # more than a period behind: skip the slots missed, keep the grid
                skipped = int((now - due) / self.period)
                self.missed += skipped
                due += skipped * self.period
            if len(loads) >= self.window_samples:
                if samples:
                    self._hand_on(windows.build(samples, loads, start))
                    start = samples[-1].at
                samples, loads = [], []

    def _hand_on(self, built: windows.Window) -> None:
        while True:
            try:
                self.windows.put_nowait(built)
                return
            except queue.Full:
                try:
                    self.windows.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass
