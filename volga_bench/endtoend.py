"""Each tier's first answer through `volga up`'s gateway, for real model architectures.

`volga bench tiers` times an instance's wakes from inside the agent. This bench is what a client sees: one
`volga up` (agent, gateway and pool in one process) serves every model; for each model and tier the instance
is moved to the tier, and one request sent with an unmodified tritonclient over gRPC wakes it. The time from
send to answer is the first-answer latency; the agent's own wake time is reported beside it, and every answer is
compared bit for bit with the model's HOT answer through the same gateway.

On the GPU machine, `architectures()` builds a ResNet-50 (torchvision), a BERT-base encoder (INT64 token ids) and
a GPT-2-medium sized decoder (transformers), or `decoder1b`, a GPT-2-architecture decoder of 1.1B parameters (20
layers of width 2048), with random weights, in fp32 and fp16, as TorchScript files: nothing is downloaded.
    python3 -m volga_agent.cli bench endtoend --gpu [--architectures resnet50,bert,gpt2,decoder1b] [-n 3] [--out FILE]
Without `--gpu` the default CTR model runs through HOT, FROZEN and COLD on the CPU.

`--storm N` is the wake storm instead: N different models (on the GPU, 64 MiB MLPs with their own weights; on the
CPU, copies of the default model) in one `volga up`, all moved to a tier, then one request to each sent at once
from N clients; the time until every one has answered (and the first), per round, every answer compared with that
model's HOT answer. `--restores-at-once 0,1,4,lead` repeats the tiers whose wake goes through the driver's restore
(SUSPENDED, FROZEN) with at most K restores let into the driver at a time, in arrival order (0: all at once; lead:
the first alone, the rest together after it, `cuda.RestoreGate`), in the same `volga up`, so the ways compare side
by side; without it they run as the node's settings say (`gpu_restore_lead`, `gpu_restores_at_once`):
    python3 -m volga_agent.cli bench endtoend --gpu --storm 16 --tiers warm,suspended --restores-at-once 0,1,lead -n 5
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import pathlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from volga_agent.app import defaultmodel
from volga_agent.app import up as volga_up
from volga_agent.node.settings import Settings
from volga_agent.worker import contract
from volga_bench import reporting
from volga_core import api

Tier = api.Tier
GPU_TIERS = (Tier.WARM, Tier.SUSPENDED, Tier.FROZEN, Tier.COLD)
CPU_TIERS = (Tier.FROZEN, Tier.COLD)


@dataclasses.dataclass(frozen=True)
class Case:
    """One model: its ModelSpec and the request sent to it."""

    spec: api.ModelSpec
    inputs: dict[str, np.ndarray]
    weights_bytes: int = 0


def _spec(name: str, source: pathlib.Path, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]],
          precision: str, gpu: bool) -> api.ModelSpec:
    return api.ModelSpec.model_validate({
        "apiVersion": "volga.dev/v1alpha1", "kind": "ModelSpec", "metadata": {"name": name},
        "spec": {"modelId": name, "framework": "torchscript", "source": str(source), "inputs": inputs,
                 "outputs": outputs, "hardware": {"gpu": gpu, "precision": precision},
                 "pool": {"hot": 1, "frozen": 0}, "runtime": {"warmupIterations": 2}}})


def architectures(folder: pathlib.Path, names: Sequence[str] = ("resnet50", "bert", "gpt2"),
                  precisions: Sequence[str] = ("fp32", "fp16")) -> list[Case]:
    """Real architectures with random weights, traced to TorchScript on the GPU (torch, torchvision, transformers)."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)

    class First(torch.nn.Module):  # type: ignore[misc,unused-ignore]
        """A transformers model's first output (its hidden states), so the traced file returns one tensor."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.inner(ids)[0]

    def build(name: str) -> tuple[torch.nn.Module, torch.Tensor, str, list[int]]:
        torch.manual_seed(0)
        if name == "resnet50":
            import torchvision

            return torchvision.models.resnet50(), torch.randn(1, 3, 224, 224), "logits", [-1, 1000]
        import transformers

        if name == "bert":
            config = transformers.BertConfig(torchscript=True)
            return First(transformers.BertModel(config)), torch.randint(0, 30000, (1, 128)), "hidden", [-1, 128, 768]
        if name == "gpt2":
            config = transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16, torchscript=True)
            return First(transformers.GPT2Model(config)), torch.randint(0, 50000, (1, 64)), "hidden", [-1, 64, 1024]
        if name == "decoder1b":
            config = transformers.GPT2Config(n_layer=20, n_embd=2048, n_head=16, torchscript=True)
            return First(transformers.GPT2Model(config)), torch.randint(0, 50000, (1, 64)), "hidden", [-1, 64, 2048]
        raise ValueError(f"unknown architecture {name!r}: resnet50, bert, gpt2 or decoder1b")

    cases = []
    for name in names:
        module, example, output, out_shape = build(name)
        for precision in precisions:
            half = precision == "fp16"
            model = (module.half() if half else module.float()).eval().cuda()
            x = example.half() if half and example.is_floating_point() else example
            path = folder / f"{name}-{precision}.pt"
            with torch.no_grad():
                torch.jit.trace(model, x.cuda()).save(str(path))
            weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            in_dtype = "INT64" if not x.is_floating_point() else ("FP16" if half else "FP32")
            spec = _spec(f"{name}-{precision}", path, [{"name": "x", "dtype": in_dtype, "shape": [-1, *x.shape[1:]]}],
                         [{"name": output, "dtype": "FP16" if half else "FP32", "shape": out_shape}], precision, True)
            cases.append(Case(spec, {"x": x.numpy()}, weights))
        del module
    torch.cuda.empty_cache()
    return cases


def default_case() -> Case:
    spec = defaultmodel.ensure()
    spec = spec.model_copy(update={"spec": spec.spec.model_copy(update={"pool": api.Pool(hot=1, frozen=0)})})
    decls = tuple(contract.TensorDecl(t.name, t.dtype.value, tuple(t.shape)) for t in spec.spec.inputs)
    return Case(spec, contract.sample_inputs(decls, batch=1, seed=0))


async def run(cases: Sequence[Case], tiers: Sequence[Tier], n: int, settings: Settings | None = None,
              progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Serve every case in one `volga up`, and time each tier's first answer through the gateway."""
    import tritonclient.grpc as grpcclient

    up = volga_up.Embedded([c.spec for c in cases], _options(settings))
    await up.start()
    report: dict[str, Any] = {"models": {}}
    try:
        await up.wait_converged()
        client = grpcclient.InferenceServerClient(up.endpoints()["grpc"])

        def ask(case: Case) -> dict[str, np.ndarray]:
            return _ask(client, case)

        for case in cases:
            model = case.spec.spec.model_id
            name = up.pool.instances(model)[0].name
            reference = await asyncio.to_thread(ask, case)
            row: dict[str, Any] = {"weights_bytes": case.weights_bytes, "mismatches": 0}
            hot: list[float] = []
            for _ in range(n):
                start = time.perf_counter()
                await asyncio.to_thread(ask, case)
                hot.append(time.perf_counter() - start)
            row["hot"] = reporting.summarize(hot)
            for tier in tiers:
                first, woke, entered = [], [], []
                for i in range(n if tier != Tier.COLD else max(1, n // 2)):
                    progress(f"{model}: {tier.value} {i + 1}/{n}")
                    move = await asyncio.to_thread(up.pool.move_to, name, tier)
                    if move is not None:
                        entered.append(move.seconds)
                    start = time.perf_counter()
                    answer = await asyncio.to_thread(ask, case)
                    first.append(time.perf_counter() - start)
                    info = up.pool.instances(model)[0]
                    woke.append(info.last_wake_ms / 1e3)
                    row["mismatches"] += int(any(not np.array_equal(answer[k], reference[k]) for k in reference))
                row[tier.value.lower()] = {"first_answer": reporting.summarize(first),
                                           "agent_wake": reporting.summarize(woke),
                                           "enter": reporting.summarize(entered) if entered else None}
            row["restore_failures"] = up.pool.slots[name].inst.restore_failures
            report["models"][model] = row
        client.close()
    finally:
        await up.stop()
    return report


def storm_cases(folder: pathlib.Path, n: int, gpu: bool, width: int = 4096) -> list[Case]:
    """N models that differ in their weights: on the GPU, one-layer MLPs of width x width fp32 (64 MiB at 4096)
    traced to TorchScript; on the CPU, the default model under N model ids."""
    if not gpu:
        base = default_case()
        return [dataclasses.replace(base, spec=base.spec.model_copy(update={
            "metadata": base.spec.metadata.model_copy(update={"name": f"storm-{k}"}),
            "spec": base.spec.spec.model_copy(update={"model_id": f"storm-{k}"})})) for k in range(n)]
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    cases = []
    for k in range(n):
        torch.manual_seed(k)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()).eval().cuda()
        path = folder / f"storm-{k}.pt"
        x = torch.randn(8, width)
        with torch.no_grad():
            torch.jit.trace(model, x.cuda()).save(str(path))
        spec = _spec(f"storm-{k}", path, [{"name": "x", "dtype": "FP32", "shape": [-1, width]}],
                     [{"name": "y", "dtype": "FP32", "shape": [-1, width]}], "fp32", True)
        cases.append(Case(spec, {"x": x.numpy()}, width * (width + 1) * 4))
    torch.cuda.empty_cache()
    return cases


def storm_ways(tiers: Sequence[Tier],
               restores_at_once: Sequence[int | str | None]) -> list[tuple[str, Tier, int | str | None]]:
    """(label, tier, the driver's gate or None to leave the settings' one) for each way a storm is measured: a tier
    woken through the driver's restore once per gate (an int K: at most K at once, 0 all; "lead": the first alone),
    labelled "suspended" as the settings say, "suspended_all" for 0, "suspended_k2" for K = 2 and
    "suspended_lead"."""

    def label(tier: Tier, k: int | str | None) -> str:
        suffix = "" if k is None else f"_{k}" if isinstance(k, str) else f"_k{k}" if k else "_all"
        return tier.value.lower() + suffix

    ways: list[tuple[str, Tier, int | str | None]] = []
    for tier in tiers:
        if tier in (Tier.SUSPENDED, Tier.FROZEN):
            ways += [(label(tier, k), tier, k) for k in restores_at_once]
        else:
            ways.append((tier.value.lower(), tier, None))
    return ways


async def storm(cases: Sequence[Case], tiers: Sequence[Tier], rounds: int, settings: Settings | None = None,
                progress: Callable[[str], None] = lambda _: None,
                restores_at_once: Sequence[int | str | None] = (None,)) -> dict[str, Any]:
    """Every case in one `volga up`; per way (`storm_ways`) and round, all instances moved to the tier, then one
    request to each at once (a client per model, released together): the time until all have answered, and the
    first."""
    import tritonclient.grpc as grpcclient

    from volga_agent.snapshot import cuda

    up = volga_up.Embedded([c.spec for c in cases], _options(settings))
    await up.start()
    report: dict[str, Any] = {"models": len(cases), "weights_bytes_each": cases[0].weights_bytes, "tiers": {}}
    threads = concurrent.futures.ThreadPoolExecutor(max_workers=len(cases) + 1)
    try:
        await up.wait_converged()
        address = up.endpoints()["grpc"]
        clients = [grpcclient.InferenceServerClient(address) for _ in cases]
        names = [up.pool.instances(c.spec.spec.model_id)[0].name for c in cases]

        def ask(k: int) -> dict[str, np.ndarray]:
            return _ask(clients[k], cases[k], timeout=120)

        references = await asyncio.to_thread(lambda: list(threads.map(ask, range(len(cases)))))
        settings_gate = up.pool.driver.gate if up.pool.driver is not None else cuda.RestoreGate()
        for label, tier, at_once in storm_ways(tiers, restores_at_once):
            if up.pool.driver is not None and tier in (Tier.SUSPENDED, Tier.FROZEN):  # none in flight now
                up.pool.driver.gate = (settings_gate if at_once is None else cuda.RestoreGate(lead=True)
                                       if at_once == "lead" else cuda.RestoreGate(int(at_once)))
            alls, firsts, each, mismatches = [], [], [], 0
            for r in range(rounds):
                progress(f"storm: {len(cases)} models, {label} {r + 1}/{rounds}")
                move = functools.partial(up.pool.move_to, target=tier)
                await asyncio.to_thread(lambda: list(threads.map(move, names)))  # noqa: B023 (awaited here)
                done = await asyncio.to_thread(_all_at_once, threads, ask, len(cases))
                seconds = [d[0] for d in done]
                mismatches += sum(any(not np.array_equal(d[1][n], references[k][n]) for n in references[k])
                                  for k, d in enumerate(done))
                alls.append(max(seconds))
                firsts.append(min(seconds))
                each += seconds
            report["tiers"][label] = {
                "tier": tier.value, "restores_at_once": at_once,
                "all_answered": reporting.summarize(alls), "first_answered": reporting.summarize(firsts),
                "each": reporting.summarize(each), "mismatches": mismatches}
        report["restore_failures"] = sum(up.pool.slots[n].inst.restore_failures for n in names)
        for client in clients:
            client.close()
    finally:
        threads.shutdown()
        await up.stop()
    return report


def _all_at_once(threads: concurrent.futures.ThreadPoolExecutor, ask: Callable[[int], dict[str, np.ndarray]],
                 n: int) -> list[tuple[float, dict[str, np.ndarray]]]:
    """ask(0..n-1) from n threads released together by a barrier: (seconds from the release, answer) each."""
    gate = threading.Barrier(n + 1)
    start = [0.0]

    def one(k: int) -> tuple[float, dict[str, np.ndarray]]:
        gate.wait()
        answer = ask(k)
        return time.perf_counter() - start[0], answer

    futures = [threads.submit(one, k) for k in range(n)]
    start[0] = time.perf_counter()
    gate.wait()
    return [f.result() for f in futures]


def format_storm(report: dict[str, Any]) -> str:
    rows = [f"{report['models']} models at once   {'all answered p50/max ms':>24} {'first p50/max ms':>17} "
            f"{'each p50/p99 ms':>16} {'mismatches':>11}"]
    for way, r in report["tiers"].items():
        rows.append(f"{way:<20} {r['all_answered']['p50_ms']:>12.1f} / {r['all_answered']['max_ms']:>9.1f} "
                    f"{r['first_answered']['p50_ms']:>8.1f} / {r['first_answered']['max_ms']:>6.1f} "
                    f"{r['each']['p50_ms']:>7.1f} / {r['each']['p99_ms']:>6.1f} {r['mismatches']:>11}")
    rows.append(f"restore failures {report['restore_failures']}")
    return "\n".join(rows)


def _options(settings: Settings | None) -> volga_up.Options:
    """One `volga up` whose pool loop does not run (tick_sec): only the bench moves instances, only requests wake
    them."""
    return volga_up.Options(settings=settings or Settings(), tick_sec=3600.0, http_port=0, grpc_port=0,
                         metrics_port=0, agent_port=-1)


def _ask(client: Any, case: Case, timeout: float | None = None) -> dict[str, np.ndarray]:
    """One request of `case` through a tritonclient gRPC client; its declared outputs."""
    import tritonclient.grpc as grpcclient

    request = []
    for name, value in case.inputs.items():
        tensor = grpcclient.InferInput(name, list(value.shape), _triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        request.append(tensor)
    result = client.infer(case.spec.spec.model_id, request, client_timeout=timeout)
    return {t.name: result.as_numpy(t.name) for t in case.spec.spec.outputs}


def _triton_dtype(dtype: np.dtype[Any]) -> str:
    return {"float32": "FP32", "float16": "FP16", "int64": "INT64", "int32": "INT32"}[np.dtype(dtype).name]


def format_table(report: dict[str, Any]) -> str:
    rows = [f"{'model':<14} {'tier':<10} {'first answer p50 ms':>20} {'p99 ms':>9} {'agent wake p50 ms':>18}"]
    for model, row in report["models"].items():
        rows.append(f"{model:<14} {'hot':<10} {row['hot']['p50_ms']:>20.1f} {row['hot']['p99_ms']:>9.1f}")
        for tier in ("warm", "suspended", "frozen", "cold"):
            if tier in row:
                r = row[tier]
                rows.append(f"{'':<14} {tier:<10} {r['first_answer']['p50_ms']:>20.1f} "
                            f"{r['first_answer']['p99_ms']:>9.1f} {r['agent_wake']['p50_ms']:>18.1f}")
        rows.append(f"{'':<14} mismatches {row['mismatches']}, restore failures {row['restore_failures']}")
    return "\n".join(rows)
