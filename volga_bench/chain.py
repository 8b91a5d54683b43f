"""`volga bench chain`: a pipeline of three models, all FROZEN, answering its first request as a chain (joint
wake, one ensemble request) against the same three models without a chain (the client calls each in turn, each
wakes when its request comes), side by side in one `volga up`.

The models are built here with the onnx helper API so that each one's output feeds the next by name:
`image` -> detect -> `features` -> recognize -> `codes` -> extract -> `fields` (dense layers, a few MiB of
weights each). One cycle freezes all six instances (not timed), then times the whole pipeline's first answer
for one side, freezes again, and times the other; every answer is compared with the HOT answer, bit for bit.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from volga_agent.app import up as volga_up
from volga_agent.node.settings import Settings
from volga_bench import reporting
from volga_core import api

Tier = api.Tier
# (model, its input, its output, output width); the first input is `image` of width WIDTHS[0].
STAGES = (("detect", "image", "features", 1024), ("recognize", "features", "codes", 1024),
          ("extract", "codes", "fields", 16))
IMAGE_WIDTH = 1024
ENSEMBLE = "pipeline"


def build_models(folder: pathlib.Path, seed: int = 0) -> dict[str, pathlib.Path]:
    """The three ONNX files (model name -> path), each a dense layer with a ReLU but the last."""
    import onnx
    from onnx import helper, numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = {}
    width = IMAGE_WIDTH
    for index, (name, source, target, out_width) in enumerate(STAGES):
        weight = (rng.standard_normal((width, out_width)) / np.sqrt(width)).astype(np.float32)
        nodes = [helper.make_node("MatMul", [source, "w"], [target if index == len(STAGES) - 1 else "z"])]
        if index < len(STAGES) - 1:
            nodes.append(helper.make_node("Relu", ["z"], [target]))
        graph = helper.make_graph(
            nodes, name, [helper.make_tensor_value_info(source, onnx.TensorProto.FLOAT, ["batch", width])],
            [helper.make_tensor_value_info(target, onnx.TensorProto.FLOAT, ["batch", out_width])],
            initializer=[numpy_helper.from_array(weight, "w")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        path = folder / f"{name}.onnx"
        onnx.save(model, str(path))
        paths[name] = path
        width = out_width
    return paths


def model_specs(paths: dict[str, pathlib.Path], prefix: str, chained: bool) -> list[api.ModelSpec]:
    """One ModelSpec per stage, model ids `{prefix}-{stage}`, each kept FROZEN; with `chained`, the first heads a
    chain of the other two, served as one model under `{prefix}-pipeline`."""
    specs = []
    width = IMAGE_WIDTH
    ids = [f"{prefix}-{name}" for name, *_ in STAGES]
    for index, (name, source, target, out_width) in enumerate(STAGES):
        spec: dict[str, Any] = {
            "modelId": ids[index], "framework": "onnx", "source": str(paths[name]),
            "inputs": [{"name": source, "dtype": "FP32", "shape": [-1, width]}],
            "outputs": [{"name": target, "dtype": "FP32", "shape": [-1, out_width]}],
            "pool": {"frozen": 1}, "runtime": {"intraOpThreads": 1}}
        if chained and index == 0:
            spec |= {"chain": ids[1:], "ensemble": f"{prefix}-{ENSEMBLE}"}
        specs.append(api.parse_model_spec({"apiVersion": api.API_VERSION, "kind": "ModelSpec",
                                           "metadata": {"name": ids[index]}, "spec": spec}))
        width = out_width
    return specs


async def run(folder: pathlib.Path, n: int, batch: int = 4,
              progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """`n` cycles of: all FROZEN, the chain's first answer; all FROZEN, the separate models' first answer."""
    import tritonclient.grpc as grpcclient

    paths = build_models(folder)
    chain_specs, separate_specs = model_specs(paths, "chain", True), model_specs(paths, "separate", False)
    # Only the bench moves instances (no idle demotion while it runs), and only requests wake them.
    options = volga_up.Options(settings=Settings(), tick_sec=3600.0, http_port=0, grpc_port=0,
                            metrics_port=0, agent_port=-1)
    up = volga_up.Embedded([*chain_specs, *separate_specs], options)
    await up.start()
    image = np.random.default_rng(1).standard_normal((batch, IMAGE_WIDTH)).astype(np.float32)
    try:
        await up.wait_converged()
        client = grpcclient.InferenceServerClient(up.endpoints()["grpc"])

        def call(model: str, name: str, value: np.ndarray, output: str) -> np.ndarray:
            tensor = grpcclient.InferInput(name, list(value.shape), "FP32")
            tensor.set_data_from_numpy(value)
            answer: np.ndarray = client.infer(model, [tensor]).as_numpy(output)
            return answer

        def steps(specs: Sequence[api.ModelSpec]) -> np.ndarray:
            value = image
            for spec, (_, source, target, _) in zip(specs, STAGES, strict=True):
                value = call(spec.spec.model_id, source, value, target)
            return value

        def ensemble() -> np.ndarray:
            return call(f"chain-{ENSEMBLE}", "image", image, "fields")

        sides: dict[str, tuple[Sequence[api.ModelSpec], Callable[[], np.ndarray]]] = {
            "chain": (chain_specs, ensemble), "chain_client_steps": (chain_specs, lambda: steps(chain_specs)),
            "separate": (separate_specs, lambda: steps(separate_specs))}
        reference = await asyncio.to_thread(steps, separate_specs)
        mismatches = int(not np.array_equal(await asyncio.to_thread(ensemble), reference))  # wakes the chain
        times: dict[str, list[float]] = {side: [] for side in [*sides, "hot"]}
        wakes: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(n):  # all HOT: the run times a wake adds to
            start = time.perf_counter()
            mismatches += int(not np.array_equal(await asyncio.to_thread(ensemble), reference))
            times["hot"].append(time.perf_counter() - start)
        for cycle in range(n):
            for side, (specs, ask) in sides.items():
                progress(f"{side}: {cycle + 1}/{n}")
                names = [up.pool.instances(s.spec.model_id)[0].name for s in specs]
                for name in names:
                    await asyncio.to_thread(up.pool.move_to, name, Tier.FROZEN)
                start = time.perf_counter()
                answer = await asyncio.to_thread(ask)
                times[side].append(time.perf_counter() - start)
                await asyncio.to_thread(up.pool.wait_converged)  # the joint wakes too
                wakes[side] += [up.pool.slots[name].last_wake_ms / 1e3 for name in names]
                mismatches += int(not np.array_equal(answer, reference))
        client.close()
        failures = sum(slot.inst.restore_failures for slot in up.pool.slots.values())
    finally:
        await up.stop()
    report: dict[str, Any] = {
        side: {"first_answer_ms": reporting.summarize(times[side])["p50_ms"],
               "first_answer": reporting.summarize(times[side]),
               **({"agent_wake_per_model": reporting.summarize(wakes[side])} if side in wakes else {})}
        for side in times}
    report |= {"models": len(STAGES), "batch": batch, "cycles": n, "mismatches": mismatches,
               "restore_failures": failures, "device": reporting.device_description("cpu"),
               "weights_bytes": sum(p.stat().st_size for p in paths.values())}
    return report


def format_report(report: dict[str, Any]) -> str:
    rows = [f"{side:20s} first answer p50 {report[side]['first_answer_ms']:9.1f} ms"
            for side in ("chain", "chain_client_steps", "separate", "hot")]
    return "\n".join([*rows, f"models {report['models']}, cycles {report['cycles']}, mismatches "
                             f"{report['mismatches']}, restore failures {report['restore_failures']}"])
