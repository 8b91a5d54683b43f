"""The agent's gRPC API (`volga.v1.Agent`): activate, hold, release, status and list instances of this node, the
sidecar gateway's load exchange with the node's autonomy loop (`ExchangeLoad`, when the loop runs), and the
neighbours' level exchange (`ExchangeLevel`, `volga_agent/neighbours.py`), whose fresh levels the gateway gets
back in ExchangeLoad's answer.

A thin layer over `pool.Pool`: wakes run on the pool's threads (they block on CRIU, the driver, process
starts), errors become gRPC statuses that say what to do: NOT_FOUND for a model with no instance on this
node, UNAVAILABLE when even a cold start failed, DEADLINE_EXCEEDED when the caller's deadline passed (the
wake goes on, so the next request finds the instance HOT).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import grpc

from volga_agent import auth, errors, load, neighbours
from volga_agent.node import pool
from volga_agent.rpc.volga.v1 import agent_pb2 as pb
from volga_agent.rpc.volga.v1 import agent_pb2_grpc as pb_grpc
from volga_core import api

log = logging.getLogger(__name__)
# How often a gateway is told to call ExchangeLoad when no autonomy loop runs here (it learns it if one starts).
IDLE_EXCHANGE_MS = 1000
# The longest an activation without a deadline waits for its model's source to be fetched.
FETCH_WAIT_S = 600.0




class Directives(Protocol):
    @property
    def batch_caps(self) -> Mapping[str, int]: ...

    @property
    def shed_retry_after_ms(self) -> Mapping[str, int]: ...


class LoadExchange(Protocol):
    """The autonomy loop's side of the exchange (`autonomy.exchange.Exchange`; this layer does not import it)."""

    def push(self, loads: Mapping[str, load.ModelLoad]) -> Directives: ...

def tier_pb(tier: api.Tier) -> Any:
    """The proto enum shares the API's tier names."""
    return pb.Tier.Value(tier.value)


def instance_pb(info: pool.InstanceInfo) -> Any:
    return pb.Instance(name=info.name, model_id=info.model_id, model_version=info.model_version,
                       tier=tier_pb(info.tier), device=info.device, socket=info.socket, node=info.node,
                       snapshot_bytes=info.snapshot_bytes, last_used_unix=info.last_used_unix,
                       last_wake_ms=info.last_wake_ms, input_hash=info.input_hash, state_reason=info.state_reason,
                       warmup_reported=info.warmup_reported, warmup_skipped=info.warmup_skipped,
                       output_mismatch=info.output_mismatch, source=info.source, source_digest=info.source_digest,
                       answered_outputs=[pb.TensorShape(name=name, shape=shape)
                                         for name, shape in info.answered_outputs])


