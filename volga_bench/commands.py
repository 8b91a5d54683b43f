"""`volga demo` and `volga bench ...`: their arguments, and each bench run to its report.

`volga_agent.cli` imports this module only when it builds its parser, and adds these commands to its `demo` and
`bench` parsers (`add_demo`, `add_bench`). The module itself imports no bench: each command imports its own when it
runs, and says how to install the bench extra when that import fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from volga_core import api

Tier = api.Tier

BENCH_EXTRA = "pip install 'volga[bench]'"


def default_snapshot_dir() -> pathlib.Path:
    """Snapshots belong on tmpfs when there is one: CRIU restores read the whole image."""
    env = os.environ.get("VOLGA_SNAPSHOT_DIR")
    if env:
        return pathlib.Path(env)
    shm = pathlib.Path("/dev/shm")
    return shm / "volga" if shm.is_dir() else pathlib.Path(tempfile.gettempdir()) / "volga-snapshots"


def _progress(quiet: bool) -> Callable[[str], None]:
    def show(message: str) -> None:
        if not quiet:
            print(f"  .. {message}", file=sys.stderr, flush=True)
    return show


def _no_bench(command: str, exc: ImportError) -> int:
    """The benches and the demo live in `volga_bench` and need the bench extra (tritonclient, trustme, ...)."""
    print(f"volga {command}: needs the bench extra, not installed here ({exc}); install it with: {BENCH_EXTRA}",
          file=sys.stderr)
    return 2


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        from volga_bench import demo
    except ImportError as exc:
        return _no_bench("demo", exc)
    return demo.run(cycles=args.cycles, requests=args.requests)


def _emit(args: argparse.Namespace, report: dict[str, Any], text: Callable[[], str]) -> None:
    """A bench's report: written to --out when given, printed as JSON with --json, else as `text()`."""
    from volga_bench import reporting

    if args.out:
        reporting.write_json(report, pathlib.Path(args.out))
    print(json.dumps(report, indent=2) if args.json else text())


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--out", help="also write the JSON report to this file")


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    from volga_agent.app import defaultmodel

    try:
        from volga_bench import tiers
    except ImportError as exc:
        return _no_bench("bench tiers", exc)
    show = _progress(args.json)
    models = pathlib.Path(args.models) if args.models else defaultmodel.default_cache()
    snapshots = default_snapshot_dir() / "bench"
    with tempfile.TemporaryDirectory(prefix="volga-") as run:
        if not args.gpu:
            spec = defaultmodel.ensure(models).spec
            report = tiers.bench_tiers(spec, pathlib.Path(run) / "w", snapshots, [Tier.FROZEN], args.n, "cpu",
                                       cold_n=args.cold_n, lazy=args.lazy, progress=show)
        else:
            report = tiers.gpu_suite(models, pathlib.Path(run), snapshots, [float(x) for x in args.sizes.split(",")],
                                     [Tier(t.upper()) for t in args.tiers.split(",")], args.n, cold_n=args.cold_n,
                                     lazy=args.lazy or args.lazy_only, burst_n=args.burst, progress=show,
                                     eager=not args.lazy_only, wake_copies=[c for c in args.wake_copy.split(",") if c],
                                     fresh_images=args.fresh_images,
                                     **({"settle_s": args.settle_ms / 1e3} if args.settle_ms is not None else {}))
    def text() -> str:
        lines = []
        for label, part in ([("", report)] if "tiers" in report else report["sizes"].items()):
            lines += [f"device: {part['device']}; model {part['model']['id']} {label}", tiers.format_table(part),
                      f"outputs match: {part['outputs_match']}; restore fallbacks: {part['restore_fallbacks']}"]
        if "wake_copy_side_by_side" in report:
            lines.append(tiers.format_side_by_side(report))
        return "\n".join(lines + ([f"burst: {report['burst']}"] if "burst" in report else []))

    _emit(args, report, text)
    parts = [report] if "tiers" in report else list(report["sizes"].values())
    return 0 if all(p["outputs_match"] and not p["restore_fallbacks"] for p in parts) else 1


