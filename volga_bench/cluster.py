"""Volga as users install it: `helm install` onto a real node (volga_bench.realnode), a ModelSpec applied with
kubectl, requests through the gateway's Service.

The tests in tests/node use these steps one by one; `volga bench cluster` times them:
  - `install_to_first_answer_s`: from `helm install` (images already on the node, as after a pull) to the first
    answer through the gateway Service of a ModelSpec applied right after the install (pods started, the model
    cold-started, frozen, woken by that request);
  - `service_frozen_wake_ms`: a FROZEN instance's first answer through the Service (kube-proxy, the gateway pod,
    CRIU inside the agent's container), the instance demoted to FROZEN by its own idle timer between requests;
  - `up_frozen_wake_ms`: the same model woken the same way under `volga up` (its own process, its images on the same
    filesystem as the node's snapshot hostPath) on the same machine, in the same run: its wakes alternate with the
    Service's, each sent while both instances are FROZEN, so both sides meet the machine's load as it varies.

    python3 -m volga_agent.cli bench cluster [-n 10] [--json] [--out FILE]
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import yaml

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.worker import contract
from volga_bench import harness, realnode, reporting

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "volga"
NODE_VALUES = CHART / "ci" / "node-values.yaml"
IMAGES = ("localhost/volga-operator:dev", "localhost/volga-agent:dev-cpu")
RELEASE = "volga"
NAMESPACE = "volga-system"
# Seconds a woken instance idles before it is frozen again: on a CPU node HOT goes to FROZEN directly, after the
# idle time of the tier entered (settings suspended_idle_sec, the chart's default 900), so all three are set.
IDLE_SEC = 2
IDLE_SETTINGS = {"hot_idle_sec": IDLE_SEC, "warm_idle_sec": IDLE_SEC, "suspended_idle_sec": IDLE_SEC}


@dataclasses.dataclass
class Installed:
    """A release of the chart on the node, and the host folders it uses."""

    node: realnode.RealNode
    folder: pathlib.Path
    release: str = RELEASE
    namespace: str = NAMESPACE

    @property
    def models(self) -> pathlib.Path:
        return self.folder / "models"

    @property
    def snapshots(self) -> pathlib.Path:
        return self.folder / "snapshots"

    def pods(self, component: str) -> list[dict[str, Any]]:
        out = self.node.kubectl("get", "pods", "-n", self.namespace, "-l",
                                f"app.kubernetes.io/component={component}", "-o", "json")
        return list(json.loads(out.stdout)["items"])

    def service_ip(self, name: str = "") -> str:
        """The ClusterIP of the gateway Service (kube-proxy's rules route it to the agent pod's gateway)."""
        out = self.node.kubectl("get", "service", "-n", self.namespace, name or f"{self.release}-gateway", "-o",
                                "jsonpath={.spec.clusterIP}")
        return out.stdout.strip()

    def grpc_target(self, port: int = 8001) -> str:
        return f"{self.service_ip()}:{port}"


def values_args(folder: pathlib.Path, **settings: Any) -> list[str]:
    """helm arguments: the node values file, the host folders of this run (snapshots, models, the model cache), and
    agent settings."""
    args = ["-f", str(NODE_VALUES), "--set", f"agent.snapshots.hostPath={folder / 'snapshots'}",
            "--set", f"agent.models.hostPath={folder / 'models'}",
            "--set", f"agent.modelCache.hostPath={folder / 'model-cache'}"]
    for name, value in settings.items():
        args += ["--set", f"agent.settings.{name}={value}"]
    return args


def install(node: realnode.RealNode, folder: pathlib.Path, *extra: str, wait: bool = True) -> Installed:
    """`helm install` the chart with the node values; the default model's file placed in the models folder."""
    installed = Installed(node, folder)
    place_default_model(installed.models)
    node.helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
              *values_args(folder, **IDLE_SETTINGS), *extra)
    if wait:
        wait_ready(installed)
    return installed


