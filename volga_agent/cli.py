"""`volga`: the command line.

    volga validate -f spec.yaml       check ModelSpecs (and their signatures against ONNX files); errors name the
                                      field path and the reason; --run loads each model and runs its warm-up once
    volga inspect MODEL.onnx          print a ready ModelSpec for an ONNX file, its signature read from the file (and
                                      a probed warm-up sample where its non-batch dimensions are dynamic)
    volga up [-f SPECS]               agent + gateway + local ModelSpec store on this machine
    volga status [--agent ADDR | --cluster [--kubeconfig F] [--namespace NS]] [--json]
                                      per model: instances, tiers, last use and wake, snapshot image sizes
    volga demo                        the embedded default model through the gateway, every tier timed
    volga bench tiers [--gpu] [--json] cold start vs each tier's wake -> first answer, in one run
    volga bench gateway [--json]      the gateway's added latency vs calling the worker directly
    volga bench gateway --batching    batch 1 vs dynamic batching in the gateway: throughput at equal p99
    volga bench peers [--json]        Volga's gateway beside KServe's ModelServer: same model, same client
    volga bench faults [--json]       `volga up` under traffic through injected faults: wrong answers, hangs, leaks
    volga bench shared [--json]       a node's first answer from another node's shared image beside its cold start
    volga build-model [--out DIR]     build the embedded default model and print its ModelSpec
    volga calibrate -f SPEC [--write] measure the model's p99 alone per batch size on this node, through a gateway
                                      (and of the worker alone); --write puts the baselines into the ModelSpec file
    volga bench decide [--json]       the autonomy decider's cost per window (2-64 models), the sampler's jitter
    volga bench slo [--json]          a latency-critical model beside a heavy one, bursty load: autonomy off vs on
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
from collections.abc import Callable

import yaml

from volga_agent import ports
from volga_agent.node import admission, signature
from volga_agent.node.settings import Settings
from volga_core import api


def cmd_validate(args: argparse.Namespace) -> int:
    if args.run and args.schema_only:
        print("volga validate: --run loads the model files, which --schema-only leaves unopened", file=sys.stderr)
        return 2
    failed = 0
    outside = 0  # ModelSpecs whose model file lies outside the model roots `volga up` would use for these files
    roots = () if args.schema_only else model_roots(args)
    labelled: list[tuple[str, api.ModelSpec]] = []
    checked: list[tuple[str, api.ModelSpec]] = []  # signatures read from the model files, for the chains
    for target in args.file:
        try:
            found = api.load_labelled(target)
        except api.SpecError as exc:
            print(exc, file=sys.stderr)
            failed += 1
            continue
        except OSError as exc:
            print(f"{target}: {exc.strerror}", file=sys.stderr)
            failed += 1
            continue
        labelled += found
        for label, spec in found:
            problems: list[tuple[str, str]] = []
            if not args.schema_only:
                spec, problems = _against_model(spec)
                off = [o.problem for o in admission.outside_roots([(label, spec)], roots)]
                outside += len(off)
                problems = off + problems
            if problems:
                print(f"{label}: ModelSpec {spec.metadata.name}: invalid\n"
                      + "\n".join(f"  {path}: {reason}" for path, reason in problems), file=sys.stderr)
                failed += 1
                continue
            checked.append((label, spec))
            digest = (f"input hash {spec.spec.input_hash()[:16]}..." if spec.spec.has_signature else
                      "a model server, run by `volga up` or a cluster's agents (docs/servers.md)"
                      if spec.spec.server is not None else
                      "inputs and outputs to be read from the model file")
            print(f"{label}: ModelSpec {spec.metadata.name} ({spec.spec.model_id}, "
                  f"{spec.spec.framework.value}) is valid; {digest}")
            if args.run:
                failed += _run_once(label, spec)
    for repeat in api.repeated(labelled):
        print(repeat, file=sys.stderr)
        failed += 1
    for chained in api.chain_errors(checked):
        print(chained, file=sys.stderr)
        failed += 1
    if outside:
        print("\n".join(admission.roots_hint(roots, roots_origin(args))), file=sys.stderr)
    return 1 if failed else 0


def _against_model(spec: api.ModelSpec) -> tuple[api.ModelSpec, list[tuple[str, str]]]:
    """The written signature held to the model file, or the one left out read from it."""
    if spec.spec.has_signature:
        return spec, signature.check(spec.spec) + signature.warmup_file_problems(spec.spec)
    try:
        filled = signature.fill(spec.spec)
    except api.SpecError as exc:
        return spec, exc.problems
    return spec.model_copy(update={"spec": filled}), signature.warmup_file_problems(filled)


def _run_once(label: str, spec: api.ModelSpec) -> int:
    """`volga validate --run`: the model loaded and its warm-up run once, as a worker would (`probe.run_once`); 1
    when it does not load or refuses a declared warm-up sample (it would not start). A skipped made-up warm-up and
    answers that contradict the declared outputs are warnings: the model serves, and its metadata says the answers."""
    from volga_agent.node import probe

    name = f"{label}: ModelSpec {spec.metadata.name}"
    if spec.spec.framework in admission.MODEL_CODE_FRAMEWORKS:
        print(f"{name}: not run: a {spec.spec.framework.value} model runs code when loaded")
        return 0
    trial = probe.run_once(spec.spec)
    if trial.report is None:
        print(f"{name}: the run failed: {trial.error}", file=sys.stderr)
        return 1
    for finding in trial.findings:
        print(f"{name}: warning: {finding}", file=sys.stderr)
    if trial.report.mismatch:
        print(f"{name}: served, the model's metadata says the shapes it answers with; the model file's output "
              "declaration is what to fix", file=sys.stderr)
    if not trial.findings:
        print(f"{name}: ran its warm-up; the answers have the declared output shapes")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from volga_agent.node import probe

    try:
        document = signature.inspect_document(pathlib.Path(args.model))
    except api.SpecError as exc:
        print(f"volga inspect: {args.model}:\n" + "\n".join(f"  {path}: {reason}" for path, reason in exc.problems),
              file=sys.stderr)
        return 1
    # Dynamic non-batch dimensions: a warm-up sample of sizes the model runs, probed, with a comment saying so.
    probed = probe.for_inspect(pathlib.Path(args.model).resolve(),
                               [api.TensorSpec.model_validate(t) for t in document["spec"]["inputs"]])
    if probed is not None and probed.warmup:
        document["spec"]["runtime"] = {"warmup": probed.warmup}
    text = yaml.safe_dump(document, sort_keys=False, default_flow_style=None, allow_unicode=True)
    print(probe.annotate(text, probed), end="")
    return 0


def cmd_build_model(args: argparse.Namespace) -> int:
    from volga_agent.app import defaultmodel

    spec = defaultmodel.ensure(pathlib.Path(args.out) if args.out else None)
    print(yaml.safe_dump(spec.to_wire(), sort_keys=False), end="")
    return 0


def _progress(quiet: bool) -> Callable[[str], None]:
    def show(message: str) -> None:
        if not quiet:
            print(f"  .. {message}", file=sys.stderr, flush=True)
    return show


DEFAULT_LABEL = "(the embedded default model)"


def load_specs(files: list[str] | None) -> signature.Loaded:
    """The ModelSpecs in `files` (the embedded default without), inputs and outputs they leave out read from
    their model files, and those refused one by one (`signature.load`); SpecError for what is no single model's
    problem (a document that does not parse, a name or model id used twice, a chain that cannot be used)."""
    from volga_agent.app import defaultmodel

    if not files:
        return signature.Loaded([(DEFAULT_LABEL, defaultmodel.ensure())])
    return signature.load(files, fetch=fetch_source)


def fetch_source(spec: api.ModelSpecSpec) -> api.ModelSpecSpec:
    """A remote source fetched into the node's model cache, credentials from this process's environment: the
    spec naming the verified local copy (a node file pinned by sourceDigest: checked). SpecError naming
    spec.source and the reason when it cannot be had."""
    import os

    from volga_agent.sources import cache, errors

    if not spec.remote_source:
        try:
            cache.verify_local(spec.source_path, spec.source_digest or "")
        except errors.SourceError as exc:
            raise api.SpecError(spec.source, [("spec.source", str(exc))]) from None
        return spec
    print(f"volga up: fetching {spec.source} into {cache.default_root()}", file=sys.stderr, flush=True)
    try:
        # One cache for the process, holding what it fetched: a later fetch does not evict an earlier one.
        local, resolved = cache.localise(cache.for_process(cache.default_root(), cache.default_budget()), spec,
                                         os.environ, holder=f"{spec.model_id}/{spec.version}")
    except (errors.SourceError, OSError) as exc:
        raise api.SpecError(spec.source, [("spec.source", str(exc))]) from None
    print(f"volga up: {spec.source}: {resolved.size} bytes, {resolved.digest} "
          f"({'cached' if resolved.hit else f'fetched in {resolved.seconds:.1f} s'})", file=sys.stderr, flush=True)
    return local


def settings_from(args: argparse.Namespace) -> Settings:
    idle = args.idle_sec
    overrides = {k: v for k, v in {"hot_idle_sec": idle, "warm_idle_sec": idle, "suspended_idle_sec": idle,
                                   "scheduler_eviction_policy": args.eviction_policy,
                                   "lazy_restore": False if args.eager_restore else args.lazy_restore or None,
                                   "allow_model_code": args.allow_model_code or None,
                                   "worker_user": getattr(args, "worker_user", None),
                                   "max_instances": args.max_instances,
                                   "criu_timeout_floor_sec": args.criu_timeout_sec,
                                   "shared_snapshots": getattr(args, "shared_snapshots", None),
                                   "autonomy_enabled": getattr(args, "autonomy", False) or None}.items()
                 if v is not None}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item}: expected NAME=VALUE")
        overrides[key.strip()] = yaml.safe_load(value)
    base: dict[str, object] = {}
    if getattr(args, "settings", None):
        loaded = yaml.safe_load(pathlib.Path(args.settings).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"--settings {args.settings}: must be a mapping of setting names to values")
        # The file may name each setting once, in any form (flat or nested, snake_case or camelCase); the flags
        # replace it whatever the form.
        Settings.nested(loaded)  # raises: a setting given twice
        base = loaded
    # The model roots: --model-root, else those the settings file or --set gives, else the default ones.
    if args.model_root or not any(key in ("model_roots", "modelRoots") for key in (*base, *overrides)):
        overrides["model_roots"] = model_roots(args)
    return Settings.from_mapping(Settings.overlay(base, overrides))


def model_roots(args: argparse.Namespace) -> tuple[str, ...]:
    """Where `volga up` lets model sources point: --model-root, else the folders of the ModelSpec files and the
    folder of the built models (`volga build-model`)."""
    from volga_agent.app import defaultmodel
    from volga_agent.node import admission
    if args.model_root:
        return tuple(str(pathlib.Path(root).resolve()) for root in args.model_root)
    return (*admission.spec_folders(args.file or []), str(defaultmodel.default_cache()))


def roots_origin(args: argparse.Namespace, roots: tuple[str, ...] | None = None) -> str:
    """Where the model roots in force come from, for the messages about them; `roots`: those in force, when a
    settings file may have given them."""
    if args.model_root:
        return "from --model-root"
    if roots is not None and roots != model_roots(args):
        return "from settings.model_roots"
    return "the default: the folders of the ModelSpec files and the built-models cache"


def cmd_up(args: argparse.Namespace) -> int:
    import logging

    import uvloop

    from volga_agent.app import up
    from volga_agent.gateway import siblings

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        loaded = load_specs(args.file)
    except (api.SpecError, OSError) as exc:
        print(exc, file=sys.stderr)
        return 2
    from volga_agent import auth

    try:
        tokens = auth.Tokens.from_file(args.token_file) if args.token_file else None
        settings = settings_from(args)
    except (OSError, ValueError) as exc:
        print(f"volga up: {exc}", file=sys.stderr)
        return 2
    from volga_agent.sources import cache

    fetched = cache.default_root().resolve()
    if settings.model_roots and any(spec.spec.source_path.is_relative_to(fetched) for spec in loaded.specs):
        # Remote sources load from the model cache's verified copies, wherever the model roots are.
        settings = settings.model_copy(update={"model_roots": (*settings.model_roots, str(fetched))})
    if not _startable(args, loaded, settings.model_roots):
        return 2
    specs = loaded.specs
    options = up.Options(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                            metrics_port=args.metrics_port, agent_port=args.agent_port,
                            snapshot_root=pathlib.Path(args.snapshot_dir) if args.snapshot_dir else None,
                            workroot=pathlib.Path(args.workdir) if args.workdir else None,
                            settings=settings, tokens=tokens, token_file=args.token_file or "",
                            gateway_processes=args.gateway_processes)
    print(f"volga up: {len(specs)} ModelSpec(s); listening on", flush=True)
    try:
        uvloop.run(up.run(specs, options, lambda line: print(line, flush=True), loaded.refused))
    except ValueError as exc:  # what the node refuses before starting anything (too many instances)
        print(f"volga up: {exc}", file=sys.stderr)
        return 2
    except (OSError, siblings.SiblingFailed) as exc:
        print(f"volga up: {exc}", file=sys.stderr)
        return 1
    return 0


def _startable(args: argparse.Namespace, loaded: signature.Loaded, roots: tuple[str, ...]) -> bool:
    """Whether `volga up` may start with what it loaded; says why not, and each ModelSpec it refused, on stderr.
    Not when a model file lies outside the model roots (every instance of it would fail; one message for all of
    them, before anything starts), nor when no ModelSpec is left to serve."""
    every = [*loaded.labelled, *((r.label, r.spec) for r in loaded.refused)]
    if outside := admission.outside_roots(every, roots):
        which = "ModelSpecs name model files" if len(outside) > 1 else "ModelSpec names a model file"
        lines = [f"volga up: {len(outside)} {which} outside the model roots; nothing was started:"]
        lines += [f"  {o.label}: ModelSpec {o.name}: {': '.join(o.problem)}" for o in outside]
        lines += [f"  {line}" for line in admission.roots_hint(roots, roots_origin(args, roots))]
        print("\n".join(lines), file=sys.stderr, flush=True)
        return False
    for r in loaded.refused:
        print(f"volga up: {r.label}: ModelSpec {r.spec.metadata.name} (model {r.model_id!r}) cannot be served:\n"
              + "\n".join(f"  {path}: {reason}" for path, reason in r.error.problems), file=sys.stderr, flush=True)
    if loaded.refused and not loaded.labelled:
        print("volga up: no ModelSpec is left to serve", file=sys.stderr, flush=True)
        return False
    if loaded.refused:
        names = ", ".join(repr(r.model_id) for r in loaded.refused)
        print(f"volga up: serving the other {len(loaded.labelled)} ModelSpec(s); requests for {names} answer "
              "UNAVAILABLE with the reason above", file=sys.stderr, flush=True)
    return True


def cmd_status(args: argparse.Namespace) -> int:
    from volga_agent.app import status

    try:
        if args.cluster or args.kubeconfig or args.namespace or args.context:
            models = status.from_cluster(args.kubeconfig, args.namespace, args.context)
        else:
            models = status.from_agent(args.agent)
    except status.SourceError as exc:
        print(f"volga status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"models": [m.to_json() for m in models]}, indent=2) if args.json else status.table(models))
    return 0


BENCH_EXTRA = "pip install 'volga[bench]'"


def _bench_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`volga demo` and `volga bench ...`: their arguments and runs live in `volga_bench` (volga_bench/commands.py),
    imported here, when the parser is built, never when this module loads. Without it both commands take any
    arguments and say how to install it."""
    helps = {"demo": "the default model through the gateway: cold start, each tier's wake, steady state",
             "bench": "benchmarks"}
    try:
        from volga_bench import commands
    except ImportError as exc:
        for name, text in helps.items():
            # A prefix character no argument starts with: every word after the command, options too, is `rest`.
            p = sub.add_parser(name, help=text, add_help=False, prefix_chars="\0")
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(func=functools.partial(_without_benches, exc))
        return
    commands.add_demo(sub.add_parser("demo", help=helps["demo"]))
    commands.add_bench(sub.add_parser("bench", help=helps["bench"]))


