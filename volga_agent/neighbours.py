"""Neighbours: each node's agent trades its water level with two other nodes' agents, so that the gateway of an
overloaded node can pass a request on to a neighbour that can take it instead of refusing it.

A level (`Level`) is what a node would say of itself in one breath: its autonomy state, memory in use, requests
in flight at its gateway, the models it can serve (HOT or not, shed or not) and where its gateway listens. It
goes over the Agent API (`ExchangeLevel`: one node's level in, the other's back) every
`neighbours_period_ms`, under 1 KB a message (`to_pb` leaves models out rather than grow past it), never on a
request's path. The neighbours of a node are the next two in the ring of the cluster's Volga nodes sorted by
name (`ring`), so every node picks the same ones without asking anyone. A level not heard again within a second
(`STALE_AFTER_S`) is dropped.

The agent hands the fresh levels to its gateway in the answer to the gateway's ExchangeLoad; the gateway picks
the least-loaded neighbour that has the model and is not overloaded itself (`choose`) when its own node sheds
the model or is in EMERGENCY (`gateway/dataplane.py`). The layer sits below the Agent API, the gateway and the
autonomy loop (docs/architecture.md): all three use its values, it uses none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import Any, Protocol

import grpc

from volga_agent import metrics, ports
from volga_agent.rpc.volga.v1 import agent_pb2 as pb
from volga_agent.rpc.volga.v1 import agent_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
MAX_LEVEL_BYTES = 1024  # one level, serialized
STALE_AFTER_S = 1.0  # a level not heard again for longer is dropped
COUNT = 2  # neighbours each node trades with
OVERLOADED = "EMERGENCY"  # a node in this autonomy state takes no forwarded request


@dataclasses.dataclass(frozen=True)
class ModelLevel:
    model_id: str
    hot: bool = False  # an instance is HOT
    shed: bool = False  # the node's loop sheds it


@dataclasses.dataclass(frozen=True)
class Level:
    """One node's water level."""

    node: str
    state: str = ""  # the autonomy state; "" when no loop runs
    memory_pct: float = 0.0
    load: float = 0.0  # requests in flight at the node's gateway
    models: tuple[ModelLevel, ...] = ()
    sequence: int = 0  # strictly increasing per node, across restarts (at least the Unix ms it was made at)
    gateway: str = ""  # the node's gateway, gRPC host:port
    gateway_http: str = ""  # and its HTTP host:port, where reported

    @property
    def overloaded(self) -> bool:
        return self.state == OVERLOADED

    def serving(self, model_id: str) -> ModelLevel | None:
        """The model's entry when this node can take its requests now: it has it, does not shed it, and is not
        overloaded."""
        if self.overloaded:
            return None
        return next((m for m in self.models if m.model_id == model_id and not m.shed), None)


@dataclasses.dataclass(frozen=True)
class Heard:
    """A level and when it was made, on the monotonic clock of the process that holds it."""

    level: Level
    at: float

    def age(self, now: float) -> float:
        return now - self.at


def to_pb(level: Level, age_ms: int = 0) -> Any:
    """The level's message, at most MAX_LEVEL_BYTES: HOT models first, and the last models left out until it fits
    (a neighbour then does not forward those to this node)."""
    models = sorted(level.models, key=lambda m: (not m.hot, m.shed, m.model_id))
    message = pb.NodeLevel(node=level.node, state=level.state, memory_pct=level.memory_pct, load=level.load,
                           models=[pb.ModelLevel(model_id=m.model_id, hot=m.hot, shed=m.shed) for m in models],
                           sequence=level.sequence, gateway=level.gateway, age_ms=age_ms,
                           gateway_http=level.gateway_http)
    while message.ByteSize() > MAX_LEVEL_BYTES and message.models:
        del message.models[-1]
    if message.ByteSize() > MAX_LEVEL_BYTES:
        raise ValueError(f"level of node {level.node!r}: {message.ByteSize()} bytes without any model, above "
                         f"{MAX_LEVEL_BYTES} (node name or gateway address too long)")
    return message


def from_pb(message: Any) -> tuple[Level, int]:
    """A level and its age in milliseconds from its message; ValueError names the field that is wrong."""
    if not message.node:
        raise ValueError("level.node is required")
    if message.ByteSize() > MAX_LEVEL_BYTES:
        raise ValueError(f"level of node {message.node!r}: {message.ByteSize()} bytes, above {MAX_LEVEL_BYTES}")
    for i, m in enumerate(message.models):
        if not m.model_id:
            raise ValueError(f"level.models[{i}].model_id is required")
    for name in ("memory_pct", "load"):
        value = getattr(message, name)
        if not value >= 0:  # NaN too
            raise ValueError(f"level.{name} must be a number >= 0, got {value!r}")
    models = tuple(ModelLevel(m.model_id, m.hot, m.shed) for m in message.models)
    level = Level(message.node, message.state, float(message.memory_pct), float(message.load), models,
                  message.sequence, message.gateway, message.gateway_http)
    return level, message.age_ms