class AgentService(pb_grpc.AgentServicer):
    def __init__(self, node_pool: pool.Pool, exchange: LoadExchange | None = None, exchange_ms: float = 50.0,
                 levels: neighbours.LevelExchange | None = None, levels_off: str = "") -> None:
        self.pool = node_pool
        self.exchange = exchange
        self.exchange_ms = exchange_ms
        self.levels = levels
        self.levels_off = levels_off or "neighbours are off"

    async def Activate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not request.model_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_id is required")
        fetched = self.pool.awaiting(request.model_id)
        if fetched is not None:  # its source is being fetched: wait within the request's deadline (no thread held)
            until = time.monotonic() + (request.timeout_ms / 1e3 if request.timeout_ms else FETCH_WAIT_S)
            while not fetched.is_set() and time.monotonic() < until:
                await asyncio.sleep(0.05)
            if not fetched.is_set():
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"{request.model_id}: its model is still being fetched (the fetch goes on)")
        work = asyncio.to_thread(self.pool.activate, request.model_id, request.instance, request.device_hint)
        task = asyncio.ensure_future(work)
        try:
            activation = await asyncio.wait_for(asyncio.shield(task), request.timeout_ms / 1e3 or None)
        except (TimeoutError, asyncio.CancelledError) as exc:
            task.add_done_callback(self._given_up)  # the wake goes on; a server's lease is not left held
            if isinstance(exc, asyncio.CancelledError):
                raise
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"{request.model_id}: not awake within {request.timeout_ms} ms (the wake goes on)")
        except errors.UnknownModel as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except errors.ActivationFailed as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; the instance is marked failed, retry later")
        return pb.ActivateResponse(instance=instance_pb(activation.instance), woke_from=tier_pb(activation.woke_from),
                                   wake_ms=activation.wake_ms, fallback=activation.fallback,
                                   also=[instance_pb(other) for other in activation.also])

    def _given_up(self, task: asyncio.Future[pool.Activation]) -> None:
        """A model server's activation whose caller stopped waiting (its deadline passed, its call was cancelled):
        released once its wake is done, as the caller's Release would have; unreleased, it would keep the server
        from its idle freeze for `serverpool.LEASE_MAX_SEC`. Other models' activations hold nothing."""
        if task.cancelled() or task.exception() is not None:
            return
        self._release_server(task.result().instance.name)

    def _release_server(self, name: str) -> None:
        """A model server's activation given back (other models' activations hold nothing)."""
        if self.pool.servers.owns(name):
            with contextlib.suppress(errors.UnknownModel):  # removed meanwhile
                self.pool.release(name)

    async def Hold(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Activate, then held until the caller ends the call or goes away (grpc cancels this then): a model
        server's activation is released as the call ends, whatever ended it."""
        reply = await self.Activate(request, context)
        try:
            yield reply
            await asyncio.Event().wait()  # the hold: only the call's end (a cancellation) ends it
        finally:
            self._release_server(reply.instance.name)

    async def Release(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self.pool.release(request.instance)
        except errors.UnknownModel as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return pb.ReleaseResponse()

    async def Status(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = await asyncio.to_thread(self.pool.status)
        s = self.pool.settings
        gpus = [pb.Gpu(index=g.index, uuid=g.uuid, product=g.product, memory_total_bytes=g.memory_total_bytes,
                       memory_used_bytes=g.memory_used_bytes, driver=g.driver, pci_bus_id=g.pci_bus_id,
                       numa_node=g.numa_node) for g in self.pool.gpus]
        return pb.StatusResponse(
            node=status.node, gpus=gpus, host_memory_budget_bytes=s.budgets.host_memory_bytes,
            host_memory_used_bytes=status.host_memory_used_bytes,
            snapshot_disk_budget_bytes=s.budgets.snapshot_disk_bytes,
            snapshot_disk_used_bytes=status.snapshot_disk_used_bytes, activations=status.activations,
            restore_failures=status.restore_failures, evictions=status.evictions,
            circuit_open=bool(status.open_circuits))

    async def ListInstances(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        infos = self.pool.instances(request.model_id, include_failed=True)
        return pb.ListInstancesResponse(instances=[instance_pb(i) for i in infos])


    async def ExchangeLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.exchange is None:
            return pb.ExchangeLoadResponse(autonomy=False, period_ms=IDLE_EXCHANGE_MS)
        loads = {}
        for pushed in request.loads:
            if not pushed.model_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "loads[].model_id is required")
            loads[pushed.model_id] = load.ModelLoad(pushed.arrivals, pushed.completed, pushed.queue_depth,
                                                    tuple(pushed.latencies_ms), pushed.shed)
        directives = self.exchange.push(loads)
        reply = pb.ExchangeLoadResponse(autonomy=True, batch_caps=directives.batch_caps,
                                        shed_retry_after_ms=directives.shed_retry_after_ms,
                                        period_ms=max(1, round(self.exchange_ms)))
        if self.levels is not None:
            reply.state = self.levels.state()
            now = time.monotonic()
            reply.neighbours.extend(neighbours.to_pb(h.level, round(h.age(now) * 1e3)) for h in self.levels.fresh(now))
        return reply

    async def ExchangeLevel(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.levels is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"node {self.pool.node} takes no part in the neighbour exchange: {self.levels_off}")
        assert self.levels is not None
        try:
            level, age_ms = neighbours.from_pb(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return neighbours.to_pb(self.levels.receive(level, age_ms))


async def serve(node_pool: pool.Pool, host: str, port: int, socket_path: str = "",
                tokens: auth.Tokens | None = None, exchange: LoadExchange | None = None,
                exchange_ms: float = 50.0, levels: neighbours.LevelExchange | None = None,
                levels_off: str = "") -> tuple[grpc.aio.Server, int]:
    """The Agent API on host:port (port -1: no TCP port) and on the UNIX socket `socket_path` (if given); the
    server and its TCP port. Without `tokens` it listens on loopback only (ValueError otherwise): whoever reaches
    it can wake and release every instance of the node. With them, every call needs one (docs/security.md).
    `exchange`: the autonomy loop's, when it runs, and how often gateways are to call ExchangeLoad. `levels`: the
    neighbour exchange, when this node takes part (else `levels_off` says why not)."""
    if port >= 0 and tokens is None and not auth.is_loopback(host):
        raise ValueError(f"the Agent API listens on {host} only with a token (--token-file): anyone who reaches it "
                         "can wake and release this node's instances")
    server = grpc.aio.server(interceptors=[auth.GrpcAuth(tokens)] if tokens is not None else None)
    pb_grpc.add_AgentServicer_to_server(AgentService(node_pool, exchange, exchange_ms, levels, levels_off), server)
    bound = -1
    if port >= 0:
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port} (agent gRPC)")
    if socket_path:
        pathlib.Path(socket_path).unlink(missing_ok=True)
        if server.add_insecure_port(f"unix:{socket_path}") == 0:
            raise OSError(f"cannot listen on {socket_path} (agent gRPC)")
    await server.start()
    return server, bound
