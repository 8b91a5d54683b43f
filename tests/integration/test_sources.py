"""Remote model sources against real stores: versitygw (S3) with models uploaded by boto3, docker-registry (OCI)
with models pushed by the oras CLI; the node's model cache fetches through them (volga_agent/sources)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
from collections.abc import Iterator

import pytest
import stores

from volga_agent.app import defaultmodel
from volga_agent.sources import cache, errors
from volga_core import api

pytestmark = pytest.mark.skipif(bool(stores.missing()), reason=stores.missing() or "stores installed")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stores.S3]:
    server = stores.S3(tmp_path_factory.mktemp("s3"))
    server.client().create_bucket(Bucket="models")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stores.Registry]:
    server = stores.Registry(tmp_path_factory.mktemp("registry"))
    yield server
    server.stop()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_an_s3_object_is_fetched_in_ranges_over_several_connections_and_verified(
        s3: stores.S3, tmp_path: pathlib.Path) -> None:
    data = os.urandom(3 << 20)
    s3.client().put_object(Bucket="models", Key="big/weights.onnx", Body=data)
    c = cache.Cache(tmp_path / "cache", connections=4, chunk_bytes=256 << 10)
    got = c.resolve("s3://models/big/weights.onnx", sha(data), s3.credentials())
    assert not got.hit and got.digest == sha(data) and got.path.read_bytes() == data
    assert c.resolve("s3://models/big/weights.onnx", sha(data), s3.credentials()).hit
    with pytest.raises(errors.SourceMismatch, match="refused"):
        cache.Cache(tmp_path / "other").resolve("s3://models/big/weights.onnx", "sha256:" + "1" * 64,
                                                s3.credentials())


def test_a_changed_s3_object_is_a_new_version(s3: stores.S3, tmp_path: pathlib.Path) -> None:
    client, c = s3.client(), cache.Cache(tmp_path / "cache")
    client.put_object(Bucket="models", Key="m.onnx", Body=b"first" * 100)
    first = c.resolve("s3://models/m.onnx", "", s3.credentials())
    client.put_object(Bucket="models", Key="m.onnx", Body=b"second" * 100)
    second = c.resolve("s3://models/m.onnx", "", s3.credentials())
    assert first.digest == sha(b"first" * 100) and second.digest == sha(b"second" * 100)
    assert first.path.read_bytes() == b"first" * 100  # the old version's bytes are not overwritten


def test_an_s3_folder_resolves_to_its_model_file_beside_its_data(s3: stores.S3, tmp_path: pathlib.Path) -> None:
    client = s3.client()
    client.put_object(Bucket="models", Key="folder/model.onnx", Body=b"graph")
    client.put_object(Bucket="models", Key="folder/model.onnx.data", Body=b"weights" * 10)
    got = cache.Cache(tmp_path / "cache").resolve("s3://models/folder/", "", s3.credentials())
    assert got.path.name == "model.onnx" and (got.path.parent / "model.onnx.data").read_bytes() == b"weights" * 10
    assert got.digest == cache.tree_digest({"model.onnx": sha(b"graph")[7:],
                                            "model.onnx.data": sha(b"weights" * 10)[7:]})


def test_a_wrong_secret_is_denied_naming_the_secret_without_the_key(s3: stores.S3, tmp_path: pathlib.Path) -> None:
    with pytest.raises(errors.SourceDenied, match="Secret 'model-store'") as caught:
        cache.Cache(tmp_path / "cache").resolve("s3://models/m.onnx", "", s3.credentials("not-the-key"),
                                                secret="model-store")
    assert "not-the-key" not in str(caught.value) and stores.SECRET not in str(caught.value)


def test_an_unreachable_store_is_unavailable_and_retryable(tmp_path: pathlib.Path) -> None:
    credentials = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b",
                   "AWS_ENDPOINT_URL": f"http://127.0.0.1:{stores.free_port()}"}
    with pytest.raises(errors.SourceUnavailable) as caught:
        cache.Cache(tmp_path / "cache").resolve("s3://models/m.onnx", "", credentials)
    assert caught.value.retry


def test_an_oras_pushed_model_is_fetched_by_tag_and_by_digest(registry: stores.Registry,
                                                              tmp_path: pathlib.Path) -> None:
    data = os.urandom(1 << 20)
    (tmp_path / "model.onnx").write_bytes(data)
    manifest = registry.push("models/resnet:v1", ["model.onnx"], tmp_path)
    c = cache.Cache(tmp_path / "cache", connections=3, chunk_bytes=128 << 10)
    by_tag = c.resolve(f"oci://{registry.host}/models/resnet:v1", sha(data))
    assert by_tag.path.name == "model.onnx" and by_tag.path.read_bytes() == data
    by_digest = c.resolve(f"oci://{registry.host}/models/resnet@{manifest}")
    assert by_digest.path == by_tag.path  # one copy per content digest


def test_an_oras_pushed_folder_is_unpacked(registry: stores.Registry, tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"graph")
    (folder / "weights.bin").write_bytes(b"w" * 1000)
    registry.push("models/bert:v1", ["bert"], tmp_path)
    got = cache.Cache(tmp_path / "cache").resolve(f"oci://{registry.host}/models/bert:v1")
    assert got.path.name == "model.onnx" and (got.path.parent / "weights.bin").read_bytes() == b"w" * 1000


def test_volga_up_reads_a_models_signature_from_its_s3_copy(s3: stores.S3, tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from volga_agent import cli

    model = defaultmodel.ensure().spec.source_path
    s3.client().upload_file(str(model), "models", "default/model.onnx")
    doc = defaultmodel.spec_document(model)
    doc["spec"]["source"] = "s3://models/default/model.onnx"
    doc["spec"].pop("inputs", None)
    doc["spec"].pop("outputs", None)
    import yaml

    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    for key, value in s3.credentials().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VOLGA_MODEL_CACHE", str(tmp_path / "cache"))
    loaded = cli.load_specs([str(tmp_path / "spec.yaml")])
    assert not loaded.refused
    spec = loaded.specs[0].spec
    assert spec.source_path.read_bytes() == model.read_bytes() and spec.inputs
    assert spec.source_path.is_relative_to(tmp_path / "cache") and spec.source_digest == sha(model.read_bytes())


class SecretsApi:
    """The CoreV1Api call `cluster.fetches` makes for a Secret, answering from a dict (the API server's part is
    in tests/k8s); counts the reads. `put` changes a Secret (a new resourceVersion)."""

    def __init__(self, secrets: dict[tuple[str, str], dict[str, str]]) -> None:
        self.secrets = secrets
        self.versions = {key: 1 for key in secrets}
        self.reads = 0

    def put(self, namespace: str, name: str, data: dict[str, str]) -> None:
        self.secrets[(namespace, name)] = data
        self.versions[(namespace, name)] = self.versions.get((namespace, name), 0) + 1

    def read_namespaced_secret(self, name: str, namespace: str, **_: object) -> object:
        import base64
        import types

        from kubernetes.client import ApiException

        self.reads += 1
        if (namespace, name) not in self.secrets:
            raise ApiException(status=404, reason="Not Found")
        data = {k: base64.b64encode(v.encode()).decode() for k, v in self.secrets[(namespace, name)].items()}
        return types.SimpleNamespace(data=data, metadata=types.SimpleNamespace(
            resource_version=str(self.versions[(namespace, name)])))


def test_a_placed_model_is_prefetched_with_its_secret_and_reported_while_it_fetches(
        s3: stores.S3, tmp_path: pathlib.Path) -> None:
    import threading

    from procs import wait_for

    from volga_agent.cluster import fetches
    from volga_core import planner

    model = defaultmodel.ensure().spec.source_path
    s3.client().upload_file(str(model), "models", "placed/model.onnx")
    doc = defaultmodel.spec_document(model)
    base = api_spec(doc, source="s3://models/placed/model.onnx", sourceSecret="store")
    wrong = api_spec(doc, source="s3://models/placed/model.onnx", sourceSecret="stale", modelId="other")
    core = SecretsApi({("ml", "store"): s3.credentials(), ("ml", "stale"): s3.credentials("wrong")})
    done = threading.Event()
    f = fetches.Fetches(core, done.set, root=str(tmp_path / "cache"))
    specs = {"ml/a": base, "ml/b": wrong}
    desired = [planner.Desired("ml.a-0", "ml/a", "ctr", "n", api.Tier.FROZEN),
               planner.Desired("ml.b-0", "ml/b", "other", "n", api.Tier.FROZEN)]
    out, kept = f.localise(specs, desired, lambda name: None)
    assert kept == [] and f.pending["ml/a"].reason == "Fetching"

    def settled() -> bool:
        nonlocal out, kept
        out, kept = f.localise(specs, desired, lambda name: None)
        return "ml/a" in f.loaded and f.pending.get("ml/b") is not None and f.pending["ml/b"].reason != "Fetching"

    wait_for("the fetches to settle", settled, timeout=60)
    assert [d.name for d in kept] == ["ml.a-0"]
    assert out["ml/a"].source_path.read_bytes() == model.read_bytes() and out["ml/a"].inputs  # signature read
    assert f.loaded["ml/a"].digest == sha(model.read_bytes()) and f.loaded["ml/a"].uri == base.source
    assert f.model_cache is not None and f.model_cache.held() == {sha(model.read_bytes())}  # not evicted while placed
    f.localise(specs, [], lambda name: None)
    assert f.model_cache.held() == set()  # no longer placed: evictable

    def denial() -> fetches.Pending | None:  # placed again: fetched again (a fetch no longer placed is forgotten)
        f.localise(specs, desired, lambda name: None)
        return f.pending["ml/b"] if f.pending["ml/b"].reason != "Fetching" else None

    denied = wait_for("the denial", denial, timeout=60)
    assert denied.reason == "SourceDenied" and "Secret 'ml/stale'" in denied.message and "wrong" not in denied.message
    reads = core.reads
    for _ in range(3):  # a denied credential is not retried: no storm of requests
        f.localise(specs, desired, lambda name: None)
    assert core.reads == reads
    f.stop()


def test_a_denied_fetch_is_tried_again_when_its_secret_changes(s3: stores.S3, tmp_path: pathlib.Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Wrong credentials in the Secret: SourceDenied naming the Secret, the store asked once however often the
    Secret is read for a change; a Secret that does not exist yet is said so; the Secret put right (a new
    resourceVersion) -> fetched."""
    from procs import wait_for

    from volga_agent.cluster import fetches
    from volga_core import planner

    monkeypatch.setenv("VOLGA_SOURCE_SECRET_POLL_SEC", "0.1")
    model = defaultmodel.ensure().spec.source_path
    s3.client().upload_file(str(model), "models", "rotated/model.onnx")
    doc = defaultmodel.spec_document(model)
    spec = api_spec(doc, source="s3://models/rotated/model.onnx", sourceSecret="store")
    later = api_spec(doc, source="s3://models/rotated/model.onnx", sourceSecret="later", modelId="later")
    core = SecretsApi({("ml", "store"): s3.credentials("wrong")})
    f = fetches.Fetches(core, lambda: None, root=str(tmp_path / "cache"))
    specs = {"ml/a": spec, "ml/b": later}
    desired = [planner.Desired("ml.a-0", "ml/a", spec.model_id, "n", api.Tier.FROZEN),
               planner.Desired("ml.b-0", "ml/b", later.model_id, "n", api.Tier.FROZEN)]

    def failed(owner: str) -> fetches.Pending | None:
        f.localise(specs, desired, lambda name: None)
        pending = f.pending.get(owner)
        return pending if pending is not None and pending.reason != "Fetching" else None

    denied = wait_for("the denial", lambda: failed("ml/a"), timeout=60)
    assert denied.reason == "SourceDenied" and "Secret 'ml/store'" in denied.message
    missing = wait_for("the missing Secret", lambda: failed("ml/b"), timeout=60)
    assert missing.reason == "SourceDenied" and "'ml/later'" in missing.message and "does not exist" in missing.message
    prefetcher = f._cache()
    reads = core.reads
    wait_for("the Secrets to be read for a change a few times", lambda: core.reads >= reads + 6, timeout=60)
    # the store asked once for the wrong key (no retry storm), never for the Secret that is not there
    assert prefetcher.attempts("ml", spec) == 1 and prefetcher.attempts("ml", later) == 0

    core.put("ml", "store", s3.credentials())
    core.put("ml", "later", s3.credentials())
    wait_for("the fetches after the Secrets changed", lambda: f.localise(specs, desired, lambda name: None) and
             {"ml/a", "ml/b"} <= f.loaded.keys(), timeout=60)
    assert f.loaded["ml/a"].digest == sha(model.read_bytes()) and not f.pending
    f.localise(specs, [], lambda name: None)  # no longer placed: nothing is read any more
    f.stop()


