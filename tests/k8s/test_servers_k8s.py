"""A model server (`framework: server`) in a cluster, on a real kube-apiserver + etcd with the real operator, a
real agent in cluster mode and the real gateway: kubectl apply a ModelSpec naming KServe's `ModelServer` (custom
pre/post-processing, knowing nothing of Volga; its files from the node's model root, this checkout); the operator
places it, the agent starts it and CRIU freezes it (its EMI FROZEN and Ready, the image on disk); a request through
the gateway by x-model-id wakes it from that image and answers as the HOT server does; the EMI says HOT, then FROZEN
again once it has been idle, and a request through another node's gateway (whose own agent knows nothing of it) is
passed on to this node's gateway and wakes it there; `volga status` lists it; kubectl delete stops the server and
removes its image.
The same server speaking the Open Inference Protocol over gRPC (`protocol: oip-grpc`) answers an unmodified
tritonclient.grpc through the gateway's gRPC port, frozen and woken by the call, by the model name in the message."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import k8s_fixtures
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from kubernetes import client as k8s
from procs import Daemon, series, wait_for
from tritonclient.utils import InferenceServerException

from volga_bench.controlplane import ControlPlane, free_ports
from volga_core import api

if not importlib.util.find_spec("kserve"):
    pytest.skip("KServe comes with the peers extra (make setup)", allow_module_level=True)

pytest_plugins = ["k8s_fixtures"]
pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[2]
NODE = "srv-a"
MODEL = "k8s-scorer"  # also the KServe model's name: its processes are found by it
GRPC_MODEL = "k8s-grpc-scorer"
IDLE_SEC = 6.0
ROWS = {"instances": [[float(i * j % 7) for i in range(16)] for j in range(1, 4)]}


def _scorers(model: str = MODEL) -> list[int]:
    """The pids of the KServe server processes of `model`."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                args = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"volga_bench.servers.kserve_scorer" in args and model.encode() in args:
                pids.append(int(proc.name))
    return pids


control_plane = k8s_fixtures.control_plane_of_its_own()  # the server's EMI must land on this module's Nodes


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("servers")
    api = control_plane.api_client()
    k8s.CoreV1Api(api).create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=NODE)))
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig), "PYTHONUNBUFFERED": "1",
           "VOLGA_RESYNC_SEC": "5"}
    settings = folder / "settings.yaml"
    # Servers run code: the node allows it, and their files come from its model root (this checkout).
    settings.write_text(yaml.safe_dump({"allowModelCode": True, "modelRoots": [str(ROOT)],
                                        "idle": {"hotSec": 1.0, "warmSec": 2.0, "suspendedSec": IDLE_SEC}}))
    py = sys.executable
    snapshots = folder / "snapshots"
    metrics_port, http_port, grpc_port, gateway_metrics_port, http_b, grpc_b = free_ports(6)
    daemons = {"operator": Daemon("operator", [py, "-m", "volga_operator", "--liveness", "", "-v"], env, folder)}
    daemons["agent"] = Daemon("agent", [
        py, "-m", "volga_agent.app.daemons", "--kube", "--node", NODE, "--port", "0", "--metrics-port",
        str(metrics_port), "--workdir", f"/tmp/vw-{NODE}", "--snapshot-dir", str(snapshots), "--settings",
        str(settings), "--gateway-address", f"127.0.0.1:{grpc_port}", "--gateway-http-address",
        f"127.0.0.1:{http_port}", "-v"], env, folder, "volga-agent")
    gateway = str(pathlib.Path(py).with_name("volga-gateway"))  # the console script, as the image runs it
    daemons["gateway"] = Daemon("gateway", [
        gateway, "--kube", "--agent", f"127.0.0.1:{daemons['agent'].port('Agent API')}", "--node", NODE,
        "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port",
        str(gateway_metrics_port)], env, folder, "volga-gateway")
    # Another node's gateway, its agent gone: what it serves of the servers it can only have passed on, to the
    # addresses this node's agent reports (ports of its own: it cannot take its own for this node's).
    daemons["gateway-b"] = Daemon("gateway-b", [
        gateway, "--kube", "--agent", "127.0.0.1:1", "--node", "srv-b", "--host", "127.0.0.2", "--http-port",
        str(http_b), "--grpc-port", str(grpc_b), "--metrics-port", "0"], env, folder, "volga-gateway")
    yield {"http": f"http://127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}",
           "http_b": f"http://127.0.0.2:{http_b}", "grpc_b": f"127.0.0.2:{grpc_b}",
           "snapshots": snapshots, "folder": folder,
           "agent_metrics": f"http://127.0.0.1:{metrics_port}/metrics",
           "gateway_metrics": f"http://127.0.0.1:{gateway_metrics_port}/metrics",
           "kubeconfig": str(control_plane.kubeconfig), "env": env,
           "agent": f"127.0.0.1:{daemons['agent'].port('Agent API')}"}
    codes = {name: d.stop() for name, d in daemons.items()}
    api.close()
    assert all(code == 0 for code in codes.values()), {n: (c, daemons[n].log.read_text()[-3000:])
                                                       for n, c in codes.items() if c}
    assert not _scorers() and not _scorers(GRPC_MODEL), "the agent left its server running"


