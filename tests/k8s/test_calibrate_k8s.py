"""Calibration on request on a real kube-apiserver + etcd: a ModelSpec annotated with volga.dev/calibrate is
measured by exactly one of the two agents (two nodes of one device kind, cpu) that hold an instance of it, the
result lands in status.calibrated with the current version, a token answered is not measured again, a new one
is, the autonomy loop takes its baselines from status.calibrated, and a model that does not start gets a
Calibrated=False answer with the reason while the agent keeps running."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from procs import Daemon, wait_for

from volga_agent.app import defaultmodel
from volga_agent.cluster import calibrations
from volga_bench.controlplane import ControlPlane
from volga_core import api
from volga_core.api import conditions
from volga_core.kube import ratelimit

pytest_plugins = ["k8s_fixtures"]
pytestmark = pytest.mark.slow
NODES = ("cal-node-a", "cal-node-b")
NS = "calibrate"
ANNOTATION = "volga.dev/calibrate"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The agents' logs and settings, and a model folder with a file that is not a model."""
    folder = tmp_path_factory.mktemp("calibrate-k8s")
    (folder / "models").mkdir()
    (folder / "models" / "broken.onnx").write_bytes(b"not an ONNX model")
    return folder


@pytest.fixture(scope="module")
def agents(control_plane: ControlPlane, crds: None, folder: pathlib.Path) -> Iterator[dict[str, Daemon]]:
    models = folder / "models"
    settings = folder / "settings.yaml"
    settings.write_text(yaml.safe_dump({
        "autonomyEnabled": True, "autonomyDebug": True,
        "modelRoots": [str(defaultmodel.default_cache()), str(models)]}))
    client = control_plane.api_client()
    core = k8s.CoreV1Api(client)
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=NS)))
    for node in NODES:
        core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=node)))
    client.close()
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig), "PYTHONUNBUFFERED": "1"}
    daemons = {node: Daemon(node, [
        sys.executable, "-m", "volga_agent.app.daemons", "--kube", "--node", node, "--port", "0", "--metrics-port", "0",
        "--workdir", f"/tmp/vw-{node}", "--snapshot-dir", str(folder / f"snapshots-{node}"),
        "--settings", str(settings), "--calibrate-iterations", "40", "-v"], env, folder, "volga-agent")
        for node in NODES}
    yield daemons
    codes = {node: daemons[node].stop() for node in NODES}
    # Later modules place on the session's nodes: none of this module's nodes or objects may linger.
    for ns in (NS, "calibrate-race", "calibrate-lease"):
        for kind in ("modelspecs", "emis"):
            control_plane.kubectl("delete", kind, "--all", "-n", ns, "--wait=false", check=False)
    client = control_plane.api_client()
    for node in NODES:
        k8s.CoreV1Api(client).delete_node(node)
    client.close()
    assert codes == dict.fromkeys(NODES, 0), {n: daemons[n].log.read_text()[-3000:] for n in NODES}


def kubectl_json(cp: ControlPlane, *args: str) -> dict[str, Any]:
    return dict(json.loads(cp.kubectl(*args, "-o", "json").stdout))


def place(cp: ControlPlane, tmp: pathlib.Path, name: str, source: pathlib.Path | None = None,
          pace_ms: float = 0.0) -> None:
    """A ModelSpec of the default model and one HOT EMI of it on each node (placed by hand: no operator)."""
    doc = defaultmodel.spec_document(source or defaultmodel.ensure().spec.source_path)
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"]["modelId"] = name
    if pace_ms:
        doc["spec"].setdefault("slo", {})["calibrationPaceMs"] = pace_ms
    objects = [doc] + [{
        "apiVersion": api.API_VERSION, "kind": "ExecutableModelInstance",
        "metadata": {"name": f"{name}-{i}", "namespace": NS,
                     "labels": {"volga.dev/modelspec": name, "volga.dev/node": node}},
        "spec": {"modelSpec": name, "modelId": name, "node": node, "targetTier": "HOT"}}
        for i, node in enumerate(NODES)]
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    cp.kubectl("apply", "-f", str(path))


