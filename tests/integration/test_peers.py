"""`volga bench peers`: the real `volga up` and KServe's real ModelServer, each driven by an unmodified tritonclient,
with small counts; the bench itself compares every answer with onnxruntime run directly."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

HAS_KSERVE = bool(os.environ.get("VOLGA_KSERVE_PYTHON")) or importlib.util.find_spec("kserve") is not None


def bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "volga_agent.cli", "bench", "peers", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.skipif(not HAS_KSERVE, reason="KServe is not installed (pip install 'volga[peers]', as make setup does)")
def test_bench_peers_prints_both_sides_in_json() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    placed = ["--server-cpus", str(cpus[0]), "--client-cpus", str(cpus[-1])] if len(cpus) > 1 else []
    out = bench("--json", "--requests", "40", "--warmup", "10", "--seconds", "0.5", "--cold-starts", "1",
                "--wakes", "2", "--idle-sec", "1", "--gateway-processes", "2", "--hot-instances", "2", *placed)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    volga, kserve = report["volga"], report["kserve"]
    for key in ("hot_p50_ms", "hot_p99_ms", "conc8_rps", "conc32_rps", "frozen_wake_ms"):
        assert isinstance(volga[key], float) and volga[key] > 0, key
    for key in ("hot_p50_ms", "hot_p99_ms", "conc8_rps", "conc32_rps", "cold_start_ms"):
        assert isinstance(kserve[key], float) and kserve[key] > 0, key
    # Every answer, from both servers, equals onnxruntime's run directly on the same inputs.
    assert volga["outputs_match"] and kserve["outputs_match"], (volga, kserve)
    assert volga["errors"] == kserve["errors"] == 0
    assert volga["frozen_wake"]["n"] == 2 and kserve["cold_start"]["n"] == 1
    assert volga["hot"]["n"] == kserve["hot"]["n"] == 40
    # The CPU time each server's processes spent per answer at 8 clients (gateway and worker apart for Volga).
    assert all(volga["conc8_cpu_us"][role] > 0 for role in ("gateway", "worker", "clients")), volga["conc8_cpu_us"]
    assert kserve["conc8_cpu_us"]["server"] > 0 and kserve["conc8_cpu_us"]["clients"] > 0, kserve["conc8_cpu_us"]
    assert report["kserve_versions"]["kserve"]
    # Volga's two gateway processes (--gateway-processes 2) counted as its gateway; KServe's one process.
    assert volga["processes"] == {"gateway": 2, "worker": 1} and kserve["processes"]["server"] >= 1
    # And with two HOT instances (--hot-instances 2): two workers.
    replicas = report["volga_hot_instances"]
    assert replicas["conc8_rps"] > 0 and replicas["outputs_match"] and replicas["processes"]["worker"] == 2
    batched = report["volga_batched"]  # the default model with dynamic batching in the gateway
    assert batched["conc8_rps"] > 0 and batched["hot"]["n"] == 40 and batched["outputs_match"]
    if placed:  # where each process was allowed to run, as read from the processes themselves
        assert volga["cpus"] == batched["cpus"] == {"clients": [cpus[-1]], "gateway": [cpus[0]],
                                                     "worker": [cpus[0]]}, volga["cpus"]
        assert kserve["cpus"] == {"clients": [cpus[-1]], "server": [cpus[0]]}, kserve["cpus"]


def test_bench_peers_names_a_missing_kserve_interpreter() -> None:
    out = bench("--kserve-python", "/nonexistent/python", timeout=120)
    assert out.returncode == 2
    assert "--kserve-python /nonexistent/python: no such interpreter" in out.stderr
