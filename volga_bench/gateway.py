"""`volga bench gateway`: what the gateway adds to a request, against calling the worker directly.

It starts `volga up` with the default model as a separate process (as a user runs it), wakes the model,
finds the worker's socket through the Agent API, and then sends requests at a fixed rate (open loop: each
request is due at start + i / rate, latency counts from when it was sent) in alternating rounds:

- direct: this process -> the worker's AF_UNIX socket (the frame protocol, tensors inline);
- gateway: this process -> an unmodified tritonclient -> the gateway (gRPC or REST) -> the worker.

Both sides run in the same run, on the same HOT instance, with the same inputs, so the difference of their
percentiles is the gateway's cost: protocol decoding, routing, shared memory, and one more process hop.

`run_batching` (`volga bench gateway --batching`) compares, in one run of one `volga up`, the default model
served one request per worker call with a copy of it whose requests the gateway batches
(`runtime.dynamicBatching`). N asynchronous tritonclient clients each send batch-1 requests in a closed loop
(the next when the last is answered). Batch 1 runs at N clients; the batched copy runs at N, 2N, 4N, ...
clients, and the report picks the busiest load whose p99 stays within the batch-1 run's: throughput at equal
p99. Every answer is compared with the model's answer to the same input sent alone.
"""

from __future__ import annotations

import asyncio
import pathlib
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import yaml
from prometheus_client import parser

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.rpc.volga.v1 import agent_pb2, agent_pb2_grpc
from volga_agent.worker import contract, protocol
from volga_bench import harness, reporting
from volga_core import api

BATCHED_ID = "ctr-batched"


def paced(rate: float, seconds: float, send: Callable[[], None]) -> list[float]:
    """Open-loop load: request i is due at start + i / rate; returns each request's latency in seconds."""
    interval = 1.0 / rate
    count = int(rate * seconds)
    latencies = []
    start = time.perf_counter()
    for i in range(count):
        due = start + i * interval
        now = time.perf_counter()
        if due - now > 0.0005:
            time.sleep(due - now - 0.0003)
        while time.perf_counter() < due:
            pass
        sent = time.perf_counter()
        send()
        latencies.append(time.perf_counter() - sent)
    return latencies