def wait_ready(installed: Installed, timeout: float = 300.0) -> None:
    """Until the operator's and the agent's pods are Ready (every container)."""
    def ready() -> bool:
        pods = installed.pods("operator") + installed.pods("agent")
        return len(pods) >= 2 and all(pod_ready(p) for p in pods)

    installed.node.wait("the operator and agent pods Ready", ready, timeout=timeout)


def pod_ready(pod: dict[str, Any]) -> bool:
    """Ready (every container), and not being deleted."""
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def place_default_model(models: pathlib.Path) -> pathlib.Path:
    """The embedded default model's file in the node's models folder (what a user copies onto a node)."""
    models.mkdir(parents=True, exist_ok=True)
    source = defaultmodel.ensure().spec.source_path
    target = models / source.name
    if not target.exists() or target.stat().st_size != source.stat().st_size:
        shutil.copyfile(source, target)
    target.chmod(0o644)
    models.chmod(0o755)
    return target


def modelspec(installed: Installed, name: str, frozen: int = 1, namespace: str = "default") -> dict[str, Any]:
    """The default model as a ModelSpec whose pool floor is FROZEN, its source on the node's models folder."""
    doc: dict[str, Any] = defaultmodel.spec_document(installed.models / defaultmodel.ensure().spec.source_path.name)
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"]["modelId"] = name
    doc["spec"]["pool"] = {"hot": 0, "frozen": frozen}
    return doc


def apply(node: realnode.RealNode, doc: dict[str, Any]) -> None:
    node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))


def emis(node: realnode.RealNode, model: str, namespace: str = "default") -> list[dict[str, Any]]:
    out = node.kubectl("get", "emi", "-n", namespace, "-l", f"volga.dev/modelspec={model}", "-o", "json")
    return list(json.loads(out.stdout)["items"])


def tiers(node: realnode.RealNode, model: str) -> list[str]:
    return [e.get("status", {}).get("tier", "") for e in emis(node, model)]


def sample(seed: int = 5) -> dict[str, np.ndarray]:
    decls = instance.decls(defaultmodel.ensure().spec.inputs)
    return contract.sample_inputs(decls, batch=4, seed=seed)


def reference(seed: int = 5) -> np.ndarray:
    """The default model's answer run directly with onnxruntime, no Volga in between."""
    import onnxruntime

    spec = defaultmodel.ensure().spec
    session = onnxruntime.InferenceSession(str(spec.source_path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["probability"], sample(seed))[0])


def ask(target: str, model: str, seed: int = 5, timeout: float = 120.0) -> np.ndarray:
    """One request with an unmodified tritonclient over gRPC, the model named in `x-model-id`."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in sample(seed).items():
        tensor = grpcclient.InferInput(name, list(value.shape), "INT64" if value.dtype == np.int64 else "FP32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client = grpcclient.InferenceServerClient(target)
    try:
        result = client.infer(model, inputs, headers={"x-model-id": model}, client_timeout=timeout)
        return np.asarray(result.as_numpy("probability"))
    finally:
        client.close()


def first_answer(target: str, model: str, timeout: float, seed: int = 5) -> np.ndarray:
    """Retry until the gateway answers: right after an install, the route or the instance may not exist yet."""
    from tritonclient.utils import InferenceServerException

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ask(target, model, seed, timeout=max(1.0, deadline - time.monotonic()))
        except InferenceServerException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def histogram_total(url: str, family: str, suffix: str, **labels: str) -> float:
    """The sum of one histogram's `_count` or `_sum` samples in an agent's /metrics, over the samples that carry
    `labels`."""
    import urllib.request

    from prometheus_client import parser

    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(sample.value for found in parser.text_string_to_metric_families(text) if found.name == family
               for sample in found.samples if sample.name == family + suffix
               and all(sample.labels.get(k) == v for k, v in labels.items()))


def freezes(url: str, model: str) -> float:
    """How many times an agent froze `model` from HOT (volga_tier_transition_latency_ms): the agent's own count,
    where an EMI's status says the tier a moment later."""
    return histogram_total(url, "volga_tier_transition_latency_ms", "_count", model=model, source="HOT",
                           target="FROZEN")


