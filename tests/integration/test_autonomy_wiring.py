"""The autonomy loop wired into the node: in `volga up --autonomy` (loop, gateway and pool in one process) and
across the daemons (the agent runs the loop, the sidecar gateway pushes its load and enforces the loop's
directives over the Agent API). A protected model whose requests exceed its SLO makes the loop shed the tolerant
co-runner: an unmodified tritonclient gets RESOURCE_EXHAUSTED / 429 with the retry hint, and once the protected
model is quiet again the tolerant one is served again.

The protected model's baseline is set far below what any request can take, so that each of its windows with
requests violates its SLO whatever the machine's speed; the bench (`volga bench slo`) shows the same loop
against real interference.
"""

from __future__ import annotations

import pathlib
import sys
import urllib.request
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from procs import Daemon, wait_for
from traffic import Traffic
from tritonclient.utils import InferenceServerException

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.worker import contract
from volga_bench import harness

RETRY_MS = 700
SETTINGS = {"autonomyEnabled": True, "autonomyPreloadBelowPct": 0.0, "autonomyOptimizeAbovePct": 100.0,
            "autonomyEmergencyAbovePct": 100.0, "autonomyShedRetryAfterMs": RETRY_MS}


def specs_file(folder: pathlib.Path) -> pathlib.Path:
    """The default model twice: `strict` (15 %, a baseline no request meets) and `loose` (300 %, no baseline)."""
    base = defaultmodel.ensure().to_wire()
    documents = []
    for name, slo in (("strict", {"interferenceTolerancePct": 15.0, "recoveryDeadlineMs": 300.0,
                                  "baselineLatencyMs": {"1": 0.001}}),
                      ("loose", {"interferenceTolerancePct": 300.0, "recoveryDeadlineMs": 5000.0})):
        doc: dict[str, Any] = yaml.safe_load(yaml.safe_dump(base))
        doc["metadata"]["name"] = doc["spec"]["modelId"] = name
        doc["spec"]["slo"] = slo
        documents.append(doc)
    path = folder / "specs.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    return path


def settings_file(folder: pathlib.Path) -> pathlib.Path:
    path = folder / "settings.yaml"
    path.write_text(yaml.safe_dump(SETTINGS))
    return path


def shed_then_unshed(grpc_address: str, http_address: str) -> None:
    """Load `strict` until `loose` is shed (seen by tritonclient over gRPC and REST), then quiet `strict` until
    `loose` is served again."""
    decls = instance.decls(defaultmodel.ensure().spec.inputs)
    x = contract.sample_inputs(decls, batch=2, seed=3)
    g = grpcclient.InferenceServerClient(grpc_address)
    h = httpclient.InferenceServerClient(http_address)
    strict = Traffic(grpc_address, "strict", harness.triton_inputs(decls, x))
    try:
        assert g.infer("loose", harness.triton_inputs(decls, x)).as_numpy("probability").shape == (2, 1)

        def shed_error() -> tuple[InferenceServerException] | None:
            try:
                g.infer("loose", harness.triton_inputs(decls, x))
            except InferenceServerException as exc:
                return (exc,)  # wait_for takes a returned exception for a failed check
            return None

        [err] = wait_for("the loop to shed the tolerant model", shed_error, timeout=120, every=0.05)
        assert str(err.status()) == "StatusCode.RESOURCE_EXHAUSTED"
        assert f"retry after {RETRY_MS} ms" in str(err)
        with pytest.raises(InferenceServerException, match=f"retry after {RETRY_MS} ms") as http_err:
            h.infer("loose", harness.triton_inputs(decls, x, httpclient))
        assert str(http_err.value.status()) == "429"
        assert strict.answered > 0  # the protected model is never shed
    finally:
        strict.close()

    def served() -> bool:
        try:
            out = g.infer("loose", harness.triton_inputs(decls, x)).as_numpy("probability")
        except InferenceServerException as exc:
            assert str(exc.status()) == "StatusCode.RESOURCE_EXHAUSTED", exc
            return False
        return bool(out.shape == (2, 1) and np.all((out > 0) & (out < 1)))

    wait_for("the loop to unshed the tolerant model", served, timeout=120, every=0.1)
    g.close()
    h.close()


def metric(url: str, name: str, labels: str) -> float:
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith(f"{name}{{{labels}}} " if labels else f"{name} "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.slow
def test_volga_up_with_autonomy_sheds_the_tolerant_model_and_unsheds_it_after(tmp_path: pathlib.Path) -> None:
    folder = tmp_path
    args = ["-f", str(specs_file(folder)), "--autonomy", "--settings", str(settings_file(folder)),
            "--snapshot-dir", str(folder / "snapshots")]
    with harness.volga_up(args) as up:
        shed_then_unshed(up.endpoints["grpc"], up.endpoints["http"].removeprefix("http://"))
        # The loop's metrics are in the agent's registry, on volga up's /metrics.
        url = up.endpoints["metrics"]
        assert metric(url, "volga_autonomy_decisions_total", 'action="Shed"') >= 1
        assert metric(url, "volga_autonomy_decisions_total", 'action="Unshed"') >= 1
        assert metric(url, "volga_slo_violating_windows_total", 'model="strict"') >= 1
        assert metric(url, "volga_autonomy_decision_latency_us_count", "") >= 1


@pytest.mark.slow
def test_the_sidecar_gateway_exchanges_its_load_for_the_agents_directives(tmp_path: pathlib.Path) -> None:
    folder = tmp_path
    specs = specs_file(folder)
    bindir = pathlib.Path(sys.executable).parent
    agent = Daemon("agent", [str(bindir / "volga-agent"), "-f", str(specs), "--node", "n1", "--port", "0",
                             "--metrics-port", "0", "--workdir", str(folder / "w"), "--settings",
                             str(settings_file(folder)), "--snapshot-dir", str(folder / "snapshots")],
                   {}, folder, "volga-agent")
    address = f"127.0.0.1:{agent.port('Agent API')}"
    gateway = Daemon("gateway", [str(bindir / "volga-gateway"), "-f", str(specs), "--agent", address,
                                 "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                     {}, folder, "volga-gateway")
    try:
        shed_then_unshed(f"127.0.0.1:{gateway.port('gRPC')}", f"127.0.0.1:{gateway.port('HTTP')}")
    finally:
        assert gateway.stop() == 0
        assert agent.stop() == 0
