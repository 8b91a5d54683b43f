"""Neighbours across real processes: three agents (nodes a, b, c) trade their water levels over the Agent API and
three sidecar gateways learn them through ExchangeLoad. Node a's autonomy loop is driven into shedding its
tolerant model `loose` (its protected model `strict` has a baseline no request meets, as in
tests/integration/test_autonomy_wiring.py); an unmodified tritonclient request for `loose` to a's gateway is then
answered by the gateway of b or c, which have the model, instead of RESOURCE_EXHAUSTED. A request that was forwarded
already is not passed on again. The neighbours are given with --neighbour (no API server needed); the Node
annotation discovery is the same ring over another directory.
"""

from __future__ import annotations

import pathlib
import re
import sys
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from procs import Daemon, series, wait_for
from traffic import Traffic
from tritonclient.utils import InferenceServerException

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.worker import contract
from volga_bench import controlplane, harness

RETRY_MS = 700
NODES = ("a", "b", "c")
SETTINGS = {"autonomyEnabled": True, "autonomyPreloadBelowPct": 0.0, "autonomyOptimizeAbovePct": 100.0,
            "autonomyEmergencyAbovePct": 100.0, "autonomyShedRetryAfterMs": RETRY_MS,
            "neighboursEnabled": True, "neighboursPeriodMs": 200.0}


def specs_file(folder: pathlib.Path, node: str) -> pathlib.Path:
    """Node a: `strict` (a baseline no request meets) and `loose`; nodes b and c: `loose` only."""
    base = defaultmodel.ensure().to_wire()
    documents = []
    slos = {"strict": {"interferenceTolerancePct": 15.0, "recoveryDeadlineMs": 300.0,
                       "baselineLatencyMs": {"1": 0.001}},
            "loose": {"interferenceTolerancePct": 300.0, "recoveryDeadlineMs": 5000.0}}
    for name in ("strict", "loose") if node == "a" else ("loose",):
        doc: dict[str, Any] = yaml.safe_load(yaml.safe_dump(base))
        doc["metadata"]["name"] = doc["spec"]["modelId"] = name
        doc["spec"]["slo"] = slos[name]
        documents.append(doc)
    path = folder / f"specs-{node}.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    return path


@pytest.mark.slow
def test_an_overloaded_nodes_gateway_passes_a_shed_models_request_to_a_neighbour(tmp_path: pathlib.Path) -> None:
    folder = tmp_path
    bindir = pathlib.Path(sys.executable).parent
    (folder / "settings.yaml").write_text(yaml.safe_dump(SETTINGS))
    (folder / "token").write_text("neighbours-test-token\n")
    ports = controlplane.free_ports(4 * len(NODES))
    agent_port = dict(zip(NODES, ports[0:3], strict=True))
    grpc_port = dict(zip(NODES, ports[3:6], strict=True))
    agent_metrics = dict(zip(NODES, ports[6:9], strict=True))
    gateway_metrics = dict(zip(NODES, ports[9:12], strict=True))
    flags = [f"--neighbour={n}=127.0.0.1:{agent_port[n]}" for n in NODES]
    daemons: list[Daemon] = []
    try:
        for node in NODES:
            daemons.append(Daemon(f"agent-{node}", [
                str(bindir / "volga-agent"), "-f", str(specs_file(folder, node)), "--node", node,
                "--port", str(agent_port[node]), "--metrics-port", str(agent_metrics[node]),
                "--token-file", str(folder / "token"), "--workdir", str(folder / f"w-{node}"),
                "--snapshot-dir", str(folder / f"snapshots-{node}"), "--settings", str(folder / "settings.yaml"),
                "--gateway-address", f"127.0.0.1:{grpc_port[node]}", *flags], {}, folder, "volga-agent"))
        for node in NODES:
            daemons.append(Daemon(f"gateway-{node}", [
                str(bindir / "volga-gateway"), "-f", str(specs_file(folder, node)), "--node", node,
                "--agent", f"127.0.0.1:{agent_port[node]}", "--agent-token-file", str(folder / "token"),
                "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", str(grpc_port[node]),
                "--metrics-port", str(gateway_metrics[node])], {}, folder, "volga-gateway"))
        metrics_a = f"http://127.0.0.1:{agent_metrics['a']}/metrics"

        # The level exchange, as node a's agent counts it: calls to both neighbours, and their levels' age.
        wait_for("node a to hear from b and c", lambda: set(series(metrics_a, "volga_neighbour_level_age_ms")) ==
                 {'{neighbour="b"}', '{neighbour="c"}'}, timeout=60)
        sent = series(metrics_a, "volga_neighbour_exchanges_sent_total")
        assert sent['{neighbour="b"}'] >= 1 and sent['{neighbour="c"}'] >= 1
        assert series(metrics_a, "volga_neighbour_level_bytes")[""] < 1024

        decls = instance.decls(defaultmodel.ensure().spec.inputs)
        x = contract.sample_inputs(decls, batch=2, seed=3)
        a = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port['a']}")
        expected = a.infer("loose", harness.triton_inputs(decls, x)).as_numpy("probability")  # served on a
        assert expected.shape == (2, 1)
        strict = Traffic(f"127.0.0.1:{grpc_port['a']}", "strict", harness.triton_inputs(decls, x))
        try:
            refusals: list[InferenceServerException] = []

            def forwarded() -> dict[str, float]:
                try:
                    out = a.infer("loose", harness.triton_inputs(decls, x)).as_numpy("probability")
                except InferenceServerException as exc:
                    refusals.append(exc)
                    raise
                np.testing.assert_allclose(out, expected, rtol=1e-5)
                return series(f"http://127.0.0.1:{gateway_metrics['a']}/metrics",
                              "volga_gateway_neighbour_forwards_total")

            counted = wait_for("a's gateway to pass loose on to a neighbour", forwarded, timeout=120, every=0.05)
            assert refusals == []  # the shed model's requests went to a neighbour rather than being refused
            [(labels, count)] = counted.items()
            target = re.search(r'target="(\w)"', labels)
            assert target and target.group(1) in ("b", "c") and 'model="loose"' in labels and count >= 1
            # The neighbour's gateway served it.
            served = series(f"http://127.0.0.1:{gateway_metrics[target.group(1)]}/metrics",
                            "volga_gateway_requests_total")
            assert served['{code="OK",model="loose",protocol="grpc"}'] >= 1

            # A request forwarded once is not passed on again: a's node sheds loose, so it is refused.
            def refused() -> tuple[InferenceServerException] | None:
                try:
                    a.infer("loose", harness.triton_inputs(decls, x), headers={"x-volga-forwarded": "z"})
                except InferenceServerException as exc:
                    return (exc,)
                return None  # a's node went out of EMERGENCY for a moment and served it itself

            [err] = wait_for("a forwarded request to be refused", refused, timeout=60, every=0.05)
            assert str(err.status()) == "StatusCode.RESOURCE_EXHAUSTED" and f"retry after {RETRY_MS} ms" in str(err)
            assert strict.answered > 0  # the protected model stays on a, served there
        finally:
            strict.close()
            a.close()
    finally:
        for daemon in reversed(daemons):
            assert daemon.stop() == 0, daemon.log.read_text()[-3000:]
