"""`volga bench slo`: a latency-critical model beside a heavy tolerant one on one `volga up`, under bursty load,
with the node autonomy loop off and on, side by side in one run.

Two ONNX models are built with the onnx helper API (stacks of MatMul + Tanh): `critical` (interference tolerance
15 %, one intra-op thread, requests of one row) and `heavy` (300 %, four intra-op threads, requests of several
rows, several times the work). `volga calibrate`'s measurement (`calibrate.measure`, a real worker alone) gives
both their baselines first, written into their ModelSpecs tagged with version and input hash. Then, per round,
`volga up` runs once without and once with `--autonomy` (the same node settings file, the same seeded arrival
schedule): tritonclient gRPC clients send `critical` open-loop arrivals at a steady rate, and `heavy`
requests from closed-loop clients (a request, then a think time), one between pulses and 8-12 during pulses of
a few seconds; a `heavy` client told to back off (RESOURCE_EXHAUSTED) waits the retry hint it was given.

Counted from the clients' own timings: the protected model's violating windows (100 ms windows by completion
time whose nearest-rank p99 exceeds its batch-1 baseline x (1 + tolerance)), its p99 over the run, and its
violation episodes (consecutive violating windows) longer than its recoveryDeadlineMs; what the tolerant model
lost (requests shed with RESOURCE_EXHAUSTED, its p99). From `volga up`'s /metrics with autonomy on: the
decision time and the sampler's jitter, as quantiles interpolated within the loop's histogram buckets. The
load average is reported: the machine may be shared.

`--gpu` runs the same two shapes as PyTorch (TorchScript) models sharing cuda:0, calibrated there.

Each round first runs the protected model alone (`volga up` serving it only, the same arrivals, no co-runner):
its violating windows are the floor no action of the loop can take away (the machine's own noise, the model's own
tail), and the report also says how many each arm had above that floor.

`--throttle-share` adds the CPU throttle (`autonomy_throttle_share`: the tolerant model's worker is stopped for that
share of every period while it gives way) to the on-run, and runs a third arm, `yield`, with the loop on and the
yield alone, so that the throttle is compared with the yield side by side in one run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import random
import re
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from volga_agent.app import calibrate
from volga_agent.host import process
from volga_bench import harness, reporting
from volga_core import api

PROTECTED, TOLERANT = "critical", "heavy"
WINDOW_S = 0.1
# The node settings of both runs; the on-run adds --autonomy. Tuned for bursts of a few seconds: into
# EMERGENCY at once when a violation has lasted 15 % of the recovery deadline, out of it (unshed) only after
# 3 s without one; the tolerant model's worker yields the CPU (nice 19) from the first violation until
# `Config.yield_calm_windows` windows of calm (a yield costs the tolerant model only while the CPU is contended).
SETTINGS: dict[str, Any] = {"autonomyEmergencyWindows": 1, "autonomyCalmWindows": 30,
                            "autonomyDeadlineSharePct": 15.0, "autonomyShedRetryAfterMs": 1000,
                            "autonomyYieldNice": 19}


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    tokens: int
    features: int
    width: int
    layers: int
    threads: int
    batch: int  # rows per request
    tolerance_pct: float
    deadline_ms: float


MODELS = (Model(PROTECTED, 512, 64, 384, 6, 1, 1, 15.0, 1000.0),
          Model(TOLERANT, 128, 64, 768, 6, 4, 4, 300.0, 10_000.0))
# `--gpu`: the same two shapes as PyTorch models sharing one GPU; the tolerant one's requests are long chains of
# large matmuls (tens of ms), the protected one's a few ms, so the GPU's time slicing between the two workers is
# what the protected model feels.
GPU_MODELS = (Model(PROTECTED, 1024, 64, 1024, 8, 1, 1, 15.0, 1000.0),
              Model(TOLERANT, 2048, 64, 4096, 8, 1, 4, 300.0, 10_000.0))


@dataclasses.dataclass(frozen=True)
class Config:
    seconds: float = 40.0  # of traffic per run
    rounds: int = 1  # off-on pairs
    protected_rate: float = 8.0  # requests/s
    tolerant_clients: int = 1  # between pulses
    tolerant_think_s: float = 0.4  # each tolerant client's pause between an answer and its next request
    pulse_every_s: float = 10.0
    pulse_s: float = 3.0
    pulse_factor: tuple[float, float] = (8.0, 12.0)
    calibrate_iterations: int = 100
    # One calibration request every this many ms (`calibrate.measure`); None: the protected model's mean arrival
    # period, as its traffic comes; 0: back to back (on the H200 machine's CPU that measured `critical` at 7.7 /
    # 10.8 ms p50 / p99, and then the model alone violated the limit in 220 of 717 windows; paced, 11.9 / 16.1 ms
    # and 4 of 476: bench/results/slo/slo-cpu-h200-2cores-*.json)
    calibrate_pace_ms: float | None = None
    seed: int = 11
    gpu: bool = False  # PyTorch models on cuda:0 instead of ONNX models on the CPU
    yield_calm_windows: int = 30  # autonomy_yield_calm_windows
    throttle_share: float = 0.0  # autonomy_throttle_share of the on-run; above 0 adds the arm `yield` (without it)
    throttle_period_ms: float = 20.0  # autonomy_throttle_period_ms
    throttle_guard: bool = False  # autonomy_throttle_guard: stop the co-runner only while the protected one computes

    alone: bool = True  # each round also runs the protected model alone, under the same arrivals

    @property
    def arms(self) -> tuple[str, ...]:
        """The runs of a round, in order: the protected model alone (`alone`), the loop off, on with the yield
        alone (with a throttle only), on."""
        return ("alone",) * self.alone + (("off", "yield", "on") if self.throttle_share else ("off", "on"))

    def settings(self, arm: str) -> dict[str, Any]:
        """The node settings file of an arm."""
        out: dict[str, Any] = {**SETTINGS, "autonomyYieldCalmWindows": self.yield_calm_windows}
        if arm == "on" and self.throttle_share:
            out.update(autonomyThrottleShare=self.throttle_share, autonomyThrottlePeriodMs=self.throttle_period_ms,
                       autonomyThrottleGuard=self.throttle_guard)
        return out

    @property
    def pace_ms(self) -> float:
        return 1e3 / self.protected_rate if self.calibrate_pace_ms is None else self.calibrate_pace_ms

    @property
    def models(self) -> tuple[Model, Model]:
        return GPU_MODELS if self.gpu else MODELS


def build_onnx(model: Model, path: pathlib.Path) -> pathlib.Path:
    """[batch, features] -> broadcast to [batch, tokens, features] -> MatMul to width -> `layers` x (MatMul
    width x width, Tanh) -> mean: [batch]. The input stays small, so that the request's cost is the model's
    compute, not the transfer of its tensors."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(len(model.name) * 1000 + model.width)
    inits = [numpy_helper.from_array((rng.standard_normal((model.features, model.width)) / 8).astype(np.float32),
                                     "w_in"),
             numpy_helper.from_array(np.array([1], dtype=np.int64), "one"),
             numpy_helper.from_array(np.array([1, model.tokens, 1], dtype=np.int64), "spread")]
    nodes = [helper.make_node("Unsqueeze", ["x", "one"], ["x1"]),
             helper.make_node("Expand", ["x1", "spread"], ["xs"]),
             helper.make_node("MatMul", ["xs", "w_in"], ["h0"])]
    for i in range(model.layers):
        w = rng.standard_normal((model.width, model.width)) / math.sqrt(model.width)
        inits.append(numpy_helper.from_array(w.astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [f"h{i}", f"w{i}"], [f"m{i}"]),
                  helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"])]
    nodes.append(helper.make_node("ReduceMean", [f"h{model.layers}"], ["y"], axes=[1, 2], keepdims=0))
    graph = helper.make_graph(
        nodes, model.name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", model.features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])], inits)
    # IR version 8 (opset 17's own): onnx releases newer than the node's onnxruntime write IR versions it refuses.
    built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="volga-bench",
                              ir_version=8)
    onnx.checker.check_model(built)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(built, path)
    return path


def build_torchscript(model: Model, path: pathlib.Path) -> pathlib.Path:
    """`build_onnx`'s graph as a traced PyTorch module (traced on the CPU; the worker moves it to the GPU)."""
    import torch

    class Net(torch.nn.Module):  # type: ignore[misc,unused-ignore]
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(len(model.name) * 1000 + model.width)
            self.w_in = torch.nn.Parameter(torch.randn(model.features, model.width, generator=generator) / 8)
            self.ws = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(model.width, model.width, generator=generator) / math.sqrt(model.width))
                for _ in range(model.layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x.unsqueeze(1).expand(-1, model.tokens, -1) @ self.w_in
            for w in self.ws:
                h = torch.tanh(h @ w)
            return h.mean(dim=(1, 2))

    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.jit.trace(Net().eval(), torch.zeros(model.batch, model.features)).save(str(path))
    return path


def spec_document(model: Model, path: pathlib.Path, gpu: bool = False) -> dict[str, Any]:
    hardware = {"hardware": {"gpu": True, "cudaGraphs": False}} if gpu else {}
    return {
        "apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": model.name},
        "spec": {**hardware, "modelId": model.name, "framework": "torchscript" if gpu else "onnx",
                 "source": f"file://{path}", "version": "1",
                 "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, model.features]}],
                 "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1]}],
                 "pool": {"frozen": 1},
                 "slo": {"interferenceTolerancePct": model.tolerance_pct, "recoveryDeadlineMs": model.deadline_ms},
                 "runtime": {"intraOpThreads": model.threads, "warmupIterations": 3}}}


