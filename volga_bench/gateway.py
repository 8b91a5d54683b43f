"""`volga bench gateway`: what the gateway adds to a request, against calling the worker directly.

It starts `volga up` with the default model as a separate process (as a user runs it), wakes the model,
finds the worker's socket through the Agent API, and then sends requests at a fixed rate (open loop: each
request is due at start + i / rate, latency counts from when it was sent) in alternating rounds:

- direct: this process -> the worker's AF_UNIX socket (the frame protocol, tensors inline);
- gateway: this process -> an unmodified tritonclient -> the gateway (gRPC or REST) -> the worker.

Both sides run in the same run, on the same HOT instance, with the same inputs, so the difference of their
percentiles is the gateway's cost: protocol decoding, routing, shared memory, and one more process hop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from volga_agent import defaultmodel, instance
from volga_agent.rpc.volga.v1 import agent_pb2, agent_pb2_grpc
from volga_agent.worker import contract, protocol
from volga_bench import harness, reporting


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
