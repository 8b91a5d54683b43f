"""The autonomy loop stepped window by window without workers: the gateway's actions (batch caps, shedding) reach a
gateway object that records them, the decision context is logged; the sampler and the CPU and GPU probes on files
and a fake NVML."""

from __future__ import annotations

import pathlib

import pytest
from autonomy_stubs import NoProbe, RecordingGateway, Windows
from procs import wait_for

from volga_agent.autonomy import loop, sampler, window
from volga_agent.node import instance, pool
from volga_agent.node.settings import Settings
from volga_core import api

Tier = api.Tier


def two_models(spec: api.ModelSpecSpec, rundir: pathlib.Path) -> pool.Pool:
    """A pool holding a strict and a loose model (instances not started: the decisions here need no worker)."""
    p = pool.Pool("n1", rundir, None)
    for name, tolerance in (("strict", 10), ("loose", 200)):
        slo = spec.slo.model_copy(update={"interference_tolerance_pct": tolerance, "baseline_latency_ms": {"1": 1.0}})
        model_spec = spec.model_copy(update={"model_id": name, "slo": slo})
        p.slots[name] = pool.Slot(instance.Instance(name, model_spec, rundir / name, None, None, "cpu"), Tier.COLD)
        p.slots[name].inst.tier = Tier.HOT  # counts as awake; no worker, so demotions have nothing to move
    return p


def test_gateway_actions_reach_the_gateway(default_spec: api.ModelSpecSpec, rundir: pathlib.Path) -> None:
    p = two_models(default_spec, rundir)
    gateway = RecordingGateway()
    autonomy = loop.Loop(p, gateway, probe=NoProbe())
    step = Windows(autonomy, cpu=50.0)

    try:
        violating = {"strict": window.ModelWindow(10, 10, 0, 0, 5.0), "loose": window.ModelWindow(10, 10, 0, 0, 1.0)}
        for _ in range(3):
            step(50.0, **violating)
        assert gateway.calls == [("set_batch_cap", "loose", 128)]
        for _ in range(3):
            step(90.0, **violating)
        assert gateway.calls[-1] == ("shed", "loose", 1000)
        for _ in range(3):
            step(50.0)
        assert gateway.calls[-2:] == [("unshed", "loose"), ("set_batch_cap", "loose", None)]
    finally:
        autonomy.stop()
        p.close()
    registry = p.metrics.registry
    assert registry.get_sample_value("volga_slo_violating_windows_total", {"model": "strict"}) == 6
    assert registry.get_sample_value("volga_autonomy_decisions_total", {"action": "Shed"}) == 1
    assert registry.get_sample_value("volga_autonomy_state", {"state": "ACCEPT"}) == 1


def test_debug_logs_the_decision_context_at_most_every_100_ms(default_spec: api.ModelSpecSpec,
                                                              rundir: pathlib.Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    p = two_models(default_spec, rundir)
    autonomy = loop.Loop(p, RecordingGateway(), settings=Settings(autonomy_debug=True), probe=NoProbe())
    caplog.set_level("INFO", logger=loop.__name__)
    try:
        for k in range(5):  # five windows at once: one log line (the others come within 100 ms of it)
            autonomy.step(window.Window(k * 0.1, (k + 1) * 0.1, 50.0, 10.0, False,
                                        {"strict": window.ModelWindow(1, 1, 0, 0, 3.0)}))
    finally:
        autonomy.stop()
        p.close()
    lines = [r.getMessage() for r in caplog.records if "autonomy decision" in r.getMessage()]
    assert len(lines) == 1
    assert "strict: p99 3.000 ms > 1.100 ms" in lines[0] and "memory 50.0%" in lines[0] and "actions:" in lines[0]


def test_the_sampler_hands_windows_on_and_reports_its_jitter() -> None:
    gateway = RecordingGateway()
    gateway.script = [{"m": window.ModelLoad(1, 1, 0, (2.0,), 0)}] * 40
    run = sampler.Sampler(sampler.CpuProbe(), gateway.drain_load, period_ms=5.0, window_samples=4, queue_size=2)
    run.start()
    try:
        wait_for("the queue to fill and windows to be dropped", lambda: run.dropped >= 2, timeout=60, every=0.02)
    finally:
        run.stop()
    first = run.windows.get_nowait()
    assert first.models["m"].arrivals == 4 and first.models["m"].p99_ms == 2.0
    assert 0 <= first.memory_pct <= 100 and 0 <= first.util_pct <= 100 and not first.gpu
    assert first.end > first.start
    p50, p99 = run.jitter()
    assert len(run.jitter_ms) >= 16 and 0 <= p50 <= p99


def test_the_cpu_probe_reads_its_open_files_again_at_each_sample(tmp_path: pathlib.Path) -> None:
    proc = tmp_path
    (proc / "pressure").mkdir()

    def write(user: int, idle: int, available_kb: int, cpu_stall_us: int) -> None:
        (proc / "stat").write_text(f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4\nintr 1 2 3\n")
        (proc / "meminfo").write_text(f"MemTotal:       1000 kB\nMemFree:         100 kB\n"
                                      f"MemAvailable:    {available_kb} kB\nBuffers: 1 kB\n")
        (proc / "pressure" / "cpu").write_text(f"some avg10=0.00 avg60=0.00 avg300=0.00 total={cpu_stall_us}\n")

    write(100, 100, 800, 0)
    probe = sampler.CpuProbe(proc)
    try:
        write(175, 125, 250, 50_000)  # 75 of 100 ticks busy; 75 % of memory in use
        first = probe.sample(probe._at + 0.1)  # 50 ms of CPU stall in 100 ms
        assert first.util_pct == pytest.approx(75.0) and first.memory_pct == pytest.approx(75.0)
        assert first.cpu_pressure_pct == pytest.approx(50.0) and first.io_pressure_pct == 0.0  # no io file
        write(185, 215, 900, 50_000)
        second = probe.sample(probe._at + 0.1)
        assert second.util_pct == pytest.approx(10.0) and second.memory_pct == pytest.approx(10.0)
        assert second.cpu_pressure_pct == 0.0
    finally:
        probe.close()


class FakeNvml:
    """pynvml's calls the GPU probe makes, answering for two GPUs (no GPU here: the real one runs on GPU nodes)."""

    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

    class NVMLError(Exception):
        pass

    class Memory:
        def __init__(self, used: int, total: int) -> None:
            self.used, self.total = used, total

    class Util:
        def __init__(self, gpu: int) -> None:
            self.gpu = gpu

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Memory:
        return self.Memory((20, 90)[handle], 100)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Util:
        return self.Util((70, 10)[handle])

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> int:
        return 1000 * (counter + 1)


def test_the_gpu_probe_reads_the_busiest_gpu() -> None:
    probe = sampler.GpuProbe(FakeNvml(), pcie_period_s=0.01)
    try:
        wait_for("a PCIe reading", lambda: probe.sample(0.0).pcie_rx_bytes_per_s > 0, timeout=5, every=0.02)
        sample = probe.sample(1.0)
    finally:
        probe.close()
    assert (sample.memory_pct, sample.util_pct, sample.gpu) == (90.0, 70.0, True)
    assert (sample.pcie_rx_bytes_per_s, sample.pcie_tx_bytes_per_s) == (4000 * 1024, 2000 * 1024)
