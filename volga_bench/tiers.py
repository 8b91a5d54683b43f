"""`volga bench tiers`: cold start against every tier's wake -> first answer, side by side in one run.

Each cycle moves one instance into a tier (not timed into the wake), then times wake + the first inference
and compares the outputs with the reference taken at the first cold start, bit for bit. Cold starts are
timed the same way: spawn, load, warm up, first answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from volga_agent.host import gpus, process
from volga_agent.node import instance
from volga_agent.snapshot import criu, cuda
from volga_agent.worker import contract
from volga_bench import reporting
from volga_core import api

# A wake's phases (instance.Transition.phases) as the report names them, apart from the driver's own timings.
WAKE_PHASES = {"restore": "criu_restore_ms", "driver": "driver_resume_ms", "wake": "worker_wake_ms",
               "adopt": "adopt_ms", "resume": "resume_ms", "release": "release_ms"}

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
    copy_path: str = ""  # how the worker copied its weights back at the last wake (`last_wake`)
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
        out["wakes_ms"] = [round(s * 1e3, 2) for s in self.wake_s]  # in order: where the spread comes from
        if self.phases:
            out["phases_ms"] = {k: [round(x, 2) for x in v] for k, v in sorted(self.phases.items())}
            out["phases_p50_ms"] = {k: round(float(np.median(v)), 3) for k, v in sorted(self.phases.items())}
            out["phases_p99_ms"] = {k: round(float(np.percentile(v, 99)), 3) for k, v in sorted(self.phases.items())}
        if self.copy_path:
            out["copy_path"] = self.copy_path
        return out


# How long a GPU instance rests in a tier before the bench wakes it, as between an idle demotion and the next
# request. A wake right after the demotion finds the driver still clearing the device memory the demotion freed:
# on an H200, mapping and refilling 8 GiB took 168.6 ms at once and 157.6-158.5 ms after 50 ms to 1 s (2 GiB: 42.4
# and 39.8-41.2 ms), bench/results/tiers/warm-settle-h200.txt.
GPU_SETTLE_S = 0.5
# How long the bench waits, after a lazily restored wake's answer, for its lazy-pages daemon to finish.
LAZY_PAGES_WAIT_S = 30.0


def _worker_gpu_mib(gpu_index: int, pid: int | None) -> float | None:
    """What the instance's worker holds on the GPU (NVML, per process): 0 with no worker (FROZEN, COLD), None where
    NVML does not say."""
    held = gpus.process_memory_bytes(gpu_index, pid) if pid else 0
    return None if held is None else round(held / 2**20, 1)


def bench_tiers(spec: api.ModelSpecSpec, workdir: pathlib.Path, snapshot_dir: pathlib.Path,
                tiers: Sequence[Tier], n: int, device: str = "cpu", batch: int = 8, cold_n: int | None = None,
                lazy: bool = False, progress: Callable[[str], None] = lambda _: None,
                settle_s: float = 0.0, eager: bool = True, wake_copy: str = "",
                fresh_images: bool = False) -> dict[str, Any]:
    """Cold starts, then `n` wakes from each tier, every answer compared with the first cold start's; each
    tier is left alone for `settle_s` before its wake (GPU_SETTLE_S says why).

    FROZEN is dumped once and then restored `n` times from that image (the worker does not change between
    wakes, so the image stays a faithful snapshot: what the pool does within `snapshot_interval_sec`), or, with
    `fresh_images`, dumped again (its weights parked again) before every wake. Without
    `eager`, FROZEN is woken with lazy pages only (`lazy`). `wake_copy` sets the worker's weight copy on a wake
    (`contract.WorkerConfig.wake_copy`); a GPU worker's own account of its last copy (`last_wake`) is read after
    each wake's answer, outside the timing, into the phases as `worker_copy_ms`, `worker_graphs_ms` and
    `staging_alloc_ms`. What the move's phases leave out of a wake is `agent_steps_ms` (the agent's own steps around
    them) and `answer_ms` (the first request after it).
    """
    driver = cuda.DriverCheckpoint() if device.startswith("cuda") else None
    engine = criu.CriuEngine(snapshot_dir) if Tier.FROZEN in tiers else None
    inst = instance.Instance(f"bench-{spec.model_id}", spec, workdir, engine, driver, device,
                             reuse_image_sec=0.0 if fresh_images else float("inf"))
    if wake_copy:
        inst.config = copy_config(inst.config, wake_copy)
    inputs = contract.sample_inputs(inst.config.inputs, batch=batch, seed=1)
    gpu_index = int(device.partition(":")[2] or 0) if device.startswith("cuda") else None
    reference: dict[str, np.ndarray] | None = None
    runs: dict[Tier | str, TierRun] = {Tier.COLD: TierRun(), **{t: TierRun() for t in tiers}}
    cold_n = n if cold_n is None else cold_n
    # With `lazy`, FROZEN is measured a second time with CRIU lazy pages, from the same image.
    passes: list[tuple[Tier | str, Tier, bool]] = [(t, t, False) for t in tiers if eager or t != Tier.FROZEN]
    if not eager:
        runs.pop(Tier.FROZEN, None)
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

    huge = contextlib.ExitStack()
    on_huge = engine is not None and device.startswith("cuda") and \
        huge.enter_context(reporting.parked_huge_pages(engine.root / instance.PARKED))
    try:
        for i in range(cold_n):
            progress(f"{spec.model_id}: cold start {i + 1}/{cold_n}")
            inst.to(Tier.COLD)
            start = time.perf_counter()
            inst.to(Tier.HOT)
            answer(runs[Tier.COLD])
            runs[Tier.COLD].wake_s.append(time.perf_counter() - start)
        stats = inst.client().call("stats").header
        process.settled()  # as the agent does once it serves
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
                woken = time.perf_counter()
                answer(run)
                answered = time.perf_counter()
                run.wake_s.append(answered - start)
                run.fallbacks += int(woke.fallback)
                for phase, seconds in woke.phases.items():
                    run.phases.setdefault(WAKE_PHASES.get(phase, phase), []).append(seconds * 1e3)
                # What the phases leave out: the agent's own steps around them, and the first answer after the wake
                run.phases.setdefault("agent_steps_ms", []).append(
                    (woken - start - sum(woke.phases.values())) * 1e3)
                run.phases.setdefault("answer_ms", []).append((answered - woken) * 1e3)
                if gpu_index is not None and tier != Tier.HOT:
                    last = inst.client().call("stats").header.get("last_wake") or {}
                    for key, name in (("copy_ms", "worker_copy_ms"), ("graphs_ms", "worker_graphs_ms"),
                                      ("staging_alloc_ms", "staging_alloc_ms"), ("map_ms", "worker_map_ms"),
                                      ("staging_populate_ms", "staging_populate_ms"),
                                      ("staging_register_ms", "staging_register_ms"),
                                      ("staging_read_ms_per_thread", "staging_read_ms"),
                                      ("staging_wait_ms_per_thread", "staging_wait_ms"),
                                      ("staging_queue_ms_per_thread", "staging_queue_ms")):
                        if key in last:
                            run.phases.setdefault(name, []).append(float(last[key]))
                    run.copy_path = str(last.get("copy", ""))
                restored = inst.restored
                pages = restored.pages_seconds(LAZY_PAGES_WAIT_S) if restored is not None else None
                if restored is not None and pages is not None:  # every lazy page delivered, from the wake's start
                    run.phases.setdefault("lazy_pages_done_ms", []).append((restored.started + pages - start) * 1e3)
                served = restored.lazy_pages.server if restored is not None and restored.lazy_pages else None
                if served is not None:  # the agent's page server: the wake's faults, the pages it fetched first
                    run.phases.setdefault("lazy_pages_faults", []).append(served.faults)
                    run.phases.setdefault("lazy_pages_first_mib", []).append(
                        sum(hi - lo for _, lo, hi in served.order) / 2**20)
                    if served.fetched_first_at is not None:  # those in, from the wake's start; the faults by then
                        run.phases.setdefault("lazy_pages_first_done_ms", []).append(
                            (served.fetched_first_at - start) * 1e3)
                        run.phases.setdefault("lazy_pages_faults_before_first_done", []).append(served.faults_first)
                    run.phases.setdefault("lazy_pages_faults_in_wake", []).append(served.faults_held)
                    run.phases.setdefault("lazy_pages_events", []).append(served.events)
                    run.phases.setdefault("lazy_pages_let_go_mib", []).append(served.let_go_bytes / 2**20)
                    run.phases.setdefault("lazy_pages_let_go_ms", []).append(served.let_go_seconds * 1e3)
                    reads = [read for read in served.reads if read.faults]
                    for name, field in (("gate_wait", "gate_wait"), ("answer", "answered")):
                        took = [1e3 * getattr(read, field) for read in reads]  # a read of faults: its waits
                        for q in (50, 90) if took else ():
                            run.phases.setdefault(f"lazy_pages_{name}_p{q}_ms", []).append(
                                float(np.percentile(took, q)))
                    if reads:  # when the faults came, from the wake's start
                        times = [(read.at - start) * 1e3 for read in reads]
                        for q in (10, 50, 90):
                            run.phases.setdefault(f"lazy_pages_fault_p{q}_ms", []).append(
                                float(np.percentile(times, q)))
                # FROZEN: the parked copies faulted in beside the driver's restore
                for premapped in inst.parking.premapped if tier == Tier.FROZEN else ():
                    if premapped.wait(LAZY_PAGES_WAIT_S) and premapped.seconds is not None:
                        run.phases.setdefault("premap_ms", []).append(premapped.seconds * 1e3)
                        run.phases.setdefault("premap_mib", []).append(premapped.bytes / 2**20)
                restored_pid = inst.pid
                if tier == Tier.FROZEN and driver is not None and restored_pid in driver.timings:
                    faults = driver.timings[restored_pid].get("restore_minflt")  # SUSPENDED: with the phases below
                    if faults is not None:
                        run.phases.setdefault("restore_minflt", []).append(faults)
                if driver is not None and tier == Tier.SUSPENDED and pid in driver.timings:
                    for phase, ms in driver.timings.pop(pid).items():
                        run.phases.setdefault(phase, []).append(ms)
        final = inst.client().call("stats").header
    finally:
        inst.close()
        huge.close()

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
        "lazy_pages": {"server": engine.lazy_pages_server,
                       "fill": engine.fill_for(device.startswith("cuda"))} if engine else None,
        "wake_copy": wake_copy or inst.config.wake_copy if device.startswith("cuda") else None,
        "parked_huge_pages": on_huge,
        "criu_breakpoints": engine.breakpoints if engine else None,
        "settle_ms": settle_s * 1e3,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return report


def copy_config(config: contract.WorkerConfig, spec: str) -> contract.WorkerConfig:
    """A worker's config with the weight copy `spec` names: "auto", "staged" or "pinned" (`WorkerConfig.wake_copy`),
    optionally followed by staging knobs: "staged-premap", "staged-chunk16", "staged-threads8", "auto-overlap"
    or "auto-serial" (graphs captured while the copies run, or after them), "auto-torch" or "auto-driver" (how
    the copies are queued), "auto-fresh" or "auto-kept" (staging buffers pinned for each copy or kept between
    them), "auto-readyread", "auto-readypopulate" or "auto-readynone" (how a parked file is readied for its
    first read, `WorkerConfig.park_ready`)."""
    name, *knobs = spec.split("-")
    changes: dict[str, Any] = {"wake_copy": name}
    for knob in knobs:
        if knob in ("premap", "progressive"):
            changes["staging_premap"] = knob == "premap"
        elif knob in ("overlap", "serial"):
            changes["staging_overlap_graphs"] = knob == "overlap"
        elif knob.startswith("chunk"):
            changes["staging_chunk_mib"] = int(knob.removeprefix("chunk"))
        elif knob.startswith("threads"):
            changes["staging_threads"] = int(knob.removeprefix("threads"))
        elif knob in ("driver", "torch"):
            changes["staging_engine"] = knob
        elif knob in ("kept", "fresh"):
            changes["staging_keep_buffers"] = knob == "kept"
        elif knob.startswith("ready"):
            changes["park_ready"] = knob.removeprefix("ready")
        else:
            raise ValueError(f"unknown weight copy knob {knob!r} in {spec!r}")
    return dataclasses.replace(config, **changes)


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


# A wake's phases as the tables show them (p50 ms), beside the floors they are held to.
TABLE_PHASES = (("criu", "criu_restore_ms"), ("adopt", "adopt_ms"), ("driver", "driver_resume_ms"),
                ("resume", "resume_ms"), ("wake", "worker_wake_ms"), ("release", "release_ms"),
                ("agent", "agent_steps_ms"), ("answer", "answer_ms"),
                ("copy", "worker_copy_ms"), ("graphs", "worker_graphs_ms"), ("pin", "staging_alloc_ms"),
                ("read", "staging_read_ms"), ("wait", "staging_wait_ms"), ("queue", "staging_queue_ms"))


def format_table(report: dict[str, Any]) -> str:
    rows = [f"{'tier':<12} {'p50 ms':>10} {'p99 ms':>10} {'n':>4} {'vs cold':>8}  phases p50 ms"]
    cold = report["tiers"]["cold"]["p50_ms"]
    for name, r in report["tiers"].items():
        phases = r.get("phases_p50_ms") or {}
        shown = " ".join(f"{label} {phases[key]:.0f}" for label, key in TABLE_PHASES if key in phases)
        rows.append(f"{name:<12} {r['p50_ms']:>10.1f} {r['p99_ms']:>10.1f} {r['n']:>4} {cold / r['p50_ms']:>7.1f}x"
                    f"  {shown}")
    if report.get("floors_ms"):
        rows.append("floors: " + ", ".join(f"{k} {v}" for k, v in report["floors_ms"].items()))
    return "\n".join(rows)


def side_by_side(report: dict[str, Any], sizes: Sequence[float], copies: Sequence[str]) -> list[dict[str, Any]]:
    """One row per size and tier: each way of copying's p50/p99 and phases, next to the floors."""
    rows = []
    for gib in sizes:
        first = report["sizes"][f"{gib:g}-{copies[0]}"]
        for tier in first["tiers"]:
            if tier in ("cold", "hot"):
                continue
            row: dict[str, Any] = {"gib": gib, "tier": tier, "floors_ms": first.get("floors_ms", {})}
            for copy in copies:
                r = report["sizes"][f"{gib:g}-{copy}"]["tiers"].get(tier)
                if r is not None:
                    row[copy] = {"p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "n": r["n"],
                                 "mismatches": r["mismatches"], "copy_path": r.get("copy_path", ""),
                                 "phases_p50_ms": {k: r.get("phases_p50_ms", {}).get(k) for _, k in TABLE_PHASES
                                                   if k in r.get("phases_p50_ms", {})}}
            rows.append(row)
    return rows