def annotate(cp: ControlPlane, name: str, *pairs: str) -> None:
    cp.kubectl("annotate", "-n", NS, "--overwrite", "modelspec", name, *pairs)


def answer(cp: ControlPlane, name: str, token: str) -> dict[str, Any] | None:
    """The ModelSpec once its cpu answer to `token` is final."""
    ms = kubectl_json(cp, "get", "-n", NS, "modelspec", name)
    for entry in ms.get("status", {}).get("calibratedFor") or ():
        if entry["device"] == "cpu" and entry["token"] == token and entry["condition"]["status"] != "Unknown":
            return ms
    return None


def measurements(agents: dict[str, Daemon], name: str) -> int:
    """How many calibrations of the ModelSpec the agents started, by their logs."""
    return sum(agents[node].log.read_text().count(f"calibrating {NS}/{name} on cpu") for node in NODES)


def loop_baselines(agents: dict[str, Daemon], name: str, node: str) -> list[tuple[int, float]] | None:
    """The baselines the node's autonomy loop last showed for the model (its debug lines)."""
    found = re.findall(rf"'{name}': \((?:True|False), \(((?:\(\d+, [\d.]+\)(?:, )?)+)\)\)",
                       agents[node].log.read_text())
    if not found:
        return None
    return [(int(b), float(ms)) for b, ms in re.findall(r"\((\d+), ([\d.]+)\)", found[-1])]


def test_calibration_on_request(control_plane: ControlPlane, agents: dict[str, Daemon],
                                tmp_path: pathlib.Path) -> None:
    cp = control_plane
    place(cp, tmp_path, "cal", pace_ms=4.0)
    wait_for("both instances HOT", lambda: all(
        e.get("status", {}).get("tier") == "HOT"
        for e in kubectl_json(cp, "get", "-n", NS, "emi", "-l", "volga.dev/modelspec=cal")["items"]), timeout=180)
    assert all(loop_baselines(agents, "cal", node) is None for node in NODES)  # no baselines yet

    annotate(cp, "cal", f"{ANNOTATION}=first")
    ms = wait_for("the cpu answer to 'first'", lambda: answer(cp, "cal", "first"), timeout=180)
    status = api.ModelSpecStatus.model_validate(ms["status"])
    assert status.calibrated_for is not None and status.calibrated is not None
    [given] = status.calibrated_for
    assert (given.device, given.token, given.condition.type, given.condition.status, given.condition.reason) == \
        ("cpu", "first", "Calibrated", "True", "Calibrated"), given
    assert given.node in NODES
    [first] = status.calibrated
    spec = defaultmodel.ensure().spec
    assert (first.device, first.version, first.input_hash, first.node) == ("cpu", "1", spec.input_hash(), given.node)
    assert first.measured_through == "gateway" and first.iterations == 40
    assert first.pace_ms == 4.0  # as the spec's slo.calibrationPaceMs asks
    assert [b.batch_size for b in first.batches] == [1, 8]
    for b in first.batches:
        assert 0 < b.p50_ms <= b.p99_ms and b.worker_p99_ms is not None and b.worker_p99_ms > 0
    assert measurements(agents, "cal") == 1  # one node of the device kind measured, the other left it

    # The autonomy loop of both nodes (cpu, like the entry) takes the baselines from status.calibrated.
    want = [(b.batch_size, b.p99_ms) for b in first.batches]
    for node in NODES:
        wait_for(f"{node}'s loop on the calibrated baselines", lambda node=node: loop_baselines(
            agents, "cal", node) == want)

    # The same token again (and another change of the object): not measured again.
    annotate(cp, "cal", f"{ANNOTATION}=first", "example.com/touched=yes")
    # A new token: measured again, once.
    annotate(cp, "cal", f"{ANNOTATION}=second")
    ms = wait_for("the cpu answer to 'second'", lambda: answer(cp, "cal", "second"), timeout=180)
    status = api.ModelSpecStatus.model_validate(ms["status"])
    assert status.calibrated is not None and status.calibrated_for is not None
    [second] = status.calibrated
    assert status.calibrated_for[0].condition.status == "True"
    assert second != first and second.version == "1" and [b.batch_size for b in second.batches] == [1, 8]
    assert measurements(agents, "cal") == 2, "the token 'first' was measured twice"
    for node in NODES:
        wait_for(f"{node}'s loop on the new baselines", lambda node=node: loop_baselines(
            agents, "cal", node) == [(b.batch_size, b.p99_ms) for b in second.batches])


