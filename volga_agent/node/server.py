"""A model server run as an instance (`framework: server`): HOT (its process tree serving), FROZEN (a CRIU image
of the whole tree) or COLD, with single-flight wakes, idle demotion and a canary checked after each restore.

The server is started as the init of its own PID namespace (`worker.nsinit --keep`), so its tree restores with
its own PIDs, as many times as needed. It listens where the instance says: a free loopback port or a Unix socket
in the instance's folder (`ServerSpec.listen`). A freeze and a wake are these steps:

    freeze  check  refuse a tree holding what CRIU cannot dump (inotify, io_uring), naming it
            record the canary's answer, when the spec gives no expected one
            hooks  the beforeCheckpoint HTTP calls (vLLM's sleep), each answering 2xx
            dump   CRIU dumps the whole tree and kills it (CRIU >= 4.2: it holds TCP sockets)
    wake    restore  CRIU restores the tree (a Unix socket file left by the dump is removed first)
            go       with the signal-file handshake, restore-complete is written
            ready    the readiness probe answers 2xx
            hooks    the afterRestore HTTP calls (vLLM's wake_up)
            canary   the canary request answers what it answered before (or what the spec expects)

With the signal-file handshake (`hooks.signalFiles`, `worker.handshake`) the image is taken once, at the
handshake, before the server opens any socket (so any CRIU 4 dumps it), and kept: every later freeze only stops
the tree, and every wake restores that image. A wake that fails falls back to a cold start and is recorded so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import logging
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator

from volga_agent import metrics
from volga_agent.host import process
from volga_agent.node import instance
from volga_agent.snapshot import criu
from volga_agent.worker import handshake, nsinit
from volga_core import api

Tier = api.Tier
log = logging.getLogger(__name__)
# What CRIU cannot dump, as /proc/PID/fd shows it, and what to tell the user.
UNDUMPABLE = {
    "anon_inode:inotify": "an inotify watch (a file watcher, such as uvicorn --reload or watchdog): run the "
                          "server without it",
    "anon_inode:[io_uring]": "an io_uring instance: CRIU cannot dump io_uring; run the server without it "
                             "(for libuv-based servers, UV_USE_IO_URING=0)",
    "anon_inode:[fanotify]": "a fanotify watch: run the server without it",
}
# What CRIU 4.1 logs when a kernel >= 6.16 refuses getsockopt(SO_PASSSEC) on an INET socket it dumps.
INET_REFUSED = re.compile(r"Can't get 1:(16|34) opt: Operation not supported")


class ServerError(RuntimeError):
    """The server did not start, answer, freeze or wake as its spec says."""


class FreezeRefused(ServerError):
    """The server holds something CRIU cannot dump; the message names it. The server stays HOT."""


class Busy(ServerError):
    """A request is in flight: the server is not frozen under it."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def undumpable(pid: int) -> list[str]:
    """What the tree rooted at `pid` holds that CRIU cannot dump, one line per process and kind."""
    found = []
    for member in process.tree(pid):
        kinds = set()
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{member}/fd"):
                with contextlib.suppress(OSError):
                    kinds.add(os.readlink(f"/proc/{member}/fd/{fd}"))
        for kind, reason in UNDUMPABLE.items():
            if kind in kinds:
                found.append(f"pid {member} ({_comm(member)}) holds {reason}")
    return found