def _without_benches(exc: ImportError, args: argparse.Namespace) -> int:
    named = args.rest[:1] if args.command == "bench" and args.rest and not args.rest[0].startswith("-") else []
    print(f"volga {' '.join([args.command, *named])}: needs the bench extra, not installed here ({exc}); "
          f"install it with: {BENCH_EXTRA}", file=sys.stderr)
    return 2


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write batch sizes as positive integers, e.g. 1,8") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: write batch sizes as positive integers, e.g. 1,8")
    return sizes


def cmd_calibrate(args: argparse.Namespace) -> int:
    from volga_agent.app import calibrate

    try:
        labelled = api.load_labelled(args.file)
    except (api.SpecError, OSError) as exc:
        print(f"volga calibrate: {exc}", file=sys.stderr)
        return 2
    chosen = [(label, s) for label, s in labelled if not args.name or s.metadata.name == args.name]
    if len(chosen) != 1:
        names = ", ".join(s.metadata.name for _, s in labelled)
        print(f"volga calibrate: {args.file}: " + (f"no ModelSpec named {args.name!r} (found {names})" if args.name
              else f"{len(labelled)} ModelSpecs ({names}): choose one with --name"), file=sys.stderr)
        return 2
    label, spec = chosen[0]
    try:
        filled = signature.fill(spec.spec)
    except api.SpecError as exc:
        print(f"volga calibrate: {exc}", file=sys.stderr)
        return 2
    device = args.device or ("cuda:0" if filled.hardware.gpu else "cpu")
    try:
        result = calibrate.measure(filled, args.batch_sizes, args.iterations, device, progress=_progress(args.json),
                                   through="worker" if args.direct else "gateway", pace_ms=args.pace_ms)
    except ValueError as exc:
        print(f"volga calibrate: {label}: {exc}", file=sys.stderr)
        return 2
    except calibrate.StartFailed as exc:
        print(f"volga calibrate: {label}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_wire(), indent=2) if args.json else calibrate.table(result))
    if args.write:
        calibrate.write(pathlib.Path(args.file), spec.metadata.name, result)
        if not args.json:
            print(f"wrote spec.slo.baselineLatencyMs and spec.slo.baselineFor into {args.file}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="volga", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="validate ModelSpec files")
    p.add_argument("-f", "--file", action="append", required=True, help="YAML file or folder (repeatable)")
    p.add_argument("--schema-only", action="store_true",
                   help="do not open the model files (specs for files that live on the nodes)")
    p.add_argument("--run", action="store_true",
                   help="also load each model and run its warm-up once, as a worker would (in a process of its own): "
                        "a declared sample it refuses fails; a refused made-up warm-up and answers that contradict "
                        "the declared outputs are warnings")
    p.add_argument("--model-root", action="append",
                   help="folder model sources must lie in, as for volga up (repeatable; default: the ModelSpec "
                        "files' folders and ~/.cache/volga/models)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("inspect", help="print a ready ModelSpec for an ONNX model file")
    p.add_argument("model", help="the .onnx file")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("build-model", help="build the embedded default model, print its ModelSpec")
    p.add_argument("--out", help="model folder (default ~/.cache/volga/models)")
    p.set_defaults(func=cmd_build_model)

    p = sub.add_parser("up", help="agent + gateway + local ModelSpec store, no Kubernetes")
    p.add_argument("-f", "--file", action="append", help="ModelSpec YAML file or folder (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=ports.DEFAULT.http_port)
    p.add_argument("--grpc-port", type=int, default=ports.DEFAULT.grpc_port)
    p.add_argument("--metrics-port", type=int, default=ports.DEFAULT.metrics_port)
    p.add_argument("--agent-port", type=int, default=ports.DEFAULT.agent_port, help="Agent gRPC API (-1: off)")
    p.add_argument("--snapshot-dir", help="where CRIU images go (default: a folder on /dev/shm)")
    p.add_argument("--idle-sec", type=float,
                   help="idle seconds before an instance goes down a tier (on a CPU node: HOT -> FROZEN)")
    lazy = p.add_mutually_exclusive_group()
    lazy.add_argument("--lazy-restore", action="store_true",
                      help="restore FROZEN images with CRIU lazy pages (the default)")
    lazy.add_argument("--eager-restore", action="store_true", help="restore FROZEN images with every page read first")
    p.add_argument("--eviction-policy", choices=["lru", "hybrid"])
    p.add_argument("--model-root", action="append",
                   help="folder model sources must lie in (repeatable; default: the ModelSpec files' folders and "
                        "~/.cache/volga/models)")
    p.add_argument("--allow-model-code", action="store_true",
                   help="load pytorch models, which run code when loaded (a .py file, or a pickled module)")
    p.add_argument("--max-instances", type=int, help="instances this node runs at most (default: from its memory)")
    p.add_argument("--worker-user", help="user workers drop to where their tiers allow it: NAME, UID or UID:GID; "
                   "root keeps them root (default: nobody)")
    p.add_argument("--token-file", help="bearer tokens (one a line) the gateway requires, but for health checks")
    p.add_argument("--gateway-processes", type=int, default=1,
                   help="gateway processes on the same ports (SO_REUSEPORT), each with its own /metrics "
                        "(volga_agent/gateway/siblings.py); default 1")
    p.add_argument("--criu-timeout-sec", type=float,
                   help="seconds a CRIU call may take before it is killed, plus 10 per GiB it moves (default 10)")
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="an agent setting by its flat name, snake_case or camelCase (autonomy_enabled=true; "
                        "docs/architecture.md), repeatable")
    p.add_argument("--autonomy", action="store_true",
                   help="run the node autonomy loop: act on the ModelSpecs' SLOs (batch caps, shedding, wakes)")
    p.add_argument("--settings", help="YAML/JSON file of node settings (the flags above take precedence)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--shared-snapshots", metavar="DIR",
                   help="a folder other nodes see too: restore the images they publish there instead of cold "
                        "starts, and publish this node's (their restores need the same --workdir path)")
    p.add_argument("--workdir", help="where the workers' sockets and logs go (default: a new folder under /tmp)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("status", help="per model: instances, tiers, last use and wake, snapshot image sizes")
    p.add_argument("--agent", default=f"127.0.0.1:{ports.DEFAULT.agent_port}",
                   help="Agent API address of a running `volga up` (default %(default)s)")
    p.add_argument("--cluster", action="store_true", help="read ModelSpecs and EMIs from the cluster instead")
    p.add_argument("--kubeconfig", help="kubeconfig file (implies --cluster; default: in-cluster, then ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context (implies --cluster)")
    p.add_argument("--namespace", "-n", help="one namespace (implies --cluster; default: all namespaces)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_status)

    _bench_commands(sub)  # demo, bench

    p = sub.add_parser("calibrate", help="measure a model's baselines on this node (p99 alone per batch size)")
    p.add_argument("-f", "--file", required=True, help="the ModelSpec YAML file")
    p.add_argument("--name", help="which ModelSpec of a multi-document file (metadata.name)")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 8], help="comma-separated (default 1,8)")
    p.add_argument("--iterations", type=int, default=200, help="timed requests per batch size")
    p.add_argument("--pace-ms", type=float, default=None,
                   help="start one timed request every this many ms, as sparse traffic comes; 0: back to back "
                        "(default: the spec's slo.calibrationPaceMs)")
    p.add_argument("--device", help="cpu or cuda:N (default: cuda:0 for a GPU ModelSpec, cpu otherwise)")
    p.add_argument("--write", action="store_true", help="write the baselines into the file, tagged with the "
                                                        "version and input hash")
    p.add_argument("--json", action="store_true", help="print the calibration as the ModelSpec status holds it")
    p.add_argument("--direct", action="store_true", help="time the worker alone (the gateway's worker client), not "
                                                         "tritonclient through a gateway in front of it")
    p.set_defaults(func=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