class Wakes:
    """One side of the comparison: requests that each wake a FROZEN instance. The instance counts as FROZEN again once
    its agent has frozen the model more times than when the last request was sent (`frozen_before`: the count the
    first wait starts from). Nothing but the request itself runs between the start and the end of its timing: the
    count is read before, the target is fixed."""

    def __init__(self, metrics_url: str, model: str, target: str, frozen_before: float = 0.0) -> None:
        self.metrics_url, self.model, self.target = metrics_url, model, target
        self.last = self.seen = frozen_before

    def is_frozen(self) -> bool:
        self.seen = freezes(self.metrics_url, self.model)
        return self.seen > self.last

    def request(self) -> np.ndarray:
        self.last = self.seen
        return ask(self.target, self.model)

    def totals(self) -> dict[str, tuple[float, float]]:
        """(sum of ms, count) of the agent's FROZEN wakes so far: the whole restore (volga_snapshot_restore_latency_ms)
        and its phases (volga_wake_phase_latency_ms: `restore` is the criu call, `wake` the worker's own)."""
        found = {}
        for key, family, labels in (("restore", "volga_snapshot_restore_latency_ms", {}),
                                    ("criu", "volga_wake_phase_latency_ms", {"phase": "restore"}),
                                    ("worker", "volga_wake_phase_latency_ms", {"phase": "wake"})):
            found[key] = (histogram_total(self.metrics_url, family, "_sum", tier="FROZEN", model=self.model, **labels),
                          histogram_total(self.metrics_url, family, "_count", tier="FROZEN", model=self.model,
                                          **labels))
        return found