def cmd_bench_server(args: argparse.Namespace) -> int:
    if args.gpu:
        return _bench_server_gpu(args)
    try:
        from volga_bench import server
    except ImportError as exc:
        return _no_bench("bench server", exc)
    report = server.bench(args.n, [s for s in args.servers.split(",") if s], args.listen_variants, args.compare_criu,
                          _progress(args.json), args.lazy)
    _emit(args, report, lambda: "\n".join(
        f"{r['server']} ({r['listen']}, criu {r['criu']}): cold start p50 {r['cold_start_ms']} ms, "
        + (f"FROZEN wake p50 {r['frozen_wake_ms']} ms ({r['speedup']}x)"
           + (f", restored lazily {r['frozen_lazy_wake_ms']} ms ({r['lazy_speedup']}x)" if "lazy_speedup" in r else "")
           + f", identical: {r['identical']}"
           if "dump_error" not in r else "CRIU cannot freeze it") for r in report["results"]))
    return 0 if all(r["identical"] for r in report["results"] if "dump_error" not in r) else 1


def _bench_server_gpu(args: argparse.Namespace) -> int:
    try:
        from volga_bench import llmserver
    except ImportError as exc:
        return _no_bench("bench server --gpu", exc)
    report = llmserver.bench(args.n, args.cold, [h for h in args.hooks.split(",") if h], args.cache_tokens,
                             args.models, _progress(args.json), args.load_threads,
                             [int(b) for b in args.stack_bytes.split(",") if b] or None)

    def line(r: dict[str, Any]) -> str:
        ttft = r["time_to_first_token_ms"]
        stack = f"{r['cuda_stack_bytes']} B" if r["cuda_stack_bytes"] else "as it is"
        return (f"{r['server']} (hooks: {r['hooks']}, CUDA stack {stack}): first token p50 / p99 ms: SUSPENDED "
                f"{ttft['suspended']['p50']} / {ttft['suspended']['p99']}, FROZEN {ttft['frozen']['p50']} / "
                f"{ttft['frozen']['p99']}"
                + (f", cold start {ttft['cold']['p50']}" if "cold" in ttft else "")
                + f"; FROZEN {r['frozen_speedup']}x faster than a cold start; image "
                f"{r['image_bytes'] / 2**30:.2f} GiB + {r['parked_bytes'] / 2**30:.2f} parked; identical: "
                f"{r['identical']}")
    _emit(args, report, lambda: "\n".join(line(r) for r in report["results"]))
    return 0 if all(r["identical"] for r in report["results"]) else 1


def cmd_bench_shared(args: argparse.Namespace) -> int:
    try:
        from volga_bench import shared
    except ImportError as exc:
        return _no_bench("bench shared", exc)
    report = shared.bench(args.n, pathlib.Path(args.models) if args.models else None, _progress(args.json))
    _emit(args, report, lambda: "\n".join((
        f"node B first answer from node A's shared image: p50 {report['node_b_first_answer_from_shared_image']}",
        f"node B cold start first answer:                 p50 {report['node_b_cold_start_first_answer']}",
        f"speedup p50 {report['speedup_p50']}x; outputs match: {report['outputs_match']}")))
    return 0 if report["outputs_match"] and not report["shared_restore_fallbacks"] else 1


def _at_once(text: str) -> int | str | None:
    if text == "lead":
        return text
    try:
        k = int(text)
    except ValueError:
        k = -1
    if k < 0:
        raise SystemExit(f"--restores-at-once: each value must be an integer >= 0 (0: all at once) or lead, "
                         f"got {text!r}")
    return k