def modelspec() -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": "ModelSpec",
            "metadata": {"name": MODEL, "namespace": "default"},
            "spec": {"modelId": MODEL, "framework": "server", "source": str(ROOT), "pool": {"hot": 0, "frozen": 1},
                     "server": {"command": [sys.executable, "-m", "volga_bench.servers.kserve_scorer",
                                            "--http_port", "{port}", "--enable_grpc", "false",
                                            "--model_name", MODEL, "--configure_logging", "false"],
                                "protocol": "oip-http", "env": {"UV_USE_IO_URING": "0"},
                                "readiness": {"path": "/v2/health/ready"},
                                "canary": {"path": f"/v1/models/{MODEL}:predict", "body": json.dumps(ROWS)}}}}


def stream_modelspec(name: str) -> dict[str, Any]:
    """The FastAPI app that streams its answer (server-sent events), on a Unix socket in its instance's folder."""
    doc = modelspec()
    doc["metadata"]["name"] = doc["spec"]["modelId"] = name
    doc["spec"]["server"] = {"command": [sys.executable, "-m", "uvicorn", "volga_bench.servers.stream_app:app",
                                         "--no-access-log", "--loop", "asyncio", "--uds", "{socket}"],
                             "listen": "unix", "readiness": {"path": "/health"}}
    return doc


def applied_frozen(cp: ControlPlane, doc: dict[str, Any], folder: pathlib.Path) -> None:
    """`kubectl apply` the ModelSpec, and wait for its EMI FROZEN and Ready (the server started and frozen)."""
    path = folder / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cp.kubectl("apply", "-f", str(path))
    wait_for("the EMI FROZEN and Ready", lambda: tier(cp, "FROZEN", model=doc["spec"]["modelId"]), timeout=240)


def grpc_modelspec() -> dict[str, Any]:
    doc = modelspec()
    doc["metadata"]["name"] = doc["spec"]["modelId"] = GRPC_MODEL
    server = doc["spec"]["server"]
    server["command"] = [*server["command"][:3], "--http_port", "{port}", "--grpc_port", "{grpc_port}",
                         "--model_name", GRPC_MODEL, "--configure_logging", "false"]
    server["protocol"] = "oip-grpc"
    server["canary"]["path"] = f"/v1/models/{GRPC_MODEL}:predict"
    return dict(doc)


def emi(cp: ControlPlane, model: str = MODEL) -> dict[str, Any] | None:
    items = json.loads(cp.kubectl("get", "emi", "-l", f"volga.dev/modelspec={model}", "-o", "json").stdout)["items"]
    return items[0] if len(items) == 1 else None


def tier(cp: ControlPlane, want: str, ready: bool = True, model: str = MODEL) -> dict[str, Any] | None:
    found = emi(cp, model)
    status = (found or {}).get("status") or {}
    is_ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", ()))
    return found if status.get("tier") == want and is_ready == ready else None