def format_side_by_side(report: dict[str, Any]) -> str:
    rows = ["wake copy side by side (p50/p99 ms; phases p50 ms)"]
    for row in report["wake_copy_side_by_side"]:
        cells = []
        for copy, r in row.items():
            if not isinstance(r, dict) or "p50_ms" not in r:
                continue
            phases = " ".join(f"{label} {r['phases_p50_ms'][key]:.0f}" for label, key in TABLE_PHASES
                              if key in r["phases_p50_ms"])
            cells.append(f"{copy} {r['p50_ms']:.0f}/{r['p99_ms']:.0f} ({phases}; mismatches {r['mismatches']})")
        floors_text = ", ".join(f"{k.replace('_ms', '')} {v}" for k, v in row["floors_ms"].items())
        rows.append(f"{row['gib']:g} GiB {row['tier']:<11} " + " | ".join(cells) + f" | floors: {floors_text}")
    return "\n".join(rows)


DRIVER_FLOOR_CHILD = r"""
import sys, torch
torch.ones(64 * 2**20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
"""


def driver_floor(repeats: int = 5) -> dict[str, Any]:
    """The driver's restore of a bare PyTorch context (64 MiB allocated, no pinned memory): the floor under the
    driver's share of every SUSPENDED and FROZEN wake."""
    import subprocess
    import sys

    driver = cuda.DriverCheckpoint()
    child = subprocess.Popen([sys.executable, "-c", DRIVER_FLOOR_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    restores = []
    try:
        assert child.stdout is not None and child.stdin is not None
        if child.stdout.readline().strip() != "ready":
            return {"error": "the bare context did not start"}
        for _ in range(repeats):
            driver.suspend(child.pid)
            driver.resume(child.pid)
            restores.append(driver.timings[child.pid]["restore_ms"] + driver.timings[child.pid]["unlock_ms"])
    finally:
        child.kill()
        child.wait()
    return {"restore_p50_ms": round(float(np.median(restores)), 1), "restores_ms": [round(r, 1) for r in restores]}


def floors(weights_bytes: int, limits: dict[str, Any]) -> dict[str, float]:
    """What each part of a GPU wake cannot beat on this machine: the weights copy at the pinned copy limit, and
    the driver's restore of a bare context."""
    out: dict[str, float] = {}
    if limits.get("pinned_h2d_gbps"):
        out["copy_at_pinned_limit_ms"] = round(weights_bytes / limits["pinned_h2d_gbps"] / 1e6, 1)
    if limits.get("driver_bare_context_restore_ms"):
        out["driver_bare_context_restore_ms"] = limits["driver_bare_context_restore_ms"]
    return out


def gpu_suite(models: pathlib.Path, run: pathlib.Path, snapshots: pathlib.Path, sizes: Sequence[float],
              tiers: Sequence[Tier], n: int, cold_n: int | None = None, lazy: bool = False, burst_n: int = 0,
              progress: Callable[[str], None] = lambda _: None, eager: bool = True,
              wake_copies: Sequence[str] = (), fresh_images: bool = False,
              settle_s: float = GPU_SETTLE_S) -> dict[str, Any]:
    """Copy limits and the driver's floor, every size through every tier (with several `wake_copies`, each size
    once per way of copying, one after the other, keyed `SIZE-COPY`), and the burst of SUSPENDED wakes, in one
    run; each tier left alone for `settle_s` before its wake."""
    import onnxruntime

    report: dict[str, Any] = {"device": reporting.device_description("cuda:0")}
    progress("copy limits")
    report["copy_limits"] = copy_limits()
    if Tier.SUSPENDED in tiers or Tier.FROZEN in tiers:
        progress("driver floor: a bare context's restore")
        floor = driver_floor()
        report["driver_floor"] = floor
        if "restore_p50_ms" in floor:
            report["copy_limits"]["driver_bare_context_restore_ms"] = floor["restore_p50_ms"]
    report["sizes"] = {}
    copies = list(wake_copies) or [""]
    for gib in sizes:
        spec = build_torch_mlp(models / f"mlp-{gib:g}gib" / "model.pt", gib)
        for copy in copies:
            key = f"{gib:g}-{copy}" if len(copies) > 1 else f"{gib:g}"
            part = bench_tiers(spec, run / f"w{gib:g}{copy}", snapshots, tiers, n, "cuda:0", cold_n=cold_n,
                               lazy=lazy, progress=progress, settle_s=settle_s, eager=eager, wake_copy=copy,
                               fresh_images=fresh_images)
            part["floors_ms"] = floors(int(part["model"]["weights_bytes"] or 0), report["copy_limits"])
            report["sizes"][key] = part
    if len(copies) > 1:
        report["wake_copy_side_by_side"] = side_by_side(report, sizes, copies)
    if burst_n:
        specs = [build_torch_mlp(models / f"burst-{k}" / "model.pt", 0.0625, seed=k, cuda_graphs=False)
                 for k in range(burst_n)]
        report["burst"] = burst(specs, run / "burst", progress=progress)
    providers = onnxruntime.get_available_providers()
    report["onnx_on_gpu"] = (
        "measurable: CUDAExecutionProvider present" if "CUDAExecutionProvider" in providers else
        f"not measured: onnxruntime {onnxruntime.__version__} here offers only {', '.join(providers)}")
    return report
