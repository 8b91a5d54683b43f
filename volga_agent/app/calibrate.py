"""`volga calibrate`: a model's baselines measured on this node, alone, and written back into its ModelSpec.

A real worker is started from the ModelSpec (`instance.Instance`, COLD -> HOT) and timed one request at a time on
two paths. The baseline path is the one requests take and the one the autonomy loop compares with the baseline
(the gateway's end-to-end latency): an unmodified tritonclient (gRPC) through a real gateway data plane
(`gateway.app.Gateway` on loopback ports of its own, routing to this worker) to the worker. The second path is the
worker alone, through the gateway's own worker client (`gateway.workers.WorkerClients`: the frame protocol,
tensors in per-connection shared memory); the difference is the gateway's overhead. `through="worker"` (`volga
calibrate --direct`) times only the worker, as baselines were measured before.

Per batch size, ascending: warm-up requests, then `iterations` timed ones on each path, back to back or one
every `pace_ms` (by default the spec's slo.calibrationPaceMs): sparse traffic finds CPUs and GPUs idle, in deeper
power states and with colder caches, and is slower than back-to-back requests, so a baseline for a model that gets
a few requests a second is measured paced. Per batch size: p50 and p99, samples per second, and the worker's peak
memory (host: VmHWM; GPU: what the worker reports allocated). The result is an
`api.Calibration`, the shape of the ModelSpec status' `calibrated` entries (p50Ms/p99Ms the baseline path,
workerP50Ms/workerP99Ms the worker alone).

`write` puts the p99s into the ModelSpec file as spec.slo.baselineLatencyMs, tagged with the version and input
hash measured (spec.slo.baselineFor), keeping everything else in the file as it was (ruamel.yaml round-trips
comments, order and quoting).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import pathlib
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
import tritonclient.grpc as grpcclient
import uvloop
from ruamel.yaml import YAML

from volga_agent.gateway import app, catalog, links, workers
from volga_agent.host import gpus
from volga_agent.node import instance
from volga_agent.worker import contract
from volga_core import api

WARMUP = 20
DEFAULT_BATCH_SIZES = (1, 8)
Through = Literal["gateway", "worker"]
T = TypeVar("T")


class StartFailed(RuntimeError):
    """The worker to measure did not start (a model that does not load, a device that is not there)."""


def device_name(device: str) -> str:
    """cpu, or the product name of the GPU (as status.calibrated keys it)."""
    return gpus.kind_of(device, gpus.discover() if device.startswith("cuda") else ())


def _peak_rss(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _pause(sent: float, pace_s: float) -> float:
    """Seconds left of this request's slot: one request starts every `pace_s` (0: back to back)."""
    return max(0.0, sent + pace_s - time.perf_counter())


async def _measure(socket_path: str, decls: tuple[contract.TensorDecl, ...], batch: int, iterations: int,
                   warmup: int, pace_s: float = 0.0) -> tuple[list[float], float]:
    clients = workers.WorkerClients(per_worker=1)
    try:
        inputs = contract.sample_inputs(decls, batch=batch, seed=batch)
        for _ in range(warmup):
            await clients.infer(socket_path, inputs)
        latencies = []
        started = time.perf_counter()
        for _ in range(iterations):
            sent = time.perf_counter()
            await clients.infer(socket_path, inputs)
            latencies.append((time.perf_counter() - sent) * 1e3)
            await asyncio.sleep(_pause(sent, pace_s))
        return latencies, time.perf_counter() - started
    finally:
        clients.close()


def batch_sizes_for(spec: api.ModelSpecSpec) -> list[int]:
    """The batch sizes the ModelSpec's baselines name, else 1 and 8; none above spec.runtime.maxBatchSize."""
    named = sorted(int(size) for size in spec.slo.baseline_latency_ms) or list(DEFAULT_BATCH_SIZES)
    return sorted({min(size, spec.runtime.max_batch_size) for size in named})


def _percentiles(latencies: Sequence[float]) -> tuple[float, float]:
    return (round(float(np.percentile(latencies, 50)), 4), round(float(np.percentile(latencies, 99)), 4))


