"""`volga bench tiers`: cold start against every tier's wake -> first answer, side by side in one run.

Each cycle moves one instance into a tier (not timed into the wake), then times wake + the first inference
and compares the outputs with the reference taken at the first cold start, bit for bit. Cold starts are
timed the same way: spawn, load, warm up, first answer.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from volga_agent.host import gpus
from volga_agent.node import instance
from volga_agent.snapshot import criu, cuda
from volga_agent.worker import contract
from volga_bench import reporting
from volga_core import api

# A wake's phases (instance.Transition.phases) as the report names them, apart from the driver's own timings.
WAKE_PHASES = {"restore": "criu_restore_ms", "driver": "driver_resume_ms", "wake": "worker_wake_ms"}

Tier = api.Tier


def gpu_memory_used_mib(index: int) -> float | None:
    gpu = next((g for g in gpus.discover() if g.index == index), None)
    return None if gpu is None else round(gpu.memory_used_bytes / 2**20, 1)


@dataclasses.dataclass
class TierRun:
    wake_s: list[float] = dataclasses.field(default_factory=list)
    enter_s: list[float] = dataclasses.field(default_factory=list)
    fallbacks: int = 0
    mismatches: int = 0
    gpu_mib_in_tier: float | None = None
    worker_gpu_mib_in_tier: float | None = None  # what the instance's worker process itself holds (NVML)
    image_bytes: int | None = None
    parked_bytes: int | None = None  # weights the image maps from a file beside it (GPU FROZEN)
    phases: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {**reporting.summarize(self.wake_s),
                               "enter": reporting.summarize(self.enter_s) if self.enter_s else None,
                               "fallbacks": self.fallbacks, "mismatches": self.mismatches}
        if self.gpu_mib_in_tier is not None:
            out["gpu_used_mib_in_tier"] = self.gpu_mib_in_tier
        if self.worker_gpu_mib_in_tier is not None:
            out["worker_gpu_mib_in_tier"] = self.worker_gpu_mib_in_tier
        if self.image_bytes is not None:
            out["image_bytes"] = self.image_bytes
        if self.parked_bytes:
            out["parked_bytes"] = self.parked_bytes
        if self.phases:
            out["phases_p50_ms"] = {k: round(float(np.median(v)), 3) for k, v in sorted(self.phases.items())}
        return out


# How long a GPU instance rests in a tier before the bench wakes it, as between an idle demotion and the next
# request. A wake right after the demotion finds the driver still clearing the device memory the demotion freed:
# on an H200, mapping and refilling 8 GiB took 168.6 ms at once and 157.6-158.5 ms after 50 ms to 1 s (2 GiB: 42.4
# and 39.8-41.2 ms), bench/results/tiers/warm-settle-h200.txt.
GPU_SETTLE_S = 0.5


def _worker_gpu_mib(gpu_index: int, pid: int | None) -> float | None:
    """What the instance's worker holds on the GPU (NVML, per process): 0 with no worker (FROZEN, COLD), None where
    NVML does not say."""
    held = gpus.process_memory_bytes(gpu_index, pid) if pid else 0
    return None if held is None else round(held / 2**20, 1)


def bench_tiers(spec: api.ModelSpecSpec, workdir: pathlib.Path, snapshot_dir: pathlib.Path,
                tiers: Sequence[Tier], n: int, device: str = "cpu", batch: int = 8, cold_n: int | None = None,
                lazy: bool = False, progress: Callable[[str], None] = lambda _: None,
                settle_s: float = 0.0) -> dict[str, Any]:
    """Cold starts, then `n` wakes from each tier, every answer compared with the first cold start's; each
    tier is left alone for `settle_s` before its wake (GPU_SETTLE_S says why).

    FROZEN is dumped once and then restored `n` times from that image (the worker does not change between
    wakes, so the image stays a faithful snapshot: what the pool does within `snapshot_interval_sec`).
    """
    driver = cuda.DriverCheckpoint() if device.startswith("cuda") else None
    engine = criu.CriuEngine(snapshot_dir) if Tier.FROZEN in tiers else None
    inst = instance.Instance(f"bench-{spec.model_id}", spec, workdir, engine, driver, device,
                             reuse_image_sec=float("inf"))
    inputs = contract.sample_inputs(inst.config.inputs, batch=batch, seed=1)
    gpu_index = int(device.partition(":")[2] or 0) if device.startswith("cuda") else None
    reference: dict[str, np.ndarray] | None = None
    runs: dict[Tier | str, TierRun] = {Tier.COLD: TierRun(), **{t: TierRun() for t in tiers}}
    cold_n = n if cold_n is None else cold_n
    # With `lazy`, FROZEN is measured a second time with CRIU lazy pages, from the same image.
    passes: list[tuple[Tier | str, Tier, bool]] = [(t, t, False) for t in tiers]
    if lazy and Tier.FROZEN in tiers:
        runs["frozen_lazy"] = TierRun()
        passes.append(("frozen_lazy", Tier.FROZEN, True))

    def answer(run: TierRun) -> None:
        nonlocal reference
        out = inst.infer(inputs)
        if reference is None:
            reference = {k: v.copy() for k, v in out.items()}
        elif not all(np.array_equal(out[k], reference[k]) for k in reference):
            run.mismatches += 1

    try:
        for i in range(cold_n):
            progress(f"{spec.model_id}: cold start {i + 1}/{cold_n}")
            inst.to(Tier.COLD)
            start = time.perf_counter()
            inst.to(Tier.HOT)
            answer(runs[Tier.COLD])
            runs[Tier.COLD].wake_s.append(time.perf_counter() - start)
        stats = inst.client().call("stats").header
        progress(f"{spec.model_id}: hot, {n * 5} requests")
        hot = runs[Tier.HOT] = TierRun()
        if gpu_index is not None:
            hot.gpu_mib_in_tier = gpu_memory_used_mib(gpu_index)
            hot.worker_gpu_mib_in_tier = _worker_gpu_mib(gpu_index, inst.pid)
        for _ in range(n * 5):
            start = time.perf_counter()
            answer(hot)
            hot.wake_s.append(time.perf_counter() - start)
        for label, tier, lazy_pages in passes:
            run = runs[label]
            inst.lazy_restore = lazy_pages
            for i in range(n):
                progress(f"{spec.model_id}: {_name(label)} wake {i + 1}/{n}")
                entered = inst.to(tier)
                run.enter_s.append(entered.seconds)
                if i == 0 and gpu_index is not None:
                    run.gpu_mib_in_tier = gpu_memory_used_mib(gpu_index)
                    run.worker_gpu_mib_in_tier = _worker_gpu_mib(gpu_index, inst.pid)
                if tier == Tier.FROZEN and inst.image is not None:
                    run.image_bytes = inst.image.size_bytes
                    run.parked_bytes = inst.parked_bytes
                pid = inst.pid
                time.sleep(settle_s)
                start = time.perf_counter()
                woke = inst.wake()
                answer(run)
                run.wake_s.append(time.perf_counter() - start)
                run.fallbacks += int(woke.fallback)
                for phase, seconds in woke.phases.items():
                    run.phases.setdefault(WAKE_PHASES.get(phase, phase), []).append(seconds * 1e3)
                if driver is not None and tier == Tier.SUSPENDED and pid in driver.timings:
                    for phase, ms in driver.timings.pop(pid).items():
                        run.phases.setdefault(phase, []).append(ms)
        final = inst.client().call("stats").header
    finally:
        inst.close()

    cold_p50 = reporting.summarize(runs[Tier.COLD].wake_s)["p50_ms"]
    report: dict[str, Any] = {
        "device": reporting.device_description(device),
        "model": {"id": spec.model_id, "framework": spec.framework.value,
                  "file_bytes": spec.source_path.stat().st_size, "weights_bytes": stats.get("weights_bytes"),
                  "load_seconds": stats.get("load_seconds"), "batch": batch,
                  "cuda_graphs": final.get("cuda_graphs"), "stable_addresses": final.get("stable_addresses")},
        "tiers": {_name(t): r.report() for t, r in runs.items()},
        "speedup_vs_cold_p50": {_name(t): round(cold_p50 / reporting.summarize(r.wake_s)["p50_ms"], 2)
                                for t, r in runs.items() if t not in (Tier.COLD, Tier.HOT)},
        "outputs_match": all(r.mismatches == 0 for r in runs.values()),
        "restore_fallbacks": sum(r.fallbacks for r in runs.values()),
        "criu": engine.version() if engine else None,
        "settle_ms": settle_s * 1e3,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return report


def _name(tier: Tier | str) -> str:
    return tier.value.lower() if isinstance(tier, Tier) else tier


def copy_limits(gib: float = 1.0, repeats: int = 5) -> dict[str, float]:
    """Host-to-device copy rates (GB/s) from pinned and pageable memory: the floor under every wake."""
    import torch

    nbytes = int(gib * 2**30)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for kind, host in (("pinned", torch.ones(nbytes, dtype=torch.uint8).pin_memory()),
                       ("pageable", torch.ones(nbytes, dtype=torch.uint8))):
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            device.copy_(host, non_blocking=kind == "pinned")
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[f"{kind}_h2d_gbps"] = round(nbytes / float(np.median(times[1:])) / 1e9, 2)
    del device
    torch.cuda.empty_cache()
    return out


def burst(models: Sequence[api.ModelSpecSpec], workdir: pathlib.Path, device: str = "cuda:0",
          progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Wake N SUSPENDED instances of different models at once; time until every one has answered."""
    import concurrent.futures

    driver = cuda.DriverCheckpoint()
    insts = [instance.Instance(f"burst-{i}", spec, workdir / f"b{i}", None, driver, device)
             for i, spec in enumerate(models)]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(insts))
    try:
        progress(f"burst: starting {len(insts)} instances")
        list(pool.map(lambda i: i.to(Tier.HOT), insts))
        inputs = [contract.sample_inputs(i.config.inputs, batch=8, seed=2) for i in insts]
        refs = [i.infer(x) for i, x in zip(insts, inputs, strict=True)]

        def wake(k: int, t0: float) -> float:
            insts[k].wake()
            out = insts[k].infer(inputs[k])
            assert all(np.array_equal(out[n], refs[k][n]) for n in out), f"burst-{k}: outputs differ"
            return time.perf_counter() - t0

        progress("burst: one after another")
        list(pool.map(lambda i: i.to(Tier.SUSPENDED), insts))
        t0 = time.perf_counter()
        sequential = [wake(k, time.perf_counter()) for k in range(len(insts))]
        sequential_total = time.perf_counter() - t0
        progress("burst: all at once")
        list(pool.map(lambda i: i.to(Tier.SUSPENDED), insts))
        t0 = time.perf_counter()
        together = list(pool.map(lambda k: wake(k, t0), range(len(insts))))
        return {"instances": len(insts), "weights_bytes_each": models[0].source_path.stat().st_size,
                "all_answered_ms": round(max(together) * 1e3, 1), "first_answered_ms": round(min(together) * 1e3, 1),
                "sequential_total_ms": round(sequential_total * 1e3, 1),
                "sequential_each": reporting.summarize(sequential)}
    finally:
        list(pool.map(lambda i: i.close(), insts))
        pool.shutdown()


