"""Routing: model id -> a HOT instance's socket, with a TTL cache and single-flight activation.

The gateway asks an agent to activate a model only when its cache has no fresh route. Concurrent requests
for the same model (and device hint) share one activation: the first creates it, the others await the
same future, so a burst of N requests against a FROZEN model wakes it once. A route is dropped when its
TTL (`gateway_cache_ttl_sec`) runs out or when a request finds the worker gone (it was demoted or died);
the next request activates again, which is cheap when the instance is still HOT. Routes are keyed by
(model, device hint), and hints are whatever clients send: the cache keeps the `max_routes` most recently
used routes, so made-up hints cannot grow it without bound.

Agents are reached through a `links.AgentLink`: in-process for `volga up`, over gRPC for the sidecar.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

from volga_agent import metrics
from volga_agent.gateway import links


@dataclasses.dataclass
class _Entry:
    route: links.Route
    expires: float


class Router:
    def __init__(self, link: links.AgentLink, ttl_sec: float = 60.0,
                 gateway_metrics: metrics.GatewayMetrics | None = None, max_routes: int = 1024) -> None:
        self.link = link
        self.ttl_sec = ttl_sec
        self.metrics = gateway_metrics or metrics.GatewayMetrics()
        self.max_routes = max_routes
        self._hits = self.metrics.route_cache.labels("hit")  # looked up once: labels() locks and hashes
        self._misses = self.metrics.route_cache.labels("miss")
        self._cache: collections.OrderedDict[tuple[str, str], _Entry] = collections.OrderedDict()
        self._inflight: dict[tuple[str, str], asyncio.Future[links.Route]] = {}

    async def route(self, model_id: str, device_hint: str = "", timeout_ms: int = 0) -> links.Route:
        key = (model_id, device_hint)
        entry = self._cache.get(key)
        if entry is not None and entry.expires > time.monotonic():
            self._cache.move_to_end(key)
            self._hits.inc()
            return entry.route
        self._misses.inc()
        future = self._inflight.get(key)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._inflight[key] = future
            asyncio.get_running_loop().create_task(self._activate(key, future, timeout_ms))
        # shield: a caller that gives up (its deadline) must not cancel the activation the others wait for.
        return await asyncio.shield(future)

    async def _activate(self, key: tuple[str, str], future: asyncio.Future[links.Route], timeout_ms: int) -> None:
        try:
            self.metrics.activations.labels(key[0]).inc()
            route = await self.link.activate(key[0], key[1], timeout_ms)
            self._cache[key] = _Entry(route, time.monotonic() + self.ttl_sec)
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_routes:
                self._cache.popitem(last=False)  # the least recently used
            future.set_result(route)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning when every waiter gave up
        finally:
            self._inflight.pop(key, None)

    def cached(self) -> int:
        """How many routes the cache holds."""
        return len(self._cache)

    def invalidate(self, model_id: str) -> None:
        for key in [k for k in self._cache if k[0] == model_id]:
            del self._cache[key]
