"""The operator's writes on a real kube-apiserver + etcd: a new ModelSpec costs its EMIs and one status write (no
finalizer: a deleted ModelSpec's EMIs go all the same, without the garbage collector this API server lacks); a
reconcile with nothing to change writes nothing; a restarted operator writes nothing where all is
right; the write limit holds as the API server counts writes.

The module has its own control plane (k8s_fixtures.own_control_plane), so the API server's request counters
(`apiserver_request_total`) hold only this module's writes, and the resourceVersions of the objects show whether
anything was written to them."""

from __future__ import annotations

import contextlib
import pathlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
from kubernetes import client as k8s
from procs import Daemon, wait_for

from volga_bench import scale
from volga_bench.controlplane import ControlPlane
from volga_core import api, nodes
from volga_core.api import crds

pytest_plugins = ["k8s_fixtures"]
pytestmark = pytest.mark.slow
NODES = ("gpu-a", "gpu-b", "gpu-c")
WANT_EMIS = 2  # scale.modelspec's pool: one WARM, one FROZEN


@pytest.fixture(scope="module")
def plane(own_control_plane: ControlPlane) -> ControlPlane:
    cp = own_control_plane
    client = cp.api_client()
    ext = k8s.ApiextensionsV1Api(client)
    for crd in crds.all_crds().values():
        ext.create_custom_resource_definition(crd)  # type: ignore[arg-type]
    core = k8s.CoreV1Api(client)
    profile = nodes.NodeProfile("", 8, scale.PRODUCT, 141 * 2**30, (0,)).annotations()
    for node in NODES:
        core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=node, annotations=profile)))
    wait_for("the CRDs to serve", lambda: k8s.CustomObjectsApi(client).list_cluster_custom_object(
        api.GROUP, api.VERSION, "modelspecs") is not None)
    client.close()
    return cp


@pytest.fixture
def kube(plane: ControlPlane) -> Iterator[k8s.CustomObjectsApi]:
    client = plane.api_client()
    yield k8s.CustomObjectsApi(client)
    client.close()


@contextlib.contextmanager
def operator(plane: ControlPlane, folder: pathlib.Path, name: str, **env: str) -> Iterator[Daemon]:
    """The operator as deployed, planning everything again every second (VOLGA_RESYNC_SEC=1)."""
    daemon = Daemon(name, [sys.executable, "-m", "volga_operator", "--liveness", "", "-v"],
                    {"KUBECONFIG": str(plane.kubeconfig), "VOLGA_RESYNC_SEC": "1", **env}, folder)
    try:
        wait_for(f"{name}'s first pass", lambda: "first pass done" in daemon.log.read_text(), timeout=60)
        yield daemon
    finally:
        assert daemon.stop() == 0, daemon.log.read_text()[-3000:]


def resync_passes(daemon: Daemon) -> int:
    return daemon.log.read_text().count("resync pass:")


def after_resyncs(daemon: Daemon, count: int = 2) -> None:
    """Wait until the operator has planned every ModelSpec again `count` more times."""
    start = resync_passes(daemon)
    wait_for(f"{count} resync passes", lambda: resync_passes(daemon) >= start + count, timeout=60)


def create_namespace(kube: k8s.CustomObjectsApi, namespace: str) -> None:
    k8s.CoreV1Api(kube.api_client).create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=namespace)))


def create_specs(kube: k8s.CustomObjectsApi, namespace: str, count: int) -> list[str]:
    names = []
    for i in range(count):
        body = scale.modelspec(i, "/models/model.onnx")
        body["metadata"]["namespace"] = namespace
        kube.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "modelspecs", body)
        names.append(body["metadata"]["name"])
    return names


def items(kube: k8s.CustomObjectsApi, namespace: str, plural: str) -> list[dict[str, Any]]:
    listed = cast(dict[str, Any], kube.list_namespaced_custom_object(api.GROUP, api.VERSION, namespace, plural))
    return cast(list[dict[str, Any]], listed["items"])