def build_torch_mlp(path: pathlib.Path, weights_gib: float, width: int = 4096, seed: int = 0,
                    cuda_graphs: bool = True) -> api.ModelSpecSpec:
    """A PyTorch MLP of about `weights_gib` GiB of fp32 weights, saved whole, and its ModelSpec."""
    import torch

    layers = max(1, round(weights_gib * 2**30 / (width * width * 4)))
    if not path.exists():
        torch.manual_seed(seed)
        blocks: list[torch.nn.Module] = []
        for _ in range(layers):
            linear = torch.nn.Linear(width, width)
            torch.nn.init.normal_(linear.weight, std=width ** -0.5)
            blocks += [linear, torch.nn.ReLU()]
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(torch.nn.Sequential(*blocks), path)
    return api.ModelSpecSpec.model_validate({
        "modelId": f"mlp-{layers}x{width}-s{seed}", "framework": "pytorch", "source": str(path),
        "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, width]}],
        "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, width]}],
        "hardware": {"gpu": True, "cudaGraphs": cuda_graphs}, "runtime": {"warmupIterations": 3},
        "slo": {"baselineLatencyMs": {"8": 5.0}},
    })


def format_table(report: dict[str, Any]) -> str:
    rows = [f"{'tier':<12} {'p50 ms':>10} {'p99 ms':>10} {'n':>4} {'vs cold':>8}"]
    cold = report["tiers"]["cold"]["p50_ms"]
    for name, r in report["tiers"].items():
        rows.append(f"{name:<12} {r['p50_ms']:>10.1f} {r['p99_ms']:>10.1f} {r['n']:>4} {cold / r['p50_ms']:>7.1f}x")
    return "\n".join(rows)


