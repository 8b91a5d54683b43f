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
