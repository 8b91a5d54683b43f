"""`volga up`: agent + gateway + a local store of ModelSpecs on one machine, no Kubernetes.

The same parts as in a cluster, wired in one process: ModelSpecs come from files instead of the API server,
the planner (`volga_core.planner`, the operator's own) places their pool floors on the one local node,
the pool converges and runs its local policy, the gateway reaches the pool in-process instead of over gRPC,
and the Agent API is served too, for tools. With `settings.autonomy.enabled` (`volga up --autonomy`) the node
autonomy loop runs too, steering this very gateway's data plane and pool. Stopping (Ctrl-C, SIGTERM) stops
every worker and removes every snapshot this run made; a CRIU call in flight is killed first, so a hung
restore does not hold it up. Its temporary folders carry an owner marker: a run killed with SIGKILL leaves
them (and, for a moment, processes) behind, and the next run removes what is proven to be a dead run's
(`process.remove_abandoned`).

ModelSpecs with `framework: server` are model servers: the planner places their pool floors like any model's and
the pool runs them as a cluster node's agent does (`node.serverpool`: brought to their floors' tiers, woken by the
first request, taken back down their ladder when idle). The gateway's REST port proxies requests that name them
(`gateway.proxy`), leasing them from the pool in this process (`proxy.PoolLink`); the other gateway processes
(`--gateway-processes`) lease them through the Agent API, and `volga status` lists them. A server runs the command
its ModelSpec gives: `volga up` runs the ModelSpecs its user hands it, so it runs their servers without
`--allow-model-code`; their folders must lie inside the model roots as model files do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import pathlib
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Sequence

import grpc
import yaml

from volga_agent import auth, metrics, ports
from volga_agent.app import server
from volga_agent.autonomy import loop as autonomy
from volga_agent.gateway import app, catalog, links, proxy, siblings
from volga_agent.host import gpus, process
from volga_agent.node import admission, pool, signature
from volga_agent.node.settings import Settings
from volga_core import api, planner

log = logging.getLogger(__name__)
NODE = socket.gethostname() or "local"
AGENT_HOST = "127.0.0.1"  # the Agent API wakes and releases instances: never beyond loopback here
# Where runs keep their temporary work folders and snapshots: (folder, name prefix).
TEMP_ROOTS = (("/tmp", "volga-run-"),
              ("/dev/shm" if pathlib.Path("/dev/shm").is_dir() else tempfile.gettempdir(), "volga-"))


@dataclasses.dataclass(frozen=True)
class Options(ports.Ports):
    """`volga up`'s options: its ports (the gateway's and the Agent API's), where it keeps its files, its settings."""

    host: str = "127.0.0.1"
    workroot: pathlib.Path | None = None
    snapshot_root: pathlib.Path | None = None
    settings: Settings = dataclasses.field(default_factory=Settings)
    tick_sec: float = 1.0
    tokens: auth.Tokens | None = None  # bearer tokens the gateway requires (the Agent API stays on loopback)
    token_file: str = ""  # where `tokens` came from: the other gateway processes read it too
    gateway_processes: int = 1  # gateway processes on the gateway's ports (`gateway/siblings.py`)


