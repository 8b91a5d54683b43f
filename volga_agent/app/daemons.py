"""`volga-agent` and `volga-gateway`: the node daemons, as the agent DaemonSet runs them.

Both take their ModelSpecs either from files (`-f`, static: a node without Kubernetes, or tests) or from the
Kubernetes API (`--kube`, the cluster mode: the agent drives the EMIs placed on its node, the gateway routes
every ModelSpec of the cluster). The agent serves the Agent gRPC API and its metrics; the gateway serves the
Open Inference Protocol and reaches its node's agent over gRPC. With `autonomyEnabled` in the agent's settings
the agent runs the node autonomy loop; the gateway sends it its per-model load and takes its directives (batch
caps, shed models) in one periodic call (`links.Exchanger`, the Agent API's ExchangeLoad). With
`neighboursEnabled` too, and Agent API tokens, the agent trades its water level with two other nodes' agents
(`neighbours.py`: found through Node annotations, or given with --neighbour) and the gateway passes an
overloaded node's requests to them.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import multiprocessing
import os
import pathlib
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import uvloop

from volga_agent import auth, metrics, neighbours, ports
from volga_agent.app import defaultmodel, server
from volga_agent.autonomy import exchange, loop
from volga_agent.gateway import app, catalog, links, proxy, siblings
from volga_agent.host import gpus, process
from volga_agent.node import admission, pool, signature
from volga_agent.node.settings import Settings
from volga_core import api, http, planner

log = logging.getLogger("volga")
# Where `volga-agent --kube` lets ModelSpec sources point unless settings.model_roots says otherwise: the chart's
# models volume and the folder `volga build-model` writes.
DEFAULT_MODEL_ROOTS = ("/var/lib/volga/models", str(defaultmodel.default_cache()))


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if bool(args.file) == args.kube:
        parser.error("give either -f FILES (static) or --kube (cluster mode)")
    return args


def _specs(files: list[str]) -> list[api.ModelSpec]:
    return signature.load_files(files)


def _signalled() -> asyncio.Event:
    """An event SIGINT or SIGTERM sets, from now on."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event


async def _until_signalled(stop: Callable[[], Awaitable[None]], event: asyncio.Event | None = None) -> None:
    event = event or _signalled()
    process.settled()
    try:
        await event.wait()
    finally:
        await stop()


def _run(main: Coroutine[Any, Any, None]) -> int:
    uvloop.run(main)
    return 0


def _calibrator(workdir: str, iterations: int) -> Callable[[api.ModelSpecSpec, str], api.Calibration]:
    """The cluster's calibrations: `volga calibrate`'s measurement (through a gateway of its own) with a worker
    of its own beside the node's instances, at the batch sizes the spec's baselines name (1 and 8 by default).
    Each runs in a fresh process: its gateway's grpc.aio server must not share this process with the Agent API's
    (grpc.aio serves one event loop per process), and a model that crashes takes only that process down."""
    from volga_agent.app import calibrate
    from volga_agent.cluster import calibrations

    def run(spec: api.ModelSpecSpec, device: str) -> api.Calibration:
        folder = pathlib.Path(workdir)
        folder.mkdir(parents=True, exist_ok=True)
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as child:
            try:
                return child.submit(calibrate.measure, spec, calibrate.batch_sizes_for(spec), iterations, device,
                                    folder).result()
            except calibrate.StartFailed as exc:
                raise calibrations.CalibrationFailed("StartFailed", str(exc)) from exc
            except ValueError as exc:
                raise calibrations.CalibrationFailed("InvalidSpec", str(exc)) from exc
            except concurrent.futures.BrokenExecutor as exc:
                raise calibrations.CalibrationFailed("CalibrationFailed", f"the measuring process died: {exc}") \
                    from exc

    return run