def converged(kube: k8s.CustomObjectsApi, namespace: str, count: int) -> bool:
    specs = items(kube, namespace, "modelspecs")
    done = [m for m in specs if (m.get("status") or {}).get("observedGeneration") == m["metadata"]["generation"]
            and m["status"].get("instances") == WANT_EMIS]
    return len(done) == count and len(items(kube, namespace, "executablemodelinstances")) == count * WANT_EMIS


def versions(kube: k8s.CustomObjectsApi) -> dict[tuple[str, str, str], str]:
    """Every ModelSpec's and EMI's resourceVersion: any write to one changes it."""
    out = {}
    for plural in ("modelspecs", "executablemodelinstances"):
        listed = cast(dict[str, Any], kube.list_cluster_custom_object(api.GROUP, api.VERSION, plural))
        for obj in listed["items"]:
            meta = obj["metadata"]
            out[(plural, meta["namespace"], meta["name"])] = meta["resourceVersion"]
    return out


def writes(plane: ControlPlane) -> dict[str, float]:
    client = plane.api_client()
    try:
        return {k.removeprefix("operator:"): v for k, v in scale.write_counts(scale._metrics(client)).items()}
    finally:
        client.close()


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    """What changed, leaving out "other": the API server's own writes (it renews its lease every 10 s)."""
    return {k: int(v - before.get(k, 0)) for k, v in after.items() if v != before.get(k, 0) and k != "other"}


def test_a_noop_reconcile_writes_nothing(plane: ControlPlane, kube: k8s.CustomObjectsApi,
                                         tmp_path: pathlib.Path) -> None:
    create_namespace(kube, "noop")
    before = writes(plane)
    with operator(plane, tmp_path, "operator") as daemon:
        names = create_specs(kube, "noop", 4)
        wait_for("the ModelSpecs to converge", lambda: converged(kube, "noop", len(names)))
        after_resyncs(daemon)
        # The EMIs and one status write per ModelSpec: nothing else.
        assert delta(writes(plane), before) == {
            "operator": 3 * len(names), "modelspec_creates": len(names),
            "POST executablemodelinstances": WANT_EMIS * len(names), "PATCH modelspecs/status": len(names)}

        held = versions(kube)
        before = writes(plane)
        # Events that change nothing the operator decides on: an annotation, a source the operator does not read.
        kube.patch_namespaced_custom_object(api.GROUP, api.VERSION, "noop", "modelspecs", names[0],
                                            {"metadata": {"annotations": {"example.com/owner": "team-a"}}})
        changed = cast(dict[str, Any], kube.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, "noop", "modelspecs", names[1], {"spec": {"source": "/models/other.onnx"}}))
        wait_for("the new generation's status", lambda: all(
            (m.get("status") or {}).get("observedGeneration") == m["metadata"]["generation"]
            for m in items(kube, "noop", "modelspecs")))
        after_resyncs(daemon)
        # The operator wrote the changed spec's observedGeneration and nothing else; the two PATCHes are the test's.
        assert delta(writes(plane), before) == {"operator": 3, "PATCH modelspecs": 2, "PATCH modelspecs/status": 1}
        now = versions(kube)
        assert {k for k in held if now[k] != held[k]} == {("modelspecs", "noop", names[0]),
                                                           ("modelspecs", "noop", names[1])}
        assert int(now[("modelspecs", "noop", names[1])]) > int(changed["metadata"]["resourceVersion"])


def test_a_restart_writes_nothing_when_all_is_right(plane: ControlPlane, kube: k8s.CustomObjectsApi,
                                                    tmp_path: pathlib.Path) -> None:
    create_namespace(kube, "restart")
    with operator(plane, tmp_path, "operator"):
        names = create_specs(kube, "restart", 6)
        wait_for("the ModelSpecs to converge", lambda: converged(kube, "restart", len(names)))
    held = versions(kube)
    before = writes(plane)
    with operator(plane, tmp_path, "operator-again") as daemon:
        assert "0 writes, 0 failed" in daemon.log.read_text()
        after_resyncs(daemon)
        assert delta(writes(plane), before) == {}
        assert versions(kube) == held