class _Gateway:
    """A gateway data plane of its own in front of one worker: gRPC on a loopback port the OS picks, its event
    loop on a thread; every request for the model routes to the worker's socket."""

    def __init__(self, spec: api.ModelSpecSpec, route: links.Route) -> None:
        self.spec = spec
        self.route = route
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="calibrate-gateway", daemon=True)
        self.gateway: app.Gateway | None = None

    def _run(self, work: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    async def _start(self) -> int:
        settings = app.Settings(host="127.0.0.1", http_port=0, grpc_port=0, metrics_port=0)
        link = links.LocalAgentLink(lambda _model, _hint: self.route)
        self.gateway = app.Gateway(catalog.Catalog({self.spec.model_id: self.spec}), link, settings)
        await self.gateway.start()
        return self.gateway.ports["grpc"]

    def __enter__(self) -> str:
        self.thread.start()
        try:
            return f"127.0.0.1:{self._run(self._start())}"
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *_: object) -> None:
        try:
            if self.gateway is not None:
                self._run(self.gateway.stop(0.5))
        except (concurrent.futures.TimeoutError, OSError):
            pass
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            if not self.thread.is_alive():
                self.loop.close()


def _measure_gateway(address: str, model: str, decls: tuple[contract.TensorDecl, ...], batch: int, iterations: int,
                     warmup: int, pace_s: float = 0.0) -> tuple[list[float], float]:
    """Time requests as a client sends them: tritonclient's gRPC client, through the gateway."""
    client = grpcclient.InferenceServerClient(address)
    try:
        arrays = contract.sample_inputs(decls, batch=batch, seed=batch)
        inputs = []
        for decl in decls:
            item = grpcclient.InferInput(decl.name, list(arrays[decl.name].shape), decl.dtype)
            item.set_data_from_numpy(arrays[decl.name])
            inputs.append(item)
        for _ in range(warmup):
            client.infer(model, inputs, client_timeout=120)
        latencies = []
        started = time.perf_counter()
        for _ in range(iterations):
            sent = time.perf_counter()
            client.infer(model, inputs, client_timeout=120)
            latencies.append((time.perf_counter() - sent) * 1e3)
            time.sleep(_pause(sent, pace_s))
        return latencies, time.perf_counter() - started
    finally:
        client.close()


def measure(spec: api.ModelSpecSpec, batch_sizes: Sequence[int], iterations: int, device: str = "cpu",
            workdir: pathlib.Path | None = None, warmup: int = WARMUP,
            progress: Callable[[str], None] = lambda _: None, through: Through = "gateway",
            pace_ms: float | None = None) -> api.Calibration:
    """Start a worker for `spec` on `device`, time each batch size alone (through a gateway and on the worker
    alone, or with `through="worker"` on the worker alone; one request every `pace_ms`, by default the spec's
    slo.calibrationPaceMs, 0 back to back), stop the worker. Samples per second are only meaningful back to
    back."""
    if pace_ms is None:
        pace_ms = spec.slo.calibration_pace_ms
    if not spec.has_signature:
        raise ValueError("spec.inputs: the signature must be known (read it from the model file first)")
    too_big = [b for b in batch_sizes if b > spec.runtime.max_batch_size]
    if too_big:
        raise ValueError(f"--batch-sizes: {too_big} above spec.runtime.maxBatchSize ({spec.runtime.max_batch_size})")
    if iterations < 1:
        raise ValueError(f"--iterations: {iterations}: time at least one request per batch size")
    if pace_ms < 0:
        raise ValueError(f"--pace-ms: {pace_ms}: a request every 0 ms (back to back) or more")
    with tempfile.TemporaryDirectory(prefix="volga-cal-", dir=workdir) as run:
        inst = instance.Instance(f"calibrate-{spec.model_id}", spec, pathlib.Path(run) / "w", None, None, device)
        progress(f"starting a worker for {spec.model_id} on {device} ...")
        try:
            inst.to(api.Tier.HOT)
        except Exception as exc:
            with contextlib.suppress(Exception):  # what is left of the worker; the start's error is the one to see
                inst.close()
            raise StartFailed(f"the worker for {spec.model_id} did not start on {device}: {exc}") from exc
        try:
            decls = instance.decls(spec.inputs)
            front: contextlib.AbstractContextManager[str] = (
                _Gateway(spec, links.Route(inst.name, inst.config.socket)) if through == "gateway"
                else contextlib.nullcontext(""))
            with front as address:
                profiles = []
                for batch in sorted(set(batch_sizes)):
                    gateway_p: tuple[float, float] | None = None
                    if address:
                        progress(f"batch {batch}: {warmup} warm-up, {iterations} timed requests through the "
                                 f"gateway ...")
                        latencies, seconds = _measure_gateway(address, spec.model_id, decls, batch, iterations,
                                                              warmup, pace_ms / 1e3)
                        gateway_p = _percentiles(latencies)
                    progress(f"batch {batch}: {warmup} warm-up, {iterations} timed requests to the worker ...")
                    worker_latencies, worker_seconds = asyncio.run(
                        _measure(inst.config.socket, decls, batch, iterations, warmup, pace_ms / 1e3))
                    worker_p = _percentiles(worker_latencies)
                    if gateway_p is None:
                        gateway_p, seconds = worker_p, worker_seconds
                    assert inst.pid is not None
                    memory = (int(inst.client().call("stats").header.get("gpu_allocated_bytes", 0))
                              if device.startswith("cuda") else _peak_rss(inst.pid))
                    profiles.append(api.BatchProfile(
                        batch_size=batch, p50_ms=gateway_p[0], p99_ms=gateway_p[1], memory_bytes=memory,
                        throughput_per_sec=round(batch * iterations / seconds, 1),
                        worker_p50_ms=worker_p[0], worker_p99_ms=worker_p[1]))
        finally:
            inst.to(api.Tier.COLD)
    return api.Calibration(device=device_name(device), version=spec.version, input_hash=spec.input_hash(),
                           measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           node=socket.gethostname(), iterations=iterations, pace_ms=pace_ms, batches=profiles,
                           measured_through=through)