def _comm(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


class ServerInstance:
    """One server process tree and its tier; every move is timed and kept in `transitions`."""

    def __init__(self, spec: api.ModelSpecSpec, workdir: str | pathlib.Path, engine: criu.CriuEngine,
                 name: str | None = None, agent_metrics: metrics.AgentMetrics | None = None) -> None:
        if spec.server is None:
            raise ValueError(f"{spec.model_id}: not a server ModelSpec (framework: server)")
        self.spec = spec
        self.server: api.ServerSpec = spec.server
        self.name = name or spec.model_id
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.signals = self.workdir / "signals"
        self.logfile = self.workdir / "server.log"
        self.engine = engine
        self.metrics = agent_metrics  # every move's time, wakes and failed ones, as the pool reports its instances'
        self.tier = Tier.COLD
        self.pid: int | None = None
        self.port = 0
        self.grpc_port = 0  # an oip-grpc server's gRPC port ({grpc_port})
        self.socket_path = self.workdir / "server.sock"
        if len(str(self.socket_path)) > instance.MAX_SOCKET_PATH:
            raise ValueError(f"{self.socket_path}: a Unix socket path is at most {instance.MAX_SOCKET_PATH} bytes")
        self.image: criu.Image | None = None
        self.handshake_image = False
        self.canary_answer: Answer | None = None
        self.transitions: list[instance.Transition] = []
        self.restore_failures = 0
        self.last_used = time.monotonic()
        self._lock = threading.RLock()  # one move at a time: concurrent wakes share the first one's
        self._active = 0
        self._active_lock = threading.Lock()

    # -- where it listens --------------------------------------------------------------------------------------
    @property
    def unix(self) -> bool:
        return self.server.listen is api.Listen.UNIX

    @property
    def base_url(self) -> str:
        """Where a client reaches it: http://127.0.0.1:PORT, or unix:PATH."""
        return f"unix:{self.socket_path}" if self.unix else f"http://127.0.0.1:{self.port}"

    @property
    def grpc_address(self) -> str:
        """Where an oip-grpc server serves gRPC (127.0.0.1:PORT); "" for the others."""
        return f"127.0.0.1:{self.grpc_port}" if self.grpc_port else ""

    @property
    def address(self) -> str:
        """`base_url` and `grpc_address` in one string (`api.listen_address`), as the Agent API reports it."""
        return api.listen_address(self.base_url, self.grpc_address)

    def call(self, method: str, path: str, body: bytes = b"", content_type: str = "application/json",
             timeout: float = 30.0) -> Answer:
        """One HTTP request to the server, on a connection of its own (none is left open for CRIU to find)."""
        conn: http.client.HTTPConnection = (_UnixConnection(str(self.socket_path), timeout) if self.unix
                                            else http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout))
        try:
            headers = {"Content-Type": content_type, "Connection": "close"} if body else {"Connection": "close"}
            conn.request(method, path, body=body or None, headers=headers)
            response = conn.getresponse()
            return Answer(response.status, response.read())
        finally:
            conn.close()

    # -- moves -------------------------------------------------------------------------------------------------
    def ensure_hot(self) -> None:
        """HOT when this returns: a cold start or a wake, whichever the tier needs; concurrent callers share one."""
        with self._lock:
            if self.tier is Tier.HOT and self.pid is not None and process.alive(self.pid):
                return
            if self.tier is Tier.FROZEN:
                self.wake()
            else:
                self.start()

    def acquire(self) -> None:
        """Make it HOT and keep it from being frozen until `release`."""
        with self._lock:
            self.ensure_hot()
            with self._active_lock:
                self._active += 1

    @property
    def in_flight(self) -> int:
        """Requests holding it HOT now (`acquire` without its `release`)."""
        with self._active_lock:
            return self._active

    def release(self) -> None:
        with self._active_lock:
            self._active -= 1
        self.last_used = time.monotonic()

    @contextlib.contextmanager
    def serving(self) -> Iterator[ServerInstance]:
        """HOT, and kept from being frozen, while the caller's request runs."""
        self.acquire()
        try:
            yield self
        finally:
            self.release()

    @property
    def path_prefix(self) -> str:
        return self.server.path_prefix

    @property
    def oip(self) -> bool:
        return self.server.protocol is not api.Protocol.HTTP

    def start(self) -> None:
        """COLD -> HOT: start the server, take the handshake image if it offers one, wait until it is ready."""
        with self._lock:
            began = time.perf_counter()
            source = self.tier
            self._kill()
            self._spawn()
            if self.server.hooks.signal_files:
                self._await_handshake(began)
                if self.image is None:
                    assert self.pid is not None
                    self.image = self.engine.dump(self.pid, self.name, leave_running=True)
                    self.handshake_image = True
                self._go_on()
            self._await_ready(began)
            self.tier = Tier.HOT
            self.last_used = time.monotonic()
            self._record(source, Tier.HOT, began)

    def freeze(self) -> None:
        """HOT -> FROZEN (see the module docstring); FreezeRefused leaves it HOT, Busy when a request runs."""
        with self._lock:
            if self.tier is not Tier.HOT or self.pid is None:
                raise instance.IllegalTransition(f"{self.name}: freeze from {self.tier.value}")
            with self._active_lock:
                if self._active:
                    raise Busy(f"{self.name}: {self._active} request(s) in flight")
            began = time.perf_counter()
            if self.server.canary is not None and self.server.canary.expect is None:
                self.canary_answer = self._canary()
            if self.handshake_image:
                self._kill()
            else:
                refused = undumpable(self.pid)
                if refused:
                    raise FreezeRefused(f"{self.name}: CRIU cannot dump this server: " + "; ".join(refused))
                for hook in self.server.hooks.before_checkpoint:
                    self._hook(hook, "beforeCheckpoint")
                old = self.image
                try:
                    self.image = self.engine.dump(self.pid, self.name)
                except criu.CriuError as exc:
                    self._undo_before_checkpoint()
                    if INET_REFUSED.search(str(exc)):
                        raise FreezeRefused(f"{self.name}: it holds TCP or UDP sockets, which this CRIU "
                                            f"({self.engine.criu}) cannot dump on this kernel (>= 6.16): install CRIU "
                                            "4.2 or newer (make criu), listen on a Unix socket (listen: unix), or "
                                            "take the image at the handshake (hooks.signalFiles)") from exc
                    raise
                process.reap(self.pid, timeout=10.0)
                self.pid = None
                if old is not None:
                    self.engine.remove(old)
            self.tier = Tier.FROZEN
            self._record(Tier.HOT, Tier.FROZEN, began)

    def _undo_before_checkpoint(self) -> None:
        """A dump that failed leaves the server running: what beforeCheckpoint did (a sleep) is undone."""
        if self.server.hooks.before_checkpoint and self.pid is not None and process.alive(self.pid):
            for hook in self.server.hooks.after_restore:
                with contextlib.suppress(ServerError):
                    self._hook(hook, "afterRestore")

    def wake(self) -> None:
        """FROZEN -> HOT through a restore; a failed one falls back to a cold start."""
        with self._lock:
            if self.tier is not Tier.FROZEN or self.image is None:
                raise instance.IllegalTransition(f"{self.name}: wake from {self.tier.value}")
            began = time.perf_counter()
            phases: dict[str, float] = {}
            try:
                (self.signals / handshake.RESTORED).unlink(missing_ok=True)
                if self.unix:
                    self.socket_path.unlink(missing_ok=True)
                restored = self.engine.restore(self.image)
                self.pid = restored.pid
                phases["restore"] = restored.seconds
                mark = time.perf_counter()
                if self.handshake_image:
                    self._go_on()
                self._await_ready(began)
                if not self.handshake_image:
                    for hook in self.server.hooks.after_restore:
                        self._hook(hook, "afterRestore")
                self._check_canary()
                phases["wake"] = time.perf_counter() - mark
            except (criu.CriuError, ServerError, instance.CanaryMismatch, OSError) as exc:
                log.warning("%s: wake failed, cold start instead: %s", self.name, exc)
                self.restore_failures += 1
                self._kill()
                if self.image is not None:
                    self.engine.keep_failure(self.image, self.name, (self.logfile,))
                    self.engine.remove(self.image)
                self.image, self.handshake_image = None, False
                self.tier = Tier.COLD
                self.start()
                self.transitions[-1] = dataclasses.replace(self.transitions[-1], source=Tier.FROZEN, fallback=True,
                                                           detail=str(exc)[:500])
                if self.metrics is not None:
                    self.metrics.restore_failures.labels(Tier.FROZEN.value, self.spec.model_id).inc()
                return
            self.tier = Tier.HOT
            self.last_used = time.monotonic()
            self._record(Tier.FROZEN, Tier.HOT, began, phases=phases)

    def demote_if_idle(self, idle_sec: float) -> bool:
        """Freeze when HOT, unused for `idle_sec` and no request runs; whether it froze."""
        with self._lock:
            if self.tier is not Tier.HOT or time.monotonic() - self.last_used < idle_sec:
                return False
            try:
                self.freeze()
            except Busy:
                return False
            return True

    def close(self) -> None:
        """Stop the server and drop its image: COLD."""
        with self._lock:
            self._kill()
            if self.image is not None:
                self.engine.remove(self.image)
            self.image, self.handshake_image = None, False
            self.tier = Tier.COLD

    def stats(self) -> dict[str, object]:
        """What metrics and status report: tier, moves, failed restores, the image's size."""
        return {"tier": self.tier.value, "transitions": len(self.transitions),
                "restore_failures": self.restore_failures,
                "image_bytes": self.image.size_bytes if self.image is not None else 0,
                "last_wake_ms": next((t.seconds * 1000 for t in reversed(self.transitions)
                                      if t.source is Tier.FROZEN), None)}

    # -- steps -------------------------------------------------------------------------------------------------
    def _spawn(self) -> None:
        self.signals.mkdir(parents=True, exist_ok=True)
        for leftover in self.signals.iterdir():
            leftover.unlink()
        if self.unix:
            self.socket_path.unlink(missing_ok=True)
        else:
            self.port = free_port()
        where = {"port": str(self.port), "socket": str(self.socket_path)}
        grpc_env = self._grpc_port()

        def fill(text: str) -> str:
            return text.replace("{port}", where["port"]).replace("{socket}", where["socket"]).replace(
                api.servers.GRPC_PORT, str(self.grpc_port))

        env = {**process.owned_env(), **{k: fill(v) for k, v in self.server.env.items()},
               handshake.SIGNAL_DIR_ENV: str(self.signals), **grpc_env,
               "VOLGA_SERVER_PORT" if not self.unix else "VOLGA_SERVER_SOCKET":
                   where["socket" if self.unix else "port"]}
        cwd = self.server.working_dir or str(self.spec.source_path)
        command = [fill(arg) for arg in self.server.command]
        nsinit.become_subreaper()
        out = subprocess.run([sys.executable, "-m", "volga_agent.worker.nsinit", "--keep", str(self.logfile), "--",
                              *command], capture_output=True, text=True, check=False, cwd=cwd, env=env)
        if out.returncode != 0:
            raise ServerError(f"{self.name}: could not start {command[0]!r}: {out.stderr.strip()}")
        self.pid = int(out.stdout.strip())

    def _grpc_port(self) -> dict[str, str]:
        """An oip-grpc server's gRPC port, picked free: the environment that says it."""
        if self.server.protocol is not api.Protocol.OIP_GRPC:
            return {}
        self.grpc_port = free_port()
        return {"VOLGA_SERVER_GRPC_PORT": str(self.grpc_port)}

    def _alive_or_raise(self, what: str) -> None:
        if self.pid is None or not process.alive(self.pid) or process.is_zombie(self.pid):
            raise ServerError(f"{self.name}: the server exited while {what}; its log ends:\n"
                              f"{process.log_tail(self.logfile)}")

    def _deadline(self, began: float) -> float:
        return began + self.server.readiness.timeout_sec

    def _await_handshake(self, began: float) -> None:
        ready = self.signals / handshake.READY
        while not ready.exists():
            self._alive_or_raise("waiting for ready-for-checkpoint")
            if time.perf_counter() > self._deadline(began):
                raise ServerError(f"{self.name}: no ready-for-checkpoint within "
                                  f"{self.server.readiness.timeout_sec:g} s (hooks.signalFiles is set: the server "
                                  "must call volga_agent.worker.handshake.checkpoint_here())")
            time.sleep(0.002)

    def _go_on(self) -> None:
        done = self.signals / handshake.RESTORED
        done.with_suffix(".tmp").write_text("")
        done.with_suffix(".tmp").rename(done)

    def _await_ready(self, began: float) -> None:
        probe = self.server.readiness
        while True:
            self._alive_or_raise("starting")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if 200 <= self.call("GET", probe.path, timeout=max(1.0, probe.interval_ms / 1000)).status < 300:
                    return
            if time.perf_counter() > self._deadline(began):
                raise ServerError(f"{self.name}: GET {probe.path} did not answer 2xx within {probe.timeout_sec:g} s; "
                                  f"the server's log ends:\n{process.log_tail(self.logfile)}")
            time.sleep(probe.interval_ms / 1000)

    def _hook(self, hook: api.HttpCall, which: str) -> None:
        try:
            answer = self.call(hook.method, hook.path, hook.body.encode(), hook.content_type, hook.timeout_sec)
        except (OSError, http.client.HTTPException) as exc:
            raise ServerError(f"{self.name}: hooks.{which} {hook.method} {hook.path} failed: {exc}") from exc
        if not 200 <= answer.status < 300:
            raise ServerError(f"{self.name}: hooks.{which} {hook.method} {hook.path} answered {answer.status}: "
                              f"{answer.body[:200]!r}")

    def _canary(self) -> Answer:
        canary = self.server.canary
        assert canary is not None
        try:
            return self.call(canary.method, canary.path, canary.body.encode(), canary.content_type,
                             canary.timeout_sec)
        except (OSError, http.client.HTTPException) as exc:
            raise ServerError(f"{self.name}: the canary {canary.method} {canary.path} failed: {exc}") from exc

    def _check_canary(self) -> None:
        canary = self.server.canary
        if canary is None:
            return
        got = self._canary()
        if canary.expect is not None:
            want = Answer(canary.expect_status, canary.expect.encode())
        elif self.canary_answer is not None:
            want = self.canary_answer
        else:
            return
        if got != want:
            raise instance.CanaryMismatch(f"{self.name}: the canary answered {got.status} {got.body[:200]!r}, "
                                          f"expected {want.status} {want.body[:200]!r}")

    def _kill(self) -> None:
        if self.pid is not None:
            if process.alive(self.pid):
                process.kill_tree(self.pid)
            self.pid = None

    def _record(self, source: Tier, target: Tier, began: float, phases: dict[str, float] | None = None) -> None:
        move = instance.Transition(source, target, time.perf_counter() - began, time.time(), phases=phases or {})
        self.transitions.append(move)
        if self.metrics is not None:
            model = self.spec.model_id
            self.metrics.transition_latency.labels(source.value, target.value, model).observe(move.seconds * 1000)
            if source is Tier.FROZEN:
                self.metrics.restore_latency.labels(source.value, model).observe(move.seconds * 1000)
                for phase, seconds in move.phases.items():
                    self.metrics.wake_phase_latency.labels(source.value, phase, model).observe(seconds * 1000)


