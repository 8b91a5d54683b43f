"""What a gateway reports of one model's load, as the node autonomy loop reads it.

The gateway's data plane drains `ModelLoad`s (`Dataplane.drain_load`); the loop reads them in-process (`volga
up`) or over the Agent API (the sidecar gateway's `links.Exchanger`, the agent's `server.py`). It lives here,
below both, because the gateway and the autonomy loop do not import each other (docs/architecture.md). The loop
accepts anything with these fields (`LoadReading`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class LoadReading(Protocol):
    """One model's load since the previous reading (read-only attributes)."""

    @property
    def arrivals(self) -> int: ...

    @property
    def completed(self) -> int: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def latencies_ms(self) -> tuple[float, ...]: ...

    @property
    def shed(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class ModelLoad:
    """One model's requests since the previous reading (counts from the gateway adapters' view: a request arrives
    when its call starts, before its body is decoded).

    An ensemble's request counts twice over: once under the ensemble's id (its end-to-end latency; its queue stays
    0, since the request waits in its models' queues), and each of its steps as a request of the step's model (from
    the step's start to its answer). Refused because a model of the ensemble is shed, it counts as an arrival and
    as shed under the ensemble's id and under each of its models'."""

    arrivals: int = 0  # requests that arrived, shed ones included
    completed: int = 0  # requests answered (any status) other than shed ones
    queue_depth: int = 0  # now: requests arrived and not yet answered (queued, waking the model, or running)
    latencies_ms: tuple[float, ...] = ()  # end-to-end latency of each completed request (the latest 65536 at most)
    shed: int = 0  # requests refused at once because the model was shed
