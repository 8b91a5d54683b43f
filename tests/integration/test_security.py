"""What a ModelSpec may make a node open and run, who may call the Agent API and the gateway, and how many
instances a node starts (docs/security.md). The real pool, the real servers, an unmodified tritonclient. What is
decided without a process or a server: tests/unit/test_security_rules.py."""

from __future__ import annotations

import asyncio
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import procs
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import trustme
import yaml
from specs import spec_at
from tritonclient.utils import InferenceServerException

from volga_agent import auth, errors
from volga_agent.app import defaultmodel, server
from volga_agent.gateway import app, catalog, links
from volga_agent.node import admission, instance, pool
from volga_agent.node.settings import Settings
from volga_agent.rpc.volga.v1 import agent_pb2, agent_pb2_grpc
from volga_agent.worker import contract, protocol
from volga_bench import harness
from volga_core import api, planner

# tritonclient.http's __del__ closes its gevent pool from whichever thread collects it, and warns.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
Tier = api.Tier
TOKEN = "s3cret-token-for-tests"


@pytest.fixture
def token_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "tokens"
    path.write_text(f"# one token a line\n{TOKEN}\n\nanother-token\n")
    return path


# --- model sources -------------------------------------------------------------------------------------------------


def test_a_refused_source_is_the_models_readiness_reason(models: pathlib.Path) -> None:
    refused = spec_at("/etc/passwd", "passwd")
    bg, up = harness.start_embedded([refused], settings=Settings(model_roots=(str(models),)))
    try:
        client = httpclient.InferenceServerClient(up.endpoints()["http"].removeprefix("http://"))
        assert not client.is_model_ready("passwd")
        [entry] = client.get_model_repository_index()
        assert entry["state"] == "UNAVAILABLE" and "spec.source: /etc/passwd: resolves to /etc/passwd, outside the " \
            "model roots" in entry["reason"], entry
        client.close()
    finally:
        bg.call(up.stop(), timeout=60)
        bg.close()


