"""How a gateway reaches what serves a model: its node's agent (in-process or over gRPC), or another gateway.

The router asks an `AgentLink` to wake a model and gets a `Route` to a HOT worker's socket. Two links
implement it: `GrpcAgentLink` for the sidecar (the agent's gRPC API) and `LocalAgentLink` for `volga up`
(a pool in the same process, given as a callable so the gateway does not import the pool). Both raise
`errors.UnknownModel` and `errors.ActivationFailed`.

Both links also say what the agent knows of a model's instances (`instances`: tier and the reason the agent
recorded, e.g. a worker that could not start), which the gateway's readiness answers are built from, and the
shapes a model's outputs answered with where they contradict its declaration, which its metadata says instead.

A sidecar gateway also keeps its node's autonomy loop informed: `Exchanger` sends the data plane's per-model
load to the agent (ExchangeLoad) every few tens of milliseconds, off the request path, and enforces the batch
caps and shed models the answer carries; the answer also carries the node's autonomy state and its neighbours'
fresh levels (`volga_agent/neighbours.py`), which the data plane reads to pass an overloaded node's requests on.

`Forwarder` is the third way out: for a model placed only on other nodes, it passes the request on to one
of their gateways over gRPC, once. Forwarded requests carry `x-volga-forwarded` and are never forwarded
again (`docs/architecture.md`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Protocol

import grpc
import numpy as np

from volga_agent import errors, load, neighbours, ports
from volga_agent.gateway import oip
from volga_agent.rpc.inference import grpc_service_pb2_grpc as oip_grpc
from volga_agent.rpc.volga.v1 import agent_pb2 as agent_pb
from volga_agent.rpc.volga.v1 import agent_pb2_grpc as agent_grpc
from volga_core import api

log = logging.getLogger(__name__)
FORWARDED = "x-volga-forwarded"
PASSED_ON = ("x-input-hash", "x-device-hint", "authorization")  # the gateways of a cluster share tokens
# How long a wake waits, within its request's deadline, for the agent's channel to connect; then UNAVAILABLE.
AGENT_CONNECT_WAIT_S = 5.0


@dataclasses.dataclass(frozen=True)
class Route:
    instance: str
    socket: str  # the HOT worker's AF_UNIX socket
    also: tuple[str, ...] = ()  # the sockets of the model's other HOT instances there, to spread requests over


@dataclasses.dataclass(frozen=True)
class InstanceState:
    """One instance of a model as its agent reports it."""

    name: str
    tier: str  # HOT, WARM, SUSPENDED, FROZEN or COLD
    reason: str = ""  # what the agent recorded about its last move, empty when it went well
    # The outputs whose answers in the worker's warm-up contradict the declaration, with the shape they answer with.
    answered_outputs: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def down(self) -> bool:
        """No worker, and the agent's last attempt to start or wake one failed: a request would fail too."""
        return self.tier == api.Tier.COLD.value and bool(self.reason)


class AgentInstance(Protocol):
    """What `LocalAgentLink` reads of the pool's instance views (`pool.InstanceInfo` has these fields)."""

    @property
    def name(self) -> str: ...

    @property
    def tier(self) -> api.Tier: ...

    @property
    def state_reason(self) -> str: ...

    @property
    def answered_outputs(self) -> tuple[tuple[str, tuple[int, ...]], ...]: ...


class AgentLink(Protocol):
    async def activate(self, model_id: str, device_hint: str, timeout_ms: int) -> Route:
        """Wake the best instance; raise errors.UnknownModel or errors.ActivationFailed."""
        ...

    async def instances(self, model_id: str) -> list[InstanceState] | None:
        """The agent's instances of the model; None when this link cannot tell. ConnectionError: no agent."""
        ...

    async def close(self) -> None: ...


def _route(reply: agent_pb.ActivateResponse) -> Route:
    return Route(reply.instance.name, reply.instance.socket, tuple(other.socket for other in reply.also))