def test_the_write_limit_holds_as_the_api_server_counts(plane: ControlPlane, kube: k8s.CustomObjectsApi,
                                                        tmp_path: pathlib.Path) -> None:
    limit = 20.0
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.monotonic(), writes(plane)["operator"]))
            stop.wait(0.25)

    with operator(plane, tmp_path, "operator", VOLGA_API_WRITES_PER_SEC=str(limit)):
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        wait_for("a first sample", lambda: samples)
        create_namespace(kube, "limit")
        names = create_specs(kube, "limit", 30)
        wait_for("the ModelSpecs to converge", lambda: converged(kube, "limit", len(names)), timeout=120)
        wait_for("a sample after the last write", lambda: samples[-1][1] == writes(plane)["operator"])
        stop.set()
        sampler.join()
    start = samples[0][1]
    total = samples[-1][1] - start
    assert total == 3 * len(names)
    # All the writes landed between the last sample that saw none of them and the first that saw all of them.
    began = max(t for t, n in samples if n == start)
    ended = min(t for t, n in samples if n == samples[-1][1])
    assert total <= limit * (ended - began) + 1, (total, ended - began)


def owned_emis(kube: k8s.CustomObjectsApi, namespace: str, name: str) -> list[dict[str, Any]]:
    return [e for e in items(kube, namespace, "executablemodelinstances") if e["spec"]["modelSpec"] == name]


def test_deleted_modelspecs_lose_their_emis_without_a_finalizer(plane: ControlPlane, kube: k8s.CustomObjectsApi,
                                                                 tmp_path: pathlib.Path) -> None:
    """This API server runs no garbage collector (no kube-controller-manager), so what removes the EMIs here is the
    operator alone: at once while it runs, at its first pass when it was away; and an EMI of a deleted ModelSpec is
    not adopted by a new one of the same name."""
    create_namespace(kube, "delete")
    with operator(plane, tmp_path, "operator"):
        names = create_specs(kube, "delete", 3)
        wait_for("the ModelSpecs to converge", lambda: converged(kube, "delete", len(names)))
        first = cast(dict[str, Any], kube.get_namespaced_custom_object(api.GROUP, api.VERSION, "delete",
                                                                      "modelspecs", names[2]))
        assert not first["metadata"].get("finalizers")
        kube.delete_namespaced_custom_object(api.GROUP, api.VERSION, "delete", "modelspecs", names[0])
        assert names[0] not in [m["metadata"]["name"] for m in items(kube, "delete", "modelspecs")]
        wait_for("the deleted ModelSpec's EMIs to go", lambda: not owned_emis(kube, "delete", names[0]))
    # While the operator is away: one ModelSpec deleted, one deleted and made again under the same name.
    kube.delete_namespaced_custom_object(api.GROUP, api.VERSION, "delete", "modelspecs", names[1])
    kube.delete_namespaced_custom_object(api.GROUP, api.VERSION, "delete", "modelspecs", names[2])
    body = scale.modelspec(2, "/models/model.onnx")
    body["metadata"]["namespace"] = "delete"
    again = cast(dict[str, Any], kube.create_namespaced_custom_object(api.GROUP, api.VERSION, "delete", "modelspecs",
                                                                      body))
    assert again["metadata"]["uid"] != first["metadata"]["uid"]
    assert len(owned_emis(kube, "delete", names[1])) == WANT_EMIS

    def renewed() -> bool:
        emis = owned_emis(kube, "delete", names[2])
        return len(emis) == WANT_EMIS and all(
            [r["uid"] for r in e["metadata"]["ownerReferences"]] == [again["metadata"]["uid"]] for e in emis)

    with operator(plane, tmp_path, "operator-again"):
        wait_for("the EMIs of the ModelSpec deleted while away to go", lambda: not owned_emis(kube, "delete", names[1]))
        wait_for("the new ModelSpec's own EMIs", renewed)
        wait_for("the new ModelSpec to converge", lambda: converged(kube, "delete", 1))
    assert not owned_emis(kube, "delete", names[0])
