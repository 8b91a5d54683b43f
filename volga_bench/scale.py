"""`volga bench scale`: the operator against a real API server with many nodes and ModelSpecs.

It starts etcd + kube-apiserver (`controlplane.ControlPlane`), kwok to keep `nodes` fake GPU nodes Ready, and the
operator as a separate process, exactly as deployed. Then it creates `modelspecs` ModelSpecs at once (what a
`kubectl apply -f` of a big folder does) and measures, in the same run:

- converge_s: from the first ModelSpec created until every ModelSpec has a status for its current generation
  counting all its EMIs, and every EMI exists (followed by a watch, so checking costs the machine little);
- the operator's writes as the API server records them in its audit log (every write to EMIs and ModelSpecs
  but the creations, with the time the server completed it), so the limit is checked from outside the
  operator: peak_writes_per_s (the most in any sliding one-second window), the total and its split by request,
  a per-second series, and write_floor_s, the time the write limit alone needs for them. The ModelSpec
  creations (the user's apply) and kwok's node heartbeats are not the operator's; the latter are reported
  apart, from the server's request counters;
- the operator's peak RSS and CPU seconds (from /proc), and the API server's and etcd's CPU beside them;
- restart_writes: the operator is stopped and started again on the converged cluster; what it writes until its
  first pass is done (and a few seconds more) should be nothing;
- converged_after_last_create_s, how far the operator trails the user's creations, and apiserver_writes_per_s,
  the creations and the operator's writes together over the run: where the API server (on a shared machine)
  takes the creations in more slowly than the write floor, these show that it, not the operator, set the pace;
- placement: the planner alone, ms per instance placed through its node index and by scoring every node, side by
  side (`placement`, also `volga bench scale --placement` without an API server).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime
import itertools
import json
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

import kubernetes
import urllib3
from kubernetes import client as k8s

from volga_bench import controlplane
from volga_core import api, planner
from volga_core import nodes as node_wire
from volga_core.api import crds

PRODUCT = "NVIDIA H200"
OPERATOR_RESOURCES = {"executablemodelinstances", "modelspecs"}
MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
_SAMPLE = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')
FIRST_PASS_DONE = "first pass done"  # the line the operator logs once its first pass's writes have landed
RESTART_QUIET_S = 5.0  # how long the restart is watched after the operator's first pass is done


def write_counts(metrics_text: str) -> dict[str, float]:
    """Mutating requests by source: the operator's, the ModelSpec creations, everything else; and the operator's
    by request ("PATCH modelspecs/status", ...) under keys starting with "operator:"."""
    out = {"operator": 0.0, "modelspec_creates": 0.0, "other": 0.0}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group("labels")))
        if labels.get("verb") not in MUTATING:
            continue
        value = float(match.group("value"))
        resource = labels.get("resource", "")
        if resource == "modelspecs" and labels.get("verb") == "POST":
            out["modelspec_creates"] += value
        elif resource in OPERATOR_RESOURCES:
            out["operator"] += value
            sub = labels.get("subresource")
            request = f"operator:{labels['verb']} {resource}{'/' + sub if sub else ''}"
            out[request] = out.get(request, 0.0) + value
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


@dataclasses.dataclass(frozen=True)
class Usage:
    """What /proc says one process has used."""

    cpu_s: float
    peak_rss_mib: float

    @classmethod
    def of(cls, pid: int) -> Usage:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; utime and stime are fields 14, 15
        ticks = os.sysconf("SC_CLK_TCK")
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
        hwm = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
        return cls(round((int(fields[11]) + int(fields[12])) / ticks, 2),
                   round(int(hwm.group(1)) / 1024, 1) if hwm else 0.0)


class Progress:
    """ModelSpecs that have converged (status for their generation, counting `want` EMIs), from a list + watch."""

    def __init__(self, custom: k8s.CustomObjectsApi, total: int, want: int,
                 progress: Callable[[str], None]) -> None:
        self.custom, self.total, self.want, self.progress = custom, total, want, progress
        self.done: set[str] = set()
        self.finished = threading.Event()
        self.finished_at: float | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="converge-watch", daemon=True)
        self._shown = 0.0
        self.version: str | None = None  # where the watch goes on from; None: list first
        self.lists = 0

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def _see(self, obj: dict[str, Any]) -> None:
        status = obj.get("status") or {}
        name = obj["metadata"]["name"]
        if status.get("observedGeneration") == obj["metadata"].get("generation") and status.get(
                "instances") == self.want:
            self.done.add(name)
        else:
            self.done.discard(name)
        if len(self.done) == self.total and not self.finished.is_set():
            self.finished_at = time.monotonic()
            self.finished.set()
        if time.monotonic() - self._shown > 5:
            self._shown = time.monotonic()
            self.progress(f"converged {len(self.done)}/{self.total}")

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._follow()
            except (urllib3.exceptions.HTTPError, kubernetes.client.ApiException) as exc:
                if getattr(exc, "status", None) == 410:
                    self.version = None  # too old a resource version: list again
                self.stopping.wait(0.5)  # the stream broke (the API server is busy or stopping)

    def _follow(self) -> None:
        """A list when there is no resourceVersion to go on from, then one watch request (it ends after a minute):
        the next goes on where this one stopped, so thousands of ModelSpecs are not listed again every minute."""
        if self.version is None:
            listed = cast(dict[str, Any], self.custom.list_namespaced_custom_object(
                api.GROUP, api.VERSION, "default", "modelspecs"))
            self.lists += 1
            for obj in listed["items"]:
                self._see(obj)
            self.version = listed["metadata"]["resourceVersion"]
        stream = kubernetes.watch.Watch().stream(
            self.custom.list_namespaced_custom_object, api.GROUP, api.VERSION, "default", "modelspecs",
            resource_version=self.version, timeout_seconds=60, allow_watch_bookmarks=True)
        for event in stream:
            if self.stopping.is_set():
                return
            if event["type"] == "ERROR":
                self.version = None  # too old a resource version: list again
                return
            self.version = event["object"]["metadata"].get("resourceVersion") or self.version
            if event["type"] in ("ADDED", "MODIFIED"):
                self._see(event["object"])


def count(custom: k8s.CustomObjectsApi, plural: str) -> int:
    """How many objects there are, from a one-item list (remainingItemCount), not a list of them all."""
    page = cast(dict[str, Any], custom.list_namespaced_custom_object(api.GROUP, api.VERSION, "default", plural,
                                                                     limit=1))
    return len(page["items"]) + int(page["metadata"].get("remainingItemCount") or 0)


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted, Panic]
rules:
- level: Metadata
  verbs: [create, update, patch, delete]
  resources: [{group: volga.dev, resources: [modelspecs, modelspecs/status, executablemodelinstances]}]
- level: None
"""


