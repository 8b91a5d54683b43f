"""A ModelSpec whose model is in an S3-compatible store, on a real kube-apiserver + etcd: boto3 uploads the model
to versitygw, `kubectl apply` creates the Secret with the store's credentials and the ModelSpec naming it, the
operator places an EMI, the agent fetches the model into its cache (EMI status.source: the digest), and a
tritonclient request through the gateway gets the model's answer. The credentials appear in no EMI, event or log."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import k8s_fixtures
import numpy as np
import pytest
import stores
import yaml
from kubernetes import client as k8s
from procs import Daemon, wait_for

from volga_agent.app import defaultmodel
from volga_agent.app import status as status_view
from volga_agent.node import instance
from volga_agent.sources import cache
from volga_agent.worker import contract
from volga_bench import harness
from volga_bench.controlplane import ControlPlane, free_ports

pytest_plugins = ["k8s_fixtures"]
ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(stores.missing()), reason=stores.missing() or "-")]
NODE = "node-s3"


def request(grpc: str, model: str, seed: int = 5) -> np.ndarray:
    import tritonclient.grpc as grpcclient

    decls = instance.decls(defaultmodel.ensure().spec.inputs)
    inputs = harness.triton_inputs(decls, contract.sample_inputs(decls, batch=4, seed=seed))
    client = grpcclient.InferenceServerClient(grpc)
    try:
        return client.infer(model, inputs, headers={"x-model-id": model}, client_timeout=120).as_numpy("probability")
    except Exception as exc:
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from None  # the message, in wait_for's last error
    finally:
        client.close()


def reference(seed: int = 5) -> np.ndarray:
    import onnxruntime

    spec = defaultmodel.ensure().spec
    session = onnxruntime.InferenceSession(str(spec.source_path), providers=["CPUExecutionProvider"])
    return session.run(["probability"], contract.sample_inputs(instance.decls(spec.inputs), batch=4, seed=seed))[0]


control_plane = k8s_fixtures.control_plane_of_its_own()  # the ModelSpec's EMI must land on this module's Nodes


@pytest.fixture(scope="module")
def setup(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("sources")
    s3 = stores.S3(folder)
    s3.client().create_bucket(Bucket="models")
    api = control_plane.api_client()
    k8s.CoreV1Api(api).create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=NODE)))
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig), "PYTHONUNBUFFERED": "1",
           "VOLGA_RESYNC_SEC": "5", "VOLGA_MODEL_CACHE": str(folder / "cache"),
           "VOLGA_SOURCE_SECRET_POLL_SEC": "1"}
    for key in [k for k in env if k.startswith("AWS_")]:
        del env[key]  # the agent gets the credentials from the Secret only
    py = sys.executable
    [grpc_port] = free_ports(1)
    settings = folder / "settings.yaml"  # model servers may run here (test_a_server_in_s3_...)
    settings.write_text(yaml.safe_dump({"allowModelCode": True}))
    daemons = {"operator": Daemon("operator", [py, "-m", "volga_operator", "--liveness", "", "-v"], env, folder)}
    daemons["agent"] = Daemon("agent", [py, "-m", "volga_agent.app.daemons", "--kube", "--node", NODE, "--port", "0",
                                        "--metrics-port", "0", "--workdir", f"/tmp/vw-{NODE}", "--snapshot-dir",
                                        str(folder / "snapshots"), "--gateway-address", f"127.0.0.1:{grpc_port}",
                                        "--settings", str(settings), "-v"], env, folder, "volga-agent")
    agent = f"127.0.0.1:{daemons['agent'].port('Agent API')}"
    # The gateway as its console script runs it, from this checkout's code.
    script = "import sys; from volga_agent.app.daemons import gateway_main; sys.exit(gateway_main())"
    daemons["gateway"] = Daemon("gateway", [
        py, "-c", script, "--kube", "--agent", agent, "--node", NODE, "--host",
        "127.0.0.1", "--http-port", "0", "--grpc-port", str(grpc_port), "--metrics-port", "0"], env, folder,
        "volga-gateway")
    yield {"s3": s3, "daemons": daemons, "folder": folder, "grpc": f"127.0.0.1:{grpc_port}",
           "http": f"http://127.0.0.1:{daemons['gateway'].port('HTTP')}"}
    codes = {name: d.stop() for name, d in daemons.items()}
    s3.stop()
    api.close()
    assert all(code == 0 for code in codes.values()), {n: (c, daemons[n].tail())
                                                       for n, c in codes.items() if c}


def test_a_model_in_s3_is_fetched_with_its_secret_and_served(control_plane: ControlPlane, setup: dict[str, Any],
                                                             tmp_path: pathlib.Path) -> None:
    s3: stores.S3 = setup["s3"]
    model = defaultmodel.ensure().spec.source_path
    s3.client().upload_file(str(model), "models", "ctr/model.onnx")
    digest = "sha256:" + hashlib.sha256(model.read_bytes()).hexdigest()
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "model-store", "namespace": "default"},
              "stringData": s3.credentials()}
    doc = defaultmodel.spec_document(model)
    doc["metadata"] = {"name": "from-s3", "namespace": "default"}
    doc["spec"].update({"modelId": "from-s3", "source": "s3://models/ctr/model.onnx",  # type: ignore[union-attr]
                        "sourceSecret": "model-store", "pool": {"hot": 0, "frozen": 1}})
    (tmp_path / "all.yaml").write_text(yaml.safe_dump_all([secret, doc]))
    control_plane.kubectl("apply", "-f", str(tmp_path / "all.yaml"))

    def emi() -> dict[str, Any] | None:
        out = control_plane.kubectl("get", "emi", "-l", "volga.dev/modelspec=from-s3", "-o", "json")
        items = json.loads(out.stdout)["items"]
        return items[0] if items and (items[0].get("status") or {}).get("source", {}).get("digest") else None

    placed = wait_for("the EMI to report its model's digest", emi, timeout=180)
    assert placed["status"]["source"]["uri"] == "s3://models/ctr/model.onnx"
    assert placed["status"]["source"]["digest"] == digest
    assert (setup["folder"] / "cache" / "sha256" / digest[7:] / "model.onnx").read_bytes() == model.read_bytes()
    [answer] = wait_for("an answer through the gateway", lambda: [request(setup["grpc"], "from-s3")], timeout=180)
    np.testing.assert_allclose(answer, reference(), rtol=1e-5)

    lines = status_view.table(status_view.from_cluster(str(control_plane.kubeconfig), "default")).splitlines()
    assert any(f"bytes from s3://models/ctr/model.onnx, {digest}" in line for line in lines), lines
    events = control_plane.kubectl("get", "events", "-A", "-o", "json").stdout
    emis = control_plane.kubectl("get", "emi", "-A", "-o", "json").stdout
    logs = "".join(d.log.read_text() for d in setup["daemons"].values())
    for text in (events, emis, logs):
        assert stores.SECRET not in text


def test_a_denied_fetch_is_fetched_once_its_secret_is_put_right(control_plane: ControlPlane, setup: dict[str, Any],
                                                                tmp_path: pathlib.Path) -> None:
    """A Secret with the wrong key: the EMI's Ready condition says SourceDenied naming the Secret, and the store is
    asked once (the agent reads the Secret for a change, not the store); `kubectl apply` of the right key ->
    fetched and answered, with no change to the ModelSpec."""
    import time

    s3: stores.S3 = setup["s3"]
    model = defaultmodel.ensure().spec.source_path
    s3.client().upload_file(str(model), "models", "rotated/model.onnx")
    digest = "sha256:" + hashlib.sha256(model.read_bytes()).hexdigest()

    def secret(key: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rotated", "namespace": "default"},
                "stringData": s3.credentials(key)}

    doc = defaultmodel.spec_document(model)
    doc["metadata"] = {"name": "rotated", "namespace": "default"}
    doc["spec"].update({"modelId": "rotated", "source": "s3://models/rotated/model.onnx",  # type: ignore[union-attr]
                        "sourceSecret": "rotated", "pool": {"hot": 0, "frozen": 1}})
    (tmp_path / "wrong.yaml").write_text(yaml.safe_dump_all([secret("not-the-key"), doc]))
    control_plane.kubectl("apply", "-f", str(tmp_path / "wrong.yaml"))

    def ready(reason: str) -> dict[str, Any] | None:
        out = control_plane.kubectl("get", "emi", "-l", "volga.dev/modelspec=rotated", "-o", "json")
        items = json.loads(out.stdout)["items"]
        conditions = (items[0].get("status") or {}).get("conditions") or [] if items else []
        found = next((c for c in conditions if c["type"] == "Ready" and c.get("reason") == reason), None)
        return found

    denied = wait_for("the EMI to say the credentials were refused", lambda: ready("SourceDenied"), timeout=180)
    assert "Secret 'default/rotated'" in denied["message"] and "not-the-key" not in denied["message"]
    time.sleep(5)  # the agent reads the Secret for a change every second meanwhile (VOLGA_SOURCE_SECRET_POLL_SEC)
    agent_log = setup["daemons"]["agent"].log
    refused = "s3://models/rotated/model.onnx: the store refused the credentials (credentials from Secret " \
              "'default/rotated')"
    assert agent_log.read_text().count(refused) == 1  # the store was asked once: no retry storm

    (tmp_path / "right.yaml").write_text(yaml.safe_dump(secret(stores.SECRET)))
    control_plane.kubectl("apply", "-f", str(tmp_path / "right.yaml"))

    def fetched() -> dict[str, Any] | None:
        out = control_plane.kubectl("get", "emi", "-l", "volga.dev/modelspec=rotated", "-o", "json")
        items = json.loads(out.stdout)["items"]
        source = (items[0].get("status") or {}).get("source") or {} if items else {}
        return items[0] if source.get("digest") else None

    assert wait_for("the fetch after the Secret changed", fetched, timeout=180)["status"]["source"]["digest"] == digest
    [answer] = wait_for("an answer through the gateway", lambda: [request(setup["grpc"], "rotated")], timeout=180)
    np.testing.assert_allclose(answer, reference(), rtol=1e-5)
    assert "Secret default/rotated changed: fetching again" in agent_log.read_text()
    assert agent_log.read_text().count(refused) == 1


def test_an_untrusted_certificate_is_named_and_a_ca_in_the_secret_fixes_it(
        control_plane: ControlPlane, setup: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """An S3 store over HTTPS with a private CA's certificate: the EMI's Ready condition says
    SourceCertificateUntrusted, naming the source and the Secret key to add; `kubectl apply` of the Secret with the
    CA's PEM as SOURCE_CA_BUNDLE -> fetched and answered."""
    model = defaultmodel.ensure().spec.source_path
    s3, files = stores.untrusted_s3(tmp_path, model)
    try:
        digest = "sha256:" + hashlib.sha256(model.read_bytes()).hexdigest()

        def secret(**extra: str) -> dict[str, Any]:
            return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tls-store", "namespace": "default"},
                    "stringData": {**s3.credentials(), **extra}}

        doc = defaultmodel.spec_document(model)
        doc["metadata"] = {"name": "over-tls", "namespace": "default"}
        doc["spec"].update({"modelId": "over-tls", "source": "s3://models/tls/model.onnx",  # type: ignore[union-attr]
                            "sourceSecret": "tls-store", "pool": {"hot": 0, "frozen": 1}})
        (tmp_path / "untrusted.yaml").write_text(yaml.safe_dump_all([secret(), doc]))
        control_plane.kubectl("apply", "-f", str(tmp_path / "untrusted.yaml"))

        def emi() -> dict[str, Any] | None:
            out = control_plane.kubectl("get", "emi", "-l", "volga.dev/modelspec=over-tls", "-o", "json")
            items = json.loads(out.stdout)["items"]
            return items[0] if items else None

        def untrusted() -> dict[str, Any] | None:
            conditions = ((emi() or {}).get("status") or {}).get("conditions") or []
            return next((c for c in conditions if c["type"] == "Ready" and
                         c.get("reason") == "SourceCertificateUntrusted"), None)

        said = wait_for("the EMI to say the certificate was not trusted", untrusted, timeout=180)
        assert "s3://models/tls/model.onnx: the server's TLS certificate was not trusted" in said["message"]
        assert "to Secret 'default/tls-store' as key SOURCE_CA_BUNDLE" in said["message"]

        (tmp_path / "trusted.yaml").write_text(yaml.safe_dump(secret(SOURCE_CA_BUNDLE=files[0].read_text())))
        control_plane.kubectl("apply", "-f", str(tmp_path / "trusted.yaml"))

        def fetched() -> dict[str, Any] | None:
            found = emi()
            return found if ((found or {}).get("status") or {}).get("source", {}).get("digest") else None

        assert wait_for("the fetch with the CA", fetched, timeout=180)["status"]["source"]["digest"] == digest
        [answer] = wait_for("an answer through the gateway", lambda: [request(setup["grpc"], "over-tls")],
                            timeout=180)
        np.testing.assert_allclose(answer, reference(), rtol=1e-5)
    finally:
        s3.stop()