# A calibration whose p99 is more than this many times its p50 was disturbed (on a shared machine, by another
# process): its p99 is no baseline, and a limit built on it would hide every violation. It is measured again.
DISTURBED_P99_OVER_P50 = 1.5
CALIBRATION_ATTEMPTS = 3


def calibrated(document: dict[str, Any], batch: int, iterations: int, device: str = "cpu",
               attempts: int = CALIBRATION_ATTEMPTS,
               pace_ms: float = 0.0) -> tuple[dict[str, Any], float, dict[str, Any]]:
    """The document with its baseline measured alone (`volga calibrate`) and tagged; the baseline p99 in ms; and
    what each attempt measured (up to `attempts` while the p99 says the measurement was disturbed; the lowest p99
    is kept)."""
    spec = api.ModelSpec.model_validate(document).spec
    tried: list[api.Calibration] = []
    for _ in range(attempts):
        tried.append(calibrate.measure(spec, [batch], iterations, device, pace_ms=pace_ms))
        first = tried[-1].batches[0]
        if first.p99_ms <= DISTURBED_P99_OVER_P50 * first.p50_ms:
            break
    result = min(tried, key=lambda r: r.batches[0].p99_ms)
    kept = result.batches[0]
    check = {"p50_ms": round(kept.p50_ms, 3), "p99_ms": round(kept.p99_ms, 3),
             "attempts": [[round(r.batches[0].p50_ms, 3), round(r.batches[0].p99_ms, 3)] for r in tried],
             "sane": kept.p99_ms <= DISTURBED_P99_OVER_P50 * kept.p50_ms}
    slo = dict(document["spec"]["slo"])
    slo["baselineLatencyMs"] = result.baselines()
    slo["baselineFor"] = {"version": result.version, "inputHash": result.input_hash, "device": result.device}
    out = {**document, "spec": {**document["spec"], "slo": slo}}
    return out, float(kept.p99_ms), check


