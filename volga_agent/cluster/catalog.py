"""A gateway's side of cluster mode (`CatalogSync`): its model catalog in step with the cluster's ModelSpecs, and
where their EMIs are.

It survives an unreachable API server: watches (`kube.watch`) retry with backoff, and until they succeed the gateway
keeps its catalog, so requests for known models keep being routed. A gateway that starts says it is ready
(`/v2/health/ready`, `ServerReady`) only once both watches have listed: before that it would answer 404 for every
model. The `kubernetes` client is synchronous; each watch runs on its own thread.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import kubernetes

from volga_agent.cluster import common
from volga_agent.gateway import catalog as gateway_catalog
from volga_core import api
from volga_core.api import conditions
from volga_core.kube import client as kube_client
from volga_core.kube import watch


class CatalogSync:
    """A gateway's routing table: the cluster's ModelSpecs and where their EMIs are, from two watches.

    The last good table stays while the API server is unreachable.
    """

    def __init__(self, catalog: gateway_catalog.Catalog, client: kubernetes.client.ApiClient | None = None) -> None:
        self.catalog = catalog
        catalog.loaded = False
        self.loaded = threading.Event()  # set once the catalog holds both watches' first lists
        self.client = client or kube_client.api_client()
        custom = kubernetes.client.CustomObjectsApi(self.client)
        self.watches = [
            watch.Watch("modelspecs", custom.list_cluster_custom_object, self._on_specs, group=api.GROUP,
                  version=api.VERSION, plural="modelspecs"),
            watch.Watch("emis", custom.list_cluster_custom_object, self._on_emis, group=api.GROUP, version=api.VERSION,
                  plural="executablemodelinstances"),
        ]

    def _on_emis(self, objects: dict[tuple[str, str], Any]) -> None:
        placements: dict[str, list[gateway_catalog.Placement]] = {}
        for (_, name), obj in objects.items():
            spec, status = obj.get("spec") or {}, obj.get("status") or {}
            ready = conditions.is_true(status.get("conditions", ()))
            placements.setdefault(str(spec.get("modelId", "")), []).append(gateway_catalog.Placement(
                name, str(spec.get("node", "")), str(status.get("tier", "")), ready, str(status.get("gateway", "")),
                str(status.get("gatewayHttp", ""))))
        self.catalog.set_placements(placements)
        self._loaded()

    def _on_specs(self, objects: dict[tuple[str, str], Any]) -> None:
        specs = []
        for (ns, name), obj in objects.items():
            parsed = common.with_signature(f"{ns}/{name}", obj)
            if parsed is not None:
                specs.append(parsed)
        self.catalog.replace(specs)
        self._loaded()

    def _loaded(self) -> None:
        # Both watches have listed once (each sets `synced` before it hands over its first list): the catalog holds
        # the specs and the placements of that moment.
        if not self.loaded.is_set() and all(w.synced.is_set() for w in self.watches):
            self.catalog.loaded = True
            self.loaded.set()

    async def start(self, wait_s: float = 30.0) -> bool:
        """Start both watches and wait up to `wait_s` for their first lists; False when the API server has not
        answered them by then (the gateway starts anyway, not ready until it does)."""
        for w in self.watches:
            w.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not self.loaded.is_set() and loop.time() < deadline:  # polled: a stop may cancel it
            await asyncio.sleep(0.02)
        return self.loaded.is_set()

    async def stop(self) -> None:
        for w in self.watches:
            w.stop()
        await asyncio.to_thread(self.client.close)