def cmd_bench_endtoend(args: argparse.Namespace) -> int:
    try:
        from volga_bench import endtoend, reporting
    except ImportError as exc:
        return _no_bench("bench endtoend", exc)
    show = _progress(args.json)
    if args.storm:
        at_once = [_at_once(k) for k in args.restores_at_once.split(",")] if args.restores_at_once else [None]
        with tempfile.TemporaryDirectory(prefix="volga-") as run:
            cases = endtoend.storm_cases(pathlib.Path(args.models or run), args.storm, args.gpu)
            tiers = [Tier(t.upper()) for t in args.tiers.split(",")] if args.tiers else (
                [Tier.SUSPENDED, Tier.FROZEN] if args.gpu else [Tier.FROZEN])
            report = asyncio.run(endtoend.storm(cases, tiers, args.n, progress=show, restores_at_once=at_once))
        report["device"] = reporting.device_description("cuda:0" if args.gpu else "cpu")
        _emit(args, report, lambda: endtoend.format_storm(report))
        return 0 if all(not t["mismatches"] for t in report["tiers"].values()) else 1
    with tempfile.TemporaryDirectory(prefix="volga-") as run:
        if args.gpu:
            cases = endtoend.architectures(pathlib.Path(args.models or run), args.architectures.split(","),
                                           args.precisions.split(","))
            tiers = [Tier(t.upper()) for t in args.tiers.split(",")] if args.tiers else list(endtoend.GPU_TIERS)
        else:
            cases = [endtoend.default_case()]
            tiers = [Tier(t.upper()) for t in args.tiers.split(",")] if args.tiers else list(endtoend.CPU_TIERS)
        report = asyncio.run(endtoend.run(cases, tiers, args.n, progress=show))
    report["device"] = reporting.device_description("cuda:0" if args.gpu else "cpu")
    _emit(args, report, lambda: endtoend.format_table(report))
    return 0 if all(not m["mismatches"] for m in report["models"].values()) else 1


def cmd_bench_gateway(args: argparse.Namespace) -> int:
    try:
        from volga_bench import gateway
    except ImportError as exc:
        return _no_bench("bench gateway", exc)
    if args.batching:
        report = gateway.run_batching(args.clients, args.seconds, args.queue_delay_us, progress=_progress(args.json))
    else:
        report = gateway.run(args.rate, args.seconds, args.rounds, args.protocol, progress=_progress(args.json))
    _emit(args, report, lambda: gateway.format_batching(report) if args.batching else gateway.format_report(report))
    return 0 if not args.batching or report["outputs_match"] else 1