class Embedded:
    """One node's agent, gateway and ModelSpec store in one process."""

    def __init__(self, specs: Sequence[api.ModelSpec], options: Options | None = None,
                 refused: Sequence[signature.Refused] = ()) -> None:
        """`refused`: ModelSpecs that could not be loaded; their models are named, answered UNAVAILABLE with the
        reason, and listed (`volga status`) as instances that could not be created, but never planned."""
        self.options = options or Options()
        names = [s.metadata.name for s in specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"metadata.name must be unique; repeated: {', '.join(dupes)}")
        self.specs = {s.metadata.name: s.spec for s in specs}
        self._documents = [s.to_wire() for s in specs]
        self.refused = {r.model_id: r for r in refused}
        processes = self.options.gateway_processes
        if processes < 1:
            raise ValueError(f"--gateway-processes: {processes}: at least 1 gateway process")
        if processes > 1 and self.options.agent_port < 0:
            raise ValueError("--gateway-processes: the other gateway processes reach the pool through the Agent API; "
                             "it is off (--agent-port -1)")
        if processes > 1 and self.options.settings.autonomy.enabled:
            raise ValueError("--gateway-processes: the autonomy loop of `volga up` steers its one in-process gateway; "
                             "run one gateway process with --autonomy")
        self.gpus = gpus.discover()
        self.settings = admission.node_settings(self.options.settings)
        self.plan = planner.plan(self.specs, [gpus.node_profile(self.gpus, NODE)])
        admission.check_count(sum(d.node == NODE for d in self.plan.desired), self.settings)
        self._owned: list[pathlib.Path] = []
        process.kill_orphans()  # before their folders go: a killed run's workers may still hold files there
        for folder, prefix in TEMP_ROOTS:
            for path in process.remove_abandoned(pathlib.Path(folder).glob(f"{prefix}*")):
                log.warning("removed %s, left by a volga up that is gone", path)
        workroot = self.options.workroot or self._temp(*TEMP_ROOTS[0])
        snapshots = self.options.snapshot_root or self._temp(*TEMP_ROOTS[1])
        self.folders = {"workdir": workroot, "snapshots": snapshots}
        self.agent_metrics = metrics.AgentMetrics()
        self.pool = pool.Pool(NODE, workroot, snapshots, self.settings, self.agent_metrics, self.gpus)
        self.pool.servers.commands_allowed = True  # the user's own ModelSpecs (see above); model roots still hold
        gw_settings = app.Settings(
            host=self.options.host, http_port=self.options.http_port, grpc_port=self.options.grpc_port,
            metrics_port=self.options.metrics_port, cache_ttl_sec=self.options.settings.gateway_cache_ttl_sec,
            tokens=self.options.tokens, reuse_port=processes > 1)
        self.siblings: siblings.Siblings | None = None
        models = catalog.Catalog({s.model_id: s for s in self.specs.values()})
        # Model servers: leased from the pool (no proxy in the request path of a volga up that has none).
        self.servers = (proxy.AgentServers(models, proxy.PoolLink(self._activate_server, self.pool.release))
                        if any(s.framework is api.Framework.SERVER for s in self.specs.values()) else None)
        self.gateway = app.Gateway(models, links.LocalAgentLink(self._activate, self._instances), gw_settings,
                                   extra_metrics=[self.agent_metrics.registry], servers=self.servers)
        for r in self.refused.values():
            reason = refusal_reason(r)
            self.gateway.catalog.refuse(r.model_id, r.spec.spec.version, reason)
            self.pool.refuse(_instance(r), r.spec.spec, reason)
        self._agent: grpc.aio.Server | None = None
        self.agent_port = 0
        self.autonomy = (autonomy.Loop(self.pool, self.gateway.dataplane, self.settings, self.agent_metrics)
                         if self.settings.autonomy.enabled else None)

    def _activate(self, model_id: str, device_hint: str) -> links.Route:
        """The gateway's in-process link to the pool."""
        act = self.pool.activate(model_id, "", device_hint)
        return links.Route(act.instance.name, act.instance.socket, tuple(other.socket for other in act.also))

    def _activate_server(self, model_id: str) -> links.Route:
        """A model server's lease from the pool: its activation, until `pool.release`."""
        act = self.pool.activate(model_id)
        return links.Route(act.instance.name, act.instance.socket)

    def _instances(self, model_id: str) -> list[pool.InstanceInfo]:
        return self.pool.instances(model_id, include_failed=True)

    def _temp(self, folder: str, prefix: str) -> pathlib.Path:
        path = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=folder))
        process.claim(path)
        self._owned.append(path)
        return path

    async def start(self) -> None:
        for name, reason in self.plan.unplaced.items():
            log.error("ModelSpec %s not placed: %s", name, reason)
        self.pool.apply(self.plan.desired, self.specs)
        self.pool.start(self.options.tick_sec)
        await self.gateway.start()
        if self.autonomy is not None:
            self.autonomy.start()
        if not auth.is_loopback(self.options.host):
            log.warning("the gateway listens on %s%s; the Agent API stays on %s", self.options.host,
                        "" if self.options.tokens else " without authentication (--token-file)", AGENT_HOST)
        if self.options.agent_port >= 0:
            self._agent, self.agent_port = await server.serve(self.pool, AGENT_HOST, self.options.agent_port)
        if self.options.gateway_processes > 1:
            await self._start_siblings()

    async def _start_siblings(self) -> None:
        """Gateway processes 1..N-1: each a `volga-gateway` on this gateway's ports, with the same ModelSpecs (as
        loaded here, signatures read), routing through the Agent API."""
        o, bound = self.options, self.gateway.ports
        specs = self.folders["workdir"] / "gateway-modelspecs.yaml"
        specs.write_text(yaml.safe_dump_all(self._documents, sort_keys=False))
        refused: list[str] = []
        if self.refused:
            path = self.folders["workdir"] / "gateway-refused.json"
            path.write_text(json.dumps([{"modelId": r.model_id, "version": r.spec.spec.version,
                                         "reason": refusal_reason(r)} for r in self.refused.values()]))
            refused = ["--refused", str(path)]
        common = [*siblings.GATEWAY_MAIN, "--agent", f"{AGENT_HOST}:{self.agent_port}", "-f", str(specs), *refused,
                  "--host", o.host, "--http-port", str(bound["http"]), "--grpc-port", str(bound["grpc"]),
                  "--cache-ttl-sec", str(o.settings.gateway_cache_ttl_sec),
                  *(["--token-file", o.token_file] if o.token_file else [])]
        self.siblings = siblings.Siblings(lambda index: [*common, "--sibling", str(index)], o.gateway_processes,
                                          o.metrics_port)
        await asyncio.to_thread(self.siblings.start)

    async def wait_converged(self, timeout: float = 300.0) -> None:
        await asyncio.to_thread(self.pool.wait_converged, timeout)

    async def stop(self) -> None:
        if self.siblings is not None:
            await asyncio.to_thread(self.siblings.stop)
        if self.autonomy is not None:
            await asyncio.to_thread(self.autonomy.stop)
        self.pool.interrupt()
        await self.gateway.stop()
        if self._agent is not None:
            await self._agent.stop(1.0)
        await asyncio.to_thread(self.pool.close)
        for path in self._owned:
            shutil.rmtree(path, ignore_errors=True)

    def warming(self) -> str:
        """How many instances are on their way to their tiers, and how many could not even be created."""
        refused = {_instance(r) for r in self.refused.values()}
        failed = sum(1 for name in [*self.pool.failed, *self.pool.servers.failed] if name not in refused)
        warming = len(self.plan.desired) - failed
        text = "1 instance warming into its tier" if warming == 1 else f"{warming} instances warming into their tiers"
        if failed:
            text += (f"; {failed} could not be created: requests for their models answer UNAVAILABLE with the "
                     "reason, `volga status` lists it")
        return text

    def endpoints(self) -> dict[str, str]:
        host = self.options.host
        ports = self.gateway.ports
        out = {"http": f"http://{host}:{ports['http']}", "grpc": f"{host}:{ports['grpc']}",
               "metrics": f"http://{host}:{ports['metrics']}/metrics"}
        # the other gateway processes' own /metrics (metrics1, metrics2, ...)
        for index, port in enumerate(self.siblings.metrics_ports() if self.siblings else [], start=1):
            out[f"metrics{index}"] = f"http://{host}:{port}/metrics"
        return {**out, "agent": f"{AGENT_HOST}:{self.agent_port}"}