def test_a_model_file_swapped_after_the_check_is_refused_by_the_worker(models: pathlib.Path, tmp_path: pathlib.Path,
                                                                        rundir: pathlib.Path,
                                                                        default_spec: api.ModelSpecSpec) -> None:
    """The pool checks each source when it creates the instance; the file, or a folder above it, is then swapped
    for a link to a loadable model outside the roots before the worker starts. The real workers refuse the file
    they opened, naming spec.source, what they reached and why; the instance's start fails with that, and the
    untouched instance serves."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(models / "m.onnx", outside / "evil.onnx")
    shutil.copy(models / "m.onnx", outside / "f.onnx")
    shutil.copy(models / "m.onnx", models / "swapped.onnx")
    (models / "sub").mkdir()
    shutil.copy(models / "m.onnx", models / "sub" / "f.onnx")
    sources = {"good": models / "m.onnx", "swapped": models / "swapped.onnx", "folder": models / "sub" / "f.onnx"}
    specs = {name: spec_at(str(source), name).spec for name, source in sources.items()}
    p = pool.Pool("n1", rundir, None, Settings(model_roots=(str(models),)))
    try:
        p.apply([planner.Desired(name, name, name, "n1", Tier.COLD) for name in specs], specs)
        assert set(p.slots) == set(specs) and not p.failed  # every source passed the agent's check
        (models / "swapped.onnx").unlink()
        (models / "swapped.onnx").symlink_to(outside / "evil.onnx")
        shutil.rmtree(models / "sub")
        (models / "sub").symlink_to(outside)
        p.apply([planner.Desired(name, name, name, "n1", Tier.HOT) for name in specs], specs)
        p.wait_converged(timeout=240)
        expected = {"swapped": (sources["swapped"], outside / "evil.onnx"), "folder": (sources["folder"],
                                                                                     outside / "f.onnx")}
        for name, (source, reached) in expected.items():
            slot = p.slots[name]
            assert slot.inst.tier == Tier.COLD, (name, slot.inst.tier, slot.reason)
            assert f"worker failed: ValueError: spec.source: {source}: the worker opened {reached}, outside the " \
                f"model roots ({models})" in slot.reason, (name, slot.reason)
            with pytest.raises(errors.ActivationFailed, match="outside the model roots"):
                p.activate(name, joint=False)
        good = p.activate("good", joint=False).instance
        assert good.tier == Tier.HOT
        with protocol.WorkerClient(good.socket) as client:
            out = client.infer(contract.sample_inputs(instance.decls(default_spec.inputs)))
        assert out["probability"].shape == (1, 1)
    finally:
        p.close()


# --- caps ----------------------------------------------------------------------------------------------------------


def many_hot(folder: pathlib.Path, model: pathlib.Path, count: int) -> pathlib.Path:
    docs = []
    for i in range(count):
        doc = spec_at(str(model), f"m{i}").to_wire()
        doc["spec"]["pool"] = {"hot": api.MAX_FLOOR, "frozen": 0}
        docs.append(doc)
    path = folder / "many.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


@pytest.mark.parametrize("cap", [None, 100])
def test_volga_up_refuses_more_hot_instances_than_the_cap(models: pathlib.Path, cap: int | None) -> None:
    default_cap = admission.node_settings(Settings()).max_instances
    count = (cap or default_cap) // api.MAX_FLOOR + 1
    path = many_hot(models, models / "m.onnx", count)
    extra = ["--max-instances", str(cap)] if cap else []
    out = subprocess.run([sys.executable, "-m", "volga_agent.cli", "up", "-f", str(path), "--http-port", "0",
                          "--grpc-port", "0", "--metrics-port", "0", "--agent-port", "-1", *extra],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"volga up: {count * api.MAX_FLOOR} instances are placed on this node, more than " \
        f"settings.max_instances ({cap or default_cap})" in out.stderr
    assert "  models" not in out.stdout  # nothing started


# --- the Agent API -------------------------------------------------------------------------------------------------


def test_the_agent_api_wants_a_token(token_file: pathlib.Path, rundir: pathlib.Path) -> None:
    node_pool = pool.Pool("n1", rundir / "w", None)
    sock = str(rundir / "agent.sock")

    async def scenario() -> None:
        with pytest.raises(ValueError, match=r"the Agent API listens on 0\.0\.0\.0 only with a token"):
            await server.serve(node_pool, "0.0.0.0", 0)
        srv, port = await server.serve(node_pool, "127.0.0.1", 0, sock, auth.Tokens.from_file(token_file))
        try:
            for target in (f"127.0.0.1:{port}", f"unix:{sock}"):
                async with grpc.aio.insecure_channel(target) as channel:
                    stub = agent_pb2_grpc.AgentStub(channel)
                    for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await stub.Status(agent_pb2.StatusRequest(), metadata=metadata)
                        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                        assert "a bearer token is required" in (err.value.details() or "")
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Activate(agent_pb2.ActivateRequest(model_id="m"))
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    with pytest.raises(grpc.aio.AioRpcError) as err:  # a streamed answer is refused as well
                        await stub.Hold(agent_pb2.ActivateRequest(model_id="m")).read()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    for token in (TOKEN, "another-token"):
                        reply = await stub.Status(agent_pb2.StatusRequest(), metadata=auth.call_credentials(token))
                        assert reply.node == "n1"
                    link = links.GrpcAgentLink(target, TOKEN)
                    assert await link.instances("m") == []
                    await link.close()
        finally:
            await srv.stop(0)

    try:
        asyncio.run(scenario())
    finally:
        node_pool.close()


def test_volga_agent_keeps_its_api_on_loopback_without_a_token(tmp_path: pathlib.Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_at("/nope.onnx").to_wire()))
    out = subprocess.run([sys.executable, "-m", "volga_agent.app.daemons", "-f", str(spec), "--agent-host", "0.0.0.0",
                          "--workdir", str(tmp_path / "w")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--agent-host 0.0.0.0: the Agent API leaves loopback only with --token-file" in out.stderr


def outward_address() -> str:
    """An address of this machine other than loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # picks the route's source address; no packet is sent
        address = str(probe.getsockname()[0])
    if address.startswith("127."):
        pytest.fail("this machine has no address other than loopback", pytrace=False)
    return address


def reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def test_volga_up_host_warns_and_never_exposes_the_agent_api(default_spec: api.ModelSpecSpec,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    spec = spec_at(str(default_spec.source_path), pool={"hot": 0, "frozen": 0})
    bg, up = harness.start_embedded([spec], host="0.0.0.0")
    try:
        agent_port = int(up.endpoints()["agent"].rpartition(":")[2])
        assert up.endpoints()["agent"] == f"127.0.0.1:{agent_port}"
        assert "listens on 0.0.0.0 without authentication (--token-file); the Agent API stays on 127.0.0.1" \
            in caplog.text
        address = outward_address()
        assert reachable(address, up.gateway.ports["grpc"]) and reachable("127.0.0.1", agent_port)
        assert not reachable(address, agent_port)
    finally:
        bg.call(up.stop(), timeout=60)
        bg.close()


# --- the gateway ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.UpProcess]:
    """`volga up --token-file` serving the default model, as a user runs it. (Embedded in this process, a stopped
    token-guarded gateway stays alive until the interpreter exits: aiohttp keeps the handlers it built through a
    middleware in a module-level cache, and tearing them down at exit printed a bare "Error in sys.excepthook".)"""
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(TOKEN + "\n")
    with harness.volga_up(["--token-file", str(tokens)]) as up:
        yield up


def default_decls() -> tuple[contract.TensorDecl, ...]:
    return instance.decls(defaultmodel.ensure().spec.inputs)
BEARER = {"authorization": f"Bearer {TOKEN}"}


def test_the_gateway_wants_a_token_over_grpc(guarded: harness.UpProcess) -> None:
    model = defaultmodel.MODEL_ID
    decls = default_decls()
    x = contract.sample_inputs(decls, batch=2, seed=8)
    client = grpcclient.InferenceServerClient(guarded.endpoints["grpc"])
    try:
        assert client.is_server_live() and client.is_server_ready()  # health checks need no token
        inputs = harness.triton_inputs(decls, x)
        for call in (lambda h: client.infer(model, inputs, headers=h),
                     lambda h: client.get_model_metadata(model, headers=h),
                     lambda h: client.is_model_ready(model, headers=h)):
            for headers in (None, {"authorization": "Bearer nope"}, {"authorization": TOKEN}):
                with pytest.raises(InferenceServerException) as err:
                    call(headers)
                assert err.value.status() == "StatusCode.UNAUTHENTICATED", err.value
        out = client.infer(model, inputs, headers=BEARER).as_numpy("probability")
        assert out.shape == (2, 1) and np.all((out > 0) & (out < 1))
        assert client.is_model_ready(model, headers=BEARER)
    finally:
        client.close()


def test_the_gateway_wants_a_token_over_rest(guarded: harness.UpProcess) -> None:
    model = defaultmodel.MODEL_ID
    decls = default_decls()
    x = contract.sample_inputs(decls, batch=2, seed=9)
    url = guarded.endpoints["http"]
    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_server_ready()
        inputs = harness.triton_inputs(decls, x, httpclient)
        with pytest.raises(InferenceServerException) as err:
            client.infer(model, inputs)
        assert "a bearer token is required" in str(err.value)
        with pytest.raises(InferenceServerException):
            client.get_model_metadata(model, headers={"authorization": "Bearer nope"})
        out = client.infer(model, inputs, headers=BEARER).as_numpy("probability")
        assert out.shape == (2, 1)
        assert client.get_model_metadata(model, headers=BEARER)["name"] == model
    finally:
        client.close()
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(f"{url}/v2/models/{model}", timeout=10)
    assert http_err.value.code == 401 and http_err.value.headers["WWW-Authenticate"] == 'Bearer realm="volga"'
    http_err.value.close()
    request = urllib.request.Request(f"{url}/v2/models/{model}", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(f"{url}/v2/health/live", timeout=10) as reply:
        assert reply.status == 200


def test_the_gateway_speaks_mutual_tls(tmp_path: pathlib.Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    client_cert = ca.issue_cert("client@volga")
    files = {}
    for name, blob in (("ca", ca.cert_pem), ("key", cert.private_key_pem), ("cert", cert.cert_chain_pems[0]),
                       ("client-key", client_cert.private_key_pem), ("client-cert", client_cert.cert_chain_pems[0])):
        files[name] = tmp_path / f"{name}.pem"
        blob.write_to_path(str(files[name]))
    settings = app.Settings(http_port=0, grpc_port=0, metrics_port=0, tls_cert_file=str(files["cert"]),
                            tls_key_file=str(files["key"]), tls_client_ca_file=str(files["ca"]))
    bg = harness.Background()
    gateway = app.Gateway(catalog.Catalog(), links.LocalAgentLink(lambda model, hint: links.Route("", "")), settings)
    bg.call(gateway.start())
    url = f"localhost:{gateway.ports['grpc']}"
    try:
        trusted = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(files["ca"]),
                                                   private_key=str(files["client-key"]),
                                                   certificate_chain=str(files["client-cert"]))
        assert trusted.is_server_live()
        trusted.close()
        anonymous = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(files["ca"]))
        with pytest.raises(InferenceServerException):
            anonymous.is_server_live()
        anonymous.close()
        plain = grpcclient.InferenceServerClient(url)
        with pytest.raises(InferenceServerException):
            plain.is_server_live()
        plain.close()
    finally:
        bg.call(gateway.stop(), timeout=30)
        bg.close()


def test_the_gateway_daemon_warns_without_authentication_beyond_loopback(tmp_path: pathlib.Path) -> None:
    assert auth.is_loopback("127.0.0.1") and auth.is_loopback("localhost") and auth.is_loopback("::1")
    assert not auth.is_loopback("0.0.0.0") and not auth.is_loopback("192.0.2.2") and not auth.is_loopback("::")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_at("/nope.onnx").to_wire()))
    command = [sys.executable, "-c",
               "import sys; from volga_agent.app import daemons; sys.exit(daemons.gateway_main())",
               "-f", str(spec), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    for extra, warned in (([], False), (["--host", "0.0.0.0"], True)):
        proc = subprocess.Popen([*command, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        assert line.startswith("volga-gateway: HTTP " + ("0.0.0.0" if warned else "127.0.0.1")), line + err
        assert ("volga-gateway listens on 0.0.0.0 without authentication" in err) is warned, err


# --- metrics -------------------------------------------------------------------------------------------------------




def test_gateway_metrics_are_open_unless_tokens_are_set(token_file: pathlib.Path) -> None:
    bg = harness.Background()
    link = links.LocalAgentLink(lambda model, hint: links.Route("", ""))
    open_gateway = app.Gateway(catalog.Catalog(), link, app.Settings(http_port=0, grpc_port=0, metrics_port=0))
    guarded_gateway = app.Gateway(catalog.Catalog(), link, app.Settings(
        http_port=0, grpc_port=0, metrics_port=0, metrics_tokens=auth.Tokens.from_file(token_file)))
    bg.call(open_gateway.start())
    bg.call(guarded_gateway.start())
    try:
        status, _, body = procs.scrape(open_gateway.ports["metrics"])
        assert status == 200 and "volga_gateway_requests" in procs.families(body)
        for token in (None, "wrong", ""):
            status, headers, body = procs.scrape(guarded_gateway.ports["metrics"], token)
            assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="volga"', (token, status)
            assert "volga_gateway" not in body and "a bearer token is required" in body
        status, _, body = procs.scrape(guarded_gateway.ports["metrics"], TOKEN)
        assert status == 200 and "volga_gateway_requests" in procs.families(body)
        # The REST port keeps its own setting: no client tokens were asked for.
        with urllib.request.urlopen(f"http://127.0.0.1:{guarded_gateway.ports['http']}/v2", timeout=10) as reply:
            assert reply.status == 200
    finally:
        bg.call(open_gateway.stop(), timeout=30)
        bg.call(guarded_gateway.stop(), timeout=30)
        bg.close()


@pytest.mark.parametrize("daemon", ["volga-gateway", "volga-agent"])
def test_metrics_token_file_guards_the_daemons_metrics(daemon: str, token_file: pathlib.Path,
                                                       tmp_path: pathlib.Path) -> None:
    """`--metrics-token-file` on the real daemons: 401 with WWW-Authenticate without a token or with a wrong one,
    the metrics with any token of the file."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_at("/nope.onnx").to_wire()))
    common = ["-f", str(spec), "--metrics-port", "0", "--metrics-token-file", str(token_file)]
    if daemon == "volga-gateway":
        main = "import sys; from volga_agent.app import daemons; sys.exit(daemons.gateway_main())"
        command = [sys.executable, "-c", main, *common, "--http-port", "0", "--grpc-port", "0"]
        expected = "volga_gateway_requests"
    else:
        command = [sys.executable, "-m", "volga_agent.app.daemons", *common, "--port", "0",
                   "--workdir", str(tmp_path / "w"), "--snapshot-dir", str(tmp_path / "s")]
        expected = "volga_activations"
    process = procs.Daemon(daemon, command, {}, tmp_path, announce=f"{daemon}")
    try:
        match = re.search(r"metrics :(\d+)", process.line)
        assert match, process.line
        port = int(match.group(1))
        for token in (None, "wrong", TOKEN + "x"):
            status, headers, body = procs.scrape(port, token)
            assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="volga"', (token, status, body)
            assert "volga_" not in body
        for token in (TOKEN, "another-token"):
            status, _, body = procs.scrape(port, token)
            assert status == 200 and expected in procs.families(body), body[:500]
    finally:
        assert process.stop() == 0, process.log.read_text()[-3000:]