def gpu_suite(models: pathlib.Path, run: pathlib.Path, snapshots: pathlib.Path, sizes: Sequence[float],
              tiers: Sequence[Tier], n: int, cold_n: int | None = None, lazy: bool = False, burst_n: int = 0,
              progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Copy limits, every size through every tier, and the burst of SUSPENDED wakes, in one run."""
    import onnxruntime

    report: dict[str, Any] = {"device": reporting.device_description("cuda:0")}
    progress("copy limits")
    report["copy_limits"] = copy_limits()
    report["sizes"] = {}
    for gib in sizes:
        spec = build_torch_mlp(models / f"mlp-{gib:g}gib" / "model.pt", gib)
        report["sizes"][f"{gib:g}"] = bench_tiers(spec, run / f"w{gib:g}", snapshots, tiers, n, "cuda:0",
                                                  cold_n=cold_n, lazy=lazy, progress=progress, settle_s=GPU_SETTLE_S)
    if burst_n:
        specs = [build_torch_mlp(models / f"burst-{k}" / "model.pt", 0.0625, seed=k, cuda_graphs=False)
                 for k in range(burst_n)]
        report["burst"] = burst(specs, run / "burst", progress=progress)
    providers = onnxruntime.get_available_providers()
    report["onnx_on_gpu"] = (
        "measurable: CUDAExecutionProvider present" if "CUDAExecutionProvider" in providers else
        f"not measured: onnxruntime {onnxruntime.__version__} here offers only {', '.join(providers)}")
    return report