class Fleet:
    """The server instances of a node by model id: what the gateway's proxy leases (`gateway.proxy.Servers`)."""

    def __init__(self, instances: Iterable[ServerInstance] = ()) -> None:
        self.instances = {i.spec.model_id: i for i in instances}

    def serves(self, model_id: str) -> bool:
        return model_id in self.instances

    def speaks_grpc(self, model_id: str) -> bool:
        return self.instances[model_id].server.protocol is api.Protocol.OIP_GRPC

    def elsewhere(self, model_id: str) -> None:
        """One node: every server of the fleet is here."""
        return None

    @contextlib.asynccontextmanager
    async def lease(self, model_id: str, timeout_sec: float | None) -> AsyncIterator[ServerInstance]:
        """The server HOT (woken in a thread: concurrent leases share one wake) until the block ends. The caller's
        deadline bounds its wait only: a wake it gives up on still completes for the next request."""
        target = self.instances[model_id]
        task = asyncio.ensure_future(asyncio.to_thread(target.acquire))
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_sec)
        except TimeoutError:
            def give_back(done: asyncio.Future[None]) -> None:
                if not done.cancelled() and done.exception() is None:
                    target.release()
            task.add_done_callback(give_back)
            raise
        try:
            yield target
        finally:
            target.release()

    def demote_idle(self, idle_sec: float) -> list[str]:
        """Freeze every server idle for `idle_sec`; the model ids frozen."""
        return [model_id for model_id, i in self.instances.items() if i.demote_if_idle(idle_sec)]

    def close(self) -> None:
        for i in self.instances.values():
            i.close()
