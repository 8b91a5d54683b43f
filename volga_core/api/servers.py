"""A model server a ModelSpec names instead of a model file (`framework: server`, `spec.server`).

Volga runs the server's command as an instance like any other: it starts it, probes it, freezes its whole process
tree with CRIU and wakes it on the first request. What Volga needs to know, and nothing about the server's code:

    command, env, workingDir    how to start it; `{port}` and `{socket}` in the command and the environment are
                                replaced by where Volga tells it to listen (also in VOLGA_SERVER_PORT / _SOCKET);
                                an oip-grpc server also gets `{grpc_port}` (VOLGA_SERVER_GRPC_PORT) for its gRPC
    protocol                    oip-http / oip-grpc (Open Inference Protocol v2) or http (plain HTTP under
                                `pathPrefix`, such as OpenAI-compatible routes); the gateway proxies accordingly:
                                an oip-grpc server's gRPC calls through the gateway's gRPC port, its HTTP (and the
                                readiness probe, hooks and canary) on {port}
    listen                      port (a free loopback port Volga picks) or unix (a socket in the instance's folder)
    readiness                   an HTTP GET that answers 2xx once the server serves
    hooks                       signalFiles: the server takes part in the handshake (`volga_agent.worker.handshake`:
                                it writes ready-for-checkpoint once initialised, before it opens its sockets, and
                                waits for restore-complete); beforeCheckpoint / afterRestore: HTTP calls made to it
                                around a freeze and a wake (vLLM's `POST /sleep?level=1` and `POST /wake_up`);
                                beforeFreeze: other calls for a CRIU freeze alone (`POST /sleep?level=2`)
    canary                      a request and, optionally, the answer it must give; a restored server answers it
                                before any request reaches it (without `expect`, the answer recorded before the
                                freeze). Without a canary the readiness probe is the check.
    connections                 refuse (a freeze waits while the server holds TCP connections open, naming them)
                                or close (frozen anyway: restored closed, the server reconnects)
"""

from __future__ import annotations

import enum
import json
import re
from typing import Annotated

import pydantic

from volga_core.api import base

# Environment variable names as POSIX shells accept them.
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_HOOKS = 8
MAX_CANARY_BODY = 64 * 1024


class Protocol(enum.StrEnum):
    OIP_HTTP = "oip-http"
    OIP_GRPC = "oip-grpc"
    HTTP = "http"


class Listen(enum.StrEnum):
    PORT = "port"
    UNIX = "unix"


class Connections(enum.StrEnum):
    """What a freeze does with the TCP connections a server holds open (to a database, a cache, another service):
    CRIU restores none as they were."""

    REFUSE = "refuse"  # the freeze waits, naming them, until the server has closed them
    CLOSE = "close"  # frozen; the restored server finds them closed, as after a network failure, and reconnects


def _path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{value!r}: a path on the server starts with '/'")
    if base.bad_characters(value) or " " in value:
        raise ValueError(f"{value!r}: a path has no spaces or control characters")
    return value


Path = Annotated[str, pydantic.Field(min_length=1, max_length=1024), pydantic.AfterValidator(_path)]


class HttpCall(base.Model):
    """One HTTP request made to the server (a hook, the readiness probe, the canary)."""

    method: str = pydantic.Field(default="POST", pattern="^(GET|POST|PUT)$",
                                 description="GET, POST or PUT. Default: POST")
    path: Path = pydantic.Field(description="the path and query on the server, such as /sleep?level=1")
    body: str = pydantic.Field(default="", max_length=MAX_CANARY_BODY, description="the request body. Default: none")
    content_type: str = pydantic.Field(default="application/json", max_length=256,
                                       description="the body's Content-Type. Default: application/json")
    timeout_sec: float = pydantic.Field(default=30.0, gt=0, le=3600,
                                        description="how long the call may take, in seconds. Default: 30")


class Readiness(base.Model):
    """How Volga tells that the server serves: a GET that answers 2xx."""

    path: Path = pydantic.Field(default="/", description="the path probed with GET. Default: /")
    timeout_sec: float = pydantic.Field(default=300.0, gt=0, le=3600, description=(
        "how long a cold start may take before the server is given up, in seconds. Default: 300"))
    interval_ms: int = pydantic.Field(default=20, ge=1, le=10_000,
                                      description="the pause between probes, in milliseconds. Default: 20")


