"""The cluster tier on a real kube-apiserver + etcd with the real operator and three real agents (their own node
names, the autonomy loop on): each agent publishes its node's autonomy state as a Node annotation and reads the
watermarks the operator publishes; a chain of two default-model ModelSpecs is placed on one node; that node's agent
is started again with memory watermarks below the machine's real memory use, so its loop goes into EMERGENCY; the
operator moves the whole chain to another node, records why (an Event, the head's status.chain) and counts it.

Only one node's watermarks are lowered; the other two cannot reach EMERGENCY (their threshold is 100 %)."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from procs import Daemon, wait_for

from volga_agent.app import defaultmodel
from volga_agent.gateway import links
from volga_bench.controlplane import ControlPlane, free_ports
from volga_core import nodes
from volga_core.api import labels

pytest_plugins = ["k8s_fixtures"]
pytestmark = pytest.mark.slow
NODES = ("tier-a", "tier-b", "tier-c")
NAMESPACE = "tier"
MIGRATE_AFTER_SEC = 5
COMMON = {"autonomyEnabled": True, "autonomyHeartbeatSec": 1.0, "autonomySampleMs": 20.0}
CALM = {**COMMON, "autonomyPreloadBelowPct": 99.0, "autonomyOptimizeAbovePct": 99.5,
        "autonomyEmergencyAbovePct": 100.0}
# Any machine uses more than 0.5 % of its memory: this node's loop reaches EMERGENCY on its own measurements.
PRESSED = {**COMMON, "autonomyPreloadBelowPct": 0.0, "autonomyOptimizeAbovePct": 0.5,
           "autonomyEmergencyAbovePct": 0.5}


class Cluster:
    def __init__(self, cp: ControlPlane, folder: pathlib.Path) -> None:
        self.cp = cp
        self.folder = folder
        self.api = cp.api_client()
        self.core = k8s.CoreV1Api(self.api)
        self.env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig), "PYTHONUNBUFFERED": "1",
                    "VOLGA_RESYNC_SEC": "5", "VOLGA_NAMESPACE": NAMESPACE}
        ports = free_ports(1 + len(NODES))
        self.operator_metrics = f"http://127.0.0.1:{ports[0]}/metrics"
        self.agent_ports = dict(zip(NODES, ports[1:], strict=True))
        self.daemons: dict[str, Daemon] = {"operator": Daemon("operator", [
            sys.executable, "-m", "volga_operator", "--liveness", "", "-v", "--metrics-port", str(ports[0]),
            "--chain-migration-after-sec", str(MIGRATE_AFTER_SEC)], self.env, folder)}
        for node in NODES:
            self.start_agent(node, CALM)

    def start_agent(self, node: str, settings: dict[str, Any]) -> None:
        path = self.folder / f"settings-{node}.yaml"
        path.write_text(yaml.safe_dump(settings))
        self.daemons[node] = Daemon(node, [
            sys.executable, "-m", "volga_agent.app.daemons", "--kube", "--node", node, "--port", "0",
            "--metrics-port", str(self.agent_ports[node]), "--workdir", f"/tmp/vw-{node}",
            "--snapshot-dir", str(self.folder / f"snapshots-{node}"), "--settings", str(path)], self.env,
            self.folder, "volga-agent")

    def metrics(self, url: str) -> str:
        return str(urllib.request.urlopen(url, timeout=10).read().decode())

    def agent_metrics(self, node: str) -> str:
        return self.metrics(f"http://127.0.0.1:{self.agent_ports[node]}/metrics")

    def autonomy(self, node: str) -> nodes.NodeAutonomy | None:
        return nodes.NodeAutonomy.from_annotations(self.core.read_node(node).metadata.annotations)

    def emis(self) -> list[dict[str, Any]]:
        out = self.cp.kubectl("get", "emi", "-n", NAMESPACE, "-o", "json")
        return list(json.loads(out.stdout)["items"])

    def ms(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self.cp.kubectl("get", "ms", "-n", NAMESPACE, name, "-o", "json").stdout))


def metric(text: str, name: str, labels_: str = "") -> float | None:
    wanted = f"{name}{{{labels_}}} " if labels_ else f"{name} "
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted)), None)


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, crds: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("tier")
    core = k8s.CoreV1Api(control_plane.api_client())
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=NAMESPACE)))
    for node in NODES:
        core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=node)))
    c = Cluster(control_plane, folder)
    yield c
    control_plane.kubectl("delete", "ms", "--all", "-n", NAMESPACE, "--timeout=120s")
    codes = {name: d.stop() for name, d in c.daemons.items()}
    core.delete_namespace(NAMESPACE)
    for node in NODES:
        core.delete_node(node)
    core.api_client.close()
    c.api.close()
    assert all(code == 0 for code in codes.values()), {n: (code, c.daemons[n].tail())
                                                       for n, code in codes.items() if code}


def modelspec(name: str, **spec: Any) -> dict[str, Any]:
    doc = defaultmodel.spec_document(defaultmodel.ensure().spec.source_path)
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    doc["spec"]["modelId"] = name
    doc["spec"]["pool"] = {"hot": 0, "frozen": 1}
    doc["spec"].update(spec)
    return doc


def ready(obj: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in obj.get("status", {}).get("conditions", ()))


def test_a_chain_leaves_a_node_that_stays_in_emergency(cluster: Cluster, tmp_path: pathlib.Path) -> None:
    c = cluster
    # Every agent publishes its state (calm: below 99 % of memory, PRELOAD) and reads the operator's watermarks.
    states = wait_for("three heartbeats", lambda: (s := {n: c.autonomy(n) for n in NODES})
                      and all(a is not None and a.state == "PRELOAD" for a in s.values()) and s)
    assert all(0 < a.memory_pct < 100 and a.period_sec == 1.0 for a in states.values())

    def watermarks_read() -> float | None:
        text = c.agent_metrics(NODES[0])
        return metric(text, "volga_cluster_nodes", 'state="all"') == 3 and metric(
            text, "volga_cluster_memory_pct", 'stat="max"')

    assert wait_for("the watermarks at the agents", watermarks_read) > 0
    configmap = c.core.read_namespaced_config_map(labels.CLUSTER_CONFIGMAP, NAMESPACE)
    marks = nodes.ClusterWatermarks.from_json(configmap.data[labels.CLUSTER_WATERMARKS_KEY])
    assert marks is not None and marks.nodes == 3 and marks.emergency_nodes == 0

    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump_all([modelspec("tier-det", chain=["tier-rec"]), modelspec("tier-rec")]))
    c.cp.kubectl("apply", "-f", str(path))

    def placed() -> dict[str, str] | None:
        items = c.emis()
        profiles = {e["spec"]["modelId"]: e["spec"]["node"] for e in items}
        done = set(profiles) == {"tier-det", "tier-rec"} and all(
            ready(e) and e.get("status", {}).get("tier") == "FROZEN" for e in items)
        return profiles if done else None

    first = wait_for("the chain FROZEN and Ready on one node", placed, timeout=300)
    [pressed] = set(first.values())
    head = c.ms("tier-det")
    assert head["status"]["chain"] == {"members": ["tier-det", "tier-rec"], "node": pressed, "nodes": [pressed],
                                       "migrations": 0}

    # The chain's node: its agent again, with watermarks below the memory the machine really uses.
    assert c.daemons[pressed].stop() == 0
    c.start_agent(pressed, PRESSED)
    emergency = wait_for("EMERGENCY published", lambda: (a := c.autonomy(pressed)) and a.state == "EMERGENCY" and a)
    assert emergency.memory_pct >= 0.5

    def moved() -> dict[str, str] | None:
        profiles = {e["spec"]["modelId"]: e["spec"]["node"] for e in c.emis()}
        return profiles if len(profiles) == 2 and pressed not in profiles.values() else None

    after = wait_for("the chain on another node", moved, timeout=120)
    [target] = set(after.values())  # all members together
    assert target in NODES and target != pressed
    assert {e["metadata"]["name"] for e in c.emis()} == {"tier-det-0", "tier-rec-0"}  # the same EMIs, patched
    chain = wait_for("status.chain updated", lambda: (s := c.ms("tier-det")["status"]["chain"])["node"] == target
                     and s)
    assert chain["migrations"] == 1 and chain["nodes"] == [target]
    assert chain["lastMigration"]["fromNode"] == pressed and chain["lastMigration"]["toNode"] == target
    assert f"node {pressed} in EMERGENCY" in chain["lastMigration"]["reason"]
    events = json.loads(c.cp.kubectl("get", "events", "-n", NAMESPACE, "--field-selector",
                                     "involvedObject.name=tier-det,reason=ChainMigrated", "-o", "json").stdout)
    [event] = events["items"]
    assert event["involvedObject"]["kind"] == "ModelSpec" and f"from {pressed} to {target}" in event["message"]

    # Counted by the operator; the decisions behind it are in the pressed agent's metrics.
    operator = c.metrics(c.operator_metrics)
    assert metric(operator, "volga_operator_chain_migrations_total", f'node="{pressed}"') == 1
    assert metric(operator, "volga_operator_writes_total", 'verb="create_event"') == 1
    agent = c.agent_metrics(pressed)
    assert metric(agent, "volga_autonomy_state", 'state="EMERGENCY"') == 1
    assert (metric(agent, "volga_autonomy_decision_latency_us_count") or 0) > 0
    assert (metric(agent, "volga_autonomy_heartbeats_total", 'why="change"') or 0) >= 1
    marks_seen = wait_for("one node in EMERGENCY in the watermarks", lambda: metric(
        c.agent_metrics(target), "volga_cluster_nodes", 'state="emergency"') == 1)
    assert marks_seen

    # The target's agent serves the chain: both FROZEN and Ready there.
    wait_for("the chain FROZEN and Ready on the target", lambda: (p := placed()) and set(p.values()) == {target},
             timeout=300)
    log = c.daemons["operator"].log.read_text()
    assert re.search(rf"tier/tier-det: chain tier-det, tier-rec moved from {pressed} to {target}", log), log[-2000:]

    # Woken together there: a wake of the head (as its gateway asks for one) wakes the other member beside it. Read
    # from the agent itself (its Agent API), not through its batched status reports.
    agent_api = f"127.0.0.1:{c.daemons[target].port('Agent API')}"

    async def wake() -> links.Route:
        return await links.GrpcAgentLink(agent_api).activate("tier-det", "", 120_000)

    async def tiers() -> dict[str, str]:
        link = links.GrpcAgentLink(agent_api)
        return {m: ",".join(i.tier for i in await link.instances(m) or ()) for m in ("tier-det", "tier-rec")}

    # The EMIs' status may still be the pressed node's last report: wait for the target's own instances.
    wait_for("both members FROZEN at the target's agent", lambda: set(asyncio.run(tiers()).values()) == {"FROZEN"},
             timeout=300)
    route = asyncio.run(wake())
    assert route.instance.endswith("tier-det-0"), route
    try:
        wait_for("both members HOT on the target", lambda: set(asyncio.run(tiers()).values()) == {"HOT"},
                 timeout=300)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {asyncio.run(tiers())}\n{c.daemons[target].log.read_text()[-4000:]}") from None