def arrivals(config: Config) -> list[float]:
    """The protected model's seeded open-loop arrivals, in seconds from the start: one per 1 / rate, each moved
    by up to a fifth of that at random. Evenly spread, so that its requests do not queue behind each other at its
    one worker: what its windows show is then the co-runner's doing (or the machine's), not its own."""
    rng = random.Random(config.seed)
    period = 1.0 / config.protected_rate
    return [t + rng.uniform(-0.2, 0.2) * period
            for t in (period * (i + 0.5) for i in range(int(config.seconds * config.protected_rate)))]


def pulses(config: Config) -> list[tuple[float, float, int]]:
    """The tolerant model's pulses: (start, end, clients), from 2 s on, every pulse_every_s, 8-12x the base
    clients each (seeded)."""
    rng = random.Random(config.seed + 1)
    out = []
    start = 2.0
    while start < config.seconds:
        out.append((start, start + config.pulse_s, round(config.tolerant_clients * rng.uniform(*config.pulse_factor))))
        start += config.pulse_every_s
    return out


@dataclasses.dataclass
class Record:
    model: str
    sent: float  # seconds from the start
    latency_ms: float = math.nan
    status: str = ""  # "OK", a gRPC status name, or "" while in flight


def retry_hint_ms(message: str) -> float | None:
    """The retry hint of a shed answer, from its message ("... retry after N ms")."""
    match = re.search(r"retry after (\d+) ms", message)
    return float(match.group(1)) if match else None


