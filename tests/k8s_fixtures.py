"""pytest fixtures for a real control plane (see volga_bench.controlplane). A test module enables them with

    pytest_plugins = ["k8s_fixtures"]

(tests/ is on sys.path through tests/conftest.py, so the plugin imports as a top-level module).
Missing binaries FAIL the test rather than skip it: CI builds them with scripts/build-k8s-bins.sh.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from kubernetes import client as k8s_client

from volga_bench.controlplane import ControlPlane, ControlPlaneError, MissingBinariesError


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    """etcd and kube-apiserver for the whole session; tests share it, so each should use its own namespace."""
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


@pytest.fixture
def kube_client(control_plane: ControlPlane) -> Iterator[k8s_client.ApiClient]:
    """An ApiClient authenticated as the admin (O=system:masters) of the session's control plane."""
    api = control_plane.api_client()
    try:
        yield api
    finally:
        api.close()  # type: ignore[no-untyped-call]


@pytest.fixture(scope="session")
def crds(control_plane: ControlPlane) -> None:
    """Volga's CRDs (crds/), applied to the session's control plane and Established."""
    control_plane.kubectl("apply", "-f", str(pathlib.Path(__file__).resolve().parent.parent / "crds"))
    control_plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/modelspecs.volga.dev",
                          "crd/executablemodelinstances.volga.dev")
