"""`volga bench shared`: a node's first answer from an image another node published, beside its own cold start.

Two nodes on one machine: each runs as its own process (a real `pool.Pool`, real workers, real CRIU) in its own
mount namespace, where its own folder is mounted on one common path, as every node's agent pod sees the same
paths in its container; the shared snapshot folder is a plain folder both see. Node A cold-starts, answers,
freezes and publishes; node B, a fresh process each round, answers its first request from A's image; then B
cold-starts with shared snapshots off. The answers are compared bit for bit with A's.

`python -m volga_bench.shared node ...` is one node's process (`run_node` starts it); the tests use it too.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from volga_agent.app import defaultmodel
from volga_agent.node import pool
from volga_agent.node.settings import Settings, SharedSnapshotSettings
from volga_agent.worker import contract
from volga_bench import reporting
from volga_core import api, planner

Tier = api.Tier
MODEL_NAME = "shared-bench"


def _node(argv: Sequence[str]) -> dict[str, Any]:
    """One node: a pool with one instance of the default model, driven through `--steps`; a JSON report."""
    p = argparse.ArgumentParser(prog="volga_bench.shared node")
    p.add_argument("--node", required=True)
    p.add_argument("--root", required=True, help="the node's own folder (the same path on every node)")
    p.add_argument("--shared", default="", help="the shared snapshot folder; empty: off")
    p.add_argument("--models", default="")
    p.add_argument("--version", default="", help="pretend the ModelSpec has this version")
    p.add_argument("--steps", default="first", help="comma-separated: first (wake + first answer), freeze")
    p.add_argument("--instance", default=f"{MODEL_NAME}-0", help="the instance's (EMI's) name")
    args = p.parse_args(argv)
    doc = defaultmodel.ensure(pathlib.Path(args.models) if args.models else None)
    spec = doc.spec if not args.version else doc.spec.model_copy(update={"version": args.version})
    root = pathlib.Path(args.root)
    settings = Settings(shared=SharedSnapshotSettings(folder=args.shared), verify_image_checksums=True)
    agent = pool.Pool(args.node, root / "work", root / "snapshots", settings)
    name = args.instance
    steps: list[dict[str, Any]] = []
    try:
        agent.apply([planner.Desired(name, MODEL_NAME, spec.model_id, args.node, Tier.COLD)], {MODEL_NAME: spec})
        agent.wait_converged()
        inst = agent.slots[name].inst
        inputs = contract.sample_inputs(inst.config.inputs, batch=4, seed=7)
        for step in args.steps.split(","):
            start = time.perf_counter()
            if step == "first":
                activation = agent.activate(spec.model_id)
                out = inst.infer(inputs)
                seconds = time.perf_counter() - start
                steps.append({"step": step, "ms": round(seconds * 1e3, 3), "woke_from": activation.woke_from.value,
                              "fallback": activation.fallback, "detail": inst.history[-1].detail,
                              "shared_snapshot": activation.instance.shared_snapshot,
                              "shared_snapshot_role": activation.instance.shared_snapshot_role,
                              "outputs": {k: np.asarray(v).tolist() for k, v in sorted(out.items())}})
            elif step == "freeze":
                agent.move_to(name, Tier.FROZEN)
                info = agent.instances()[0]
                steps.append({"step": step, "ms": round((time.perf_counter() - start) * 1e3, 3),
                              "tier": info.tier.value, "shared_snapshot": info.shared_snapshot,
                              "shared_snapshot_role": info.shared_snapshot_role})
            else:
                raise SystemExit(f"--steps: unknown step {step!r}")
        registry = agent.metrics.registry
        counts = {metric: registry.get_sample_value(f"volga_snapshot_shared_{metric}_total",
                                                    {"model": spec.model_id}) or 0.0
                  for metric in ("restores", "restore_failures", "publishes")}
        images = [{"digest": e.digest, "node": e.manifest.node, "version": e.version,
                   "size_bytes": e.manifest.size_bytes} for e in agent.shared_images()]
    finally:
        agent.close()
    return {"node": args.node, "steps": steps, "shared": counts, "images": images}


def run_node(node: str, folder: pathlib.Path, common: pathlib.Path, shared: pathlib.Path | None,
             steps: str, version: str = "", models: pathlib.Path | None = None, timeout: float = 300.0,
             instance: str = f"{MODEL_NAME}-0") -> dict[str, Any]:
    """Run one node's process with `folder` mounted on `common` (its own mount namespace); its report."""
    folder.mkdir(parents=True, exist_ok=True)
    common.mkdir(parents=True, exist_ok=True)
    command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
               'mount --bind "$0" "$1" && shift && exec "$@"', str(folder), str(common),
               sys.executable, "-m", "volga_bench.shared", "node", "--node", node, "--root", str(common),
               "--shared", str(shared or ""), "--steps", steps, "--version", version,
               "--models", str(models or ""), "--instance", instance]
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"node {node} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def bench(n: int, models: pathlib.Path | None = None, progress: Callable[[str], None] = lambda _: None
          ) -> dict[str, Any]:
    """Node A publishes once; then `n` fresh node-B processes answer from A's image and `n` cold-start."""
    with tempfile.TemporaryDirectory(prefix="vsb-", dir="/tmp") as tmp:
        base = pathlib.Path(tmp)
        common, shared = base / "node", base / "shared"
        progress("node A: cold start, first answer, freeze, publish")
        a = run_node("node-a", base / "a", common, shared, "first,freeze", models=models)
        reference = a["steps"][0]["outputs"]
        shared_ms, cold_ms, mismatches, fallbacks, details = [], [], 0, 0, set()
        for i in range(n):
            progress(f"node B: first answer from A's image {i + 1}/{n}")
            b = run_node("node-b", base / f"b{i}", common, shared, "first", models=models)["steps"][0]
            shared_ms.append(b["ms"] / 1e3)
            mismatches += int(b["outputs"] != reference)
            fallbacks += int(b["shared_snapshot_role"] != "restored")
            details.add(b["detail"].split(" of node")[0])
            progress(f"node B: cold start {i + 1}/{n}")
            c = run_node("node-b", base / f"c{i}", common, None, "first", models=models)["steps"][0]
            cold_ms.append(c["ms"] / 1e3)
            mismatches += int(c["outputs"] != reference)
    cold, restored = reporting.summarize(cold_ms), reporting.summarize(shared_ms)
    return {
        "device": reporting.device_description("cpu"),
        "model": {"id": defaultmodel.MODEL_ID, "batch": 4},
        "node_a": {"cold_first_answer_ms": a["steps"][0]["ms"], "freeze_and_publish_ms": a["steps"][1]["ms"],
                   "published": a["images"]},
        "node_b_first_answer_from_shared_image": restored,
        "node_b_cold_start_first_answer": cold,
        "speedup_p50": round(cold["p50_ms"] / restored["p50_ms"], 2),
        "outputs_match": mismatches == 0,
        "shared_restore_fallbacks": fallbacks,
        "details": sorted(details),
        "rounds": n,
    }


if __name__ == "__main__":
    if sys.argv[1:2] != ["node"]:
        raise SystemExit("usage: python -m volga_bench.shared node --node NAME --root DIR [--shared DIR] ...")
    print(json.dumps(_node(sys.argv[2:])))