def ring(nodes: Iterable[str], me: str, count: int = COUNT) -> tuple[str, ...]:
    """The `count` nodes after `me` in the ring of the node names, sorted (fewer when the cluster is smaller)."""
    names = sorted(set(nodes) | {me})
    at = names.index(me)
    return tuple(names[(at + i) % len(names)] for i in range(1, min(count, len(names) - 1) + 1))


def choose(heard: Iterable[Heard], model_id: str, me: str, now: float,
           stale_after_s: float = STALE_AFTER_S) -> Level | None:
    """Where an overloaded node's request for `model_id` goes: the fresh neighbour (not `me`) that has the model,
    does not shed it and is not overloaded, the least loaded first (then one with the model HOT, then the least
    memory in use, then by name); None when there is none."""
    best: tuple[tuple[float, bool, float, str], Level] | None = None
    for h in heard:
        level = h.level
        if level.node == me or not level.gateway or h.age(now) > stale_after_s:
            continue
        entry = level.serving(model_id)
        if entry is None:
            continue
        key = (level.load, not entry.hot, level.memory_pct, level.node)
        if best is None or key < best[0]:
            best = (key, level)
    return None if best is None else best[1]


class Source(Protocol):
    """This node's side of the levels (`autonomy.exchange.Water` in the agent)."""

    def state(self) -> str: ...

    def level(self) -> Level:
        """The node's level now (its sequence is set by `LevelExchange`)."""
        ...


