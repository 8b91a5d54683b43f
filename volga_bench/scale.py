"""`volga bench scale`: the operator against a real API server with many nodes and ModelSpecs.

It starts etcd + kube-apiserver (`controlplane.ControlPlane`), kwok to keep `nodes` fake GPU nodes Ready, and the
operator as a separate process, exactly as deployed. Then it creates `modelspecs` ModelSpecs at once (what a
`kubectl apply -f` of a big folder does) and measures, in the same run:

- converge_s: from the first ModelSpec created until every ModelSpec has all its EMIs and a status for its
  current generation;
- peak_writes_per_s: the operator's writes as the API server counts them (its `apiserver_request_total`
  for EMIs and for ModelSpec patches, sampled every second), so the limit is checked from outside the
  operator. The ModelSpec creations (the user's apply) and kwok's node heartbeats are not the operator's
  and are reported apart.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from kubernetes import client as k8s

from volga_bench import controlplane
from volga_operator import api, planner
from volga_operator.api import crds

PRODUCT = "NVIDIA H200"
OPERATOR_RESOURCES = {"executablemodelinstances", "modelspecs"}
MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
_SAMPLE = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def write_counts(metrics_text: str) -> dict[str, float]:
    """Mutating requests by source: the operator's, the ModelSpec creations, everything else."""
    out = {"operator": 0.0, "modelspec_creates": 0.0, "other": 0.0}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group("labels")))
        if labels.get("verb") not in MUTATING:
            continue
        value = float(match.group("value"))
        if labels.get("resource") == "modelspecs" and labels.get("verb") == "POST":
            out["modelspec_creates"] += value
        elif labels.get("resource") in OPERATOR_RESOURCES:
            out["operator"] += value
        else:
            out["other"] += value
    return out


def _metrics(client: k8s.ApiClient) -> str:
    """The API server's own metrics, fetched with the client's credentials (admin certificate)."""
    response = client.rest_client.pool_manager.request("GET", f"{client.configuration.host}/metrics", timeout=10)
    if response.status != 200:
        raise RuntimeError(f"GET /metrics: {response.status}")
    return str(response.data.decode())


def modelspec(index: int, source: str) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION, "kind": "ModelSpec",
        "metadata": {"name": f"model-{index:04d}", "namespace": "default"},
        "spec": {"modelId": f"model-{index:04d}", "framework": "onnx", "source": source,
                 "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, 16]}],
                 "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, 1]}],
                 "hardware": {"gpu": True, "gpuProduct": PRODUCT},
                 "pool": {"hot": 0, "warm": 1, "suspended": 0, "frozen": 1}},
    }


def run(nodes: int = 200, modelspecs: int = 1000, writes_per_sec: float = 200.0,
        progress: Callable[[str], None] = lambda _: None, timeout: float = 600.0) -> dict[str, Any]:
    folder = pathlib.Path(tempfile.mkdtemp(prefix="volga-scale-", dir="/tmp"))
    cp = controlplane.ControlPlane()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        progress("starting etcd + kube-apiserver")
        cp.start()
        client = cp.api_client()
        ext = k8s.ApiextensionsV1Api(client)
        for crd in crds.all_crds().values():
            ext.create_custom_resource_definition(crd)  # type: ignore[arg-type]
        env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig)}
        kwok = controlplane.bin_dir() / "kwok"
        progress(f"starting kwok and {nodes} fake GPU nodes")
        procs.append(subprocess.Popen(
            [str(kwok), f"--kubeconfig={cp.kubeconfig}", "--manage-all-nodes=false",
             "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake", "--node-lease-duration-seconds=0"],
            stdout=(folder / "kwok.log").open("w"), stderr=subprocess.STDOUT, env=env))
        core = k8s.CoreV1Api(client)
        profile = planner.NodeProfile("", 8, PRODUCT, 141 * 2**30, (0, 1)).annotations()
        for i in range(nodes):
            core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(
                name=f"gpu-{i:03d}", labels={"type": "kwok"},
                annotations={"kwok.x-k8s.io/node": "fake", **profile})))

        def ready_nodes() -> int:
            items = core.list_node().items
            conditions = [(n.status.conditions if n.status else None) or [] for n in items]
            return sum(any(c.type == "Ready" and c.status == "True" for c in cs) for cs in conditions)

        kwok_ready = controlplane.eventually(lambda: ready_nodes() == nodes, timeout=180,
                                        what=f"kwok to mark {nodes} nodes Ready")
        progress("starting the operator")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "volga_operator", "--liveness", ""],
            stdout=(folder / "operator.log").open("w"), stderr=subprocess.STDOUT,
            env={**env, "VOLGA_API_WRITES_PER_SEC": str(writes_per_sec)}))
        time.sleep(3)  # let it list the (empty) ModelSpecs and the nodes

        samples: list[tuple[float, dict[str, float]]] = []
        stop = threading.Event()

        def sample() -> None:
            sampler = cp.api_client()
            while not stop.is_set():
                samples.append((time.monotonic(), write_counts(_metrics(sampler))))
                stop.wait(1.0)
            sampler.close()

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        time.sleep(1.5)
        custom = k8s.CustomObjectsApi(client)
        progress(f"creating {modelspecs} ModelSpecs")
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda i: custom.create_namespaced_custom_object(
                api.GROUP, api.VERSION, "default", "modelspecs", modelspec(i, "/models/model.onnx")),
                range(modelspecs)))
        created_s = time.monotonic() - start
        want_emis = sum(modelspec(0, "")["spec"]["pool"].values())

        def converged() -> bool:
            items = cast(dict[str, Any], custom.list_namespaced_custom_object(
                api.GROUP, api.VERSION, "default", "modelspecs"))["items"]
            done = sum(1 for m in items if m.get("status", {}).get("observedGeneration") == m["metadata"]["generation"]
                       and m["status"].get("instances") == want_emis)
            progress(f"converged {done}/{modelspecs}")
            return done == modelspecs

        controlplane.eventually(converged, timeout=timeout, what="every ModelSpec to have its EMIs and status")
        converge_s = time.monotonic() - start
        emis = len(cast(dict[str, Any], custom.list_namespaced_custom_object(
            api.GROUP, api.VERSION, "default", "executablemodelinstances"))["items"])
        time.sleep(2.0)  # one more sample after the last write
        stop.set()
        sampler.join()
        rates = [(b[1]["operator"] - a[1]["operator"]) / (b[0] - a[0]) for a, b in itertools.pairwise(samples)]
        others = [(b[1]["other"] - a[1]["other"]) / (b[0] - a[0]) for a, b in itertools.pairwise(samples)]
        total = samples[-1][1]["operator"] - samples[0][1]["operator"]
        client.close()
        return {
            "nodes": nodes, "modelspecs": modelspecs, "emis": emis,
            "converge_s": round(converge_s, 2), "peak_writes_per_s": round(max(rates), 1),
            "write_limit_per_s": writes_per_sec, "operator_writes": int(total),
            "mean_writes_per_s": round(total / converge_s, 1), "modelspec_create_s": round(created_s, 2),
            "peak_other_writes_per_s": round(max(others), 1), "kwok_nodes_ready": bool(kwok_ready),
            "samples": len(samples), "kube_apiserver": "v1.34.4 (built from k8s.io/kubernetes)",
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    finally:
        for proc in reversed(procs):
            controlplane.terminate(proc)
        cp.stop()