def test_a_model_that_does_not_start_gets_a_reason(control_plane: ControlPlane, agents: dict[str, Daemon],
                                                   folder: pathlib.Path, tmp_path: pathlib.Path) -> None:
    cp = control_plane
    broken = folder / "models" / "broken.onnx"
    place(cp, tmp_path, "cal-broken", broken)
    annotate(cp, "cal-broken", f"{ANNOTATION}=try")
    ms = wait_for("the cpu answer to 'try'", lambda: answer(cp, "cal-broken", "try"), timeout=180)
    [given] = api.ModelSpecStatus.model_validate(ms["status"]).calibrated_for or []
    assert (given.condition.status, given.condition.reason) == ("False", "StartFailed"), given
    assert "did not start" in (given.condition.message or "")
    assert not ms["status"].get("calibrated")
    assert measurements(agents, "cal-broken") == 1
    for node in NODES:
        assert agents[node].proc.poll() is None, f"{node}'s agent exited"


# -- the lease, on the API server, with two nodes in this process --------------------------------------------------


class FirstReadTogether:
    """The API as one node sees it, but its first read of a ModelSpec waits for the other node's: both claim
    from the same resourceVersion."""

    def __init__(self, custom: k8s.CustomObjectsApi, barrier: threading.Barrier) -> None:
        self.custom = custom
        self.barrier = barrier
        self.reads = 0

    def get_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> Any:
        obj = self.custom.get_namespaced_custom_object(*args, **kwargs)
        self.reads += 1
        if self.reads == 1:
            self.barrier.wait(timeout=60)
        return obj

    def __getattr__(self, name: str) -> Any:
        return getattr(self.custom, name)


def recorded(calls: list[str], node: str) -> calibrations.Calibrator:
    """Stands in for the measurement (the test above runs the real one): records who measured."""

    def measure(spec: api.ModelSpecSpec, device: str, /) -> api.Calibration:
        calls.append(node)
        return api.Calibration(device=device, version=spec.version, input_hash=spec.input_hash(), batches=[
            api.BatchProfile(batch_size=1, p50_ms=1.0, p99_ms=2.0, memory_bytes=1, throughput_per_sec=1.0)])

    return measure