class Hooks(base.Model):
    signal_files: bool = pydantic.Field(default=False, description=(
        "the server writes ready-for-checkpoint in $VOLGA_SIGNAL_DIR once initialised (before it opens its "
        "sockets) and waits for restore-complete (`volga_agent.worker.handshake`): Volga takes its image there, "
        "once, and every wake restores that image. Default: false"))
    before_checkpoint: list[HttpCall] = pydantic.Field(default_factory=list, max_length=MAX_HOOKS, description=(
        f"HTTP calls made, in order, before each move down: WARM, SUSPENDED, and a freeze unless beforeFreeze is "
        f"given (at most {MAX_HOOKS}); each must answer 2xx. Default: none"))
    after_restore: list[HttpCall] = pydantic.Field(default_factory=list, max_length=MAX_HOOKS, description=(
        f"HTTP calls made, in order, after each wake (at most {MAX_HOOKS}); each must answer 2xx. Default: none"))
    before_freeze: list[HttpCall] = pydantic.Field(default_factory=list, max_length=MAX_HOOKS, description=(
        "HTTP calls made, in order, before a CRIU freeze instead of beforeCheckpoint, which then sets the server to "
        "sleep for WARM and SUSPENDED only (vLLM's /sleep?level=2 here: the weights left out of the image, where "
        "level 1 keeps them in host memory for a faster wake in place). A server asleep through beforeCheckpoint is "
        f"woken (afterRestore) and put to sleep with these before the freeze (at most {MAX_HOOKS}). "
        "Default: beforeCheckpoint"))

    @pydantic.model_validator(mode="after")
    def _sleeps_again(self) -> Hooks:
        if self.before_freeze and self.before_checkpoint and not self.after_restore:
            raise ValueError("beforeFreeze: a server asleep through beforeCheckpoint is woken by the afterRestore "
                             "hooks before it sleeps again for a freeze; give afterRestore")
        if self.before_freeze and self.signal_files:
            raise ValueError("beforeFreeze: with signalFiles the image is taken once, at the handshake, and no "
                             "later freeze calls the server; leave out one or the other")
        return self


# A JSON field of an answer: names and list indices joined by dots (choices.0.text).
_FIELD = r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$"


class Canary(HttpCall):
    """A request the server answers before any other after a wake, and the answer it must give."""

    expect_status: int = pydantic.Field(default=200, ge=100, le=599, description="the status. Default: 200")
    expect: str | None = pydantic.Field(default=None, max_length=MAX_CANARY_BODY, description=(
        "the body it must answer; unset: the body it answered before the freeze"))
    compare: list[Annotated[str, pydantic.Field(min_length=1, max_length=256, pattern=_FIELD)]] = pydantic.Field(
        default_factory=list, max_length=32, description=(
            "the JSON fields of the answer that must be equal, each a path of names and list indices joined by dots "
            "(choices, choices.0.text); the rest, such as the id and the time an OpenAI-compatible server gives "
            "every answer afresh, is not compared. Default: the whole body, byte for byte"))

    @pydantic.model_validator(mode="after")
    def _expect_is_json(self) -> Canary:
        if self.compare and self.expect is not None:
            try:
                json.loads(self.expect)
            except ValueError as exc:
                raise ValueError(f"expect: with compare, the expected answer is JSON: {exc}") from None
        return self

    def differs(self, got: bytes, want: bytes) -> str:
        """How the answer `got` differs from `want` where this canary looks (the `compare` fields, or the whole
        body); "" where it does not."""
        if not self.compare:
            return "" if got == want else f"{got[:200]!r}, expected {want[:200]!r}"
        try:
            fields, wanted = json_fields(got, self.compare), json_fields(want, self.compare)
        except ValueError as exc:
            return str(exc)
        path = next((p for p in self.compare if fields[p] != wanted[p]), None)
        return "" if path is None else f"{path} is {str(fields[path])[:200]}, expected {str(wanted[path])[:200]}"


def json_fields(body: bytes, paths: list[str]) -> dict[str, object]:
    """The values at `paths` (`Canary.compare`) in a JSON body; ValueError saying which is missing or that the body
    is not JSON."""
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc}): {body[:200]!r}") from None
    found: dict[str, object] = {}
    for path in paths:
        value = document
        for step in path.split("."):
            if isinstance(value, dict) and step in value:
                value = value[step]
            elif isinstance(value, list) and step.isdigit() and int(step) < len(value):
                value = value[int(step)]
            else:
                raise ValueError(f"no field {path} (at {step!r}) in {body[:200]!r}")
        found[path] = value
    return found