def _instance(refused: signature.Refused) -> str:
    """The name a refused ModelSpec's one instance is listed under (as the planner names a first instance)."""
    return f"{refused.spec.metadata.name}-0"


def refusal_reason(refused: signature.Refused) -> str:
    """Why a refused ModelSpec's model is not served, as requests for it, its readiness and `volga status` say."""
    return (f"its ModelSpec {refused.spec.metadata.name} ({refused.label}) could not be loaded when volga up "
            f"started: {refused.reason}; fix it and restart volga up")


async def run(specs: Sequence[api.ModelSpec], options: Options, announce: Callable[[str], None] = print,
              refused: Sequence[signature.Refused] = ()) -> None:
    """Serve until SIGINT or SIGTERM, then stop cleanly."""
    embedded = Embedded(specs, options, refused)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await embedded.start()
    except BaseException:
        await embedded.stop()  # what did start (the pool's workers, the gateway) stops, before the error is told
        raise
    try:
        for name, url in embedded.endpoints().items():
            announce(f"  {name:<8} {url}")
        for name, path in embedded.folders.items():
            announce(f"  {name:<8} {path}")
        announce(f"  models   {', '.join(sorted(s.model_id for s in embedded.specs.values()))} "
                 f"({embedded.warming()})")
        if embedded.refused:
            announce(f"  refused  {', '.join(sorted(embedded.refused))} (not served: requests for them answer "
                     "UNAVAILABLE with the reason)")
        announce("Ctrl-C stops everything and removes the snapshots.")
        process.settled()
        await stop.wait()
    finally:
        announce("stopping: workers, snapshots ...")
        await embedded.stop()
        announce("stopped.")