def test_a_server_in_s3_is_fetched_whole_and_woken_through_the_gateway(
        control_plane: ControlPlane, setup: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """A FastAPI app uploaded to an S3 folder by boto3 (its code in src/ beside a README), a ModelSpec naming the
    folder, its Secret and `workingDir: src`: the agent fetches the folder into its cache, runs the server there and
    freezes it (EMI FROZEN, Ready, status.source the folder's digest); a streamed request through the gateway wakes
    it and is answered as the HOT server answers."""
    import urllib.request

    s3: stores.S3 = setup["s3"]
    app = (ROOT / "volga_bench" / "servers" / "stream_app.py").read_bytes()
    s3.client().put_object(Bucket="models", Key="stream-app/src/app.py", Body=app)
    s3.client().put_object(Bucket="models", Key="stream-app/README", Body=b"a streaming app\n")
    digest = cache.tree_digest({"src/app.py": hashlib.sha256(app).hexdigest(),
                                "README": hashlib.sha256(b"a streaming app\n").hexdigest()})
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "server-store", "namespace": "default"},
              "stringData": s3.credentials()}
    doc = {"apiVersion": "volga.dev/v1alpha1", "kind": "ModelSpec", "metadata": {"name": "stream-s3",
                                                                                  "namespace": "default"},
           "spec": {"modelId": "stream-s3", "framework": "server", "source": "s3://models/stream-app/",
                    "sourceSecret": "server-store", "sourceDigest": digest, "pool": {"frozen": 1},
                    "server": {"command": [sys.executable, "-m", "uvicorn", "app:app", "--no-access-log", "--loop",
                                           "asyncio", "--port", "{port}"],
                               "workingDir": "src", "readiness": {"path": "/health"}}}}
    (tmp_path / "server.yaml").write_text(yaml.safe_dump_all([secret, doc]))
    control_plane.kubectl("apply", "-f", str(tmp_path / "server.yaml"))

    def emi(tier: str) -> dict[str, Any] | None:
        out = control_plane.kubectl("get", "emi", "-l", "volga.dev/modelspec=stream-s3", "-o", "json")
        items = json.loads(out.stdout)["items"]
        status = (items[0].get("status") or {}) if len(items) == 1 else {}
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", ()))
        return items[0] if status.get("tier") == tier and ready else None

    frozen = wait_for("the server fetched and FROZEN", lambda: emi("FROZEN"), timeout=240)
    assert frozen["status"]["source"]["uri"] == "s3://models/stream-app/"
    assert frozen["status"]["source"]["digest"] == digest
    assert (setup["folder"] / "cache" / "sha256" / digest[7:] / "src" / "app.py").read_bytes() == app

    def stream() -> bytes:
        request = urllib.request.Request(f"{setup['http']}/v1/stream", data=json.dumps(
            {"prompt": "volga", "tokens": 6, "delay_ms": 10}).encode(), headers={
            "x-model-id": "stream-s3", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert reply.status == 200
            return bytes(reply.read())

    woken, hot = stream(), stream()
    assert woken == hot and woken.count(b"data: ") == 7
    logs = "".join(d.log.read_text() for d in setup["daemons"].values())
    assert stores.SECRET not in logs
    control_plane.kubectl("delete", "ms", "stream-s3", "--timeout=120s")
