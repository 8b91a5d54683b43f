"""The autonomy loop's gateway when the gateway is another process (the sidecar of a cluster node).

The loop steers a `loop.Gateway`; in `volga up` that is the gateway's data plane itself. In a cluster the
gateway runs beside the agent, so an `Exchange` stands in for it on the agent's side: what the loop decides
(batch caps, shed models) is kept as directives, and the load the gateway pushes (`push`, from the Agent API's
ExchangeLoad call, every few tens of milliseconds) is summed until the sampler drains it. The gateway takes the
directives back in the answer to the same call, so nothing crosses between the processes on a request's path.

`Water` is the node's water level for its neighbours (`volga_agent/neighbours.py`): the loop's standing (state and
memory), the gateway's requests in flight and the models the pool can serve.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping

from volga_agent import neighbours
from volga_agent.autonomy import loop
from volga_agent.autonomy import window as windows
from volga_agent.node import pool
from volga_core import api


@dataclasses.dataclass(frozen=True)
class Directives:
    """What the gateway is to enforce, in full (not changes): caps by model, shed models with their retry hint."""

    batch_caps: Mapping[str, int]
    shed_retry_after_ms: Mapping[str, int]


@dataclasses.dataclass
class _Sum:
    arrivals: int = 0
    completed: int = 0
    queue_depth: int = 0
    shed: int = 0
    latencies_ms: list[float] = dataclasses.field(default_factory=list)


class Exchange:
    """Directives out, load in; safe from any thread (the loop's, the sampler's, the Agent API's)."""

    # Latencies kept per model between two drains: a sampler that stalls must not let them grow without end.
    MAX_LATENCIES = 65536

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caps: dict[str, int] = {}
        self._shed: dict[str, int] = {}
        self._loads: dict[str, _Sum] = {}
        self._in_flight: dict[str, int] = {}  # the latest queue depth the gateway pushed, by model

    # -- the loop's side (loop.Gateway) ---------------------------------------------------------------

    def set_batch_cap(self, model: str, cap: int | None) -> None:
        with self._lock:
            if cap is None:
                self._caps.pop(model, None)
            else:
                self._caps[model] = cap

    def shed(self, model: str, retry_after_ms: int) -> None:
        with self._lock:
            self._shed[model] = retry_after_ms

    def unshed(self, model: str) -> None:
        with self._lock:
            self._shed.pop(model, None)

    def drain_load(self) -> dict[str, windows.ModelLoad]:
        with self._lock:
            loads, self._loads = self._loads, {}
        return {m: windows.ModelLoad(s.arrivals, s.completed, s.queue_depth, tuple(s.latencies_ms), s.shed)
                for m, s in loads.items()}

    # -- the gateway's side (the Agent API) ------------------------------------------------------------

    def push(self, loads: Mapping[str, windows.LoadReading]) -> Directives:
        """Add the gateway's load since its previous push; the directives in force."""
        with self._lock:
            for model, load in loads.items():
                total = self._loads.get(model)
                if total is None:
                    total = self._loads[model] = _Sum()
                total.arrivals += load.arrivals
                total.completed += load.completed
                total.queue_depth = load.queue_depth  # a level, not a count: the latest holds
                self._in_flight[model] = load.queue_depth
                total.shed += load.shed
                room = self.MAX_LATENCIES - len(total.latencies_ms)
                if room > 0:
                    total.latencies_ms.extend(load.latencies_ms[-room:])
            return Directives(dict(self._caps), dict(self._shed))

    def directives(self) -> Directives:
        with self._lock:
            return Directives(dict(self._caps), dict(self._shed))

    def in_flight(self) -> int:
        """Requests the gateway last said it holds (arrived, not answered), over all models."""
        with self._lock:
            return sum(self._in_flight.values())

    def shed_models(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._shed)


class Water:
    """This node's level for `neighbours.LevelExchange`: what the loop, the gateway's exchange and the pool know
    now."""

    def __init__(self, node_pool: pool.Pool, autonomy: loop.Loop, steering: Exchange, gateway: str,
                 gateway_http: str = "") -> None:
        self.pool = node_pool
        self.loop = autonomy
        self.steering = steering
        self.gateway = gateway
        self.gateway_http = gateway_http

    def state(self) -> str:
        return self.loop.standing.state.value

    def level(self) -> neighbours.Level:
        shed = self.steering.shed_models()
        hot: dict[str, bool] = {}
        for info in self.pool.instances():
            if info.tier == api.Tier.COLD and info.state_reason:
                continue  # its last start failed: it cannot serve
            hot[info.model_id] = hot.get(info.model_id, False) or info.tier == api.Tier.HOT
        models = tuple(neighbours.ModelLevel(m, h, m in shed) for m, h in sorted(hot.items()))
        standing = self.loop.standing
        return neighbours.Level(self.pool.node, standing.state.value, round(standing.memory_pct, 1),
                                float(self.steering.in_flight()), models, gateway=self.gateway,
                                gateway_http=self.gateway_http)