def warm_up(client: grpcclient.InferenceServerClient, model: str, inputs: list[Any], attempts: int = 20) -> None:
    """One request answered, honouring retry hints: a loop that sheds from its first windows (a slow machine
    violates at once) may shed the warm-up too."""
    for _ in range(attempts - 1):
        try:
            client.infer(model, inputs)
            return
        except InferenceServerException as exc:
            hint = retry_hint_ms(str(exc))
            if hint is None:
                raise
            time.sleep(hint / 1e3)
    client.infer(model, inputs)


def drive(address: str, config: Config, inputs: dict[str, list[Any]], drain_s: float = 30.0,
          start: float | None = None) -> list[Record]:
    """The protected model's arrivals open-loop (each at its time, answered or not the earlier ones); the tolerant
    model's clients closed-loop, each a request then a think time, as many as the pulse in force asks for, and
    each honouring the retry hint of a shed answer as a well-behaved client does. `start` (perf_counter) is the
    schedule's zero, now when not given."""
    protected = grpcclient.InferenceServerClient(address)
    records: list[Record] = []
    lock = threading.Lock()
    done = threading.Semaphore(0)
    sent_protected = 0
    stop = threading.Event()
    plan = pulses(config)
    start = time.perf_counter() if start is None else start

    def answered(record: Record, sent: float, result: Any, error: Any) -> None:
        record.latency_ms = (time.perf_counter() - sent) * 1e3
        record.status = "OK" if error is None else str(error.status()).removeprefix("StatusCode.")
        done.release()

    def tolerant(index: int) -> None:
        client = grpcclient.InferenceServerClient(address)
        try:
            while not stop.is_set():
                now = time.perf_counter() - start
                wanted = next((n for a, b, n in plan if a <= now < b), config.tolerant_clients)
                if index >= wanted:
                    stop.wait(0.02)
                    continue
                record = Record(TOLERANT, now)
                with lock:
                    records.append(record)
                sent = time.perf_counter()
                pause = config.tolerant_think_s
                try:
                    client.infer(TOLERANT, inputs[TOLERANT], client_timeout=drain_s)
                    record.status = "OK"
                except InferenceServerException as exc:
                    record.status = str(exc.status()).removeprefix("StatusCode.")
                    pause = max(pause, (retry_hint_ms(str(exc)) or 0.0) / 1e3)
                record.latency_ms = (time.perf_counter() - sent) * 1e3
                stop.wait(pause)
        finally:
            client.close()

    most = max([n for _, _, n in plan] + [config.tolerant_clients])
    threads = [threading.Thread(target=tolerant, args=(i,), daemon=True) for i in range(most)]
    for thread in threads:
        thread.start()
    try:
        for at in arrivals(config):
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            record = Record(PROTECTED, time.perf_counter() - start)
            with lock:
                records.append(record)
            sent_protected += 1
            protected.async_infer(PROTECTED, inputs[PROTECTED], callback=functools.partial(
                answered, record, start + record.sent), client_timeout=drain_s)
        time.sleep(max(0.0, start + config.seconds - time.perf_counter()))
        stop.set()
        deadline = time.monotonic() + drain_s
        for _ in range(sent_protected):
            if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
        for thread in threads:
            thread.join(timeout=drain_s)
    finally:
        stop.set()
        protected.close()
    return records


