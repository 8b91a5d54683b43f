"""Neighbours found through the cluster: agents in `--kube` mode publish their Agent API address as a Node
annotation and trade levels with the agents of the other annotated Nodes (a real kube-apiserver, real agent
processes). An agent whose Agent API has no tokens publishes nothing and says why."""

from __future__ import annotations

import os
import pathlib
import sys
import uuid

import pytest
import yaml
from kubernetes import client as k8s
from procs import Daemon, series, wait_for

from volga_bench.controlplane import ControlPlane, free_ports
from volga_core.api import labels

pytest_plugins = ["k8s_fixtures"]
pytestmark = pytest.mark.slow


def test_agents_find_their_neighbours_through_node_annotations(control_plane: ControlPlane, crds: None,
                                                               tmp_path: pathlib.Path) -> None:
    folder = tmp_path
    suffix = uuid.uuid4().hex[:6]
    nodes = [f"nb-{suffix}-{i}" for i in range(3)]  # the last one has no tokens: it takes no part
    core = k8s.CoreV1Api(control_plane.api_client())
    for node in nodes:
        core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=node)))
    (folder / "settings.yaml").write_text(yaml.safe_dump({"autonomyEnabled": True, "neighboursEnabled": True}))
    (folder / "token").write_text("k8s-neighbours-token\n")
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig)}
    agent_ports, metrics_ports = free_ports(3), free_ports(3)
    daemons = []
    try:
        for i, node in enumerate(nodes):
            address = ["--agent-address", f"127.0.0.1:{agent_ports[i]}"]
            tokens = ["--token-file", str(folder / "token")] if i < 2 else []
            daemons.append(Daemon(node, [sys.executable, "-m", "volga_agent.app.daemons", "--kube", "--node", node,
                                         "--port", str(agent_ports[i]), "--metrics-port", str(metrics_ports[i]),
                                         "--workdir", str(folder / f"w{i}"), "--snapshot-dir", str(folder / f"s{i}"),
                                         "--settings", str(folder / "settings.yaml"), *address, *tokens], env, folder,
                                  "volga-agent"))

        def annotated() -> dict[str, str]:
            found = {n: (core.read_node(n).metadata.annotations or {}).get(labels.AGENT_API_KEY) for n in nodes}
            return found if found[nodes[0]] and found[nodes[1]] else {}

        found = wait_for("the agents to publish their Agent API address", annotated, timeout=60)
        assert found == {nodes[0]: f"127.0.0.1:{agent_ports[0]}", nodes[1]: f"127.0.0.1:{agent_ports[1]}",
                         nodes[2]: None}
        for i, other in ((0, nodes[1]), (1, nodes[0])):
            url = f"http://127.0.0.1:{metrics_ports[i]}/metrics"
            wait_for(f"{nodes[i]} to hear from {other}", lambda url=url, other=other: series(
                url, "volga_neighbour_level_age_ms").get(f'{{neighbour="{other}"}}') is not None, timeout=60)
            assert set(series(url, "volga_neighbour_exchanges_sent_total")) == {f'{{neighbour="{other}"}}'}
        assert "neighbours are off: the Agent API has no tokens" in daemons[2].log.read_text()
    finally:
        codes = [daemon.stop() for daemon in daemons]
        for node in nodes:  # later modules place on the session's nodes: none of these may linger
            core.delete_node(node)
        core.api_client.close()
        assert codes == [0] * len(daemons), [d.log.read_text()[-3000:] for d in daemons]