def api_spec(doc: dict, **changes: str) -> api.ModelSpecSpec:
    spec = dict(doc["spec"])  # type: ignore[arg-type]
    spec.pop("inputs", None)
    spec.pop("outputs", None)
    spec.update(changes)
    return api.ModelSpecSpec.model_validate(spec)


@pytest.mark.slow
def test_volga_up_serves_a_model_pushed_to_s3_with_credentials_from_its_environment(
        s3: stores.S3, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import subprocess
    import sys

    import numpy as np
    import tritonclient.http as httpclient
    import yaml

    from volga_agent.node import instance
    from volga_agent.worker import contract
    from volga_bench import harness

    spec = defaultmodel.ensure().spec
    s3.client().upload_file(str(spec.source_path), "models", "served/model.onnx")
    doc = defaultmodel.spec_document(spec.source_path)
    doc["spec"]["source"] = "s3://models/served/model.onnx"  # type: ignore[index]
    doc["spec"]["sourceDigest"] = sha(spec.source_path.read_bytes())  # type: ignore[index]
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    for key, value in s3.credentials().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VOLGA_MODEL_CACHE", str(tmp_path / "cache"))
    with harness.volga_up(["-f", str(tmp_path / "spec.yaml"), "--snapshot-dir", str(tmp_path / "snapshots")]) as up:
        client = httpclient.InferenceServerClient(up.endpoints["http"].removeprefix("http://"))
        decls = instance.decls(spec.inputs)
        x = contract.sample_inputs(decls, batch=2, seed=7)
        out = client.infer(spec.model_id, harness.triton_inputs(decls, x, httpclient)).as_numpy("probability")
        client.close()
        assert out.shape == (2, 1) and np.all((out > 0) & (out < 1))
        # `volga status` against the running `volga up` (its Agent API) says where the bytes came from
        root = pathlib.Path(__file__).resolve().parents[2]
        status = subprocess.run([sys.executable, "-m", "volga_agent.cli", "status", "--agent", up.endpoints["agent"]],
                                capture_output=True, text=True, timeout=60, cwd=root,
                                env={**os.environ, "PYTHONPATH": str(root)})
        listed = subprocess.run([sys.executable, "-m", "volga_agent.cli", "status", "--agent", up.endpoints["agent"],
                                 "--json"], capture_output=True, text=True, timeout=60, cwd=root,
                                env={**os.environ, "PYTHONPATH": str(root)})
    line = f"bytes from s3://models/served/model.onnx, {sha(spec.source_path.read_bytes())}"
    assert status.returncode == 0 and any(line in row for row in status.stdout.splitlines()), status.stdout
    [model] = json.loads(listed.stdout)["models"]
    assert model["instanceList"] and all(i["source"] == line for i in model["instanceList"])
    output = "".join(up.output)
    assert "s3://models/served/model.onnx" in output and stores.SECRET not in output
    assert (tmp_path / "cache" / "sha256" / sha(spec.source_path.read_bytes())[7:] / "model.onnx").is_file()


def test_a_request_during_the_fetch_waits_for_it_and_is_answered(s3: stores.S3, tmp_path: pathlib.Path) -> None:
    """The Agent API's Activate for a model whose source is being fetched waits (no error) until the bytes are
    on the node and its instance exists, then wakes it; one whose deadline passes first says so."""
    import asyncio

    import grpc
    from procs import wait_for

    from volga_agent.app import server
    from volga_agent.cluster import fetches
    from volga_agent.node import pool
    from volga_agent.rpc.volga.v1 import agent_pb2 as pb
    from volga_agent.rpc.volga.v1 import agent_pb2_grpc as pb_grpc
    from volga_core import planner

    model = defaultmodel.ensure().spec.source_path
    s3.client().upload_file(str(model), "models", "waited/model.onnx")
    spec = api_spec(defaultmodel.spec_document(model), source="s3://models/waited/model.onnx", sourceSecret="store")
    f = fetches.Fetches(SecretsApi({("ml", "store"): s3.credentials()}), lambda: None, root=str(tmp_path / "cache"))
    node_pool = pool.Pool("n", tmp_path / "work", None, pool.Settings(model_roots=(str(tmp_path / "cache"),)))
    node_pool.awaiting = f.awaiting
    specs = {"ml/a": spec}
    desired = [planner.Desired("ml.a-0", "ml/a", spec.model_id, "n", api.Tier.COLD)]

    def apply() -> None:
        out, kept = f.localise(specs, desired, lambda name: None)
        node_pool.apply(kept, out)
        f.applied()

    async def scenario() -> tuple[str, str]:
        grpc_server, port = await server.serve(node_pool, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.AgentStub(channel)
                apply()  # the fetch starts; no instance yet
                assert f.awaiting(spec.model_id) is not None
                try:
                    await stub.Activate(pb.ActivateRequest(model_id=spec.model_id, timeout_ms=1), timeout=30)
                    late = "answered"
                except grpc.aio.AioRpcError as exc:
                    late = f"{exc.code().name}: {exc.details()}"
                waiting = asyncio.ensure_future(stub.Activate(pb.ActivateRequest(model_id=spec.model_id,
                                                                                 timeout_ms=120_000), timeout=150))
                await asyncio.to_thread(wait_for, "the fetch", lambda: "ml/a" in (
                    f.localise(specs, desired, lambda name: None) and f.loaded), 60)
                await asyncio.sleep(0.2)
                assert not waiting.done()  # the bytes are here, the instance is not: the request still waits
                apply()
                reply = await waiting
                return late, reply.instance.name
        finally:
            await grpc_server.stop(None)
            node_pool.close()

    late, name = asyncio.run(scenario())
    assert late.startswith("DEADLINE_EXCEEDED") and "still being fetched" in late
    assert name == "ml.a-0" and f.awaiting(spec.model_id) is None


def test_an_http_source_is_fetched_in_ranges_from_a_real_server(registry: stores.Registry,
                                                                 tmp_path: pathlib.Path) -> None:
    """The registry serves blobs over plain HTTP with byte ranges and ETags: a file URL like any other server's."""
    data = os.urandom(2 << 20)
    (tmp_path / "weights.onnx").write_bytes(data)
    registry.push("models/plain:v1", ["weights.onnx"], tmp_path)
    url = f"http://{registry.host}/v2/models/plain/blobs/{sha(data)}"
    c = cache.Cache(tmp_path / "cache", connections=4, chunk_bytes=256 << 10)
    got = c.resolve(url, sha(data))
    assert got.path.read_bytes() == data and got.digest == sha(data)
    with pytest.raises(errors.SourceNotFound):
        cache.Cache(tmp_path / "other").resolve(f"http://{registry.host}/v2/models/plain/blobs/sha256:{'0' * 64}")


def test_https_and_oci_over_tls_with_the_ca_from_the_environment(tmp_path: pathlib.Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    files = stores.self_signed(tmp_path)
    registry = stores.Registry(tmp_path, tls=files)
    try:
        data = os.urandom(1 << 20)
        (tmp_path / "model.onnx").write_bytes(data)
        registry.push("models/tls:v1", ["model.onnx"], tmp_path)
        url = f"https://{registry.host}/v2/models/tls/blobs/{sha(data)}"
        with pytest.raises(errors.SourceUntrusted, match="TLS certificate was not trusted") as caught:
            cache.Cache(tmp_path / "untrusted").resolve(url)  # a CA it does not know: refused, not fetched
        assert not caught.value.retry and "SOURCE_CA_BUNDLE" in str(caught.value) and url in str(caught.value)
        with pytest.raises(errors.SourceUntrusted, match="Secret 'ml/store'"):
            cache.Cache(tmp_path / "untrusted").resolve(f"oci://{registry.host}/models/tls:v1", sha(data),
                                                        {"SOURCE_PLAIN_HTTP": "false"}, secret="ml/store")
        # volga up's environment: SOURCE_CA_BUNDLE names a PEM file
        got = cache.Cache(tmp_path / "c0").resolve(url, sha(data), {"SOURCE_CA_BUNDLE": str(files[0])})
        assert got.path.read_bytes() == data
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(files[0]))
        got = cache.Cache(tmp_path / "c1").resolve(url)
        assert got.path.read_bytes() == data
        pulled = cache.Cache(tmp_path / "c2").resolve(f"oci://{registry.host}/models/tls:v1", sha(data),
                                                     {"SOURCE_PLAIN_HTTP": "false"})
        assert pulled.path.read_bytes() == data
    finally:
        registry.stop()


def test_an_s3_endpoint_with_an_untrusted_certificate_is_a_configuration_error(tmp_path: pathlib.Path) -> None:
    """versitygw over HTTPS with a certificate of a private CA: the fetch is refused naming the source, the Secret
    and the reason, is not tried again (one read of the Secret), and goes through once the Secret carries the CA's
    PEM as SOURCE_CA_BUNDLE."""
    from procs import wait_for

    from volga_agent.cluster import fetches
    from volga_core import planner

    model = defaultmodel.ensure().spec.source_path
    s3, files = stores.untrusted_s3(tmp_path, model)
    try:
        spec = api_spec(defaultmodel.spec_document(model), source="s3://models/tls/model.onnx", sourceSecret="store")
        core = SecretsApi({("ml", "store"): s3.credentials()})
        f = fetches.Fetches(core, lambda: None, root=str(tmp_path / "cache"))
        desired = [planner.Desired("ml.a-0", "ml/a", spec.model_id, "n", api.Tier.FROZEN)]

        def settled() -> fetches.Pending | None:
            f.localise({"ml/a": spec}, desired, lambda name: None)
            pending = f.pending.get("ml/a")
            return pending if pending is not None and pending.reason != "Fetching" else None

        pending = wait_for("the fetch to fail", settled, timeout=60)
        assert pending.reason == "SourceCertificateUntrusted", pending
        assert "s3://models/tls/model.onnx" in pending.message and "was not trusted" in pending.message
        assert "Secret 'ml/store'" in pending.message and "SOURCE_CA_BUNDLE" in pending.message
        f.applied()
        assert f.awaiting(spec.model_id) is None  # requests are not held for a fetch that is not tried again
        reads = core.reads
        for _ in range(3):
            f.localise({"ml/a": spec}, desired, lambda name: None)
        assert core.reads == reads == 1  # not tried again in a loop
        f.stop()

        core.secrets[("ml", "store")] = {**s3.credentials(), "SOURCE_CA_BUNDLE": files[0].read_text()}
        got = cache.Cache(tmp_path / "cache").resolve(spec.source, "", core.secrets[("ml", "store")],
                                                      secret="ml/store")
        assert got.path.read_bytes() == model.read_bytes()
    finally:
        s3.stop()


def test_volga_up_names_an_untrusted_certificate_and_takes_a_ca_file(tmp_path: pathlib.Path) -> None:
    """`volga up -f` with a model in an S3 store over HTTPS signed by a private CA: refused at once (exit 2) naming
    the source and the untrusted certificate; with SOURCE_CA_BUNDLE naming the CA's file it fetches."""
    import subprocess
    import sys

    import yaml

    model = defaultmodel.ensure().spec.source_path
    s3, files = stores.untrusted_s3(tmp_path, model)
    try:
        doc = defaultmodel.spec_document(model)
        doc["spec"]["source"] = "s3://models/tls/model.onnx"  # type: ignore[index]
        (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
        root = pathlib.Path(__file__).resolve().parents[2]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **s3.credentials(),
               "VOLGA_MODEL_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(root)}
        up = [sys.executable, "-m", "volga_agent.cli", "up", "-f", str(tmp_path / "spec.yaml"), "--snapshot-dir",
              str(tmp_path / "snapshots")]
        out = subprocess.run(up, capture_output=True, text=True, timeout=120, cwd=root, env=env)
        assert out.returncode == 2, out.stderr
        assert "s3://models/tls/model.onnx: the server's TLS certificate was not trusted" in out.stderr
        assert "SOURCE_CA_BUNDLE (a PEM file in volga up's environment" in out.stderr
        assert stores.SECRET not in out.stdout + out.stderr
        # The same checks `volga up` makes before it serves, with the CA's file in its environment.
        check = [sys.executable, "-c", "from volga_agent import cli; import sys; "
                 "print(cli.load_specs(sys.argv[1:]).specs[0].spec.source_digest)", str(tmp_path / "spec.yaml")]
        ok = subprocess.run(check, capture_output=True, text=True, timeout=120, cwd=root,
                            env={**env, "SOURCE_CA_BUNDLE": str(files[0])})
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.strip() == sha(model.read_bytes())
    finally:
        s3.stop()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # no fetch thread dies unheard
def test_a_full_disk_refuses_what_does_not_fit_and_evicts_only_what_makes_room(
        s3: stores.S3, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache on a 24 MiB file system: a model larger than what eviction could free is refused (CacheFull)
    without evicting anything; one that fits once a model no instance holds is evicted gets that room; the held
    model's bytes stay. A disk that has filled by the time the bytes are written: CacheFull, the space given
    back; on a file system without fallocate, the write that finds the disk full is CacheFull."""
    import errno

    from volga_agent.sources import download

    blobs = {name: os.urandom(mib << 20) for name, mib in (("a", 8), ("b", 8), ("c", 20), ("d", 12))}
    for name, data in blobs.items():
        s3.client().put_object(Bucket="models", Key=f"disk/{name}.onnx", Body=data)
    with stores.small_disk(tmp_path / "disk", 24) as disk:
        c = cache.Cache(disk / "cache")
        got = {name: c.resolve(f"s3://models/disk/{name}.onnx", "", s3.credentials()) for name in ("a", "b")}
        c.hold("served-a", got["a"].digest)  # an instance holds a; b is held by none
        with pytest.raises(errors.CacheFull, match="do not fit the model cache") as caught:
            c.resolve("s3://models/disk/c.onnx", "", s3.credentials())
        assert caught.value.reason == "CacheFull" and "s3://models/disk/c.onnx" in str(caught.value)
        assert got["b"].path.exists() and c.evictions == 0  # evicting b would not have made room: kept
        d = c.resolve("s3://models/disk/d.onnx", "", s3.credentials())
        assert d.path.read_bytes() == blobs["d"] and c.evictions == 1 and not got["b"].path.exists()
        assert got["a"].path.read_bytes() == blobs["a"]  # the held model's bytes were not touched
        assert not any((disk / "cache" / "partial").iterdir())

        # The disk filled by another writer after the cache looked: the fetch's reservation fails at once.
        free = shutil.disk_usage(disk).free
        part = disk / "cache" / "partial" / "x.part"
        with pytest.raises(errors.CacheFull, match="no space left on the cache's disk"):
            download.fetch(lambda start, end: iter([bytes(end - start)]), free + (1 << 20), part, "v1")
        assert part.stat().st_size == 0 and shutil.disk_usage(disk).free >= free - (64 << 10)

        # A file system without fallocate: the disk fills while the bytes are written, and that is CacheFull too.
        def no_fallocate(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.EOPNOTSUPP, "not supported")

        monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
        with pytest.raises(errors.CacheFull, match="the cache's disk filled during the fetch"):
            download.fetch(lambda start, end: iter([bytes(end - start)]), free + (1 << 20), part, "v2",
                           chunk_bytes=1 << 20)


@pytest.mark.slow
def test_volga_up_serves_the_model_that_fits_a_full_disk(s3: stores.S3, tmp_path: pathlib.Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`volga up -f` with two S3 models and its cache on a 100 MiB file system: the 70 MiB default model fits and
    is answered; the 40 MiB one does not (the first is held by its instance), is refused with the cache-full
    reason, and its requests answer UNAVAILABLE."""
    import numpy as np
    import tritonclient.http as httpclient
    import yaml

    from volga_agent.node import instance
    from volga_agent.worker import contract
    from volga_bench import harness

    spec = defaultmodel.ensure().spec
    s3.client().upload_file(str(spec.source_path), "models", "full/model.onnx")
    s3.client().put_object(Bucket="models", Key="full/big.onnx", Body=os.urandom(40 << 20))
    fits = defaultmodel.spec_document(spec.source_path)
    fits["spec"]["source"] = "s3://models/full/model.onnx"  # type: ignore[index]
    big = defaultmodel.spec_document(spec.source_path)
    big["metadata"] = {"name": "too-big"}
    big["spec"].update({"source": "s3://models/full/big.onnx", "modelId": "too-big"})  # type: ignore[union-attr]
    (tmp_path / "specs.yaml").write_text(yaml.safe_dump_all([fits, big]))
    for key, value in s3.credentials().items():
        monkeypatch.setenv(key, value)
    with stores.small_disk(tmp_path / "disk", 100) as disk:
        monkeypatch.setenv("VOLGA_MODEL_CACHE", str(disk / "cache"))
        with harness.volga_up(["-f", str(tmp_path / "specs.yaml"), "--snapshot-dir", str(tmp_path / "snaps")]) as up:
            client = httpclient.InferenceServerClient(up.endpoints["http"].removeprefix("http://"))
            decls = instance.decls(spec.inputs)
            x = contract.sample_inputs(decls, batch=2, seed=7)
            out = client.infer(spec.model_id, harness.triton_inputs(decls, x, httpclient)).as_numpy("probability")
            with pytest.raises(Exception, match="unavailable") as refused:
                client.infer("too-big", harness.triton_inputs(decls, x, httpclient))
            client.close()
        assert out.shape == (2, 1) and np.all((out > 0) & (out < 1))
        output = "".join(up.output)
        assert "s3://models/full/big.onnx" in output and "do not fit the model cache" in output, output[-3000:]
        assert "[503] model 'too-big' is unavailable" in str(refused.value)
        assert "s3://models/full/big.onnx: 41943040 bytes do not fit the model cache" in str(refused.value)
        assert not (disk / "cache" / "partial").exists() or not any((disk / "cache" / "partial").iterdir())


def test_an_unreachable_store_is_reported_and_tried_again(tmp_path: pathlib.Path) -> None:
    from procs import wait_for

    from volga_agent.cluster import fetches
    from volga_core import planner

    model = defaultmodel.ensure().spec.source_path
    spec = api_spec(defaultmodel.spec_document(model), source="s3://models/gone/model.onnx", sourceSecret="store")
    credentials = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b",
                   "AWS_ENDPOINT_URL": f"http://127.0.0.1:{stores.free_port()}"}
    core = SecretsApi({("ml", "store"): credentials})
    f = fetches.Fetches(core, lambda: None, root=str(tmp_path / "cache"))
    desired = [planner.Desired("ml.a-0", "ml/a", spec.model_id, "n", api.Tier.FROZEN)]

    def reported() -> fetches.Pending | None:
        f.localise({"ml/a": spec}, desired, lambda name: None)
        pending = f.pending.get("ml/a")
        return pending if pending is not None and pending.reason == "SourceUnavailable" else None

    pending = wait_for("the unreachable store to be reported", reported, timeout=60)
    assert "unreachable" in pending.message
    assert f.awaiting(spec.model_id) is not None  # requests keep waiting while it is tried again
    wait_for("a second attempt", lambda: core.reads >= 2, timeout=60)  # backoff: 2 s, then 4 s, ...
    f.stop()


def test_a_model_servers_folder_is_fetched_whole(s3: stores.S3, registry: stores.Registry,
                                                 tmp_path: pathlib.Path) -> None:
    """A server's source is its folder (code, data, no model file of a known kind, or several): fetched whole, it
    resolves to the folder; the same folder as a model's source is refused for having no model file to load."""
    folder = tmp_path / "scorer"
    (folder / "static").mkdir(parents=True)
    (folder / "app.py").write_text("print('serving')\n")
    (folder / "static" / "vocab.txt").write_text("a\nb\n")
    registry.push("servers/scorer:v1", ["scorer"], tmp_path)
    s3.client().put_object(Bucket="models", Key="scorer/app.py", Body=b"print('serving')\n")
    s3.client().put_object(Bucket="models", Key="scorer/static/vocab.txt", Body=b"a\nb\n")
    c = cache.Cache(tmp_path / "cache")
    want = cache.tree_digest({"app.py": sha(b"print('serving')\n")[7:], "static/vocab.txt": sha(b"a\nb\n")[7:]})
    for source, credentials in ((f"oci://{registry.host}/servers/scorer:v1", {}),
                                ("s3://models/scorer/", s3.credentials())):
        got = c.resolve(source, "", credentials, whole=True)
        assert got.path.is_dir() and got.digest == want, (source, got)
        assert (got.path / "static" / "vocab.txt").read_text() == "a\nb\n"
        assert c.lookup(source, want, whole=True) == dataclasses.replace(got, hit=True, seconds=0.0)
        assert c.lookup(source, want) is None  # no model file chosen in it
        with pytest.raises(errors.SourceNotFound, match="no model files at its top"):
            cache.Cache(tmp_path / f"models-{len(source)}").resolve(source, "", credentials)


def test_volga_up_serves_a_server_pushed_to_a_registry(registry: stores.Registry, tmp_path: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A FastAPI app the user pushed with `oras push` as a folder (its code beside a data file it reads) and a
    ModelSpec naming it by oci://: `volga up` fetches the folder into the model cache, runs the server in its
    `workingDir` inside it, freezes it at its floor, and a streamed request through the gateway wakes it and is
    answered as the HOT server answers."""
    import asyncio
    import json
    import subprocess
    import sys

    import aiohttp
    import yaml
    from procs import wait_for

    from volga_bench import harness

    app = tmp_path / "stream-app" / "src"
    app.mkdir(parents=True)
    root = pathlib.Path(__file__).resolve().parents[2]
    shutil.copy(root / "volga_bench" / "servers" / "stream_app.py", app / "app.py")
    registry.push("servers/stream:v1", ["stream-app"], tmp_path)
    doc = {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": "pushed"},
           "spec": {"modelId": "pushed", "framework": "server", "source": f"oci://{registry.host}/servers/stream:v1",
                    "pool": {"frozen": 1},
                    "server": {"command": [sys.executable, "-m", "uvicorn", "app:app", "--no-access-log", "--loop",
                                           "asyncio", "--port", "{port}"],
                               "workingDir": "src", "readiness": {"path": "/health"}}}}
    (tmp_path / "pushed.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("VOLGA_MODEL_CACHE", str(tmp_path / "cache"))

    def listed(up: harness.UpProcess) -> list[dict[str, str]]:
        out = subprocess.run([sys.executable, "-m", "volga_agent.cli", "status", "--agent", up.endpoints["agent"],
                              "--json"], capture_output=True, text=True, timeout=60, check=True, cwd=root)
        [model] = [m for m in json.loads(out.stdout)["models"] if m["modelId"] == "pushed"]
        return list(model["instanceList"])

    def tiers(up: harness.UpProcess) -> list[str]:
        return [i["tier"] for i in listed(up)]

    async def stream(url: str) -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as session, session.post(
                f"{url}/v1/stream", json={"prompt": "volga", "tokens": 6, "delay_ms": 10},
                headers={"x-model-id": "pushed"}) as reply:
            return reply.status, await reply.read()

    with harness.volga_up(["-f", str(tmp_path / "pushed.yaml"), "--snapshot-dir", str(tmp_path / "snapshots"),
                           "--idle-sec", "30"]) as up:
        wait_for("the server frozen at its floor", lambda: tiers(up) == ["FROZEN"], timeout=120, every=0.5)
        woken = asyncio.run(stream(up.endpoints["http"]))
        assert tiers(up) == ["HOT"]
        hot = asyncio.run(stream(up.endpoints["http"]))
        [where] = [i["source"] for i in listed(up)]  # `volga status` says where its files came from
    assert woken[0] == 200 and woken == hot and woken[1].count(b"data: ") == 7, (woken, hot)
    output = "".join(up.output)
    assert f"oci://{registry.host}/servers/stream:v1" in output
    [entry] = (tmp_path / "cache" / "sha256").iterdir()
    assert (entry / "src" / "app.py").is_file()
    assert where == f"bytes from oci://{registry.host}/servers/stream:v1, sha256:{entry.name}", where
