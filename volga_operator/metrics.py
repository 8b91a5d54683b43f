"""The operator's Prometheus metrics and their `/metrics` endpoint (`--metrics-port`, VOLGA_METRICS_PORT; with
`--metrics-token-file`, VOLGA_METRICS_TOKEN_FILE, a scrape must carry a bearer token, as the node daemons' do).

Its own registry, so that tests may run several operators' loops in one process.
"""

from __future__ import annotations

import prometheus_client as prom
from aiohttp import web

from volga_core import http


class OperatorMetrics:
    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = registry or prom.CollectorRegistry()
        r = self.registry
        self.writes = prom.Counter("volga_operator_writes", "API writes done, by verb", ["verb"], registry=r)
        self.write_failures = prom.Counter(
            "volga_operator_write_failures", "API writes that failed (planned again later), by verb", ["verb"],
            registry=r)
        self.chain_migrations = prom.Counter(
            "volga_operator_chain_migrations", "Chains moved off a node that stayed in EMERGENCY, by the node left",
            ["node"], registry=r)
        self.nodes_by_state = prom.Gauge(
            "volga_operator_nodes_autonomy_state", "Nodes by the autonomy state of their fresh heartbeat (stale: "
            "a heartbeat older than three of its periods)", ["state"], registry=r)
        self.cluster_memory = prom.Gauge(
            "volga_operator_cluster_memory_pct", "Memory use of the nodes with a fresh heartbeat, as published to "
            "the agents", ["stat"], registry=r)

    async def serve(self, host: str, port: int, tokens: http.Tokens | None = None) -> tuple[web.AppRunner, int]:
        """The `/metrics` endpoint on the running event loop (with `tokens`: a bearer token required); its runner
        (`cleanup()` stops it) and its port (0 picks a free one)."""
        return await http.serve_metrics([self.registry], host, port, tokens)
