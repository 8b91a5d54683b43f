"""The gateway process: its settings, and the start and stop of its three endpoints around one dataplane.

Wire-compatible with an unmodified `tritonclient` (defaults: HTTP 8000, gRPC 8001, metrics 8002). The
request path is `dataplane.py`; `grpc_service.py` and `rest.py` are its protocol adapters. Everything runs
on one asyncio loop: grpc.aio for gRPC, aiohttp for REST and /metrics (`docs/architecture.md`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import grpc
import prometheus_client as prom
from aiohttp import web

from volga_agent import auth, metrics
from volga_agent.gateway import catalog, dataplane, grpc_proxy, grpc_service, links, proxy, rest
from volga_agent.rpc.inference import grpc_service_pb2_grpc as pb_grpc
from volga_core import http


@dataclasses.dataclass(frozen=True)
class Settings:
    node: str = ""  # this gateway's node: instances elsewhere are not reachable through its agent
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    cache_ttl_sec: float = 60.0
    max_request_bytes: int = 64 * 2**20
    shm_bytes: int = 16 * 2**20
    tokens: auth.Tokens | None = None  # bearer tokens every call but health checks must carry (gRPC and REST)
    metrics_tokens: auth.Tokens | None = None  # bearer tokens a /metrics scrape must carry; None: open
    # gRPC over TLS: the server's certificate and key (PEM files); with a client CA, clients must present a
    # certificate it signed (mTLS).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # Let other gateway processes listen on the same HTTP and gRPC ports (SO_REUSEPORT; `siblings.py`).
    reuse_port: bool = False


class Gateway:
    """One dataplane served over gRPC and REST, with a /metrics endpoint (its own registry and `extra_metrics`)."""

    def __init__(self, models: catalog.Catalog, link: links.AgentLink, settings: Settings | None = None,
                 gateway_metrics: metrics.GatewayMetrics | None = None,
                 extra_metrics: list[prom.CollectorRegistry] | None = None,
                 servers: proxy.Servers | None = None) -> None:
        self.settings = s = settings or Settings()
        self.dataplane = dataplane.Dataplane(models, link, s.node, s.cache_ttl_sec, s.max_request_bytes, s.shm_bytes,
                                             gateway_metrics)
        # Model servers, passed through over REST and gRPC; their requests count in the dataplane's load, an
        # overloaded node's go to a neighbour that takes them, and a shed server's are refused otherwise.
        self.servers = proxy.Counted(servers, self.dataplane) if servers is not None else None
        self.catalog = models
        self.metrics = self.dataplane.metrics
        self.extra_metrics = extra_metrics or []
        self._grpc: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self.ports: dict[str, int] = {}

    async def start(self) -> None:
        s = self.settings
        options = [("grpc.max_receive_message_length", s.max_request_bytes),
                   ("grpc.max_send_message_length", s.max_request_bytes), ("grpc.so_reuseport", int(s.reuse_port))]
        interceptors = [auth.GrpcAuth(s.tokens, grpc_service.OPEN_METHODS)] if s.tokens is not None else None
        self._grpc = grpc.aio.server(options=options, interceptors=interceptors)
        passes = (grpc_proxy.GrpcPass(self.servers, s.max_request_bytes, self.dataplane.metrics)
                  if self.servers is not None else None)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(grpc_service.Servicer(self.dataplane, passes), self._grpc)
        address = f"{s.host}:{s.grpc_port}"
        if s.tls_cert_file:
            self.ports["grpc"] = self._grpc.add_secure_port(address, _server_credentials(s))
        else:
            self.ports["grpc"] = self._grpc.add_insecure_port(address)
        if self.ports["grpc"] == 0:
            raise OSError(f"cannot listen on {s.host}:{s.grpc_port} (gRPC)")
        await self._grpc.start()
        self.ports["http"] = await self._listen(rest.app(self.dataplane, s.tokens, self.servers), s.http_port,
                                                reuse_port=s.reuse_port, **rest.RUNNER_OPTIONS)
        self.ports["metrics"] = await self._listen(http.metrics_app([self.metrics.registry, *self.extra_metrics],
                                                                      s.metrics_tokens), s.metrics_port)

    async def _listen(self, http_app: web.Application, port: int, reuse_port: bool = False, **options: Any) -> int:
        runner, bound = await http.listen(http_app, self.settings.host, port, reuse_port, **options)
        self._runners.append(runner)
        return bound

    async def stop(self, grace: float = 2.0) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace)
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        await self.dataplane.close()


def _server_credentials(s: Settings) -> grpc.ServerCredentials:
    """TLS for the gRPC port from PEM files; with a client CA, mutual TLS."""
    ca = pathlib.Path(s.tls_client_ca_file).read_bytes() if s.tls_client_ca_file else None
    pair = (pathlib.Path(s.tls_key_file).read_bytes(), pathlib.Path(s.tls_cert_file).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)
