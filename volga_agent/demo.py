"""`volga demo`: the embedded default model served by `volga up`, driven with an unmodified tritonclient.

It builds the default model, starts agent + gateway in this process (ephemeral ports), lets the pool warm
the snapshot tier (cold start, then freeze), and then times, through the gateway: cold start -> first
answer, FROZEN wake -> first answer, and steady-state HOT requests. Every answer is compared with the first.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from volga_agent import bench, defaultmodel, local
from volga_agent.worker import contract
from volga_operator import api

Tier = api.Tier
T = TypeVar("T")


class Background:
    """An asyncio loop on a thread, for driving the embedded server from synchronous client code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="volga-up", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


def start_embedded(specs: list[api.ModelSpec], **options: Any) -> tuple[Background, local.Embedded]:
    """Start `volga up`'s parts on ephemeral ports in a background loop."""
    defaults: dict[str, Any] = {"http_port": 0, "grpc_port": 0, "metrics_port": 0, "agent_port": 0}
    bg = Background()
    embedded = bg.call(_make(specs, local.Options(**{**defaults, **options})))
    bg.call(embedded.start())
    return bg, embedded


async def _make(specs: list[api.ModelSpec], options: local.Options) -> local.Embedded:
    return local.Embedded(specs, options)


def triton_inputs(decls: tuple[contract.TensorDecl, ...], arrays: dict[str, np.ndarray],
                  client_module: Any = None) -> list[Any]:
    """tritonclient InferInputs for the arrays (`client_module`: tritonclient.grpc (default) or .http)."""
    if client_module is None:
        import tritonclient.grpc

        client_module = tritonclient.grpc
    out = []
    for decl in decls:
        item = client_module.InferInput(decl.name, list(arrays[decl.name].shape), decl.dtype)
        item.set_data_from_numpy(arrays[decl.name])
        out.append(item)
    return out


def run(cycles: int = 5, requests: int = 300, say: Callable[[str], None] = print) -> int:
    import tritonclient.grpc as grpcclient

    say("Volga demo: the embedded default model (CTR ranking, ONNX on the CPU) behind the gateway")
    say("  building the model (first run only) ...")
    spec = defaultmodel.ensure()
    model = spec.spec.model_id
    bg, embedded = start_embedded([spec])
    try:
        ep = embedded.endpoints()
        say(f"  volga up: gRPC {ep['grpc']}, HTTP {ep['http']}, metrics {ep['metrics']}")
        say("  warming the pool: cold start, then freeze into the snapshot tier (pool floor frozen: 1) ...")
        bg.call(embedded.wait_converged(), timeout=300)
        name = embedded.pool.instances(model)[0].name
        client = grpcclient.InferenceServerClient(ep["grpc"])
        decls = embedded.gateway.catalog.decls(model)
        inputs = triton_inputs(decls, contract.sample_inputs(decls, batch=16, seed=3))  # built once, outside the timing
        headers = {"x-model-id": model}
        reference: np.ndarray | None = None
        same = True

        def ask() -> float:
            nonlocal reference, same
            start = time.perf_counter()
            result = client.infer(model, inputs, headers=headers)
            elapsed = time.perf_counter() - start
            out = result.as_numpy("probability")
            if reference is None:
                reference = out.copy()
            same = same and bool(np.array_equal(out, reference))
            return elapsed

        timings: dict[str, list[float]] = {"cold": [], "frozen": [], "hot": []}
        for tier, label in ((Tier.COLD, "cold start"), (Tier.FROZEN, "FROZEN wake")):
            for i in range(cycles):
                embedded.pool.move_to(name, tier)
                say(f"  {label} {i + 1}/{cycles}: instance is {tier.value}; request -> gateway -> wake -> answer")
                timings[tier.value.lower()].append(ask())
        say(f"  steady state: {requests} requests to the HOT instance through the gateway ...")
        for _ in range(requests):
            timings["hot"].append(ask())
        image = embedded.pool.instances(model)[0]
        status = embedded.pool.status()
        client.close()
    finally:
        bg.call(embedded.stop(), timeout=60)
        bg.close()

    rows = {"cold start -> first answer": timings["cold"], "FROZEN wake -> first answer": timings["frozen"],
            "HOT request (steady state)": timings["hot"]}
    say("")
    say(f"{'through the gateway (tritonclient gRPC)':<40}{'p50 ms':>9}{'p99 ms':>9}{'n':>6}")
    for label, samples in rows.items():
        s = bench.summarize(samples)
        say(f"{label:<40}{s['p50_ms']:>9.1f}{s['p99_ms']:>9.1f}{s['n']:>6}")
    cold, frozen = bench.summarize(timings["cold"]), bench.summarize(timings["frozen"])
    say(f"FROZEN wake is {cold['p50_ms'] / frozen['p50_ms']:.1f}x faster than a cold start; "
        f"activations {status.activations}, restore fallbacks {status.restore_failures}, "
        f"snapshot {image.snapshot_bytes / 2**20:.0f} MiB")
    say(f"every answer identical to the first: {'yes' if same else 'NO'}")
    return 0 if same and status.restore_failures == 0 else 1