class ServerSpec(base.Model):
    """A model server Volga runs, freezes and wakes (see the module docstring)."""

    command: list[Annotated[str, pydantic.Field(max_length=4096)]] = pydantic.Field(
        min_length=1, max_length=256, description=(
            "the command and its arguments; {port} and {socket} are replaced by where the server is to listen"))
    env: dict[str, Annotated[str, pydantic.Field(max_length=4096)]] = pydantic.Field(
        default_factory=dict, max_length=256, description="environment variables added to the agent's. Default: none")
    working_dir: str | None = pydantic.Field(default=None, max_length=4096, description=(
        "the folder it runs in: relative to the ModelSpec's source folder, or an absolute path on the node (a node "
        "source only). Default: the source folder"))
    protocol: Protocol = pydantic.Field(default=Protocol.HTTP, description=(
        "oip-http or oip-grpc (Open Inference Protocol v2, passed through) or http (proxied under pathPrefix, "
        "streaming kept streaming). Default: http"))
    path_prefix: Path = pydantic.Field(default="/", description=(
        "with http: the paths the gateway forwards, such as /v1 for OpenAI-compatible routes. Default: /"))
    listen: Listen = pydantic.Field(default=Listen.PORT, description=(
        "port: a free loopback port Volga picks ({port}); unix: a Unix socket in the instance's folder ({socket}). "
        "Default: port"))
    readiness: Readiness = pydantic.Field(default_factory=Readiness, description="the readiness probe")
    hooks: Hooks = pydantic.Field(default_factory=Hooks, description="the freeze and wake hooks. Default: none")
    canary: Canary | None = pydantic.Field(default=None, description=(
        "the request a woken server must answer as expected before it serves. Default: the readiness probe only"))
    connections: Connections = pydantic.Field(default=Connections.REFUSE, description=(
        "the TCP connections the server holds open at a freeze (to a database, a cache, another service), which "
        "CRIU restores none of as they were: refuse (the freeze waits, naming them, until the server has closed "
        "them, in a beforeCheckpoint hook say) or close (frozen anyway: the woken server finds them closed, as after "
        "a network failure, and must reconnect). Default: refuse"))

    @pydantic.field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = sorted(name for name in env if not _ENV_NAME.match(name))
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: an environment variable's name is letters, digits and "
                             "'_', not starting with a digit")
        reserved = sorted(name for name in env if name.startswith("VOLGA_"))
        if reserved:
            raise ValueError(f"{', '.join(reserved)}: VOLGA_ variables are set by Volga")
        return env

    @pydantic.model_validator(mode="after")
    def _placeholders(self) -> ServerSpec:
        text = " ".join([*self.command, *self.env.values()])
        if self.listen is Listen.UNIX and "{port}" in text:
            raise ValueError("listen is unix, but the command or env uses {port}: write {socket}, or listen: port")
        if self.listen is Listen.PORT and "{socket}" in text:
            raise ValueError("listen is port, but the command or env uses {socket}: write {port}, or listen: unix")
        if self.listen is Listen.UNIX and self.protocol is Protocol.OIP_GRPC:
            raise ValueError("listen: unix is for HTTP servers; an oip-grpc server listens on a port")
        if self.protocol is Protocol.OIP_GRPC and GRPC_PORT not in text:
            raise ValueError(f"protocol is oip-grpc, but neither the command nor env says where to serve gRPC: "
                             f"write {GRPC_PORT} (a loopback port Volga picks)")
        if self.protocol is not Protocol.OIP_GRPC and GRPC_PORT in text:
            raise ValueError(f"the command or env uses {GRPC_PORT}, which only protocol: oip-grpc has")
        return self


GRPC_PORT = "{grpc_port}"
_GRPC_MARK = "#grpc="


def listen_address(base_url: str, grpc_address: str = "") -> str:
    """Where a running server listens, in one string (the Agent API's instance `socket`): its HTTP base URL
    (http://127.0.0.1:PORT or unix:PATH), and for oip-grpc its gRPC address after `#grpc=`."""
    return f"{base_url}{_GRPC_MARK}{grpc_address}" if grpc_address else base_url


def split_address(address: str) -> tuple[str, str]:
    """(HTTP base URL, gRPC address or "") of a `listen_address`."""
    base_url, _, grpc_address = address.partition(_GRPC_MARK)
    return base_url, grpc_address