def _cpus(text: str) -> tuple[int, ...]:
    """An argparse type: a CPU list such as 0,1 or 2-9, of CPUs this process may run on."""
    from volga_agent.host import gpus

    try:
        cpus = gpus.cpu_list(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list such as 0,1 or 2-9") from None
    missing = sorted(set(cpus) - os.sched_getaffinity(0))
    if not cpus or missing:
        raise argparse.ArgumentTypeError(f"{text!r}: CPUs {missing or 'none'} are not available here "
                                         f"(available: {sorted(os.sched_getaffinity(0))})")
    return cpus


def cmd_bench_peers(args: argparse.Namespace) -> int:
    try:
        from volga_bench import peers
    except ImportError as exc:
        return _no_bench("bench peers", exc)
    settings = peers.Settings(requests=args.requests, warmup=args.warmup, seconds=args.seconds,
                              concurrency=tuple(args.clients), cold_starts=args.cold_starts, wakes=args.wakes,
                              idle_sec=args.idle_sec, kserve_python=args.kserve_python or "",
                              batched=not args.no_batched, external_data=args.external_data,
                              server_cpus=args.server_cpus, client_cpus=args.client_cpus,
                              gateway_processes=args.gateway_processes, hot_instances=args.hot_instances)
    try:
        report = peers.run(settings, progress=_progress(args.json))
    except peers.KServeMissing as exc:
        print(f"volga bench peers: {exc}", file=sys.stderr)
        return 2
    _emit(args, report, lambda: peers.format_report(report))
    return 0 if report["volga"]["outputs_match"] and report["kserve"]["outputs_match"] else 1


def cmd_bench_chain(args: argparse.Namespace) -> int:
    try:
        from volga_bench import chain
    except ImportError as exc:
        return _no_bench("bench chain", exc)
    with tempfile.TemporaryDirectory(prefix="volga-") as run:
        report = asyncio.run(chain.run(pathlib.Path(run), args.n, args.batch, progress=_progress(args.json)))
    _emit(args, report, lambda: chain.format_report(report))
    return 0 if not report["mismatches"] and not report["restore_failures"] else 1


def cmd_bench_scale(args: argparse.Namespace) -> int:
    try:
        from volga_bench import scale
    except ImportError as exc:
        return _no_bench("bench scale", exc)
    if args.placement:
        placed = scale.placement(args.nodes, args.modelspecs)
        _emit(args, placed, lambda: f"{placed['index_ms_per_placement']} ms per placement on {placed['nodes']} nodes "
              f"({placed['exhaustive_ms_per_placement']} ms scoring every node)")
        return 0
    show = _progress(args.json)
    report = scale.run(args.nodes, args.modelspecs, args.writes_per_sec, progress=show)
    _emit(args, report, lambda:
          f"{report['modelspecs']} ModelSpecs on {report['nodes']} nodes: converged in {report['converge_s']} s, "
          f"peak {report['peak_writes_per_s']} writes/s (limit {report['write_limit_per_s']:g})")
    return 0 if report["peak_writes_per_s"] <= report["write_limit_per_s"] else 1


def cmd_bench_cluster(args: argparse.Namespace) -> int:
    try:
        from volga_bench import cluster
    except ImportError as exc:
        return _no_bench("bench cluster", exc)
    report = cluster.bench(args.n, progress=_progress(args.json))
    _emit(args, report, lambda: cluster.format_report(report))
    return 0 if report["identical"] else 1


def cmd_bench_decide(args: argparse.Namespace) -> int:
    try:
        from volga_bench import decide
    except ImportError as exc:
        return _no_bench("bench decide", exc)
    report = decide.run(args.windows, args.sample_seconds, args.period_ms, progress=_progress(args.json))
    _emit(args, report, lambda: decide.format_report(report))
    return 0


def cmd_bench_faults(args: argparse.Namespace) -> int:
    try:
        from volga_bench import faults
    except ImportError as exc:
        return _no_bench("bench faults", exc)
    report = faults.run(args.rate, progress=_progress(args.json))
    _emit(args, report, lambda: faults.format_table(report))
    return 0 if not (report["wrong_total"] or report["hangs_total"] or report["leaked_total"]) else 1


def cmd_bench_fetch(args: argparse.Namespace) -> int:
    try:
        from volga_bench import fetch
    except ImportError as exc:
        return _no_bench("bench fetch", exc)
    report = fetch.run(args.size_mib, args.connections, args.rounds, progress=_progress(args.json))
    _emit(args, report, lambda: fetch.format_table(report))
    return 0


def cmd_bench_slo(args: argparse.Namespace) -> int:
    try:
        from volga_bench import slo
    except ImportError as exc:
        return _no_bench("bench slo", exc)
    config = slo.Config(seconds=args.seconds, rounds=args.rounds, calibrate_iterations=args.calibrate_iterations,
                        calibrate_pace_ms=args.calibrate_pace_ms,
                        pulse_every_s=args.pulse_every, pulse_s=args.pulse_seconds, gpu=args.gpu,
                        yield_calm_windows=args.yield_calm_windows, throttle_share=args.throttle_share,
                        throttle_period_ms=args.throttle_period_ms, throttle_guard=args.throttle_guard,
                        alone=not args.no_alone)
    report = slo.run(config, progress=_progress(args.json))
    _emit(args, report, lambda: slo.format_report(report))
    return 0


def _share(text: str) -> float:
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0.0 <= share < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: a share of each period, at least 0 and below 1, e.g. 0.75")
    return share


def add_demo(p: argparse.ArgumentParser) -> None:
    """`volga demo`'s arguments, on the parser `volga_agent.cli` made for it."""
    p.add_argument("--cycles", type=int, default=5, help="wakes per tier")
    p.add_argument("--requests", type=int, default=300, help="steady-state requests")
    p.set_defaults(func=cmd_demo)


def add_bench(parser: argparse.ArgumentParser) -> None:
    """The `volga bench ...` commands, under the parser `volga_agent.cli` made for `bench`."""
    bench = parser.add_subparsers(dest="bench", required=True)
    p = bench.add_parser("tiers", help="cold start vs wake -> first answer per tier")
    p.add_argument("--gpu", action="store_true", help="PyTorch models on cuda:0: HOT, WARM, SUSPENDED, FROZEN, COLD")
    p.add_argument("--sizes", default="0.5", help="GPU model weights in GiB, comma-separated (with --gpu)")
    p.add_argument("--cold-n", type=int, help="cold starts (default: -n)")
    p.add_argument("--burst", type=int, default=0, help="also wake this many SUSPENDED models at once (with --gpu)")
    p.add_argument("--tiers", default="warm,suspended,frozen", help="tiers to wake from (with --gpu)")
    p.add_argument("--lazy", action="store_true", help="also time FROZEN wakes with CRIU lazy pages")
    p.add_argument("--lazy-only", action="store_true", help="FROZEN wakes with CRIU lazy pages only (with --gpu)")
    p.add_argument("--wake-copy", default="", help="the workers' weight copy on a wake, comma-separated to compare "
                   "them in one run: auto, staged, pinned, with knobs such as staged-chunk16 or auto-overlap "
                   "(volga_bench.tiers.copy_config; with --gpu; default: the worker's)")
    p.add_argument("--fresh-images", action="store_true",
                   help="freeze afresh before every FROZEN wake, its weights parked again (default: one image, "
                        "restored n times) (with --gpu)")
    p.add_argument("--settle-ms", type=float,
                   help="how long a tier is left alone before its wake (with --gpu; default: 500)")
    p.add_argument("--models", help="where models are built")
    p.add_argument("-n", type=int, default=10, help="wakes per tier (and cold starts)")
    _report_args(p)
    p.set_defaults(func=cmd_bench_tiers)

    p = bench.add_parser("server", help="model servers (KServe, FastAPI): cold start vs FROZEN wake, first answer "
                         "through the gateway's proxy")
    p.add_argument("-n", type=int, default=5, help="cold starts and wakes per server")
    p.add_argument("--servers", default="", help="comma-separated: kserve, fastapi-stream (default: both)")
    p.add_argument("--listen-variants", action="store_true",
                   help="also the FastAPI server listening on a Unix socket")
    p.add_argument("--compare-criu", default="", metavar="PATH",
                   help="with --listen-variants: also freeze the FastAPI server, on a port and on a Unix socket, with "
                        "this other criu binary (such as 4.1.1)")
    p.add_argument("--lazy", action="store_true",
                   help="also FROZEN wakes restored lazily (pages served by VOLGA_LAZY_PAGES_SERVER, default the "
                        "agent's), each after an eager one")
    p.add_argument("--gpu", action="store_true",
                   help="an LLM server (1.17B parameters, KV cache, streaming) on the GPU instead: time to first token "
                        "from a cold start, SUSPENDED and FROZEN, with and without the hooks that release its memory")
    p.add_argument("--cold", type=int, default=3, help="with --gpu: cold starts")
    p.add_argument("--hooks", default="", help="with --gpu: comma-separated: none, level1, level2, level1-freeze2 "
                   "(level 1 for SUSPENDED, level 2 before a freeze), each alone or with -parked or -parked-eager "
                   "(default: each alone)")
    p.add_argument("--cache-tokens", type=int, default=32768, help="with --gpu: the KV cache's length in tokens")
    p.add_argument("--load-threads", type=int, default=0,
                   help="with --gpu: the threads the server brings its weights in with (default: its own choice)")
    p.add_argument("--stack-bytes", default="",
                   help="with --gpu: comma-separated CUDA stacks (bytes per thread) the server's contexts are lowered "
                        "to before each driver checkpoint with -parked hooks, each a way of its own (0: left as the "
                        "server has it; default: the agent's gpu_stack_bytes default)")
    p.add_argument("--models", help="with --gpu: where the model is written (default: the temporary folder)")
    _report_args(p)
    p.set_defaults(func=cmd_bench_server)

    p = bench.add_parser("shared", help="a node's first answer from another node's shared image vs its cold start")
    p.add_argument("-n", type=int, default=5, help="rounds: fresh node-B processes each way")
    p.add_argument("--models", help="where models are built")
    _report_args(p)
    p.set_defaults(func=cmd_bench_shared)

    p = bench.add_parser("endtoend", help="each tier's first answer through `volga up`'s gateway (tritonclient)")
    p.add_argument("--gpu", action="store_true", help="ResNet-50, BERT-base, GPT-2-medium on cuda:0 (random weights)")
    p.add_argument("--architectures", default="resnet50,bert,gpt2", help="with --gpu: which, comma-separated")
    p.add_argument("--precisions", default="fp32,fp16", help="with --gpu: fp32, fp16 or both")
    p.add_argument("--tiers", help="tiers to wake from (default: warm,suspended,frozen,cold on a GPU; frozen,cold)")
    p.add_argument("--models", help="where the GPU models are built (default: a temporary folder)")
    p.add_argument("-n", type=int, default=3, help="wakes per tier (with --storm: rounds per tier)")
    p.add_argument("--storm", type=int, default=0, metavar="N",
                   help="the wake storm instead: N models moved to each tier, then one request to each at once")
    p.add_argument("--restores-at-once", default="", metavar="K,...",
                   help="with --storm: SUSPENDED and FROZEN storms once per K, the driver's restores at most K at a "
                        "time in arrival order (0: all at once; lead: the first alone, the rest together after it); "
                        "default: as the settings say")
    _report_args(p)
    p.set_defaults(func=cmd_bench_endtoend)

    p = bench.add_parser("gateway", help="gateway vs direct worker calls at a fixed request rate")
    p.add_argument("--rate", type=float, default=500.0, help="requests per second")
    p.add_argument("--seconds", type=float, default=4.0, help="per side and round")
    p.add_argument("--rounds", type=int, default=3, help="alternating direct/gateway rounds")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    _report_args(p)
    p.add_argument("--batching", action="store_true",
                   help="batch 1 vs dynamic batching, closed-loop clients: throughput at equal p99 (gRPC)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients of the batch-1 run (with --batching)")
    p.add_argument("--queue-delay-us", type=int, default=0,
                   help="maxQueueDelayMicroseconds of the batched model (with --batching)")
    p.set_defaults(func=cmd_bench_gateway)

    p = bench.add_parser("peers", help="Volga's gateway beside KServe's ModelServer: same model, same client")
    p.add_argument("--requests", type=int, default=2000, help="HOT requests of the one client")
    p.add_argument("--warmup", type=int, default=200, help="requests before any timing, per server")
    p.add_argument("--seconds", type=float, default=6.0, help="per concurrency level")
    p.add_argument("--clients", type=int, nargs="+", default=[8, 32], help="concurrency levels (batch 1)")
    p.add_argument("--cold-starts", type=int, default=3, help="KServe process starts")
    p.add_argument("--wakes", type=int, default=5, help="Volga FROZEN wakes")
    p.add_argument("--idle-sec", type=float, default=2.0, help="volga up --idle-sec: back to FROZEN between wakes")
    p.add_argument("--external-data", action="store_true",
                   help="both servers load the default model with its weights beside it (ONNX external data)")
    p.add_argument("--kserve-python", help="the interpreter that runs KServe (default: $VOLGA_KSERVE_PYTHON, "
                   "else this one, with the peers extra)")
    p.add_argument("--no-batched", action="store_true", help="leave out Volga with dynamic batching")
    p.add_argument("--server-cpus", type=_cpus, default=(), metavar="LIST",
                   help="CPUs the servers run on, e.g. 0,1 or 0-3 (default: all)")
    p.add_argument("--client-cpus", type=_cpus, default=(), metavar="LIST",
                   help="CPUs the clients run on, e.g. 2-9 (default: all)")
    p.add_argument("--gateway-processes", type=int, default=1,
                   help="Volga's gateway processes (volga up --gateway-processes; default 1)")
    p.add_argument("--hot-instances", type=int, default=1,
                   help="above 1: also Volga with this many HOT instances of the model (pool.hot), requests spread "
                        "over their workers")
    _report_args(p)
    p.set_defaults(func=cmd_bench_peers)
    p = bench.add_parser("faults", help="volga up under traffic: corrupt and truncated images, killed workers "
                         "and agents, a full snapshot disk")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    _report_args(p)
    p.set_defaults(func=cmd_bench_faults)

    p = bench.add_parser("fetch", help="a cold start from S3 vs from a local file; the model cache's download rate "
                         "vs boto3's on the same object")
    p.add_argument("--size-mib", type=int, default=1024, help="the model's size in MiB (default 1024)")
    p.add_argument("--connections", type=int, default=10, help="the cache's connections per object")
    p.add_argument("--rounds", type=int, default=3, help="downloads by each, alternated (medians reported)")
    _report_args(p)
    p.set_defaults(func=cmd_bench_fetch)

    p = bench.add_parser("chain", help="a chain of three FROZEN models vs the same models unchained: first answer")
    p.add_argument("-n", type=int, default=5, help="cycles per side (default 5)")
    p.add_argument("--batch", type=int, default=4, help="rows per request (default 4)")
    _report_args(p)
    p.set_defaults(func=cmd_bench_chain)

    p = bench.add_parser("scale", help="the operator on a real API server with kwok nodes and many ModelSpecs")
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--modelspecs", type=int, default=1000)
    p.add_argument("--writes-per-sec", type=float, default=200.0, help="the operator's API write limit")
    p.add_argument("--placement", action="store_true", help="only the planner's cost per placement, no API server")
    _report_args(p)
    p.set_defaults(func=cmd_bench_scale)

    p = bench.add_parser("cluster", help="helm install onto a real node: install to first answer, FROZEN wake through "
                                         "the gateway Service vs volga up")
    p.add_argument("-n", type=int, default=10, help="FROZEN wakes timed each way (default 10)")
    _report_args(p)
    p.set_defaults(func=cmd_bench_cluster)

    p = bench.add_parser("decide", help="the autonomy decider's cost per window and the sampler's jitter")
    p.add_argument("--windows", type=int, default=3000, help="windows decided per model count")
    p.add_argument("--sample-seconds", type=float, default=2.0, help="how long to run the sampler (0: not)")
    p.add_argument("--period-ms", type=float, default=10.0, help="the sampler's period")
    _report_args(p)
    p.set_defaults(func=cmd_bench_decide)

    p = bench.add_parser("slo", help="a latency-critical and a heavy tolerant model, bursty load: autonomy off vs on")
    p.add_argument("--seconds", type=float, default=40.0, help="traffic per run")
    p.add_argument("--rounds", type=int, default=1, help="off/on pairs")
    p.add_argument("--pulse-every", type=float, default=10.0, help="seconds between the tolerant model's pulses")
    p.add_argument("--pulse-seconds", type=float, default=3.0, help="how long a pulse lasts")
    p.add_argument("--calibrate-iterations", type=int, default=100, help="timed requests of each baseline")
    p.add_argument("--calibrate-pace-ms", type=float, default=None,
                   help="one calibration request every this many ms (default: the protected model's mean arrival "
                        "period, as its traffic comes; 0: back to back)")
    p.add_argument("--gpu", action="store_true", help="two PyTorch models sharing cuda:0 instead of ONNX on the CPU")
    p.add_argument("--yield-calm-windows", type=int, default=30,
                   help="windows without a violation before the tolerant worker gets its CPU priority back")
    p.add_argument("--throttle-share", type=_share, default=0.0,
                   help="with the loop on, also stop the tolerant worker this share of every period while it gives "
                        "way (autonomy_throttle_share), beside a run with the yield alone; 0: no throttle")
    p.add_argument("--throttle-period-ms", type=float, default=20.0, help="the throttle's period")
    p.add_argument("--throttle-guard", action="store_true",
                   help="the throttle stops the tolerant worker only while the protected model computes "
                   "(autonomy_throttle_guard)")
    p.add_argument("--no-alone", action="store_true",
                   help="leave out the run of the protected model alone (the floor of violating windows)")
    _report_args(p)
    p.set_defaults(func=cmd_bench_slo)