@dataclasses.dataclass(frozen=True)
class AuditedWrite:
    at: float  # unix time the API server finished it
    request: str  # "PATCH modelspecs/status", ...


def operator_writes(audit_log: pathlib.Path) -> list[AuditedWrite]:
    """The operator's writes in the API server's audit log, by when the server completed each: every write to
    ModelSpecs and EMIs except the ModelSpec creations (the user's apply)."""
    verbs = {"create": "POST", "update": "PUT", "patch": "PATCH", "delete": "DELETE"}
    out = []
    for line in audit_log.read_text().splitlines():
        entry = json.loads(line)
        ref = entry.get("objectRef") or {}
        resource, sub = ref.get("resource", ""), ref.get("subresource")
        if entry.get("verb") not in verbs or resource not in OPERATOR_RESOURCES:
            continue
        if resource == "modelspecs" and entry["verb"] == "create":
            continue
        at = datetime.datetime.fromisoformat(entry["stageTimestamp"]).timestamp()
        out.append(AuditedWrite(at, f"{verbs[entry['verb']]} {resource}{'/' + sub if sub else ''}"))
    return sorted(out, key=lambda w: w.at)


def peak_per_second(times: list[float]) -> int:
    """The most writes the server completed in any one-second window (sliding, not binned)."""
    most, first = 0, 0
    for last, at in enumerate(times):
        while times[first] <= at - 1.0:
            first += 1
        most = max(most, last - first + 1)
    return most


