"""The ports a node listens on, named once for `volga up`, the daemons and their command lines.

The gateway serves the Open Inference Protocol over HTTP/REST and gRPC and its metrics; the agent serves the
Agent gRPC API. The defaults are the ones the chart and the clients (tritonclient: 8000 and 8001) expect.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Ports:
    """Listening ports; 0 picks a free one (tests), a negative agent port serves no Agent API (`volga up`)."""

    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    agent_port: int = 8010


DEFAULT = Ports()

# gRPC channel options for what a node calls on other processes of the cluster (its agent, its neighbours' agents,
# other nodes' gateways): try again within a second once one is back, not after gRPC's default backoff, which
# grows to two minutes while nothing listens (a sidecar that starts before its agent, any restart), and in which
# every call fails at once with the last attempt's error.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]