def run(rate: float = 500.0, seconds: float = 4.0, rounds: int = 3, protocol_name: str = "grpc",
        progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    spec = defaultmodel.ensure().spec
    decls = instance.decls(spec.inputs)
    arrays = contract.sample_inputs(decls, batch=1, seed=9)
    headers = {"x-model-id": spec.model_id}
    progress("starting volga up (default model) ...")
    with harness.volga_up() as up:
        ep = up.endpoints
        with grpc.insecure_channel(ep["agent"]) as channel:
            stub = agent_pb2_grpc.AgentStub(channel)
            progress("waking the model through the Agent API ...")
            socket_path = stub.Activate(agent_pb2.ActivateRequest(model_id=spec.model_id), timeout=180).instance.socket
        if protocol_name == "grpc":
            gclient: Any = grpcclient.InferenceServerClient(ep["grpc"])
            module: Any = grpcclient
        else:
            gclient = httpclient.InferenceServerClient(ep["http"].removeprefix("http://"))
            module = httpclient
        inputs = harness.triton_inputs(decls, arrays, module)
        direct = protocol.WorkerClient(socket_path)
        reference = direct.infer(arrays)["probability"]
        mismatches = 0

        def via_direct() -> None:
            nonlocal mismatches
            mismatches += int(not np.array_equal(direct.infer(arrays)["probability"], reference))

        def via_gateway() -> None:
            nonlocal mismatches
            out = gclient.infer(spec.model_id, inputs, headers=headers).as_numpy("probability")
            mismatches += int(not np.array_equal(out, reference))

        for _ in range(200):  # warm both paths: connections, shared memory, caches
            via_direct()
            via_gateway()
        samples: dict[str, list[float]] = {"direct": [], "gateway": []}
        started = time.perf_counter()
        for r in range(rounds):
            for side, send in (("direct", via_direct), ("gateway", via_gateway)):
                progress(f"round {r + 1}/{rounds}: {side} at {rate:g} requests/s for {seconds:g} s")
                samples[side].extend(paced(rate, seconds, send))
        wall = time.perf_counter() - started
        direct.close()
        gclient.close()

    d, g = reporting.summarize(samples["direct"]), reporting.summarize(samples["gateway"])
    d["mean_ms"] = round(float(np.mean(samples["direct"]) * 1e3), 3)
    g["mean_ms"] = round(float(np.mean(samples["gateway"]) * 1e3), 3)
    return {
        "rate_rps": rate,
        "protocol": protocol_name,
        "device": reporting.device_description("cpu"),
        "model": spec.model_id,
        "batch": 1,
        "direct": d,
        "gateway": g,
        "added_p50_ms": round(g["p50_ms"] - d["p50_ms"], 3),
        "added_p99_ms": round(g["p99_ms"] - d["p99_ms"], 3),
        "achieved_rps": round(sum(len(v) for v in samples.values()) / wall, 1),
        "outputs_match": mismatches == 0,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def format_report(report: dict[str, Any]) -> str:
    d, g = report["direct"], report["gateway"]
    return "\n".join([
        f"{report['protocol']} at {report['rate_rps']:g} requests/s, {report['device']}",
        f"{'':<10}{'p50 ms':>9}{'p99 ms':>9}{'n':>7}",
        f"{'direct':<10}{d['p50_ms']:>9.3f}{d['p99_ms']:>9.3f}{d['n']:>7}",
        f"{'gateway':<10}{g['p50_ms']:>9.3f}{g['p99_ms']:>9.3f}{g['n']:>7}",
        f"added: p50 {report['added_p50_ms']:.3f} ms, p99 {report['added_p99_ms']:.3f} ms; "
        f"outputs match: {report['outputs_match']}",
    ])


def _batching_specs(folder: pathlib.Path, delay_us: int) -> pathlib.Path:
    """The default model twice, both HOT: as it is, and with dynamic batching in the gateway."""
    doc: dict[str, Any] = defaultmodel.spec_document(defaultmodel.ensure().spec.source_path)
    doc["spec"]["pool"] = {"hot": 1, "frozen": 0}
    batched: dict[str, Any] = yaml.safe_load(yaml.safe_dump(doc))
    batched["metadata"]["name"] = batched["spec"]["modelId"] = BATCHED_ID
    batched["spec"]["runtime"]["dynamicBatching"] = {"enabled": True, "maxQueueDelayMicroseconds": delay_us,
                                                     "maxQueueSize": 4096}
    for d in (doc, batched):
        api.parse_model_spec(d)
    path = folder / "models.yaml"
    path.write_text(yaml.safe_dump_all([doc, batched]))
    return path


async def _closed_loop(address: str, model: str, clients: int, seconds: float,
                       requests: list[list[Any]], answers: list[np.ndarray]) -> dict[str, Any]:
    """`clients` tritonclients, each sending its own input again as soon as the last answer came."""
    conns = [grpcaio.InferenceServerClient(address) for _ in range(clients)]
    latencies: list[float] = []
    mismatches = 0
    stop = time.perf_counter() + seconds

    async def client(i: int) -> None:
        nonlocal mismatches
        conn, inputs, want = conns[i], requests[i % len(requests)], answers[i % len(answers)]
        while time.perf_counter() < stop:
            sent = time.perf_counter()
            result = await conn.infer(model, inputs)
            latencies.append(time.perf_counter() - sent)
            mismatches += int(not np.array_equal(result.as_numpy("probability"), want))

    started = time.perf_counter()
    try:
        await asyncio.gather(*(client(i) for i in range(clients)))
    finally:
        for conn in conns:
            await conn.close()
    wall = time.perf_counter() - started
    summary: dict[str, Any] = {"clients": clients, "throughput_rps": round(len(latencies) / wall, 1),
                               **reporting.summarize(latencies), "mismatches": mismatches}
    return summary


def _batch_sizes(metrics_url: str, model: str) -> tuple[float, float]:
    """(worker calls, rows) the gateway's batcher sent for the model so far."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = {"count": 0.0, "sum": 0.0}
    for family in parser.text_string_to_metric_families(text):
        if family.name == "volga_gateway_batch_size":
            for sample in family.samples:
                kind = sample.name.rsplit("_", 1)[-1]
                if sample.labels.get("model") == model and kind in found:
                    found[kind] = sample.value
    return found["count"], found["sum"]


def run_batching(clients: int = 8, seconds: float = 5.0, delay_us: int = 0, max_clients: int = 128,
                 progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    spec = defaultmodel.ensure().spec
    decls = instance.decls(spec.inputs)
    inputs = [contract.sample_inputs(decls, batch=1, seed=100 + i) for i in range(16)]
    with tempfile.TemporaryDirectory(prefix="volga-bench-") as folder:
        specs = _batching_specs(pathlib.Path(folder), delay_us)
        progress("starting volga up (the default model, and a copy with dynamic batching) ...")
        with harness.volga_up(["-f", str(specs)]) as up:
            address, metrics_url = up.endpoints["grpc"], up.endpoints["metrics"]
            requests = [harness.triton_inputs(decls, x, grpcclient) for x in inputs]
            with grpcclient.InferenceServerClient(address) as sync:
                answers = [sync.infer(spec.model_id, r).as_numpy("probability") for r in requests]

            async def measure(model: str, n: int, warm: bool = True) -> dict[str, Any]:
                if warm:
                    await _closed_loop(address, model, n, min(1.0, seconds), requests, answers)
                return await _closed_loop(address, model, n, seconds, requests, answers)

            async def both() -> tuple[dict[str, Any], list[dict[str, Any]]]:
                progress(f"batch 1: {clients} clients for {seconds:g} s")
                single = await measure(spec.model_id, clients)
                sweep = []
                n = clients
                while n <= max_clients:
                    progress(f"dynamic batching: {n} clients for {seconds:g} s")
                    calls, rows = _batch_sizes(metrics_url, BATCHED_ID)
                    point = await measure(BATCHED_ID, n)
                    calls_after, rows_after = _batch_sizes(metrics_url, BATCHED_ID)
                    point["mean_batch_rows"] = round((rows_after - rows) / max(1.0, calls_after - calls), 2)
                    sweep.append(point)
                    if point["p99_ms"] > single["p99_ms"]:
                        break
                    n *= 2
                return single, sweep

            single, sweep = asyncio.run(both())
    within = [p for p in sweep if p["p99_ms"] <= single["p99_ms"]]
    chosen = max(within, key=lambda p: p["throughput_rps"]) if within else sweep[0]
    same_load = sweep[0]
    return {
        "model": spec.model_id,
        "device": reporting.device_description("cpu"),
        "protocol": "grpc",
        "request_rows": 1,
        "max_queue_delay_us": delay_us,
        "seconds_per_run": seconds,
        "batch1": single,
        "dynamic_at_equal_p99": chosen,
        "throughput_gain_at_equal_p99": round(chosen["throughput_rps"] / single["throughput_rps"], 2),
        "dynamic_at_equal_clients": same_load,
        "dynamic_sweep": sweep,
        "outputs_match": single["mismatches"] == 0 and all(p["mismatches"] == 0 for p in sweep),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def format_batching(report: dict[str, Any]) -> str:
    rows = [("batch 1", report["batch1"]), ("dynamic, equal p99", report["dynamic_at_equal_p99"]),
            ("dynamic, equal clients", report["dynamic_at_equal_clients"])]
    lines = [f"{report['model']} over gRPC, batch-1 requests, closed loop, {report['device']}",
             f"{'':<24}{'clients':>8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'rows/call':>10}"]
    for name, r in rows:
        lines.append(f"{name:<24}{r['clients']:>8}{r['throughput_rps']:>9.1f}{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}"
                     f"{r.get('mean_batch_rows', 1):>10}")
    lines.append(f"throughput at equal p99: x{report['throughput_gain_at_equal_p99']}; "
                 f"outputs match: {report['outputs_match']}")
    return "\n".join(lines)