class CpuWatch:
    """Where the CPU time of each 100 ms window went, read from /proc (clock ticks) at each window's end: `volga
    up`'s own process (gateway, agent, loop), each model's worker (a child of it, known by its work folder), this
    process (the clients) and, on the CPUs this process may use, everything else on the machine ("other")."""

    def __init__(self, up_pid: int, start: float) -> None:
        self.up_pid = up_pid
        self.start = start
        self.cpus = sorted(os.sched_getaffinity(0))
        self.tick_ms = 1000.0 / os.sysconf("SC_CLK_TCK")
        self.rows: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._workers: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, name="cpu-watch", daemon=True)

    def __enter__(self) -> CpuWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _find_workers(self) -> None:
        found = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            if process.parent(int(entry.name)) != self.up_pid:
                continue
            try:
                folder = os.path.basename(os.readlink(f"/proc/{entry.name}/cwd"))
            except OSError:
                continue
            model = next((m for m in (PROTECTED, TOLERANT) if folder.startswith(f"{m}-")), None)
            if model is not None:
                found[int(entry.name)] = model
        self._workers = found

    def _node_ticks(self) -> int:
        busy = 0
        wanted = {f"cpu{c}" for c in self.cpus}
        for line in pathlib.Path("/proc/stat").read_text().splitlines():
            parts = line.split()
            if parts and parts[0] in wanted:
                busy += sum(int(parts[i]) for i in (1, 2, 3, 6, 7, 8))  # user nice system irq softirq steal
        return busy

    def _read(self) -> dict[str, int]:
        out = {"gateway": process.cpu_ticks(self.up_pid), "clients": process.cpu_ticks(os.getpid()),
               PROTECTED: 0, TOLERANT: 0, "node": self._node_ticks()}
        for pid, model in self._workers.items():
            out[model] += process.cpu_ticks(pid)
        return out

    def _run(self) -> None:
        k = 0
        self._find_workers()
        before = self._read()
        while not self._stop.is_set():
            k += 1
            delay = self.start + k * WINDOW_S - time.perf_counter()
            if delay > 0 and self._stop.wait(delay):
                break
            if k % 10 == 0:  # a demoted or restored worker has a new PID
                workers = dict(self._workers)
                self._find_workers()
                if workers != self._workers:
                    before = self._read()
                    self.rows.append({})
                    continue
            now = self._read()
            ms = {name: (now[name] - before[name]) * self.tick_ms for name in now}
            ours = sum(v for name, v in ms.items() if name != "node")
            row = {name: ms[name] for name in ("gateway", "clients", PROTECTED, TOLERANT)}
            row["other"] = max(0.0, ms["node"] - ours)
            self.rows.append(row)
            before = now


def attribute(records: Sequence[Record], rows: Sequence[dict[str, float]], violating_at_s: Sequence[float],
              limit_ms: float) -> dict[str, Any]:
    """The CPU time (ms per 100 ms window, by whom) and the tolerant model's requests in flight, in the windows
    where the protected model violated and in the others; and each violating window in full."""
    bad = {round(t / WINDOW_S) for t in violating_at_s}
    tolerant = [(r.sent, r.sent + r.latency_ms / 1e3) for r in records if r.model == TOLERANT
                and not math.isnan(r.latency_ms)]
    protected: dict[int, list[float]] = {}
    for r in records:
        if r.model == PROTECTED and r.status == "OK":
            protected.setdefault(int((r.sent + r.latency_ms / 1e3) / WINDOW_S), []).append(r.latency_ms)

    def in_flight(w: int) -> int:
        a, b = w * WINDOW_S, (w + 1) * WINDOW_S
        return sum(1 for s, e in tolerant if s < b and e > a)

    groups: dict[str, list[dict[str, float]]] = {"violating": [], "ok": []}
    detail = []
    for w, row in enumerate(rows):
        if not row or w not in protected:
            continue
        full = {**row, "tolerant_in_flight": float(in_flight(w))}
        groups["violating" if w in bad else "ok"].append(full)
        if w in bad:
            detail.append({"at_s": round(w * WINDOW_S, 1), "p99_ms": round(max(protected[w]), 2),
                           "requests": len(protected[w]), **{k: round(v, 1) for k, v in full.items()}})
    means = {name: ({k: round(sum(g[k] for g in group) / len(group), 1) for k in group[0]} if group else {})
             for name, group in groups.items()}
    per_window = [len(v) for v in protected.values()]
    return {"cpu_ms_per_window": means, "windows": {k: len(v) for k, v in groups.items()},
            "protected_requests_per_window": {"mean": round(sum(per_window) / len(per_window), 2) if per_window
                                              else 0.0, "max": max(per_window, default=0)},
            "limit_ms": round(limit_ms, 3), "violating": detail}


