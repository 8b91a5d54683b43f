"""The neighbour directory (`NeighbourDirectory`): publishes the node's Agent API address for its neighbours and
finds theirs (`volga_agent/neighbours.py`), through Node annotations.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import kubernetes

from volga_core.api import labels
from volga_core.kube import client as kube_client
from volga_core.kube import ratelimit, watch

log = logging.getLogger(__name__)


class NeighbourDirectory:
    """The cluster's agents that trade water levels (`neighbours.py`): publishes this node's Agent API address as
    the Node annotation `labels.AGENT_API_KEY` and hands `on_change` the node -> address map of every Node that
    carries one (this one included)."""

    def __init__(self, node: str, address: str, on_change: Callable[[dict[str, str]], None],
                 writes_per_sec: float = 200.0) -> None:
        self.node = node
        self.address = address
        self.on_change = on_change
        self.bucket = ratelimit.TokenBucket.within(writes_per_sec)
        self.client = kube_client.api_client()
        self.core = kubernetes.client.CoreV1Api(self.client)
        self._stop = threading.Event()
        self.watch = watch.Watch("nodes", watch.json_lister(self.core.list_node), self._on_nodes)
        self._thread = threading.Thread(target=self._publish, name="agent-api-annotation", daemon=True)

    def _on_nodes(self, objects: dict[tuple[str, str], Any]) -> None:
        found = {}
        for (_, name), obj in objects.items():
            address = ((obj.get("metadata") or {}).get("annotations") or {}).get(labels.AGENT_API_KEY)
            if address:
                found[name] = str(address)
        self.on_change(found)

    def _publish(self) -> None:
        body = {"metadata": {"annotations": {labels.AGENT_API_KEY: self.address}}}

        def publish() -> None:
            ratelimit.write_sync(self.bucket, lambda: self.core.patch_node(self.node, body, _request_timeout=10))

        def failed(exc: BaseException | None, _delay: float) -> None:
            log.info("node %s: cannot publish its Agent API address yet: %s", self.node, exc)

        kube_client.until_stopped(publish, self._stop, 0.5, 30.0, failed)

    async def start(self) -> None:
        self._thread.start()
        self.watch.start()

    async def stop(self) -> None:
        self._stop.set()
        self.watch.stop()
        await asyncio.to_thread(self.client.close)
