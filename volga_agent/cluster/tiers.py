"""The node's part of the cluster tier (`TierSync`, with the autonomy loop on).

It publishes the loop's state as the `volga.dev/autonomy` Node annotation, at once on a change and every
`autonomy_heartbeat_sec`, through AgentSync's token bucket and never on a request's path, and reads the cluster's
watermarks the operator publishes (a ConfigMap) into the loop and the agent's metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import prometheus_client as prom

from volga_agent.autonomy import loop as autonomy_loop
from volga_agent.cluster import sync as agent_sync
from volga_core import nodes
from volga_core.api import labels
from volga_core.kube import client as kube_client
from volga_core.kube import ratelimit, watch

log = logging.getLogger(__name__)


class TierSync:
    """The node's autonomy state out (a Node annotation, a heartbeat of seconds), the cluster's watermarks in."""

    def __init__(self, sync: agent_sync.AgentSync, autonomy: autonomy_loop.Loop, heartbeat_sec: float,
                 namespace: str | None = None) -> None:
        self.sync = sync
        self.loop = autonomy
        self.period = heartbeat_sec
        self.namespace = namespace or os.environ.get("VOLGA_NAMESPACE") or os.environ.get("POD_NAMESPACE") or "default"
        self._stop = threading.Event()
        registry = sync.pool.metrics.registry
        self.heartbeats = prom.Counter(
            "volga_autonomy_heartbeats", "Writes of the node's autonomy annotation, by why (change, refresh)",
            ["why"], registry=registry)
        self.cluster_memory = prom.Gauge(
            "volga_cluster_memory_pct", "Memory use of the nodes with a fresh heartbeat (mean, max), as the operator "
            "published it", ["stat"], registry=registry)
        self.cluster_nodes = prom.Gauge(
            "volga_cluster_nodes", "Nodes with a fresh heartbeat (all, emergency), as the operator published it",
            ["state"], registry=registry)
        self.watch = watch.Watch("cluster-watermarks", watch.json_lister(sync.core.list_namespaced_config_map),
                                 self._on_watermarks, namespace=self.namespace,
                                 field_selector=f"metadata.name={labels.CLUSTER_CONFIGMAP}")
        self._thread = threading.Thread(target=self._beat, name="autonomy-heartbeat", daemon=True)

    async def start(self) -> None:
        self.watch.start()
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        self.watch.stop()
        await asyncio.to_thread(self._thread.join, 5)

    def _on_watermarks(self, objects: dict[tuple[str, str], Any]) -> None:
        for obj in objects.values():
            marks = nodes.ClusterWatermarks.from_json((obj.get("data") or {}).get(labels.CLUSTER_WATERMARKS_KEY))
            if marks is None:
                log.warning("ConfigMap %s/%s: no readable %s", self.namespace, labels.CLUSTER_CONFIGMAP,
                            labels.CLUSTER_WATERMARKS_KEY)
                continue
            self.loop.cluster = marks
            self.cluster_memory.labels("mean").set(marks.mean_memory_pct)
            self.cluster_memory.labels("max").set(marks.max_memory_pct)
            self.cluster_nodes.labels("all").set(marks.nodes)
            self.cluster_nodes.labels("emergency").set(marks.emergency_nodes)

    def beat(self, why: str) -> None:
        """Write the loop's standing now."""
        standing = self.loop.standing
        value = nodes.NodeAutonomy(standing.state.value, standing.since, time.time(), standing.memory_pct,
                                     self.period).annotation()
        body = {"metadata": {"annotations": {labels.AUTONOMY_KEY: value}}}
        ratelimit.write_sync(self.sync.bucket, lambda: self.sync.core.patch_node(self.sync.node, body,
                                                                                 _request_timeout=10))
        self.heartbeats.labels(why).inc()

    def _beat(self) -> None:
        written: Any = None
        last = float("-inf")
        while not self._stop.wait(min(0.25, self.period / 4)):
            state = self.loop.standing.state
            if state == written and time.monotonic() - last < self.period:
                continue
            try:
                self.beat("change" if state != written else "refresh")
            except kube_client.TRANSIENT as exc:
                log.info("node %s: autonomy heartbeat deferred: %s", self.sync.node, exc)
                self._stop.wait(min(self.period, 5.0))
                continue
            written, last = state, time.monotonic()
