"""`volga`: the command line.

    volga validate -f spec.yaml       check ModelSpecs; errors name the field path and the reason
    volga demo                        the embedded default model: cold start, freeze, wake on a request
    volga bench tiers [--gpu] [--json] cold start vs each tier's wake -> first answer, in one run
    volga build-model [--out DIR]     build the embedded default model and print its ModelSpec
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import yaml

from volga_operator import api

Tier = api.Tier


def default_snapshot_dir() -> pathlib.Path:
    """Snapshots belong on tmpfs when there is one: CRIU restores read the whole image."""
    env = os.environ.get("VOLGA_SNAPSHOT_DIR")
    if env:
        return pathlib.Path(env)
    shm = pathlib.Path("/dev/shm")
    return shm / "volga" if shm.is_dir() else pathlib.Path(tempfile.gettempdir()) / "volga-snapshots"


def cmd_validate(args: argparse.Namespace) -> int:
    failed = 0
    for target in args.file:
        try:
            specs = api.load_model_specs(target)
        except api.SpecError as exc:
            print(exc, file=sys.stderr)
            failed += 1
            continue
        except OSError as exc:
            print(f"{target}: {exc.strerror}", file=sys.stderr)
            failed += 1
            continue
        for spec in specs:
            problems = []
            if not args.schema_only and not spec.spec.source_path.exists():
                problems.append(f"  spec.source: model file {spec.spec.source_path} does not exist")
            if problems:
                print(f"{target}: ModelSpec {spec.metadata.name}: invalid\n" + "\n".join(problems), file=sys.stderr)
                failed += 1
            else:
                print(f"{target}: ModelSpec {spec.metadata.name} ({spec.spec.model_id}, "
                      f"{spec.spec.framework.value}) is valid; input hash {spec.spec.input_hash()[:16]}...")
    return 1 if failed else 0


def cmd_build_model(args: argparse.Namespace) -> int:
    from volga_agent import defaultmodel

    spec = defaultmodel.ensure(pathlib.Path(args.out) if args.out else None)
    print(yaml.safe_dump(spec.to_wire(), sort_keys=False), end="")
    return 0


def _progress(quiet: bool) -> object:
    def show(message: str) -> None:
        if not quiet:
            print(f"  .. {message}", file=sys.stderr, flush=True)
    return show


def cmd_demo(args: argparse.Namespace) -> int:
    import numpy as np

    from volga_agent import defaultmodel, instance
    from volga_agent.snapshot import criu
    from volga_agent.worker import runtime

    print("Volga demo: the embedded default model (CTR ranking, ONNX on the CPU)")
    print("  building the model (first run only) ...", flush=True)
    spec = defaultmodel.ensure().spec
    size_mb = spec.source_path.stat().st_size / 1e6
    print(f"  model {spec.model_id}: {size_mb:.0f} MB at {spec.source_path}")
    engine = criu.CriuEngine(default_snapshot_dir() / "demo")
    with tempfile.TemporaryDirectory(prefix="volga-") as run:
        inst = instance.Instance("demo-ctr", spec, run, engine)
        request = runtime.sample_inputs(inst.config.inputs, batch=16, seed=3)
        try:
            print("  cold start: spawn worker, load, warm up, answer ...", flush=True)
            start = time.perf_counter()
            inst.to(Tier.HOT)
            reference = inst.infer(request)["probability"]
            cold = time.perf_counter() - start
            wakes, freezes, same = [], [], True
            for i in range(args.cycles):
                freezes.append(inst.to(Tier.FROZEN).seconds)
                assert inst.image is not None
                print(f"  cycle {i + 1}/{args.cycles}: frozen into {inst.image.size_bytes / 2**20:.0f} MiB "
                      f"({engine.root}); a request arrives: wake ...", flush=True)
                start = time.perf_counter()
                woke = inst.wake()
                out = inst.infer(request)["probability"]
                wakes.append(time.perf_counter() - start)
                same = same and bool(np.array_equal(out, reference)) and not woke.fallback
        finally:
            inst.close()
    wake = sorted(wakes)[len(wakes) // 2]
    print()
    print(f"{'':<34}{'latency':>10}")
    print(f"{'cold start -> first answer':<34}{cold * 1e3:>8.0f} ms")
    print(f"{'FROZEN wake -> first answer (p50)':<34}{wake * 1e3:>8.0f} ms")
    print(f"{'freeze (CRIU dump, p50)':<34}{sorted(freezes)[len(freezes) // 2] * 1e3:>8.0f} ms")
    print(f"{'speed-up':<34}{cold / wake:>9.1f}x")
    print(f"outputs identical to the first answer after every wake: {'yes' if same else 'NO'}")
    return 0 if same else 1


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    from volga_agent import bench, defaultmodel

    if args.gpu:
        workroot = pathlib.Path(args.models or defaultmodel.default_cache())
        spec = bench.build_torch_mlp(workroot / f"mlp-{args.model_gib:g}gib" / "model.pt", args.model_gib)
        tiers = [Tier.WARM, Tier.SUSPENDED, Tier.FROZEN]
        device = "cuda:0"
    else:
        spec = defaultmodel.ensure(pathlib.Path(args.models) if args.models else None).spec
        tiers = [Tier.FROZEN]
        device = "cpu"
    with tempfile.TemporaryDirectory(prefix="volga-") as run:
        report = bench.bench_tiers(spec, pathlib.Path(run) / "w", default_snapshot_dir() / "bench", tiers,
                                   args.n, device, progress=_progress(args.json))  # type: ignore[arg-type]
    if args.gpu:
        import onnxruntime

        providers = onnxruntime.get_available_providers()
        report["onnx_on_gpu"] = (
            "measurable: CUDAExecutionProvider present" if "CUDAExecutionProvider" in providers else
            f"not measured: onnxruntime {onnxruntime.__version__} here offers only {', '.join(providers)}")
    if args.out:
        bench.write_json(report, pathlib.Path(args.out))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"device: {report['device']}; model {report['model']['id']}")
        print(bench.format_table(report))
        print(f"outputs match: {report['outputs_match']}; restore fallbacks: {report['restore_fallbacks']}")
    return 0 if report["outputs_match"] and not report["restore_fallbacks"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="volga", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="validate ModelSpec files")
    p.add_argument("-f", "--file", action="append", required=True, help="YAML file or folder (repeatable)")
    p.add_argument("--schema-only", action="store_true",
                   help="do not check that model files exist here (specs for files that live on the nodes)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("build-model", help="build the embedded default model, print its ModelSpec")
    p.add_argument("--out", help="model folder (default ~/.cache/volga/models)")
    p.set_defaults(func=cmd_build_model)

    p = sub.add_parser("demo", help="cold start vs wake from a CRIU snapshot, on the default model")
    p.add_argument("--cycles", type=int, default=3)
    p.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("tiers", help="cold start vs wake -> first answer per tier")
    p.add_argument("--gpu", action="store_true", help="PyTorch model on cuda:0: HOT, WARM, SUSPENDED, FROZEN, COLD")
    p.add_argument("--model-gib", type=float, default=0.5, help="GPU model weights in GiB (with --gpu)")
    p.add_argument("--models", help="where models are built")
    p.add_argument("-n", type=int, default=10, help="wakes per tier (and cold starts)")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--out", help="also write the JSON report to this file")
    p.set_defaults(func=cmd_bench_tiers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