def nearest_rank_p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def judge(records: Sequence[Record], limit_ms: float, deadline_ms: float, seconds: float) -> dict[str, Any]:
    """The protected model's windows by completion time: violating ones, episodes, the run's p99."""
    ok = [r for r in records if r.model == PROTECTED and r.status == "OK"]
    by_window: dict[int, list[float]] = {}
    for r in ok:
        by_window.setdefault(int((r.sent + r.latency_ms / 1e3) / WINDOW_S), []).append(r.latency_ms)
    windows = math.ceil(seconds / WINDOW_S)
    violating = [w for w in range(windows) if w in by_window and nearest_rank_p99(by_window[w]) > limit_ms]
    episodes: list[int] = []
    for w in violating:
        if episodes and w - 1 in violating:
            episodes[-1] += 1
        else:
            episodes.append(1)
    lengths_ms = [n * WINDOW_S * 1e3 for n in episodes]
    failed = [r for r in records if r.model == PROTECTED and r.status != "OK"]
    return {"violating_windows": len(violating), "windows_judged": sum(1 for w in range(windows) if w in by_window),
            "p99_ms": round(float(np.percentile([r.latency_ms for r in ok], 99)), 2) if ok else None,
            "p50_ms": round(float(np.percentile([r.latency_ms for r in ok], 50)), 2) if ok else None,
            "requests": len(ok), "failed": len(failed), "episodes": len(episodes),
            "longest_episode_ms": max(lengths_ms, default=0.0),
            "episodes_past_deadline": sum(1 for x in lengths_ms if x > deadline_ms),
            "violating_at_s": [round(w * WINDOW_S, 1) for w in violating]}


def tolerant_summary(records: Sequence[Record]) -> dict[str, Any]:
    mine = [r for r in records if r.model == TOLERANT]
    ok = [r.latency_ms for r in mine if r.status == "OK"]
    return {"requests": len(mine), "answered": len(ok), "shed": sum(r.status == "RESOURCE_EXHAUSTED" for r in mine),
            "other_errors": sum(r.status not in ("OK", "RESOURCE_EXHAUSTED") for r in mine),
            "p99_ms": round(float(np.percentile(ok, 99)), 2) if ok else None,
            "p50_ms": round(float(np.percentile(ok, 50)), 2) if ok else None}


def histogram_quantiles(text: str, name: str, quantiles: Sequence[float]) -> dict[float, float | None]:
    """Quantiles of a Prometheus histogram (no labels) from its exposition, interpolated within buckets as
    PromQL's histogram_quantile does."""
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith(f'{name}_bucket{{le="'):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((math.inf if le == "+Inf" else float(le), float(line.split()[-1])))
    buckets.sort()
    out: dict[float, float | None] = {}
    total = buckets[-1][1] if buckets else 0.0
    for q in quantiles:
        if not total:
            out[q] = None
            continue
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, count in buckets:
            if count >= rank:
                if math.isinf(bound):
                    out[q] = lower
                else:
                    out[q] = lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
                break
            lower, below = bound, count
    return out