def table(calibration: api.Calibration) -> str:
    through = calibration.measured_through
    pace = f"one every {calibration.pace_ms:g} ms" if calibration.pace_ms else "back to back"
    lines = [f"{calibration.device}, version {calibration.version}, input hash {calibration.input_hash[:16]}..., "
             f"{calibration.iterations} requests per batch size, {pace}; the baseline (p99): "
             + ("through a gateway (tritonclient gRPC)" if through == "gateway" else "the worker alone"),
             f"{'batch':>6}{'p50 ms':>10}{'p99 ms':>10}"
             + (f"{'worker p50':>12}{'worker p99':>12}{'gateway +p99':>14}" if through == "gateway" else "")
             + f"{'memory MiB':>12}{'samples/s':>12}"]
    for b in calibration.batches:
        row = f"{b.batch_size:>6}{b.p50_ms:>10.3f}{b.p99_ms:>10.3f}"
        if through == "gateway":
            worker_p50, worker_p99 = b.worker_p50_ms or 0.0, b.worker_p99_ms or 0.0
            row += f"{worker_p50:>12.3f}{worker_p99:>12.3f}{b.p99_ms - worker_p99:>14.3f}"
        lines.append(row + f"{b.memory_bytes / 2**20:>12.1f}{b.throughput_per_sec:>12.1f}")
    return "\n".join(lines)


def write(path: pathlib.Path, name: str, calibration: api.Calibration) -> None:
    """Set spec.slo.baselineLatencyMs and spec.slo.baselineFor of the ModelSpec `name` in the file, leaving the
    rest of the file as it was. Baselines of another version or input hash are replaced, not merged."""
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096
    documents = list(yaml.load_all(path.read_text()))
    target = next((d for d in documents if isinstance(d, dict) and d.get("metadata", {}).get("name") == name), None)
    if target is None:
        raise ValueError(f"{path}: no ModelSpec named {name!r}")
    slo = target["spec"].setdefault("slo", {})
    tag = {"version": calibration.version, "inputHash": calibration.input_hash, "device": calibration.device}
    old = slo.get("baselineFor")
    same = old is not None and (old.get("version"), old.get("inputHash")) == (tag["version"], tag["inputHash"])
    baselines = dict(slo.get("baselineLatencyMs") or {}) if same else {}
    baselines.update(calibration.baselines())
    slo["baselineLatencyMs"] = {k: baselines[k] for k in sorted(baselines, key=int)}
    slo["baselineFor"] = tag
    with path.open("w") as out:
        if len(documents) == 1:
            yaml.dump(documents[0], out)
        else:
            yaml.dump_all(documents, out)
