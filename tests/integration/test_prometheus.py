"""A real Prometheus scrapes a running agent and gateway, and the PromQL of the chart's dashboard answers with the
restores this test performed.

`volga up`'s parts run in this process (real workers, real CRIU); Prometheus (Debian's `prometheus` package) scrapes
their metrics endpoint, which serves the gateway's and the agent's registries, every second. The test freezes the
default model's instance and wakes it with tritonclient requests through the gateway, then asks Prometheus.
"""

from __future__ import annotations

import json
import math
import pathlib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
import tritonclient.grpc as grpcclient
from procs import wait_for
from prometheus_server import Prometheus

from volga_agent.app import defaultmodel
from volga_agent.app import up as volga_up
from volga_agent.worker import contract
from volga_bench import harness
from volga_core import api

# tritonclient's __del__ may warn from whichever thread collects it.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "volga" / "dashboards" / "volga.json"
RESTORES = 3
RESTORE_P99 = 'histogram_quantile(0.99, sum by (le, tier) (rate(volga_snapshot_restore_latency_ms_bucket[1m])))'


@pytest.fixture(scope="module")
def up() -> Iterator[volga_up.Embedded]:
    bg, embedded = harness.start_embedded([defaultmodel.ensure()])
    try:
        bg.call(embedded.wait_converged(), timeout=300)
        yield embedded
    finally:
        bg.call(embedded.stop(), timeout=60)
        bg.close()


@pytest.fixture(scope="module")
def prometheus(up: volga_up.Embedded, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    target = urllib.parse.urlsplit(up.endpoints()["metrics"]).netloc
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), target)
    try:
        yield server
    finally:
        server.stop()


def test_prometheus_sees_the_restores_performed(up: volga_up.Embedded, prometheus: Prometheus) -> None:
    model = defaultmodel.MODEL_ID
    name = up.pool.instances(model)[0].name
    decls = up.gateway.catalog.decls(model)
    inputs = harness.triton_inputs(decls, contract.sample_inputs(decls, batch=4, seed=5))
    registry = up.agent_metrics.registry
    frozen = {"tier": api.Tier.FROZEN.value, "model": model}
    client = grpcclient.InferenceServerClient(up.endpoints()["grpc"])

    def wake_from_frozen() -> None:
        up.pool.move_to(name, api.Tier.FROZEN)
        client.infer(model, inputs, headers={"x-model-id": model})  # the gateway wakes the instance: a restore

    def prometheus_count() -> float | None:
        return prometheus.scalar(f'sum(volga_snapshot_restore_latency_ms_count{{tier="FROZEN",model="{model}"}})')

    try:
        wait_for("the target to be up", lambda: prometheus.scalar('up{job="volga"}') == 1, timeout=60)
        before = registry.get_sample_value("volga_snapshot_restore_latency_ms_count", frozen)
        assert prometheus_count() is None and before is None, "restores happened before the test made any"
        # One restore first, seen by a scrape, so that rate() over the window sees the next ones as an increase.
        wake_from_frozen()
        wait_for("Prometheus to see the first restore", lambda: prometheus_count() == 1, timeout=60)
        for _ in range(RESTORES - 1):
            wake_from_frozen()
        wait_for(f"Prometheus to see {RESTORES} restores", lambda: prometheus_count() == RESTORES, timeout=60)
    finally:
        client.close()

    # What the agent recorded in its own registry is what the test did, and what Prometheus stored.
    assert registry.get_sample_value("volga_snapshot_restore_latency_ms_count", frozen) == RESTORES

    result = prometheus.query(RESTORE_P99)
    by_tier = {r["metric"].get("tier"): float(r["value"][1]) for r in result}
    assert set(by_tier) == {"FROZEN"}, result
    assert math.isfinite(by_tier["FROZEN"]) and by_tier["FROZEN"] > 0, result
    # The gateway's registry is scraped from the same endpoint: every wake was an answered request.
    assert prometheus.scalar(f'sum(volga_gateway_requests_total{{code="OK",model="{model}"}})') == RESTORES
    assert prometheus.scalar(f'sum(volga_activations_total{{tier="FROZEN",model="{model}"}})') == RESTORES
    assert (prometheus.scalar("sum(volga_emis_active_total)") or 0) >= 1


def test_dashboard_queries_run_on_the_scraped_series(up: volga_up.Embedded, prometheus: Prometheus) -> None:
    """Every PromQL expression of the Grafana dashboard parses and runs on real series (Grafana's variables set as
    Grafana would); the restore latency panels return the FROZEN tier of the default model."""
    wait_for("restores to be scraped",
             lambda: prometheus.scalar("sum(volga_snapshot_restore_latency_ms_count)") == RESTORES, timeout=60)
    dashboard = json.loads(DASHBOARD.read_text())
    answered = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$model", ".*")
            answered[(panel["title"], target["refId"])] = prometheus.query(expr)
    for title in ("Restore latency p50 by tier and model", "Restore latency p99 by tier and model"):
        series = answered[(title, "A")]
        labels = {(r["metric"].get("tier"), r["metric"].get("model")) for r in series}
        assert ("FROZEN", defaultmodel.MODEL_ID) in labels, (title, series)
    assert answered[("Requests by code", "A")], "no request series"