class BackgroundTask:
    """A coroutine run as a task of its own on the running loop (`start`), cancelled and waited for (`stop`); for
    the periodic exchanges here and in the gateway."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._task: asyncio.Task[None] | None = None

    def start(self, work: Coroutine[Any, Any, None]) -> None:
        self._task = asyncio.get_running_loop().create_task(work, name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class LevelExchange:
    """The agent's side: every `period_ms` send this node's level to each neighbour and keep theirs; keep the
    levels neighbours send in (`receive`); hand out the fresh ones (`fresh`). Neighbours come from `directory`
    (node name -> Agent API address), which may change at any time (`set_directory`: a Node watch)."""

    def __init__(self, node: str, source: Source, token: str = "", period_ms: float = 200.0,
                 agent_metrics: metrics.AgentMetrics | None = None, stale_after_s: float = STALE_AFTER_S) -> None:
        self.node = node
        self.source = source
        self.metadata = [("authorization", f"Bearer {token}")] if token else None
        self.period = period_ms / 1e3
        self.stale_after_s = stale_after_s
        self.metrics = agent_metrics or metrics.AgentMetrics()
        self._lock = threading.Lock()
        self._directory: dict[str, str] = {}
        self._heard: dict[str, Heard] = {}
        self._sequence = 0
        self._channels: dict[str, tuple[grpc.aio.Channel, pb_grpc.AgentStub]] = {}
        self._task = BackgroundTask("neighbour-exchange")
        self._failing: set[str] = set()

    # -- who -----------------------------------------------------------------------------------------

    def set_directory(self, addresses: Mapping[str, str]) -> None:
        """The cluster's agents that take part (this one may be among them), by node name; any thread."""
        before = self.neighbours()
        with self._lock:
            self._directory = {n: a for n, a in addresses.items() if a}
        now = self.neighbours()
        if now != before:  # Node objects change often (status); the ring seldom
            log.info("neighbours of node %s: %s", self.node, ", ".join(now) or "none")
            for gone in set(before) - set(now):
                with contextlib.suppress(KeyError):
                    self.metrics.neighbour_age.remove(gone)

    def neighbours(self) -> tuple[str, ...]:
        with self._lock:
            names = list(self._directory)
        return ring(names, self.node)

    # -- levels --------------------------------------------------------------------------------------

    def own(self) -> Level:
        """This node's level now, with a fresh sequence."""
        level = self.source.level()
        with self._lock:
            self._sequence = max(self._sequence + 1, int(time.time() * 1e3))
            sequence = self._sequence
        return dataclasses.replace(level, node=self.node, sequence=sequence)

    def state(self) -> str:
        return self.source.state()

    def record(self, level: Level, age_ms: int = 0, now: float | None = None) -> bool:
        """Keep a neighbour's level unless a newer one of its node is already kept; whether it was kept."""
        if level.node == self.node:
            return False
        at = (time.monotonic() if now is None else now) - age_ms / 1e3
        with self._lock:
            kept = self._heard.get(level.node)
            if kept is not None and kept.level.sequence >= level.sequence and kept.age(at) <= self.stale_after_s:
                return False
            self._heard[level.node] = Heard(level, at)
        return True

    def receive(self, level: Level, age_ms: int = 0) -> Level:
        """A neighbour's ExchangeLevel: keep its level, give ours."""
        self.record(level, age_ms)
        return self.own()

    def fresh(self, now: float | None = None) -> list[Heard]:
        """The levels heard within the last STALE_AFTER_S; older ones are dropped."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for node in [n for n, h in self._heard.items() if h.age(now) > self.stale_after_s]:
                del self._heard[node]
            return sorted(self._heard.values(), key=lambda h: h.level.node)

    # -- the periodic exchange -----------------------------------------------------------------------

    def start(self) -> None:
        self._task.start(self._run())

    async def stop(self) -> None:
        await self._task.stop()
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.exchange_once()
            except Exception:  # the next round tries again; one bad level must not end the exchange
                log.exception("neighbour exchange of node %s failed", self.node)
            await asyncio.sleep(max(0.0, self.period - (time.monotonic() - started)))

    async def exchange_once(self) -> None:
        """One round: this node's level to each neighbour, theirs kept; the age gauges brought up to date."""
        names = self.neighbours()
        with self._lock:
            addresses = {n: self._directory[n] for n in names if n in self._directory}
        message = to_pb(self.own())
        self.metrics.neighbour_level_bytes.set(message.ByteSize())
        await asyncio.gather(*(self._call(n, a, message) for n, a in addresses.items()))
        self._forget_channels(set(addresses.values()))
        now = time.monotonic()
        with self._lock:
            heard = dict(self._heard)
        for name in names:
            kept = heard.get(name)
            if kept is not None:
                self.metrics.neighbour_age.labels(name).set(round(kept.age(now) * 1e3, 1))

    async def _call(self, name: str, address: str, message: Any) -> None:
        self.metrics.neighbour_sent.labels(name).inc()
        try:
            # A slow answer still counts while it is fresh: up to half the time a level stays fresh.
            timeout = max(self.period, self.stale_after_s / 2)
            reply = await self._stub(address).ExchangeLevel(message, timeout=timeout, metadata=self.metadata)
            level, age_ms = from_pb(reply)
        except (grpc.aio.AioRpcError, ValueError) as exc:
            self.metrics.neighbour_failed.labels(name).inc()
            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            if name not in self._failing:
                log.warning("neighbour %s (%s) gave no level (retrying): %s", name, address, why)
            self._failing.add(name)
            return
        if name in self._failing:
            log.info("neighbour %s (%s) answers again", name, address)
        self._failing.discard(name)
        self.record(level, age_ms)

    def _stub(self, address: str) -> pb_grpc.AgentStub:
        found = self._channels.get(address)
        if found is None:
            channel = grpc.aio.insecure_channel(address, options=ports.RECONNECT_OPTIONS)
            found = self._channels[address] = (channel, pb_grpc.AgentStub(channel))  # type: ignore[no-untyped-call]
        return found[1]

    def _forget_channels(self, keep: set[str]) -> None:
        for address in [a for a in self._channels if a not in keep]:
            channel, _ = self._channels.pop(address)
            asyncio.get_running_loop().create_task(channel.close())


def off_reason(enabled: bool, tokens: bool, autonomy: bool, addressed: bool) -> str:
    """Why this node's agent does not take part, or "" when it does."""
    if not enabled:
        return "neighboursEnabled is false"
    if not tokens:
        return ("the Agent API has no tokens (--token-file), so it listens on loopback only and other nodes "
                "cannot reach it")
    if not autonomy:
        return "autonomyEnabled is false: there is no water level to trade"
    if not addressed:
        return ("no Agent API address to publish for other nodes (--agent-address, or an --agent-host other than "
                "loopback or 0.0.0.0 with a fixed --port)")
    return ""


def heard_from(levels: Sequence[Any], now: float) -> tuple[Heard, ...]:
    """The gateway's side: the levels an ExchangeLoad answer carries, timed on this process's clock. Levels that
    do not parse are left out (logged)."""
    out = []
    for message in levels:
        try:
            level, age_ms = from_pb(message)
        except ValueError as exc:
            log.warning("ExchangeLoad: a neighbour level left out: %s", exc)
            continue
        out.append(Heard(level, now - age_ms / 1e3))
    return tuple(out)


def addresses_of(pairs: Iterable[str]) -> dict[str, str]:
    """`NODE=HOST:PORT` strings (the agent's --neighbour flags) as a directory; ValueError names the bad one."""
    out: dict[str, str] = {}
    for pair in pairs:
        node, sep, address = pair.partition("=")
        if not sep or not node.strip() or not address.strip():
            raise ValueError(f"--neighbour {pair!r}: expected NODE=HOST:PORT")
        out[node.strip()] = address.strip()
    return out

