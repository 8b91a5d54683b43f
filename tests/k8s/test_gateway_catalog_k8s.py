"""A gateway in a cluster says it is ready (`/v2/health/ready`, the OIP's ServerReady) only once its catalog holds
the cluster's ModelSpecs and EMIs. Before it has listed them it knows no model: ready then, it would answer 404 for
every request a load balancer sends it."""

from __future__ import annotations

import pathlib
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import tritonclient.grpc as grpcclient
import yaml
from k8s_fixtures import install_crds
from kubernetes import client as k8s
from procs import Daemon, wait_for

from volga_agent.cluster import catalog as catalog_sync
from volga_agent.gateway import app, catalog, links
from volga_bench import harness
from volga_bench.controlplane import ControlPlane, free_ports
from volga_core import api

pytest_plugins = ["k8s_fixtures"]
MODEL = "catalog-ready"


def _status(url: str) -> int:
    """The HTTP status a GET of `url` answers; 0 while nothing listens there."""
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _health(gateway: app.Gateway) -> int:
    return _status(f"http://127.0.0.1:{gateway.ports['http']}/v2/health/ready")


def _server_ready(gateway: app.Gateway) -> bool:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ports['grpc']}")
    try:
        return bool(client.is_server_ready())
    finally:
        client.close()


@pytest.fixture
def background() -> Iterator[harness.Background]:
    bg = harness.Background()
    yield bg
    bg.close()


def _started(bg: harness.Background, client: k8s.ApiClient, wait_s: float
             ) -> tuple[catalog_sync.CatalogSync, bool, app.Gateway]:
    models = catalog.Catalog()
    sync = catalog_sync.CatalogSync(models, client)  # it closes the client when stopped
    listed = bg.call(sync.start(wait_s))
    gateway = app.Gateway(models, links.LocalAgentLink(lambda model, hint: links.Route("", "")),
                          app.Settings(host="127.0.0.1", http_port=0, grpc_port=0, metrics_port=0))
    bg.call(gateway.start())
    return sync, listed, gateway


def test_a_gateway_is_not_ready_while_the_api_server_has_not_listed_its_models(
        background: harness.Background, control_plane: ControlPlane, tmp_path: pathlib.Path) -> None:
    unreachable = control_plane.kubeconfig_dict()
    [port] = free_ports(1)
    unreachable["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"  # nothing listens there
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump(unreachable))
    sync, listed, gateway = _started(background, control_plane.api_client(config), wait_s=1.0)
    try:
        assert not listed and not gateway.dataplane.catalog.loaded
        assert _health(gateway) == 503
        assert not _server_ready(gateway)
    finally:
        background.call(gateway.stop(), timeout=30)
        background.call(sync.stop(), timeout=30)


def test_a_gateway_is_ready_once_it_knows_the_clusters_models(
        background: harness.Background, control_plane: ControlPlane, tmp_path: pathlib.Path) -> None:
    install_crds(control_plane)
    doc = {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": MODEL, "namespace": "default"},
           "spec": {"modelId": MODEL, "framework": "server", "source": str(tmp_path),
                    "server": {"command": [sys.executable, "-m", "http.server", "{port}"]}}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    control_plane.kubectl("apply", "-f", str(tmp_path / "spec.yaml"))
    sync, listed, gateway = _started(background, control_plane.api_client(), wait_s=60.0)
    try:
        # Started, the gateway already knows the model: no request finds it unknown.
        assert listed and gateway.dataplane.catalog.loaded and gateway.dataplane.catalog.known(MODEL)
        assert _health(gateway) == 200
        assert _server_ready(gateway)
    finally:
        background.call(gateway.stop(), timeout=30)
        background.call(sync.stop(), timeout=30)
        control_plane.kubectl("delete", "ms", MODEL, "--ignore-not-found")


def test_the_gateway_process_is_alive_and_not_ready_while_its_catalog_loads(
        control_plane: ControlPlane, tmp_path: pathlib.Path) -> None:
    """`volga-gateway --kube` with the API server out of reach: its HTTP port answers at once, alive (a liveness
    probe does not restart it) and not ready (a readiness probe keeps traffic away)."""
    unreachable = control_plane.kubeconfig_dict()
    [api_port, http_port, grpc_port] = free_ports(3)
    unreachable["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{api_port}"
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump(unreachable))
    gateway = Daemon("gateway", [
        str(pathlib.Path(sys.executable).with_name("volga-gateway")), "--kube", "--agent", "127.0.0.1:1", "--node",
        "nowhere", "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--metrics-port", "0"], {"KUBECONFIG": str(config)}, tmp_path)
    base = f"http://127.0.0.1:{http_port}/v2/health"

    def status(path: str) -> int:
        return _status(f"{base}/{path}")

    try:
        wait_for("the gateway alive", lambda: status("live") == 200, timeout=30)
        assert status("ready") == 503
        assert "volga-gateway: HTTP" not in gateway.log.read_text()  # not announced while it waits for its lists
    finally:
        assert gateway.stop() == 0, gateway.log.read_text()[-2000:]
