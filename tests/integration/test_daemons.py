"""`volga-agent` and `volga-gateway` as separate processes with static ModelSpecs (a node without Kubernetes)."""

from __future__ import annotations

import pathlib
import sys

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from procs import Daemon, wait_for

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.rpc.volga.v1 import agent_pb2, agent_pb2_grpc
from volga_agent.worker import contract
from volga_bench import harness

pytestmark = pytest.mark.slow


def test_agent_and_gateway_processes(tmp_path: pathlib.Path) -> None:
    spec = defaultmodel.ensure()
    specs = tmp_path / "specs.yaml"
    specs.write_text(yaml.safe_dump(spec.to_wire()))
    bindir = pathlib.Path(sys.executable).parent
    agent = Daemon("agent", [str(bindir / "volga-agent"), "-f", str(specs), "--node", "n1", "--port", "0",
                             "--metrics-port", "0", "--workdir", str(tmp_path / "w"),
                             "--snapshot-dir", str(tmp_path / "snapshots")], {}, tmp_path, "volga-agent")
    address = f"127.0.0.1:{agent.port('Agent API')}"
    gateway = Daemon("gateway", [str(bindir / "volga-gateway"), "-f", str(specs), "--agent", address,
                                 "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                     {}, tmp_path, "volga-gateway")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = agent_pb2_grpc.AgentStub(channel)
            def frozen_instances() -> list[agent_pb2.Instance]:
                listed = stub.ListInstances(agent_pb2.ListInstancesRequest()).instances
                return [i for i in listed if i.tier == agent_pb2.FROZEN]

            frozen = wait_for("the pool to freeze its instance", frozen_instances)
            assert frozen[0].model_id == spec.spec.model_id and frozen[0].snapshot_bytes > 0
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.port('gRPC')}")
            decls = instance.decls(spec.spec.inputs)
            x = contract.sample_inputs(decls, batch=2, seed=4)
            out = client.infer(spec.spec.model_id, harness.triton_inputs(decls, x)).as_numpy("probability")
            client.close()
            assert out.shape == (2, 1) and np.all((out > 0) & (out < 1))
            status = stub.Status(agent_pb2.StatusRequest())
            assert status.node == "n1" and status.activations == 1 and status.restore_failures == 0
            [info] = stub.ListInstances(agent_pb2.ListInstancesRequest(model_id=spec.spec.model_id)).instances
            assert info.tier == agent_pb2.HOT and info.last_wake_ms > 0
            with pytest.raises(grpc.RpcError) as err:
                stub.Activate(agent_pb2.ActivateRequest(model_id="nope"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        assert gateway.stop() == 0
        assert agent.stop() == 0
    assert not any((tmp_path / "snapshots").rglob("pstree.img"))