def _rates(samples: list[tuple[float, dict[str, float]]], source: str) -> list[float]:
    return [(b[1][source] - a[1][source]) / (b[0] - a[0]) for a, b in itertools.pairwise(samples)]


def placement(nodes: int = 1000, modelspecs: int = 5000, batch: int = 100, rounds: int = 3) -> dict[str, Any]:
    """The planner alone, side by side: ms per new instance placed, through the node index and by scoring every
    node (`planner.plan(exhaustive=True)`, what each placement cost before the index), for `batch` new ModelSpecs
    of the bench's kind on `nodes` nodes that already hold the other ModelSpecs' instances (best of `rounds`)."""
    profiles = [node_wire.NodeProfile(f"gpu-{i:03d}", 8, PRODUCT, 141 * 2**30, (0, 1)) for i in range(nodes)]
    spec = api.ModelSpecSpec.model_validate(modelspec(0, "/models/model.onnx")["spec"])
    slots = sum(modelspec(0, "")["spec"]["pool"].values())
    placed = max(0, modelspecs - batch) * slots
    base_load = {n.name: placed // nodes + (i < placed % nodes) for i, n in enumerate(profiles)}
    specs = {f"default/model-{i:04d}": spec for i in range(batch)}
    out: dict[str, Any] = {"nodes": nodes, "instances_placed_before": placed, "new_modelspecs": batch}
    plans = []
    for name, exhaustive in (("exhaustive", True), ("index", False)):
        best = float("inf")
        for _ in range(rounds):
            began = time.perf_counter()
            result = planner.plan(specs, profiles, base_load=base_load, exhaustive=exhaustive)
            best = min(best, time.perf_counter() - began)
        plans.append(result)
        out[f"{name}_ms_per_placement"] = round(best * 1000 / len(result.desired), 4)
    out["same_placements"] = plans[0] == plans[1]
    out["speedup"] = round(out["exhaustive_ms_per_placement"] / out["index_ms_per_placement"], 1)
    return out


def run(nodes: int = 200, modelspecs: int = 1000, writes_per_sec: float = 200.0,
        progress: Callable[[str], None] = lambda _: None, timeout: float = 900.0) -> dict[str, Any]:
    placing = placement(nodes, modelspecs)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="volga-scale-", dir="/tmp"))
    (folder / "audit-policy.yaml").write_text(AUDIT_POLICY)
    audit_log = folder / "audit.log"
    cp = controlplane.ControlPlane(extra_apiserver_args=[f"--audit-policy-file={folder / 'audit-policy.yaml'}",
                                                         f"--audit-log-path={audit_log}"])
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
        profile = node_wire.NodeProfile("", 8, PRODUCT, 141 * 2**30, (0, 1)).annotations()
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

        def operator(log_name: str) -> subprocess.Popen[bytes]:
            proc = subprocess.Popen(
                [sys.executable, "-m", "volga_operator", "--liveness", ""],
                stdout=(folder / log_name).open("w"), stderr=subprocess.STDOUT,
                env={**env, "VOLGA_API_WRITES_PER_SEC": str(writes_per_sec)})
            procs.append(proc)
            return proc

        def first_pass_done(log_name: str) -> bool:
            return FIRST_PASS_DONE in (folder / log_name).read_text(errors="replace")

        progress("starting the operator")
        first = operator("operator.log")
        controlplane.eventually(lambda: first_pass_done("operator.log"), timeout=120,
                                what="the operator's first pass")
        server_before = {name: Usage.of(pid) for name, pid in cp.pids().items()}

        samples: list[tuple[float, dict[str, float]]] = []
        stop = threading.Event()

        def sample() -> None:
            sampler = cp.api_client()
            while not stop.is_set():
                asked = time.monotonic()
                counts = write_counts(_metrics(sampler))
                samples.append(((asked + time.monotonic()) / 2, counts))  # the server counted somewhere between
                stop.wait(1.0)
            sampler.close()

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        time.sleep(1.5)
        custom = k8s.CustomObjectsApi(client)
        want_emis = sum(modelspec(0, "")["spec"]["pool"].values())
        watcher = Progress(k8s.CustomObjectsApi(cp.api_client()), modelspecs, want_emis, progress)
        watcher.start()
        load_before = os.getloadavg()[0]
        progress(f"creating {modelspecs} ModelSpecs")
        start, start_unix = time.monotonic(), time.time()
        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda i: custom.create_namespaced_custom_object(
                api.GROUP, api.VERSION, "default", "modelspecs", modelspec(i, "/models/model.onnx")),
                range(modelspecs)))
        created_s = time.monotonic() - start
        if not watcher.finished.wait(timeout):
            raise AssertionError(f"only {len(watcher.done)} of {modelspecs} ModelSpecs converged in {timeout} s")
        controlplane.eventually(lambda: count(custom, "executablemodelinstances") == modelspecs * want_emis,
                                timeout=timeout, what="every EMI to exist")
        converge_s = max(cast(float, watcher.finished_at), time.monotonic() - 0.2) - start
        converged_unix = start_unix + converge_s
        time.sleep(2.0)  # one more sample after the last write
        used = Usage.of(first.pid)
        server = {name: Usage.of(pid).cpu_s - server_before[name].cpu_s for name, pid in cp.pids().items()}
        load_after = os.getloadavg()[0]

        progress("restarting the operator on the converged cluster")
        controlplane.terminate(first)
        restarted_at, restarted_unix = time.monotonic(), time.time()
        second = operator("operator-restart.log")
        controlplane.eventually(lambda: first_pass_done("operator-restart.log"), timeout=300,
                                what="the restarted operator's first pass")
        restart_settle_s = time.monotonic() - restarted_at
        time.sleep(RESTART_QUIET_S)
        stop.set()
        sampler.join()
        watcher.stop()
        restart_used = Usage.of(second.pid)
        audited = operator_writes(audit_log)
        converging = [w for w in audited if w.at <= converged_unix + 2.0]
        total = len(converging)
        by_request = collections.Counter(w.request for w in converging)
        restart_writes = sum(1 for w in audited if w.at >= restarted_unix)
        series = collections.Counter(int(w.at - start_unix) for w in converging)
        client.close()
        floor = total / writes_per_sec
        return {
            "nodes": nodes, "modelspecs": modelspecs, "emis": modelspecs * want_emis,
            "converge_s": round(converge_s, 2), "write_floor_s": round(floor, 2),
            "converge_over_floor": round(converge_s / floor, 3) if floor else None,
            "operator_writes": int(total), "writes_per_modelspec": round(total / modelspecs, 2),
            "operator_writes_by_request": dict(sorted(by_request.items())),
            "peak_writes_per_s": peak_per_second([w.at for w in audited]),
            "peak_writes_per_s_sampled": round(max(_rates(samples, "operator")), 1),
            "writes_per_s_series": [series.get(i, 0) for i in range(int(converge_s) + 1)],
            "write_limit_per_s": writes_per_sec, "mean_writes_per_s": round(total / converge_s, 1),
            "operator_peak_rss_mib": used.peak_rss_mib, "operator_cpu_s": used.cpu_s,
            "apiserver_cpu_s": round(server.get("kube-apiserver", 0.0), 1),
            "etcd_cpu_s": round(server.get("etcd", 0.0), 1),
            "cpu_cores": os.cpu_count(), "load_avg_1m": [load_before, load_after],
            "restart_writes": int(restart_writes), "restart_first_pass_s": round(restart_settle_s, 2),
            "restart_operator_cpu_s": restart_used.cpu_s, "restart_operator_peak_rss_mib": restart_used.peak_rss_mib,
            "modelspec_create_s": round(created_s, 2), "placement": placing,
            "converged_after_last_create_s": round(converge_s - created_s, 2),
            "apiserver_writes_per_s": round((total + modelspecs) / converge_s, 1),
            "peak_other_writes_per_s": round(max(_rates(samples, "other")), 1), "kwok_nodes_ready": bool(kwok_ready),
            "samples": len(samples), "kube_apiserver": "v1.34.4 (built from k8s.io/kubernetes)",
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    finally:
        for proc in reversed(procs):
            controlplane.terminate(proc)
        cp.stop()