def spec_and_emis(cp: ControlPlane, tmp: pathlib.Path, ns: str, name: str, nodes: tuple[str, ...],
                  token: str) -> tuple[dict[tuple[str, str], Any], dict[tuple[str, str], Any]]:
    cp.kubectl("create", "namespace", ns, check=False)
    doc = defaultmodel.spec_document(defaultmodel.ensure().spec.source_path)
    doc["metadata"] = {"name": name, "namespace": ns, "annotations": {ANNOTATION: token}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cp.kubectl("apply", "-f", str(path))
    obj = kubectl_json(cp, "get", "-n", ns, "modelspec", name)
    emis = {(ns, f"{name}-{node}"): {"metadata": {"name": f"{name}-{node}"},
                                     "spec": {"modelSpec": name, "node": node}} for node in nodes}
    return {(ns, name): obj}, emis


def final_answer(cp: ControlPlane, ns: str, name: str) -> api.CalibrationAnswer | None:
    status = kubectl_json(cp, "get", "-n", ns, "modelspec", name).get("status") or {}
    for entry in status.get("calibratedFor") or ():
        if entry["condition"]["status"] != "Unknown":
            return api.CalibrationAnswer.model_validate(entry)
    return None


def test_two_nodes_claiming_at_once_measure_once(control_plane: ControlPlane, crds: None,
                                                 kube_client: k8s.ApiClient, tmp_path: pathlib.Path) -> None:
    cp, ns, nodes = control_plane, "calibrate-race", ("race-x", "race-y")
    objects, emis = spec_and_emis(cp, tmp_path, ns, "race", nodes, "t1")
    spec = defaultmodel.ensure().spec
    barrier = threading.Barrier(2)
    calls: list[str] = []
    sides = [calibrations.Calibrations(FirstReadTogether(k8s.CustomObjectsApi(kube_client), barrier), node,
                                       recorded(calls, node), ratelimit.TokenBucket.within(100),
                                       lambda: {f"{ns}/race": spec}) for node in nodes]
    try:
        for side in sides:
            assert side.consider(objects, emis, []) == [
                calibrations.CalibrationRequest(ns, "race", "t1", "cpu", "cpu")]
            side.start()
        answer = wait_for("an answer", lambda: final_answer(cp, ns, "race"))
    finally:
        for side in sides:
            side.stop()
    assert len(calls) == 1 and answer.node == calls[0] and answer.condition.status == "True"
    [loser] = [side.custom for side in sides if side.node != calls[0]]
    assert isinstance(loser, FirstReadTogether) and loser.reads == 2  # its claim met a conflict: it read again
    [calibrated] = kubectl_json(cp, "get", "-n", ns, "modelspec", "race")["status"]["calibrated"]
    assert calibrated["node"] == calls[0] and calibrated["batches"][0]["p99Ms"] == 2.0


def test_a_lapsed_claim_is_taken_over_and_a_held_one_is_not(control_plane: ControlPlane, crds: None,
                                                            kube_client: k8s.ApiClient,
                                                            tmp_path: pathlib.Path) -> None:
    cp, ns = control_plane, "calibrate-lease"
    custom = k8s.CustomObjectsApi(kube_client)
    spec = defaultmodel.ensure().spec
    for name, renewed in (("lapsed", conditions.timestamp(time.time() - 600)), ("held", conditions.timestamp())):
        objects, emis = spec_and_emis(cp, tmp_path, ns, name, ("lease-z",), "t2")
        claim = {"device": "cpu", "token": "t2", "node": "lease-gone", "renewedAt": renewed, "leaseSec": 60,
                 "condition": {"type": "Calibrated", "status": "Unknown", "reason": "Measuring", "message": "",
                               "lastTransitionTime": renewed}}
        custom.patch_namespaced_custom_object_status(api.GROUP, api.VERSION, ns, "modelspecs", name,
                                                     {"status": {"calibratedFor": [claim]}})
        objects = {(ns, name): kubectl_json(cp, "get", "-n", ns, "modelspec", name)}
        calls: list[str] = []
        side = calibrations.Calibrations(custom, "lease-z", recorded(calls, "lease-z"),
                                         ratelimit.TokenBucket.within(100),
                                         lambda name=name: {f"{ns}/{name}": spec})  # type: ignore[misc]
        queued = side.consider(objects, emis, [])
        if name == "held":
            assert queued == []  # another node renewed its claim in time: left to it
            continue
        assert queued == [calibrations.CalibrationRequest(ns, name, "t2", "cpu", "cpu")]
        side.start()
        try:
            answer = wait_for("the lapsed claim taken over", lambda name=name: final_answer(cp, ns, name))
        finally:
            side.stop()
        assert (answer.node, answer.token, answer.condition.status, calls) == ("lease-z", "t2", "True", ["lease-z"])
