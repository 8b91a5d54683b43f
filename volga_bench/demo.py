"""`volga demo`: the embedded default model served by `volga up`, driven with an unmodified tritonclient.

It builds the default model, starts agent + gateway in this process (ephemeral ports), lets the pool warm
the snapshot tier (cold start, then freeze), and then times, through the gateway: cold start -> first
answer, FROZEN wake -> first answer, and steady-state HOT requests. Every answer is compared with the first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import tritonclient.grpc as grpcclient

from volga_agent.app import defaultmodel
from volga_agent.worker import contract
from volga_bench import harness, reporting
from volga_core import api

Tier = api.Tier


def run(cycles: int = 5, requests: int = 300, say: Callable[[str], None] = print) -> int:
    say("Volga demo: the embedded default model (CTR ranking, ONNX on the CPU) behind the gateway")
    say("  building the model (first run only) ...")
    spec = defaultmodel.ensure()
    model = spec.spec.model_id
    bg, embedded = harness.start_embedded([spec])
    try:
        ep = embedded.endpoints()
        say(f"  volga up: gRPC {ep['grpc']}, HTTP {ep['http']}, metrics {ep['metrics']}")
        say("  warming the pool: cold start, then freeze into the snapshot tier (pool floor frozen: 1) ...")
        bg.call(embedded.wait_converged(), timeout=300)
        name = embedded.pool.instances(model)[0].name
        client = grpcclient.InferenceServerClient(ep["grpc"])
        decls = embedded.gateway.catalog.decls(model)
        # Built once, outside the timing.
        inputs = harness.triton_inputs(decls, contract.sample_inputs(decls, batch=16, seed=3))
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
        s = reporting.summarize(samples)
        say(f"{label:<40}{s['p50_ms']:>9.1f}{s['p99_ms']:>9.1f}{s['n']:>6}")
    cold, frozen = reporting.summarize(timings["cold"]), reporting.summarize(timings["frozen"])
    say(f"FROZEN wake is {cold['p50_ms'] / frozen['p50_ms']:.1f}x faster than a cold start; "
        f"activations {status.activations}, restore fallbacks {status.restore_failures}, "
        f"snapshot {image.snapshot_bytes / 2**20:.0f} MiB")
    say(f"every answer identical to the first: {'yes' if same else 'NO'}")
    return 0 if same and status.restore_failures == 0 else 1