def alternate_wakes(n: int, sides: dict[str, Wakes], expected: np.ndarray,
                    wait: Callable[[str, Callable[[], Any], float], Any]) -> dict[str, dict[str, Any]]:
    """n rounds; in each, every side in turn: wait until every side's instance is FROZEN (so no freeze of one runs
    during the other's wake), then time one request (send to answer). The sides thus share the machine's load as it
    varies. Beside each side's first answers, its agent's own means over those wakes: the whole restore, the criu
    call, the worker's part."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    mismatches = dict.fromkeys(sides, 0)
    before = {name: side.totals() for name, side in sides.items()}
    for _ in range(n):
        for name, side in sides.items():
            for other in sides.values():
                wait("every instance FROZEN after idling", other.is_frozen, 120.0)
            start = time.perf_counter()
            answer = side.request()
            seconds[name].append(time.perf_counter() - start)
            mismatches[name] += int(not np.array_equal(answer, expected))
    report = {}
    for name, side in sides.items():
        after = side.totals()
        means = {}
        for key, (total, count) in after.items():
            done = count - before[name][key][1]
            means[key] = round((total - before[name][key][0]) / done, 1) if done else None
        report[name] = {"first_answer": reporting.summarize(seconds[name]), "mismatches": mismatches[name],
                        "restores": after["restore"][1] - before[name]["restore"][1],
                        "agent_restore_mean_ms": means["restore"], "agent_criu_restore_mean_ms": means["criu"],
                        "agent_worker_wake_mean_ms": means["worker"]}
    return report


def agent_metrics_url(installed: Installed, port: int = 8012) -> str:
    [pod] = [p for p in installed.pods("agent") if not p["metadata"].get("deletionTimestamp")]
    return f"http://{pod['status']['podIP']}:{port}/metrics"


def bench(n: int = 10, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The whole comparison in one run: a real node, the chart installed, then `volga up` on the same machine."""
    expected = reference()
    report: dict[str, Any] = {"n": n, "model": defaultmodel.MODEL_ID, "device": reporting.device_description("cpu"),
                              "kernel": os.uname().release,
                              "load_average": [round(x, 2) for x in os.getloadavg()],
                              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with realnode.RealNode() as node:
        report["node_start_s"] = round(node.last_start_s or 0.0, 2)
        progress("importing the images")
        report["image_import_s"] = {k: round(v, 1) for k, v in node.import_images(
            (*IMAGES, realnode.PAUSE_IMAGE)).items()}
        folder = node.root / "volga"
        progress("helm install")
        start = time.monotonic()
        installed = install(node, folder, wait=False)
        apply(node, modelspec(installed, "bench"))
        node.wait("the gateway Service", lambda: installed.service_ip(), timeout=60)
        answer = first_answer(installed.grpc_target(), "bench", timeout=600)
        report["install_to_first_answer_s"] = round(time.monotonic() - start, 2)
        report["install_first_answer_identical"] = bool(np.array_equal(answer, expected))
        progress("FROZEN wakes through the Service and under volga up, alternating")
        metrics = agent_metrics_url(installed)
        pod = Wakes(metrics, "bench", installed.grpc_target(), frozen_before=freezes(metrics, "bench"))
        with tempfile.TemporaryDirectory(dir="/tmp", prefix="volga-up-") as snapshots, \
                harness.volga_up(["--idle-sec", str(IDLE_SEC), "--snapshot-dir", snapshots]) as up:
            # The same model under `volga up` (its own process, as users run it), its images on the same filesystem
            # as the node's hostPath, frozen by the same idle timer, woken by the same client; its first freeze
            # follows its cold start.
            local = Wakes(up.endpoints["metrics"], defaultmodel.MODEL_ID, up.endpoints["grpc"])
            report.update(alternate_wakes(n, {"service": pod, "up": local}, expected,
                                          lambda what, check, timeout: node.wait(what, check, timeout=timeout)))
        node.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "120s", check=False)
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    report["service_frozen_wake_ms"] = report["service"]["first_answer"]["p50_ms"]
    report["up_frozen_wake_ms"] = report["up"]["first_answer"]["p50_ms"]
    report["service_over_up"] = round(report["service_frozen_wake_ms"] / report["up_frozen_wake_ms"], 2)
    report["identical"] = report["install_first_answer_identical"] and not (
        report["service"]["mismatches"] or report["up"]["mismatches"])
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"real node: started in {report['node_start_s']} s; images imported {report['image_import_s'] or '(cached)'}",
        f"helm install -> first answer through the Service: {report['install_to_first_answer_s']} s",
        f"FROZEN wake, first answer p50 / p99 over {report['n']}:",
        f"  through the gateway Service  {report['service']['first_answer']['p50_ms']:8.1f} / "
        f"{report['service']['first_answer']['p99_ms']:.1f} ms",
        f"  under volga up               {report['up']['first_answer']['p50_ms']:8.1f} / "
        f"{report['up']['first_answer']['p99_ms']:.1f} ms",
        f"  the agent's own restore, mean: {report['service']['agent_restore_mean_ms']} ms in the pod, "
        f"{report['up']['agent_restore_mean_ms']} ms under volga up (the criu call "
        f"{report['service'].get('agent_criu_restore_mean_ms')} / {report['up'].get('agent_criu_restore_mean_ms')} ms)",
        f"  load average {report['load_average']} at the start, {report.get('load_average_end')} at the end",
        f"  Service / volga up: {report['service_over_up']}x (target <= 1.2x); every answer identical: "
        f"{report['identical']}",
    ]
    return "\n".join(lines)


def main() -> int:
    """`make node`: a real node with Volga installed and the default model applied, until Ctrl-C; then everything
    is removed and the host put back."""
    import signal
    import threading

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with realnode.RealNode() as node:
        node.import_images((*IMAGES, realnode.PAUSE_IMAGE))
        installed = install(node, node.root / "volga")
        apply(node, modelspec(installed, defaultmodel.MODEL_ID))
        node.wait("the default model FROZEN", lambda: tiers(node, defaultmodel.MODEL_ID) == ["FROZEN"], timeout=300)
        print(f"""Volga runs on a real node (helm release {RELEASE!r} in {NAMESPACE!r}); the default model is FROZEN.
  export KUBECONFIG={node.kubeconfig}
  kubectl get pods -n {NAMESPACE}; kubectl get ms,emi
  curl -s http://{installed.service_ip()}:8000/v2/models/{defaultmodel.MODEL_ID}
  (tritonclient: grpc target {installed.grpc_target()})
Ctrl-C stops the node and removes it.""", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