def one_run(specs: pathlib.Path, settings: pathlib.Path, arm: str, config: Config,
            inputs: dict[str, list[Any]], limit_ms: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """One `volga up` under the traffic of `arm` (`Config.arms`): the loop runs in all but "off" and "alone"; for
    "alone", `specs` holds the protected model only and no tolerant client runs, so the protected model's arrivals
    are the same and nothing else is."""
    alone = arm == "alone"
    autonomy = arm not in ("off", "alone")
    deadline_ms = config.models[0].deadline_ms
    args = ["-f", str(specs), "--settings", str(settings), *(["--autonomy"] if autonomy else [])]
    if alone:
        config = dataclasses.replace(config, tolerant_clients=0)  # and so no pulses
    with harness.volga_up(args) as up:
        warm = grpcclient.InferenceServerClient(up.endpoints["grpc"])
        for model in (PROTECTED,) if alone else (PROTECTED, TOLERANT):  # HOT before the clock starts
            for _ in range(3):
                warm_up(warm, model, inputs[model])
        warm.close()
        progress(f"{arm}: {config.seconds:g} s of traffic ...")
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        with CpuWatch(up.proc.pid, start) as watch:
            records = drive(up.endpoints["grpc"], config, inputs, start=start)
        metrics_text = urllib.request.urlopen(up.endpoints["metrics"], timeout=10).read().decode()
    protected = judge(records, limit_ms, deadline_ms, config.seconds)
    decision = histogram_quantiles(metrics_text, "volga_autonomy_decision_latency_us", (0.5, 0.99))
    jitter = histogram_quantiles(metrics_text, "volga_autonomy_sample_jitter_ms", (0.5, 0.99))
    actions = {line.split('action="', 1)[1].split('"', 1)[0]: float(line.split()[-1])
               for line in metrics_text.splitlines() if line.startswith("volga_autonomy_decisions_total{")}
    return {"protected": protected, "tolerant": tolerant_summary(records),
            "cpu": attribute(records, watch.rows, protected["violating_at_s"], limit_ms),
            "decision_us": {"p50": _round(decision[0.5]), "p99": _round(decision[0.99])},
            "sampling_jitter_ms": {"p50": _round(jitter[0.5]), "p99": _round(jitter[0.99])},
            "actions": actions, "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def run(config: Config | None = None, progress: Callable[[str], None] = lambda _: None,
        workdir: pathlib.Path | None = None) -> dict[str, Any]:
    config = config or Config()
    with tempfile.TemporaryDirectory(prefix="volga-bench-slo-", dir=workdir) as folder:
        root = pathlib.Path(folder)
        documents, baselines, checks = [], {}, {}
        for model in config.models:
            path = (build_torchscript(model, root / model.name / "model.pt") if config.gpu
                    else build_onnx(model, root / model.name / "model.onnx"))
            progress(f"calibrating {model.name} alone (batch {model.batch}, {config.calibrate_iterations} "
                     f"requests, one every {config.pace_ms:g} ms) ...")
            document, baselines[model.name], checks[model.name] = calibrated(
                spec_document(model, path, config.gpu), model.batch, config.calibrate_iterations,
                "cuda:0" if config.gpu else "cpu", pace_ms=config.pace_ms)
            documents.append(document)
        specs = root / "specs.yaml"
        specs.write_text(yaml.safe_dump_all(documents))
        alone_specs = root / "alone.yaml"
        alone_specs.write_text(yaml.safe_dump_all(documents[:1]))
        settings = {}
        for arm in config.arms:
            settings[arm] = root / f"settings-{arm}.yaml"
            settings[arm].write_text(yaml.safe_dump(config.settings(arm)))
        rng = np.random.default_rng(config.seed)
        inputs = {}
        for model in config.models:
            x = rng.standard_normal((model.batch, model.features)).astype(np.float32)
            item = grpcclient.InferInput("x", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            inputs[model.name] = [item]
        protected = config.models[0]
        limit_ms = baselines[PROTECTED] * (1 + protected.tolerance_pct / 100)
        runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in config.arms}
        for round_ in range(config.rounds):
            for arm in config.arms:
                progress(f"round {round_ + 1}/{config.rounds}: {arm}")
                runs[arm].append(one_run(alone_specs if arm == "alone" else specs, settings[arm], arm, config,
                                         inputs, limit_ms, progress))
    return {**report(config, baselines, limit_ms, runs), "calibration": checks}


def report(config: Config, baselines: dict[str, float], limit_ms: float,
           runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def side(name: str) -> dict[str, Any]:
        items = [r["protected"] for r in runs[name]]
        p99s = [p["p99_ms"] for p in items if p["p99_ms"] is not None]
        return {"violating_windows": sum(p["violating_windows"] for p in items),
                "windows_judged": sum(p["windows_judged"] for p in items),
                "p99_ms": max(p99s) if p99s else None,
                "episodes": sum(p["episodes"] for p in items),
                "episodes_past_deadline": sum(p["episodes_past_deadline"] for p in items),
                "longest_episode_ms": max((p["longest_episode_ms"] for p in items), default=0.0)}

    def tolerant(name: str) -> dict[str, Any]:
        items = [r["tolerant"] for r in runs[name]]
        p99s = [t["p99_ms"] for t in items if t["p99_ms"] is not None]
        p50s = [t["p50_ms"] for t in items if t["p50_ms"] is not None]
        return {"requests": sum(t["requests"] for t in items), "shed": sum(t["shed"] for t in items),
                "answered": sum(t["answered"] for t in items),
                "other_errors": sum(t["other_errors"] for t in items), "p99_ms": max(p99s) if p99s else None,
                "p50_ms": max(p50s) if p50s else None}

    on_runs = runs["on"]
    off, on = side("off"), side("on")
    # With a throttle: the on-run beside the yield alone.
    arm = {"autonomy_yield": side("yield"), "throttle": {
        "share": config.throttle_share, "period_ms": config.throttle_period_ms, "guard": config.throttle_guard,
        "fewer_violating_windows_than_yield_x": (round(side("yield")["violating_windows"] / on["violating_windows"], 2)
                                                 if on["violating_windows"] else None)}} if "yield" in runs else {}
    # The protected model alone under the same arrivals: the violating windows no co-runner causes (the machine's
    # own noise, the model's own tail), which no action of the loop can take away.
    floor: dict[str, Any] = {}
    if "alone" in runs:
        alone = side("alone")
        above = {name: max(0, side(name)["violating_windows"] - alone["violating_windows"])
                 for name in runs if name != "alone"}
        floor = {"protected_alone": alone, "violating_windows_above_alone": above,
                 "fewer_violating_windows_above_alone_x": round(above["off"] / above["on"], 2) if above["on"]
                 else None}
    return {
        "autonomy_off": off, "autonomy_on": on, **arm, **floor,
        "fewer_violating_windows_x": (round(off["violating_windows"] / on["violating_windows"], 2)
                                      if on["violating_windows"] else None),
        "decision_us": {"p50": max((r["decision_us"]["p50"] or 0.0) for r in on_runs) if on_runs else None,
                        "p99": max((r["decision_us"]["p99"] or 0.0) for r in on_runs) if on_runs else None},
        "sampling_jitter_ms": {"p99": max((r["sampling_jitter_ms"]["p99"] or 0.0) for r in on_runs)
                               if on_runs else None},
        "tolerant": {name: tolerant(name) for name in runs},
        "baseline_p99_ms": {k: round(v, 3) for k, v in baselines.items()},
        "protected_limit_ms": round(limit_ms, 3),
        "tolerance_pct": {m.name: m.tolerance_pct for m in config.models},
        "recovery_deadline_ms": config.models[0].deadline_ms,
        "settings": config.settings("on"),
        "config": dataclasses.asdict(config),
        "runs": runs, "device": reporting.device_description("cuda:0" if config.gpu else "cpu"),
        "load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def format_report(r: dict[str, Any]) -> str:
    lines = [f"protected limit {r['protected_limit_ms']:.2f} ms (baseline p99 {r['baseline_p99_ms'][PROTECTED]:.2f} "
             f"ms x 1.15), load average {r['load_average']} on {r['cpus']} CPUs",
             f"{'autonomy':>9}{'violating':>11}{'judged':>8}{'p99 ms':>9}{'episodes':>10}{'> deadline':>11}"
             f"{'tolerant shed':>15}{'tolerant p99':>14}"]
    names = [name for name in ("alone", "off", "yield", "on") if name in r["runs"]]
    for name in names:
        s, t = r["protected_alone" if name == "alone" else f"autonomy_{name}"], r["tolerant"][name]
        lines.append(f"{name:>9}{s['violating_windows']:>11}{s['windows_judged']:>8}{s['p99_ms'] or 0:>9.1f}"
                     f"{s['episodes']:>10}{s['episodes_past_deadline']:>11}{t['shed']:>15}{t['p99_ms'] or 0:>14.1f}")
    lines.append(f"decision p50 {r['decision_us']['p50']} us, p99 {r['decision_us']['p99']} us; sampling jitter p99 "
                 f"{r['sampling_jitter_ms']['p99']} ms; {r['fewer_violating_windows_x']}x fewer violating windows")
    if "protected_alone" in r:
        above = r["violating_windows_above_alone"]
        lines.append(f"above the {r['protected_alone']['violating_windows']} violating windows of the protected model "
                     f"alone: off {above['off']}, on {above['on']} "
                     + (f"({r['fewer_violating_windows_above_alone_x']}x fewer)" if above["on"] else "(none left)"))
    for model, check in r.get("calibration", {}).items():
        lines.append(f"calibration of {model}: p50 {check['p50_ms']} ms, p99 {check['p99_ms']} ms after "
                     f"{len(check['attempts'])} attempt(s)" + ("" if check["sane"] else " (disturbed: p99 > "
                                                               f"{DISTURBED_P99_OVER_P50:g} x p50)"))
    if "throttle" in r:
        lines.append(f"on: throttle {r['throttle']['share']:g} of every {r['throttle']['period_ms']:g} ms"
                     + (" while the protected model computes" if r["throttle"].get("guard") else "") + "; yield: the "
                     f"loop on without it; {r['throttle']['fewer_violating_windows_than_yield_x']}x fewer violating "
                     "windows than the yield alone")
    for name in names:
        for run in r["runs"][name]:
            cpu = run["cpu"]
            for kind in ("violating", "ok"):
                if cpu["cpu_ms_per_window"][kind]:
                    lines.append(f"autonomy {name}, {cpu['windows'][kind]} {kind} windows, CPU ms per 100 ms: "
                                 + ", ".join(f"{k} {v:g}" for k, v in cpu["cpu_ms_per_window"][kind].items()))
    return "\n".join(lines)