def predict(url: str) -> tuple[int, Any]:
    request = urllib.request.Request(f"{url}/v1/models/{MODEL}:predict", data=json.dumps(ROWS).encode(),
                                     headers={"x-model-id": MODEL, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return reply.status, json.loads(reply.read())


def test_server_modelspec_frozen_woken_through_the_gateway_and_deleted(
        control_plane: ControlPlane, cluster: dict[str, Any], tmp_path: pathlib.Path) -> None:
    cp = control_plane
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(modelspec()))
    cp.kubectl("apply", "-f", str(path))
    # Placed, started, frozen by CRIU: its floor.
    frozen = wait_for("the server's EMI FROZEN and Ready", lambda: tier(cp, "FROZEN"), timeout=240)
    assert frozen["spec"]["node"] == NODE and frozen["status"]["snapshotBytes"] > 0
    assert any(cluster["snapshots"].rglob("pstree.img")), "no CRIU image of the server"
    assert not _scorers(), "FROZEN, yet its processes run"

    def modelspec_ready() -> dict[str, Any] | None:  # the operator counts it as any model's
        ms = json.loads(cp.kubectl("get", "ms", MODEL, "-o", "json").stdout)
        status = ms.get("status") or {}
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", ()))
        return ms if ready and (status.get("tiers") or {}).get("FROZEN") == 1 else None

    wait_for("the ModelSpec Ready, one instance FROZEN", modelspec_ready)
    # `volga status` (cluster) lists it.
    out = subprocess.run([sys.executable, "-m", "volga_agent.cli", "status", "--kubeconfig", cluster["kubeconfig"],
                          "--json"], capture_output=True, text=True, check=True, cwd=ROOT)
    [listed] = [m for m in json.loads(out.stdout)["models"] if m["modelId"] == MODEL]
    assert [(i["node"], i["tier"]) for i in listed["instanceList"]] == [(NODE, "FROZEN")], listed
    # It speaks HTTP only: a gRPC call for it is refused by name, without waking it (the wakes are counted below).
    client = grpcclient.InferenceServerClient(cluster["grpc"])
    try:
        with pytest.raises(InferenceServerException, match="without gRPC"):
            client.infer(MODEL, [grpcclient.InferInput("rows", [3, 16], "FP32")], client_timeout=30)
    finally:
        client.close()

    # A request through the gateway by x-model-id wakes it from that image; the HOT server answers the same.
    status, woken = predict(cluster["http"])
    assert status == 200 and len(woken["predictions"]) == 3
    status, hot = predict(cluster["http"])
    assert status == 200 and hot == woken
    wakes = series(cluster["agent_metrics"], "volga_activations_total")
    assert wakes.get(f'{{model="{MODEL}",tier="FROZEN"}}') == 1.0, wakes
    assert not series(cluster["agent_metrics"], "volga_snapshot_restore_failures_total"), "the wake fell back"
    wait_for("the EMI reported HOT", lambda: tier(cp, "HOT"))

    # Idle for IDLE_SEC: frozen again, and a second wake answers the same.
    wait_for("the EMI FROZEN again after idle", lambda: tier(cp, "FROZEN"), timeout=60)
    wait_for("its processes gone", lambda: not _scorers())
    # Through the other node's gateway: passed on to this node's, which wakes it.
    assert predict(cluster["http_b"]) == (200, hot)
    wakes = series(cluster["agent_metrics"], "volga_activations_total")
    assert wakes.get(f'{{model="{MODEL}",tier="FROZEN"}}') == 2.0, wakes

    # Deleted: the server stops and its image goes.
    cp.kubectl("delete", "ms", MODEL, "--timeout=120s")
    wait_for("EMI gone", lambda: json.loads(cp.kubectl("get", "emi", "-o", "json").stdout)["items"] == [])
    wait_for("server processes gone", lambda: not _scorers())
    wait_for("image removed", lambda: not any(cluster["snapshots"].rglob("pstree.img")))


def infer_grpc(address: str) -> tuple[np.ndarray, np.ndarray]:
    """An unmodified tritonclient.grpc call through the gateway, the model named in the message."""
    rows = grpcclient.InferInput("rows", [3, 16], "FP32")
    rows.set_data_from_numpy(np.asarray(ROWS["instances"], dtype=np.float32))
    client = grpcclient.InferenceServerClient(address)
    try:
        answer = client.infer(GRPC_MODEL, [rows], client_timeout=120)
        return answer.as_numpy("probabilities"), answer.as_numpy("label")
    finally:
        client.close()


def test_oip_grpc_server_frozen_and_woken_by_tritonclient(control_plane: ControlPlane, cluster: dict[str, Any],
                                                         tmp_path: pathlib.Path) -> None:
    cp = control_plane
    path = tmp_path / "grpc-server.yaml"
    path.write_text(yaml.safe_dump(grpc_modelspec()))
    cp.kubectl("apply", "-f", str(path))
    wait_for("the gRPC server's EMI FROZEN and Ready", lambda: tier(cp, "FROZEN", model=GRPC_MODEL), timeout=240)
    assert not _scorers(GRPC_MODEL), "FROZEN, yet its processes run"

    woken = infer_grpc(cluster["grpc"])  # wakes it from its image
    assert woken[0].shape == (3, 4) and woken[0].dtype == np.float64 and woken[1].shape == (3,)
    hot = infer_grpc(cluster["grpc"])
    assert all(np.array_equal(a, b) for a, b in zip(woken, hot, strict=True))
    wakes = series(cluster["agent_metrics"], "volga_activations_total")
    assert wakes.get(f'{{model="{GRPC_MODEL}",tier="FROZEN"}}') == 1.0, wakes
    counted = {labels: value for labels, value in series(cluster["gateway_metrics"], "volga_gateway_requests_total")
               .items() if f'model="{GRPC_MODEL}"' in labels and 'protocol="grpc"' in labels}
    assert counted == {f'{{code="OK",model="{GRPC_MODEL}",protocol="grpc"}}': 2.0}, counted
    # The model's readiness and metadata pass through too (KServe's own answer, not the gateway's).
    client = grpcclient.InferenceServerClient(cluster["grpc"])
    try:
        assert client.is_model_ready(GRPC_MODEL)
        assert client.get_model_metadata(GRPC_MODEL).name == GRPC_MODEL
    finally:
        client.close()

    # Its process killed while HOT: the agent notices, starts it again and brings it back to its floor.
    for pid in _scorers(GRPC_MODEL):
        os.kill(pid, signal.SIGKILL)
    assert wait_for("the death counted", lambda: series(cluster["agent_metrics"], "volga_worker_deaths_total").get(
        f'{{model="{GRPC_MODEL}"}}') == 1.0)
    wait_for("FROZEN again", lambda: tier(cp, "FROZEN", model=GRPC_MODEL), timeout=60)
    wait_for("its processes gone", lambda: not _scorers(GRPC_MODEL))
    again = infer_grpc(cluster["grpc_b"])  # through the other node's gateway, passed on
    assert all(np.array_equal(a, b) for a, b in zip(again, hot, strict=True))
    assert not series(cluster["agent_metrics"], "volga_snapshot_restore_failures_total"), "a wake fell back"
    cp.kubectl("delete", "ms", GRPC_MODEL, "--timeout=120s")
    wait_for("server processes gone", lambda: not _scorers(GRPC_MODEL))


def _holding(marker: str) -> list[int]:
    """The pids whose environment names `marker` (a server's instance folder carries its EMI's name)."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "environ").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def test_a_server_criu_cannot_freeze_stays_hot_and_says_why(control_plane: ControlPlane, cluster: dict[str, Any],
                                                            tmp_path: pathlib.Path) -> None:
    """uvicorn's default loop (uvloop) holds an io_uring instance: the EMI stays HOT, not Ready, naming it."""
    if not importlib.util.find_spec("uvloop"):
        pytest.skip("uvloop is what holds the io_uring instance here")
    cp = control_plane
    name = "k8s-uring"
    doc = modelspec()
    doc["metadata"]["name"] = doc["spec"]["modelId"] = name
    doc["spec"]["server"] = {"command": [sys.executable, "-m", "uvicorn", "volga_bench.servers.stream_app:app",
                                         "--no-access-log", "--port", "{port}"], "readiness": {"path": "/health"}}
    path = tmp_path / "uring.yaml"
    path.write_text(yaml.safe_dump(doc))
    cp.kubectl("apply", "-f", str(path))
    refused = wait_for("the EMI HOT and not Ready", lambda: tier(cp, "HOT", ready=False, model=name), timeout=240)
    [condition] = [c for c in refused["status"]["conditions"] if c["type"] == "Ready"]
    assert condition["reason"] == "FreezeRefused" and "io_uring" in condition["message"], condition
    assert _holding(f"default.{name}-0"), "its server does not run"
    cp.kubectl("delete", "ms", name, "--timeout=120s")
    wait_for("its server gone", lambda: not _holding(f"default.{name}-0"))


def test_a_streaming_server_on_a_unix_socket_woken_through_the_gateway(
        control_plane: ControlPlane, cluster: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """The FastAPI app on a Unix socket in its instance's folder (group-writable, for a gateway of another user):
    FROZEN, woken by a streamed request through the gateway, the events the same as HOT, in more than one chunk."""
    cp = control_plane
    name = "k8s-stream"
    applied_frozen(cp, stream_modelspec(name), tmp_path)
    [sock] = pathlib.Path(f"/tmp/vw-{NODE}/servers/default.{name}-0").glob("server.sock")
    assert sock.stat().st_mode & 0o060 == 0o060, oct(sock.stat().st_mode)

    def stream() -> list[bytes]:
        request = urllib.request.Request(f"{cluster['http']}/v1/stream", data=json.dumps(
            {"prompt": "volga", "tokens": 6, "delay_ms": 30}).encode(), headers={
            "x-model-id": name, "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert reply.status == 200
            chunks = []
            while chunk := reply.read1():
                chunks.append(chunk)
            return chunks

    woken = stream()
    hot = stream()
    assert len(woken) > 1 and b"".join(woken) == b"".join(hot) and b"".join(woken).count(b"data: ") == 7
    wakes = series(cluster["agent_metrics"], "volga_activations_total")
    assert wakes.get(f'{{model="{name}",tier="FROZEN"}}') == 1.0, wakes
    cp.kubectl("delete", "ms", name, "--timeout=120s")
    wait_for("its server gone", lambda: not _holding(f"default.{name}-0"))


def test_a_gateway_killed_mid_request_leaves_its_server_to_go_idle(
        control_plane: ControlPlane, cluster: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """A gateway holds a server for a request through the Agent API's Hold call. Killed mid-answer (SIGKILL, a
    streamed answer half passed on), its connection ends the call: the agent lets the server go idle and freezes it
    again, as after an answered request, instead of keeping it HOT for the hour a lost activation is held."""
    cp = control_plane
    name = "k8s-held"
    applied_frozen(cp, stream_modelspec(name), tmp_path)
    http_port, grpc_port = free_ports(2)
    gateway = Daemon("gateway-killed", [
        str(pathlib.Path(sys.executable).with_name("volga-gateway")), "--kube", "--agent", cluster["agent"], "--node",
        NODE, "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port",
        "0"], cluster["env"], tmp_path, "volga-gateway")
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/stream", data=json.dumps(
        {"prompt": "volga", "tokens": 600, "delay_ms": 50}).encode(), headers={  # 30 s of answer
        "x-model-id": name, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert reply.status == 200 and reply.read1().startswith(b"data: ")  # woken, the answer streaming
            os.killpg(gateway.proc.pid, signal.SIGKILL)
            gateway.proc.wait()
    finally:
        gateway.stop()
    wait_for("the EMI HOT", lambda: tier(cp, "HOT", model=name), timeout=60)
    wait_for("the EMI FROZEN again once idle", lambda: tier(cp, "FROZEN", model=name), timeout=60)
    cp.kubectl("delete", "ms", name, "--timeout=120s")
    wait_for("its server gone", lambda: not _holding(f"default.{name}-0"))
