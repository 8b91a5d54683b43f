"""pytest fixtures for a real control plane (see volga_bench.controlplane). A test module enables them with

    pytest_plugins = ["k8s_fixtures"]

(tests/ is on sys.path through pytest's `pythonpath` setting, so the plugin imports as a top-level module; the
tests in tests/k8s and tests/images use it). Missing binaries FAIL the test rather than skip it: CI builds them with
scripts/build-k8s-bins.sh.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s_client
from kubernetes.client import V1Namespace, V1ObjectMeta

from volga_bench.controlplane import ControlPlane, ControlPlaneError, MissingBinariesError
from volga_core import api


@contextlib.contextmanager
def _started() -> Iterator[ControlPlane]:
    try:
        cp = ControlPlane()
    except MissingBinariesError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        cp.start()
    except ControlPlaneError as exc:
        cp.stop()
        pytest.fail(str(exc), pytrace=False)
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    """etcd and kube-apiserver for the whole session; tests share it, so each should use its own namespace."""
    with _started() as cp:
        yield cp


@pytest.fixture(scope="module")
def own_control_plane() -> Iterator[ControlPlane]:
    """etcd and kube-apiserver for one module alone: the API server's request counters and the objects'
    resourceVersions hold only that module's writes."""
    with _started() as cp:
        yield cp


def control_plane_of_its_own() -> Any:
    """A module's `control_plane` fixture on a control plane of the module's own, Volga's CRDs installed; a module
    takes it with `control_plane = k8s_fixtures.control_plane_of_its_own()` where the session's would not do (there,
    Nodes that earlier modules made with no agent on them can take its EMIs' slots, which are then never served)."""

    @pytest.fixture(scope="module", name="control_plane")
    def plane(own_control_plane: ControlPlane) -> ControlPlane:
        install_crds(own_control_plane)
        return own_control_plane

    return plane


@pytest.fixture
def kube_client(control_plane: ControlPlane) -> Iterator[k8s_client.ApiClient]:
    """An ApiClient authenticated as the admin (O=system:masters) of the session's control plane."""
    api = control_plane.api_client()
    try:
        yield api
    finally:
        api.close()  # type: ignore[no-untyped-call]


def install_crds(cp: ControlPlane, within_sec: float = 120.0) -> None:
    """Volga's CRDs (crds/), applied to a control plane and Established: their conditions are read until they say
    so, and a CRD that does not get there within `within_sec` fails naming the conditions it has."""
    cp.kubectl("apply", "-f", str(pathlib.Path(__file__).resolve().parent.parent / "crds"))
    deadline = time.monotonic() + within_sec
    for name in ("modelspecs.volga.dev", "executablemodelinstances.volga.dev"):
        while True:
            crd = json.loads(cp.kubectl("get", f"crd/{name}", "-o", "json").stdout)
            # A CRD just created has `status.conditions: null` until its controller has looked at it.
            conditions = {c["type"]: c["status"] for c in (crd.get("status") or {}).get("conditions") or []}
            if conditions.get("Established") == "True":
                break
            assert time.monotonic() < deadline, f"crd/{name} not Established within {within_sec:.0f} s: {conditions}"
            time.sleep(0.5)


@pytest.fixture(scope="session")
def crds(control_plane: ControlPlane) -> None:
    """Volga's CRDs (crds/), applied to the session's control plane and Established."""
    install_crds(control_plane)


@pytest.fixture
def custom(crds: None, kube_client: k8s_client.ApiClient) -> Iterator[tuple[k8s_client.CustomObjectsApi, str]]:
    """A namespace of its own on the session's control plane, with Volga's CRDs: (the objects' API, namespace)."""
    namespace = f"vt-{uuid.uuid4().hex[:8]}"  # left in place: no namespace controller runs
    k8s_client.CoreV1Api(kube_client).create_namespace(V1Namespace(metadata=V1ObjectMeta(name=namespace)))
    objects = k8s_client.CustomObjectsApi(kube_client)
    yield objects, namespace
    # The control plane is shared: an operator started by a later test would place what is left here.
    objects.delete_collection_namespaced_custom_object(api.GROUP, api.VERSION, namespace, "modelspecs")