def agent_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="volga-agent", description=__doc__)
    parser.add_argument("--node", default=os.environ.get("NODE_NAME") or socket.gethostname())
    parser.add_argument("-f", "--file", action="append", help="static ModelSpecs (no Kubernetes)")
    parser.add_argument("--kube", action="store_true", help="cluster mode: drive the EMIs of this node")
    parser.add_argument("--host", default=os.environ.get("VOLGA_LISTEN", "127.0.0.1"), help="metrics address")
    parser.add_argument("--port", type=int, default=ports.DEFAULT.agent_port, help="Agent gRPC API (-1: none)")
    parser.add_argument("--agent-host", default="127.0.0.1",
                        help="Agent gRPC API address; other than loopback only with --token-file")
    parser.add_argument("--socket", default=os.environ.get("VOLGA_AGENT_SOCKET", ""),
                        help="also serve the Agent gRPC API on this UNIX socket")
    parser.add_argument("--token-file", default=os.environ.get("VOLGA_AGENT_TOKEN_FILE", ""),
                        help="bearer tokens (one a line) every Agent API call must carry")
    parser.add_argument("--metrics-port", type=int, default=8012)
    parser.add_argument("--metrics-token-file", default=os.environ.get("VOLGA_METRICS_TOKEN_FILE", ""),
                        help="bearer tokens (one a line) a /metrics scrape must carry; default: none asked")
    parser.add_argument("--workdir", default=os.environ.get("VOLGA_WORKDIR", "/run/volga"))
    parser.add_argument("--snapshot-dir", default=os.environ.get("VOLGA_SNAPSHOT_DIR", "/dev/shm/volga"))
    parser.add_argument("--settings", help="YAML/JSON file of agent settings (camelCase names; docs/architecture.md)")
    parser.add_argument("--gateway-address", default=os.environ.get("VOLGA_GATEWAY_ADDRESS", ""),
                        help="this node's gateway (gRPC host:port), reported in EMI status so other gateways can "
                             "forward requests for this node's models")
    parser.add_argument("--gateway-http-address", default=os.environ.get("VOLGA_GATEWAY_HTTP_ADDRESS", ""),
                        help="this node's gateway's HTTP host:port, reported beside --gateway-address: where other "
                             "gateways pass a model server's HTTP requests on (default: that host on their own "
                             "HTTP port)")
    parser.add_argument("--calibrate-iterations", type=int, default=200,
                        help="cluster mode: timed requests per batch size when a ModelSpec asks for a calibration "
                             "(the volga.dev/calibrate annotation)")
    parser.add_argument("--agent-address", default=os.environ.get("VOLGA_AGENT_ADDRESS", ""),
                        help="the Agent API as other nodes reach it (host:port), published for the neighbour "
                             "exchange; default: --agent-host:--port when that is neither loopback nor a wildcard")
    parser.add_argument("--neighbour", action="append", default=[], metavar="NODE=HOST:PORT",
                        help="an agent to trade water levels with (repeatable), instead of the Node annotations")
    parser.add_argument("--shared-snapshots", default=os.environ.get("VOLGA_SHARED_SNAPSHOTS", ""), metavar="DIR",
                        help="a folder every node mounts (settings.shared_snapshots, which it overrides): restore "
                             "the images other nodes publish there instead of cold starts, and publish this node's "
                             "(their restores need the same --workdir and --snapshot-dir paths)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = _parse(parser, argv)
    if args.calibrate_iterations < 1:
        parser.error(f"--calibrate-iterations {args.calibrate_iterations}: at least 1")
    try:
        static_neighbours = neighbours.addresses_of(args.neighbour)
    except ValueError as exc:
        parser.error(str(exc))
    settings = Settings()
    if args.settings:
        import yaml

        settings = Settings.from_mapping(yaml.safe_load(pathlib.Path(args.settings).read_text()) or {})
    if args.shared_snapshots:
        shared_snapshots = settings.shared.model_copy(update={"folder": args.shared_snapshots})
        settings = settings.model_copy(update={"shared": shared_snapshots})
    if args.kube and not settings.model_roots:
        # ModelSpecs from the API server name files on this node: only Volga's model folders by default.
        settings = settings.model_copy(update={"model_roots": DEFAULT_MODEL_ROOTS})
    if args.kube and settings.model_roots:
        from volga_agent.sources import cache

        # Remote sources load from the model cache's verified copies (`cluster.fetches`).
        settings = settings.model_copy(update={"model_roots": (*settings.model_roots, str(cache.default_root()))})
    settings = admission.node_settings(settings)
    tokens = auth.Tokens.from_file(args.token_file) if args.token_file else None
    metrics_tokens = auth.Tokens.from_file(args.metrics_token_file) if args.metrics_token_file else None
    if tokens is None and not auth.is_loopback(args.agent_host):
        parser.error(f"--agent-host {args.agent_host}: the Agent API leaves loopback only with --token-file")

    async def main() -> None:
        found = gpus.discover()
        node_metrics = metrics.AgentMetrics()
        node_pool = pool.Pool(args.node, args.workdir, args.snapshot_dir, settings, node_metrics, found)
        steering = exchange.Exchange() if settings.autonomy.enabled else None
        autonomy = loop.Loop(node_pool, steering, settings, node_metrics) if steering is not None else None
        # Other nodes reach neither a loopback nor a wildcard address: those need --agent-address.
        specific = args.agent_host not in ("0.0.0.0", "::", "[::]") and not auth.is_loopback(args.agent_host)
        published = args.agent_address or (f"{args.agent_host}:{args.port}" if args.port > 0 and specific else "")
        off = neighbours.off_reason(settings.neighbours.enabled, tokens is not None, autonomy is not None,
                                    bool(static_neighbours or not args.kube or published))
        if settings.neighbours.enabled and off:
            log.warning("node %s: neighbours are off: %s", args.node, off)
        levels = None
        if not off and autonomy is not None and steering is not None and tokens is not None:
            water = exchange.Water(node_pool, autonomy, steering, args.gateway_address, args.gateway_http_address)
            levels = neighbours.LevelExchange(args.node, water, tokens.values[0].decode(),
                                              settings.neighbours.period_ms, node_metrics)
        grpc_server, port = await server.serve(node_pool, args.agent_host, args.port, args.socket, tokens,
                                               steering, settings.autonomy.exchange_ms, levels, off)
        metrics_runner, metrics_port = await http.serve_metrics([node_metrics.registry], args.host,
                                                                  args.metrics_port, metrics_tokens)
        cluster: Any = None
        tier: Any = None
        follower: Any = None
        if args.kube:
            from volga_agent.cluster import sync, tiers, uninstall

            if settings.shared.node_local and os.environ.get(uninstall.DAEMONSET_ENV):
                # The node keeps images across agent restarts; they go when the DaemonSet goes (helm uninstall).
                follower = uninstall.Follower(os.environ[uninstall.DAEMONSET_ENV])
                follower.start()

            cluster = sync.AgentSync(node_pool, args.node, found, settings.api_writes_per_sec,
                                     gateway_address=args.gateway_address,
                                     gateway_http_address=args.gateway_http_address,
                                     calibrator=_calibrator(args.workdir, args.calibrate_iterations))
            if autonomy is not None:
                autonomy.views.measured = cluster.measured  # status.calibrated where the spec has no baselines
            await cluster.start()
            if autonomy is not None:
                tier = tiers.TierSync(cluster, autonomy, settings.autonomy.heartbeat_sec)
                await tier.start()
        else:
            specs = _specs(args.file)
            by_name = {s.metadata.name: s.spec for s in specs}
            plan = planner.plan(by_name, [gpus.node_profile(found, args.node)])
            node_pool.apply(plan.desired, by_name)
        directory: Any = None
        if levels is not None:
            if static_neighbours or not args.kube:
                levels.set_directory(static_neighbours)
            else:
                from volga_agent.cluster import directory as neighbour_directory

                directory = neighbour_directory.NeighbourDirectory(args.node, published, levels.set_directory,
                                                                   settings.api_writes_per_sec)
                await directory.start()
        node_pool.start()
        if autonomy is not None:
            autonomy.start()
        if levels is not None:
            levels.start()
        where = ", ".join([f"{args.agent_host}:{port}"] * (port >= 0) + [args.socket] * bool(args.socket))
        print(f"volga-agent {args.node}: Agent API {where}, metrics :{metrics_port}, "
              f"{len(found)} GPU(s)", flush=True)

        async def stop() -> None:
            if levels is not None:
                await levels.stop()
            if directory is not None:
                await directory.stop()
            if autonomy is not None:
                await asyncio.to_thread(autonomy.stop)
            if tier is not None:
                await tier.stop()
            if cluster is not None:
                await cluster.stop()
            await grpc_server.stop(2.0)
            await metrics_runner.cleanup()
            await asyncio.to_thread(node_pool.close)
            if follower is not None:
                await asyncio.to_thread(uninstall.clean_if_uninstalled, settings.shared.folder, follower.ref,
                                        follower=follower)
                follower.stop()

        await _until_signalled(stop)

    return _run(main())


def gateway_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="volga-gateway", description=__doc__)
    parser.add_argument("--agent", default=os.environ.get("VOLGA_AGENT", "127.0.0.1:8010"))
    parser.add_argument("--node", default=os.environ.get("NODE_NAME", ""),
                        help="this node (cluster mode): models placed only elsewhere are answered UNAVAILABLE")
    parser.add_argument("-f", "--file", action="append", help="static ModelSpecs (no Kubernetes)")
    parser.add_argument("--kube", action="store_true", help="cluster mode: route every ModelSpec of the cluster")
    parser.add_argument("--host", default=os.environ.get("VOLGA_LISTEN", "127.0.0.1"))
    parser.add_argument("--http-port", type=int, default=ports.DEFAULT.http_port)
    parser.add_argument("--grpc-port", type=int, default=ports.DEFAULT.grpc_port)
    parser.add_argument("--metrics-port", type=int, default=ports.DEFAULT.metrics_port)
    parser.add_argument("--metrics-token-file", default=os.environ.get("VOLGA_METRICS_TOKEN_FILE", ""),
                        help="bearer tokens (one a line) a /metrics scrape must carry; default: none asked")
    parser.add_argument("--cache-ttl-sec", type=float, default=60.0)
    parser.add_argument("--token-file", default=os.environ.get("VOLGA_GATEWAY_TOKEN_FILE", ""),
                        help="bearer tokens (one a line) that clients must send, but for health checks")
    parser.add_argument("--agent-token-file", default=os.environ.get("VOLGA_AGENT_TOKEN_FILE", ""),
                        help="the token this gateway sends to the Agent API (its first line)")
    parser.add_argument("--tls-cert", default="", help="gRPC over TLS: the server certificate (PEM)")
    parser.add_argument("--tls-key", default="", help="gRPC over TLS: the server key (PEM)")
    parser.add_argument("--tls-client-ca", default="", help="gRPC mutual TLS: the CA of client certificates (PEM)")
    parser.add_argument("--processes", type=int, default=int(os.environ.get("VOLGA_GATEWAY_PROCESSES", "1")),
                        help="gateway processes on the same ports (SO_REUSEPORT), each with its own /metrics on "
                             "--metrics-port + its index (volga_agent/gateway/siblings.py); default 1")
    parser.add_argument("--sibling", type=int, default=0, help=argparse.SUPPRESS)  # set by process 0 for the others
    # Set by `volga up` for its other gateway processes: a JSON list of the models it refused ({modelId, version,
    # reason}), which they answer UNAVAILABLE with the reason, as its own gateway does.
    parser.add_argument("--refused", default="", help=argparse.SUPPRESS)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = _parse(parser, argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.processes < 1:
        parser.error(f"--processes: {args.processes}: at least 1 gateway process")
    spawns = args.processes > 1 and args.sibling == 0
    if args.sibling:
        siblings.die_with_parent()
    tokens = auth.Tokens.from_file(args.token_file) if args.token_file else None
    metrics_tokens = auth.Tokens.from_file(args.metrics_token_file) if args.metrics_token_file else None
    agent_token = auth.Tokens.from_file(args.agent_token_file).values[0].decode() if args.agent_token_file else ""
    if not auth.is_loopback(args.host) and tokens is None:
        log.warning("volga-gateway listens on %s without authentication: anyone who reaches it may call every "
                    "model (--token-file; docs/security.md)", args.host)

    async def main() -> None:
        models = catalog.Catalog()
        settings = app.Settings(node=args.node, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                                metrics_port=args.metrics_port, cache_ttl_sec=args.cache_ttl_sec, tokens=tokens,
                                metrics_tokens=metrics_tokens,
                                tls_cert_file=args.tls_cert, tls_key_file=args.tls_key,
                                tls_client_ca_file=args.tls_client_ca,
                                reuse_port=args.processes > 1 or args.sibling > 0)
        link = links.GrpcAgentLink(args.agent, agent_token)
        model_servers = proxy.AgentServers(models, link, args.node)
        gw = app.Gateway(models, link, settings, servers=model_servers)
        exchanger = links.Exchanger(gw.dataplane, link)
        watcher: Any = None
        if args.kube:
            from volga_agent.cluster import catalog as catalog_sync

            watcher = catalog_sync.CatalogSync(models)  # not ready (503) until both watches have listed
        else:
            models.replace([s.spec for s in _specs(args.file)])
            if args.refused:
                for refused in json.loads(pathlib.Path(args.refused).read_text()):
                    models.refuse(refused["modelId"], refused["version"], refused["reason"])
        await gw.start()  # live at once: a probe sees it alive, and not ready while the catalog loads
        model_servers.http_port = gw.ports["http"]
        exchanger.start()
        signalled = _signalled()

        async def stop() -> None:
            if others is not None:
                await asyncio.to_thread(others.stop)
            await exchanger.stop()
            if watcher is not None:
                await watcher.stop()
            await gw.stop()

        others: siblings.Siblings | None = None
        if watcher is not None:
            listed, waiting = asyncio.ensure_future(watcher.start()), asyncio.ensure_future(signalled.wait())
            await asyncio.wait([listed, waiting], return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if signalled.is_set():  # stopped while it waited
                listed.cancel()
                await stop()
                return
            if not listed.result():
                log.warning("the API server has not listed the ModelSpecs and EMIs yet: the gateway serves not "
                            "ready (/v2/health/ready 503) and becomes ready once it has")
        # Process 0 of several reads this line from the others for their metrics port (`siblings.READY`).
        print(f"volga-gateway: HTTP {args.host}:{gw.ports['http']}, gRPC {args.host}:{gw.ports['grpc']}, "
              f"metrics :{gw.ports['metrics']}, agent {args.agent}", flush=True)
        if spawns:
            given = list(sys.argv[1:] if argv is None else argv)

            def command(index: int) -> list[str]:  # the same arguments, on the ports process 0 holds
                return [*siblings.GATEWAY_MAIN, *given, "--sibling", str(index), "--grpc-port", str(gw.ports["grpc"]),
                        "--http-port", str(gw.ports["http"])]

            others = siblings.Siblings(command, args.processes, args.metrics_port)
            try:
                await asyncio.to_thread(others.start)
            except siblings.SiblingFailed as exc:
                print(f"volga-gateway: {exc}", file=sys.stderr, flush=True)
                await exchanger.stop()
                await gw.stop()
                raise SystemExit(1) from None
            print(f"volga-gateway: {args.processes} processes; the others' metrics on :"
                  + ", :".join(map(str, others.metrics_ports())), flush=True)

        await _until_signalled(stop, signalled)

    return _run(main())


if __name__ == "__main__":
    sys.exit(agent_main())
