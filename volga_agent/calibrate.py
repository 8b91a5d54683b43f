"""`volga calibrate`: a model's baselines measured on this node, alone, and written back into its ModelSpec.

A real worker is started from the ModelSpec (`instance.Instance`, COLD -> HOT) and fed through the gateway's own
worker client (`gateway.workers.WorkerClients`: the frame protocol, tensors in per-connection shared memory), one
request at a time, so that the latency measured is the one the gateway sees of a worker with nothing beside it.
Per batch size, ascending: warm-up requests, then `iterations` timed ones; p50 and p99, samples per second, and
the worker's peak memory (host: VmHWM; GPU: what the worker reports allocated). The result is an
`api.Calibration`, the shape of the ModelSpec status' `calibrated` entries.

`write` puts the p99s into the ModelSpec file as spec.slo.baselineLatencyMs, tagged with the version and input
hash measured (spec.slo.baselineFor), keeping everything else in the file as it was (ruamel.yaml round-trips
comments, order and quoting).
"""

from __future__ import annotations

import asyncio
import pathlib
import socket
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np
from ruamel.yaml import YAML

from volga_agent import gpus, instance
from volga_agent.gateway import workers
from volga_agent.worker import contract
from volga_operator import api

WARMUP = 20


def device_name(device: str) -> str:
    """cpu, or the product name of the GPU (as status.calibrated keys it)."""
    if not device.startswith("cuda"):
        return "cpu"
    index = int(device.partition(":")[2] or 0)
    found = next((g.product for g in gpus.discover() if g.index == index), "")
    return found or device


def _peak_rss(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


async def _measure(socket_path: str, decls: tuple[contract.TensorDecl, ...], batch: int, iterations: int,
                   warmup: int) -> tuple[list[float], float]:
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
        return latencies, time.perf_counter() - started
    finally:
        clients.close()


def measure(spec: api.ModelSpecSpec, batch_sizes: Sequence[int], iterations: int, device: str = "cpu",
            workdir: pathlib.Path | None = None, warmup: int = WARMUP,
            progress: Callable[[str], None] = lambda _: None) -> api.Calibration:
    """Start a worker for `spec` on `device`, time each batch size alone, stop the worker."""
    if not spec.has_signature:
        raise ValueError("spec.inputs: the signature must be known (read it from the model file first)")
    too_big = [b for b in batch_sizes if b > spec.runtime.max_batch_size]
    if too_big:
        raise ValueError(f"--batch-sizes: {too_big} above spec.runtime.maxBatchSize ({spec.runtime.max_batch_size})")
    with tempfile.TemporaryDirectory(prefix="volga-cal-", dir=workdir) as run:
        inst = instance.Instance(f"calibrate-{spec.model_id}", spec, pathlib.Path(run) / "w", None, None, device)
        progress(f"starting a worker for {spec.model_id} on {device} ...")
        inst.to(api.Tier.HOT)
        try:
            decls = instance.decls(spec.inputs)
            profiles = []
            for batch in sorted(set(batch_sizes)):
                progress(f"batch {batch}: {warmup} warm-up, {iterations} timed requests ...")
                latencies, seconds = asyncio.run(_measure(inst.config.socket, decls, batch, iterations, warmup))
                assert inst.pid is not None
                memory = (int(inst.client().call("stats").header.get("gpu_allocated_bytes", 0))
                          if device.startswith("cuda") else _peak_rss(inst.pid))
                profiles.append(api.BatchProfile(
                    batch_size=batch, p50_ms=round(float(np.percentile(latencies, 50)), 4),
                    p99_ms=round(float(np.percentile(latencies, 99)), 4), memory_bytes=memory,
                    throughput_per_sec=round(batch * iterations / seconds, 1)))
        finally:
            inst.to(api.Tier.COLD)
    return api.Calibration(device=device_name(device), version=spec.version, input_hash=spec.input_hash(),
                           measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           node=socket.gethostname(), iterations=iterations, batches=profiles)


def table(calibration: api.Calibration) -> str:
    lines = [f"{calibration.device}, version {calibration.version}, input hash {calibration.input_hash[:16]}..., "
             f"{calibration.iterations} requests per batch size",
             f"{'batch':>6}{'p50 ms':>10}{'p99 ms':>10}{'memory MiB':>12}{'samples/s':>12}"]
    for b in calibration.batches:
        lines.append(f"{b.batch_size:>6}{b.p50_ms:>10.3f}{b.p99_ms:>10.3f}{b.memory_bytes / 2**20:>12.1f}"
                     f"{b.throughput_per_sec:>12.1f}")
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