class GrpcAgentLink:
    """The agent's gRPC API (the sidecar case)."""

    def __init__(self, address: str, token: str = "") -> None:
        self.address = address  # host:port, or unix:PATH
        self.channel = grpc.aio.insecure_channel(address, options=ports.RECONNECT_OPTIONS)
        self.stub = agent_grpc.AgentStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else None

    async def _connected(self, timeout_ms: int) -> None:
        """Wait a little for the channel to connect: a call on a channel that is between two attempts fails at
        once with the last attempt's error, though the agent may be listening by now."""
        if self.channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY:
            return
        wait = min(AGENT_CONNECT_WAIT_S, timeout_ms / 1e3) if timeout_ms else AGENT_CONNECT_WAIT_S
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.channel.channel_ready(), wait)

    async def _request(self, model_id: str, device_hint: str, timeout_ms: int) -> agent_pb.ActivateRequest:
        """The activation's request, once the channel is ready; its deadline less the wait for that."""
        started = time.monotonic()
        await self._connected(timeout_ms)
        if timeout_ms:
            timeout_ms = max(1, timeout_ms - int((time.monotonic() - started) * 1e3))
        return agent_pb.ActivateRequest(model_id=model_id, device_hint=device_hint, timeout_ms=timeout_ms)

    def _failed(self, exc: grpc.aio.AioRpcError) -> Exception:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return errors.UnknownModel(exc.details())
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TimeoutError(exc.details())
        return errors.ActivationFailed(f"agent {self.address}: {exc.code().name}: {exc.details()}")

    async def activate(self, model_id: str, device_hint: str, timeout_ms: int) -> Route:
        request = await self._request(model_id, device_hint, timeout_ms)
        try:
            reply = await self.stub.Activate(request, timeout=request.timeout_ms / 1e3 if timeout_ms else None,
                                             metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._failed(exc) from None
        return _route(reply)

    @contextlib.asynccontextmanager
    async def hold(self, model_id: str, timeout_ms: int) -> AsyncIterator[Route]:
        """Activate the model's server and keep it from being frozen until the block is left (a request answered):
        the agent's Hold call, open for as long. Should this process die first, its connection ends the call and
        the agent releases the server."""
        request = await self._request(model_id, "", timeout_ms)
        call = self.stub.Hold(request, metadata=self.metadata)  # no deadline: the hold lasts as long as the request
        try:
            try:
                reply = await asyncio.wait_for(call.read(), request.timeout_ms / 1e3 if timeout_ms else None)
            except grpc.aio.AioRpcError as exc:
                raise self._failed(exc) from None
            if reply is grpc.aio.EOF:
                raise errors.ActivationFailed(f"agent {self.address}: the hold of {model_id} ended without an answer")
            yield _route(reply)
        finally:
            call.cancel()  # the agent releases the server as the call ends

    async def instances(self, model_id: str) -> list[InstanceState] | None:
        try:
            reply = await self.stub.ListInstances(agent_pb.ListInstancesRequest(model_id=model_id), timeout=5.0,
                                                  metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise ConnectionError(f"agent {self.address}: {exc.code().name}: {exc.details()}") from None
        return [InstanceState(i.name, agent_pb.Tier.Name(i.tier), i.state_reason,
                              tuple((o.name, tuple(o.shape)) for o in i.answered_outputs)) for i in reply.instances]

    async def exchange_load(self, loads: Mapping[str, LoadReading], timeout: float = 1.0) -> Directives:
        """Send the load since the previous call; the autonomy loop's directives back. ConnectionError: no agent."""
        request = agent_pb.ExchangeLoadRequest(loads=[
            agent_pb.ModelLoad(model_id=m, arrivals=x.arrivals, completed=x.completed, queue_depth=x.queue_depth,
                               latencies_ms=x.latencies_ms, shed=x.shed) for m, x in loads.items()])
        try:
            reply = await self.stub.ExchangeLoad(request, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise ConnectionError(f"agent {self.address}: {exc.code().name}: {exc.details()}") from None
        return Directives(reply.autonomy, dict(reply.batch_caps), dict(reply.shed_retry_after_ms), reply.period_ms,
                          reply.state, neighbours.heard_from(reply.neighbours, time.monotonic()))

    async def close(self) -> None:
        await self.channel.close()


LoadReading = load.LoadReading


@dataclasses.dataclass(frozen=True)
class Directives:
    """The node's autonomy loop's word, in full: caps by model, shed models with their retry hint."""

    autonomy: bool
    batch_caps: Mapping[str, int]
    shed_retry_after_ms: Mapping[str, int]
    period_ms: int
    state: str = ""  # the node's autonomy state
    neighbours: tuple[neighbours.Heard, ...] = ()  # the neighbours' fresh levels


class Steered(Protocol):
    """What `Exchanger` reads and steers of the data plane."""

    def drain_load(self) -> Mapping[str, LoadReading]: ...

    def set_batch_cap(self, model: str, cap: int | None) -> None: ...

    def shed(self, model: str, retry_after_ms: int) -> None: ...

    def unshed(self, model: str) -> None: ...

    def set_neighbours(self, state: str, heard: tuple[neighbours.Heard, ...]) -> None: ...


class Exchanger:
    """The sidecar's half of the load exchange: a task that drains the data plane's load, sends it to the agent,
    and makes the data plane's caps and sheds what the agent's answer says, every `period_ms` the agent asks for.
    Failures (no agent yet, a restart) are logged once per run of them and retried; the data plane keeps what
    it was last told until an answer says otherwise."""

    def __init__(self, plane: Steered, link: GrpcAgentLink, period_ms: float = 50.0) -> None:
        self.plane = plane
        self.link = link
        self.period = period_ms / 1e3
        self.exchanges = 0  # answered calls
        self._caps: dict[str, int] = {}
        self._shed: dict[str, int] = {}
        self._levels: tuple[str, tuple[neighbours.Heard, ...]] = ("", ())
        self._task = neighbours.BackgroundTask("load-exchange")

    def start(self) -> None:
        self._task.start(self._run())

    async def stop(self) -> None:
        await self._task.stop()

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                directives = await self.link.exchange_load(self.plane.drain_load())
            except ConnectionError as exc:
                if not failing:
                    log.warning("load exchange with the agent failed (retrying): %s", exc)
                failing = True
            else:
                failing = False
                self.exchanges += 1
                self.apply(directives)
                if directives.period_ms:
                    self.period = directives.period_ms / 1e3
            await asyncio.sleep(self.period)

    def apply(self, directives: Directives) -> None:
        """Make the data plane's caps and sheds those of `directives`, changing only what differs."""
        for model, cap in directives.batch_caps.items():
            if self._caps.get(model) != cap and _tried(functools.partial(self.plane.set_batch_cap, model, cap)):
                self._caps[model] = cap
        for model in [m for m in self._caps if m not in directives.batch_caps]:
            _tried(functools.partial(self.plane.set_batch_cap, model, None))
            del self._caps[model]
        for model, retry in directives.shed_retry_after_ms.items():
            if self._shed.get(model) != retry and _tried(functools.partial(self.plane.shed, model, retry)):
                self._shed[model] = retry
        for model in [m for m in self._shed if m not in directives.shed_retry_after_ms]:
            self.plane.unshed(model)
            del self._shed[model]
        levels = (directives.state, directives.neighbours)
        if levels != self._levels:
            self.plane.set_neighbours(*levels)
            self._levels = levels


def _tried(call: Callable[[], None]) -> bool:
    try:
        call()
    except (errors.UnknownModel, ValueError) as exc:  # a model this gateway's catalog does not hold (yet)
        log.debug("load exchange: %s", exc)
        return False
    return True


class LocalAgentLink:
    """A pool in the same process (`volga up`): `activate(model_id, device_hint)` blocks, so it runs in a thread;
    `instances(model_id)` (the pool's instance views, failed ones included) is quick and runs inline."""

    def __init__(self, activate: Callable[[str, str], Route],
                 instances: Callable[[str], Sequence[AgentInstance]] | None = None) -> None:
        self._activate = activate
        self._instances = instances

    async def activate(self, model_id: str, device_hint: str, timeout_ms: int) -> Route:
        return await asyncio.to_thread(self._activate, model_id, device_hint)

    async def instances(self, model_id: str) -> list[InstanceState] | None:
        if self._instances is None:
            return None
        return [InstanceState(i.name, i.tier.value, i.state_reason, i.answered_outputs)
                for i in self._instances(model_id)]

    async def close(self) -> None:
        return None


class Forwarder:
    """Other nodes' gateways, one gRPC channel each."""

    def __init__(self, max_message_bytes: int = 64 * 2**20) -> None:
        self.max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> oip_grpc.GRPCInferenceServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            options = [("grpc.max_receive_message_length", self.max_message_bytes),
                       ("grpc.max_send_message_length", self.max_message_bytes), *ports.RECONNECT_OPTIONS]
            channel = self._channels[address] = grpc.aio.insecure_channel(address, options=options)
        return oip_grpc.GRPCInferenceServiceStub(channel)

    async def infer(self, address: str, model_id: str, inputs: Mapping[str, np.ndarray], headers: Mapping[str, str],
                    origin: str, timeout: float | None) -> dict[str, np.ndarray]:
        metadata = [("x-model-id", model_id), (FORWARDED, origin or "unknown")]
        metadata += [(k, headers[k]) for k in PASSED_ON if headers.get(k)]
        try:
            response = await self._stub(address).ModelInfer(oip.encode_grpc_request(model_id, inputs),
                                                            metadata=metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise oip.error(exc.code().name, f"forwarded to the gateway at {address}: {exc.details()}") from None
        return oip.decode_grpc_response(response)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
