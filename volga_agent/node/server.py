"""A model server run as an instance (`framework: server`): HOT (its process tree serving), FROZEN (a CRIU image
of the whole tree) or COLD, with single-flight wakes, idle demotion and a canary checked after each restore.

The server is started in its own PID namespace (`worker.nsinit --keep`), so its tree restores with its own PIDs,
as many times as needed (on a GPU without one: CUDA fails in it); the namespace's init is tini, the server its
child (`nsinit --init`: criu's dump needs the init's folder writable, and the server's own may not be). It
listens where the instance says: a free loopback port or a Unix socket in the instance's folder
(`ServerSpec.listen`). A freeze and a wake are these steps:

    freeze  check  refuse a tree holding what CRIU cannot dump (inotify, io_uring), naming it
            record the canary's answer, when the spec gives no expected one
            hooks  the beforeCheckpoint HTTP calls (vLLM's sleep), or beforeFreeze where the spec gives them, each
                   answering 2xx
            open   the TCP connections the tree still holds: refused, naming them, or (`connections: close`)
                   dumped, to be restored closed
            dump   CRIU dumps the whole tree and kills it (CRIU >= 4.2: it holds TCP sockets)
    wake    restore  CRIU restores the tree (a Unix socket file left by the dump is removed first)
            go       with the signal-file handshake, restore-complete is written
            ready    the readiness probe answers 2xx
            hooks    the afterRestore HTTP calls (vLLM's wake_up)
            canary   the canary request answers what it answered before (or what the spec expects)

With the signal-file handshake (`hooks.signalFiles`, `worker.handshake`) the image is taken once, at the
handshake, before the server opens any socket (so any CRIU 4 dumps it), and kept: every later freeze only stops
the tree, and every wake restores that image. A wake that fails falls back to a cold start and is recorded so.

On a GPU (the instance is given the driver's checkpoint API, `snapshot.cuda`), the ladder has two more rungs, and
every process of the tree that holds a CUDA context (an open /dev/nvidia* file) is moved, each by its own PID:

    WARM       the beforeCheckpoint hooks have run (vLLM's sleep: the KV cache released, the weights offloaded to
               host memory); the process keeps its context. Only where the spec names such hooks.
    SUSPENDED  the hooks, then the driver checkpoints each CUDA process (lock + checkpoint): the GPU state lands
               in the process's host memory and the GPU holds nothing of it; the processes keep running.
    FROZEN     from SUSPENDED, CRIU dumps the tree: the image carries what the driver left in host memory, so
               what the hooks released before is what the image does not carry. Where the spec gives beforeFreeze
               (vLLM's level 2, the weights released, beside beforeCheckpoint's level 1, the weights kept in host
               memory), a server asleep through beforeCheckpoint is first restored by the driver, woken by its
               afterRestore hooks and set to sleep by beforeFreeze, then checkpointed again and dumped: a deeper
               sleep for the image, on the idle path, and the faster wake in place for WARM and SUSPENDED.

A wake from each runs the rest in reverse: the restore, the driver's restore of each process (the node's restore
gate orders them with the other instances'), the afterRestore hooks, the readiness probe, the canary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
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
from volga_agent.host import priority, process
from volga_agent.node import gpu_freeze, instance
from volga_agent.snapshot import criu, cuda
from volga_agent.worker import contract, handshake, nsinit, regions
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
# How long a process may take to park the driver's copy (copying it into a file at several GB/s).
PARK_TIMEOUT_SEC = 60.0
# How long a process may take to lower its CUDA contexts' stack (a few driver calls); past it the checkpoint goes on.
TRIM_TIMEOUT_SEC = 10.0


class ServerError(RuntimeError):
    """The server did not start, answer, freeze or wake as its spec says."""


class FreezeRefused(ServerError):
    """The server holds something CRIU cannot dump; the message names it. The server stays HOT."""


class Busy(ServerError):
    """A request is in flight: the server is not frozen under it."""


class HoldsConnections(ServerError):
    """The server holds TCP connections open, and its spec says a freeze waits for them to close
    (`server.connections: refuse`); the message names them. It stays where it was."""


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
        kinds = set(process.open_files(member))
        for kind, reason in UNDUMPABLE.items():
            if kind in kinds:
                found.append(f"pid {member} ({_comm(member)}) holds {reason}")
    return found


# TCP states of a connection (include/net/tcp_states.h), as /proc/net/tcp writes them: CRIU restores none of these
# as they were. A listening socket (0A) and an unconnected one (07) it dumps.
TCP_CONNECTED = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
                 "08": "CLOSE_WAIT", "09": "LAST_ACK", "0B": "CLOSING"}
# Those of a connection being closed, such as the server's end of the agent's own last call (its canary, a hook) in
# the moment before the server closes it: a freeze waits this long for them to go.
TCP_CLOSING = frozenset({"FIN_WAIT1", "FIN_WAIT2", "CLOSE_WAIT", "LAST_ACK", "CLOSING"})
CLOSING_WAIT_SEC = 1.0
# A server without CUDA processes is restored lazily from FROZEN where its image is this big or more (the pages its
# last wake touched first, the rest after the wake): measured on 2 vCPUs, side by side, KServe's 93 MB image woke in
# 55.2 ms lazily against 81.5 eagerly, and a FastAPI app's 47 MB one in about the same time either way (51.4 / 54.1),
# whose first lazy wake (nothing recorded yet) was the slower on earlier days (docs/servers.md, Measured).
LAZY_MIN_BYTES = 64 << 20


def _endpoint(text: str) -> str:
    """An address:port of /proc/net/tcp{,6} (each 32-bit word of the address in host order, the port in hex)."""
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, words)}:{int(port, 16)}"
    return f"[{socket.inet_ntop(socket.AF_INET6, words)}]:{int(port, 16)}"


def tcp_connections(pid: int) -> list[tuple[str, str]]:
    """The TCP connections the tree rooted at `pid` holds open: each one's state, and a line naming the process, both
    ends and the state."""
    owners: dict[int, int] = {}  # socket inode -> the first process of the tree holding it
    for member in process.tree(pid):
        for name in process.open_files(member):
            if name.startswith("socket:["):
                owners.setdefault(int(name[8:-1]), member)
    found: list[tuple[str, str]] = []
    tables: set[tuple[str, str]] = set()  # each network namespace's tables once
    for member in sorted(set(owners.values())):
        with contextlib.suppress(OSError):
            namespace = os.readlink(f"/proc/{member}/ns/net")
            for table in ("tcp", "tcp6"):
                if (namespace, table) in tables:
                    continue
                tables.add((namespace, table))
                for line in pathlib.Path(f"/proc/{member}/net/{table}").read_text().splitlines()[1:]:
                    fields = line.split()
                    inode, state = int(fields[9]), fields[3]
                    if inode in owners and state in TCP_CONNECTED:
                        holder, name = owners[inode], TCP_CONNECTED[state]
                        found.append((name, f"pid {holder} ({_comm(holder)}): {_endpoint(fields[1])} -> "
                                            f"{_endpoint(fields[2])} ({name})"))
    return found


def _comm(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def cuda_processes(root: int) -> list[int]:
    """The processes of the tree rooted at `root` that hold a CUDA context (an open /dev/nvidia* file), parents
    first."""
    return [member for member in process.tree(root)
            if any(name.startswith("/dev/nvidia") for name in process.open_files(member))]


def ns_pid(pid: int) -> int:
    """The process's PID in its own (innermost) PID namespace: the server's tree keeps these across a restore."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return pid


_DEPTHS = {Tier.HOT: 0, Tier.WARM: 1, Tier.SUSPENDED: 2, Tier.FROZEN: 3, Tier.COLD: 4}


def _depth(tier: Tier) -> int:
    return _DEPTHS[tier]


def floor_tier(pool: api.Pool) -> Tier:
    """The tier a server is kept in when idle: the highest its pool floors name (FROZEN when they name none)."""
    for tier, count in ((Tier.HOT, pool.hot), (Tier.WARM, pool.warm), (Tier.SUSPENDED, pool.suspended)):
        if count:
            return tier
    return Tier.FROZEN


class ServerInstance:
    """One server process tree and its tier; every move is timed and kept in `transitions`."""

    def __init__(self, spec: api.ModelSpecSpec, workdir: str | pathlib.Path, engine: criu.CriuEngine,
                 name: str | None = None, agent_metrics: metrics.AgentMetrics | None = None,
                 driver: cuda.DriverCheckpoint | None = None, lazy_restore: bool | None = None,
                 cuda_stack_bytes: int = contract.DEFAULT_CUDA_STACK_BYTES) -> None:
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
        self.driver = driver  # the CUDA driver's checkpoint API: WARM and SUSPENDED, and FROZEN with a context
        self.slept = ""  # the hooks that set it to sleep (beforeCheckpoint or beforeFreeze), until afterRestore ran
        self.gpu_pids: tuple[int, ...] = ()  # the processes the driver has checkpointed (the same after a restore)
        self._handshake_gpu_pids: tuple[int, ...] = ()  # those the handshake image holds checkpointed
        # FROZEN wakes with CRIU lazy pages: the tree runs before its memory is read. None: for a tree with CUDA
        # processes where every one parked the driver's copy (lazily, the driver's restore would fault an unparked
        # copy in through userfaultfd, many times slower), for one without where its image is LAZY_MIN_BYTES or more.
        # Not for a server that holds pinned host memory at the driver's checkpoint (the driver's restore fails after
        # a lazy restore of it): a lazy wake whose driver restore fails turns them off for this instance, and falls
        # back to a cold start.
        self.lazy_restore = lazy_restore
        # The driver's copies parked beside the images (`handshake.park_driver_copy_when_asked`): the folder and
        # the file the current image maps; each process's pages before the driver's checkpoint (by its PID in the
        # server's namespace), for the processes that park; what each reported at the last freeze.
        self.parking = gpu_freeze.Parking(engine.root / instance.PARKED / f"server-{self.workdir.name}"
                                          if driver is not None else None)
        self._before_checkpoint: dict[int, regions.Presence] = {}
        self.driver_copies: dict[int, dict[str, object]] = {}
        # The per-thread stack the CUDA contexts of the processes that park are lowered to before each driver
        # checkpoint (0: left as the server has it), and what each reported the last time, by PID in its namespace.
        self.cuda_stack_bytes = cuda_stack_bytes
        self.stack_trims: dict[int, dict[str, object]] = {}
        self.copies_parked = False  # the current image maps every CUDA process's copy from the parked file
        self._restored: criu.Restored | None = None
        self.transitions: list[instance.Transition] = []
        self.restore_failures = 0
        self.last_used = time.monotonic()
        self._lock = threading.RLock()  # one move at a time: concurrent wakes share the first one's
        # Held by the autonomy loop's duty cycle while it keeps the tree stopped (`stoppable`): a move waits for the
        # tree to be continued, and no tree is stopped while a move is under way (`_moves`).
        self.stop_gate = threading.Lock()
        self._moves = 0
        self._active = 0
        self._active_lock = threading.Lock()

    @property
    def restored(self) -> criu.Restored | None:
        """The CRIU restore the running tree came from, until the driver checkpoints it or it is frozen again."""
        return self._restored

    @property
    def restored_lazily(self) -> bool:
        """Whether the running tree came from a restore with CRIU's lazy pages."""
        return self._restored is not None and self._restored.lazy_pages is not None

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
    @contextlib.contextmanager
    def _move(self) -> Iterator[None]:
        """A move under the instance's lock, with the tree running: a duty cycle that stopped it (holding
        `stop_gate`) continues it first, and stops none while the move is under way."""
        with self._lock:
            self._moves += 1
            try:
                with self.stop_gate:
                    pass
                yield
            finally:
                self._moves -= 1

    def stoppable(self) -> int | None:
        """What a duty cycle may stop now, called with `stop_gate` held: the HOT server's process group (negative,
        as kill(2) takes it: the server is a session of its own, `worker.nsinit`, and under its namespace's init a
        group of its own, as tini makes it), or None while a move is under way or the tree does not run."""
        if self._moves or self.tier is not Tier.HOT or self.pid is None:
            return None
        if self.driver is not None:  # no namespace, no init: the server is the session's leader
            return -self.pid
        command = process.children(self.pid)
        return -command[0] if command else None

    def ensure_hot(self) -> None:
        """HOT when this returns: a cold start or a wake, whichever the tier needs; concurrent callers share one."""
        with self._lock:
            if self.tier is Tier.HOT and self.pid is not None and process.alive(self.pid):
                return
            if self.tier is Tier.FROZEN:
                self.wake()
            elif self.tier in (Tier.WARM, Tier.SUSPENDED) and self.pid is not None and process.alive(self.pid):
                self.wake_in_place()
            else:
                self.start()

    def acquire(self) -> instance.Transition | None:
        """Make it HOT and keep it from being frozen until `release`. The move this call made to get there; None when
        it was HOT, or when a concurrent caller's wake made it so (that wake is the other caller's)."""
        with self._lock:
            moves = len(self.transitions)
            self.ensure_hot()
            with self._active_lock:
                self._active += 1
            return self.transitions[-1] if len(self.transitions) > moves else None

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
        with self._move():
            began = time.perf_counter()
            source = self.tier
            self._kill()
            self.slept, self.gpu_pids = "", ()  # a new process: nothing of the old one's sleep or checkpoint
            self._spawn()
            if self.server.hooks.signal_files:
                self._await_handshake(began)
                if self.image is None:
                    assert self.pid is not None
                    self.image = self._dump_at_handshake(self.pid)
                    self.handshake_image = True
                self._go_on()
            self._await_ready(began)
            self.tier = Tier.HOT
            self.last_used = time.monotonic()
            self._record(source, Tier.HOT, began)

    # -- the GPU ladder -----------------------------------------------------------------------------------------
    @property
    def can_warm(self) -> bool:
        """WARM is the hooks' tier: a GPU and beforeCheckpoint hooks to release what the server holds."""
        return self.driver is not None and bool(self.server.hooks.before_checkpoint)

    def _leave_hot(self) -> None:
        """What a move down from HOT does first: no request may be running, and the canary's answer is recorded
        (when the spec gives no expected one) while the server still answers it."""
        with self._active_lock:
            if self._active:
                raise Busy(f"{self.name}: {self._active} request(s) in flight")
        if self.server.canary is not None and self.server.canary.expect is None:
            self.canary_answer = self._canary()

    def _sleep_hooks(self, freeze: bool = False) -> None:
        """The beforeCheckpoint hooks (before a freeze: beforeFreeze, where the spec gives them), once until the
        afterRestore ones undo them. A server asleep through the other list is woken (afterRestore) first. A server
        that is called has its CUDA processes running: one under the driver's checkpoint is restored first."""
        which = self._sleep_for(freeze)
        hooks = self.server.hooks.before_freeze if which == "beforeFreeze" else self.server.hooks.before_checkpoint
        if self.slept == which or not (hooks or self.slept):
            return
        self._resume_gpu()
        self._wake_hooks()
        for hook in hooks:
            self._hook(hook, which)
            self.slept = which  # asleep, if only partly, from its first answer: afterRestore undoes it

    def _sleep_for(self, freeze: bool) -> str:
        """The hooks that set the server to sleep before a freeze (`freeze`) or a move to WARM or SUSPENDED."""
        return "beforeFreeze" if freeze and self.server.hooks.before_freeze else "beforeCheckpoint"

    def _wake_hooks(self) -> None:
        if self.slept:
            for hook in self.server.hooks.after_restore:
                self._hook(hook, "afterRestore")
            self.slept = ""

    def _checkpoint_gpu(self) -> None:
        """The driver checkpoints every process of the tree that holds a CUDA context, remembered by its PID in the
        server's namespace (a restore gives the tree new PIDs outside it). A failure resumes those already done."""
        assert self.pid is not None
        if self.driver is None or self.gpu_pids:
            return
        self._all_pages_in()
        done: list[int] = []
        self._before_checkpoint = {}
        try:
            for pid in cuda_processes(self.pid):
                self._trim_stack(pid)
                self._note_pages(pid)
                self.driver.suspend(pid)
                done.append(pid)
        except cuda.DriverCheckpointError:
            for pid in done:
                with contextlib.suppress(cuda.DriverCheckpointError):
                    self.driver.resume(pid)
            raise
        self.gpu_pids = tuple(ns_pid(pid) for pid in done)

    def _resume_gpu(self) -> None:
        """The driver restores each process it checkpointed (through the node's restore gate)."""
        if self.driver is None or not self.gpu_pids:
            return
        assert self.pid is not None
        hosts = {ns_pid(pid): pid for pid in process.tree(self.pid)}
        missing = [p for p in self.gpu_pids if p not in hosts]
        if missing:
            raise ServerError(f"{self.name}: the processes the driver checkpointed are gone (PIDs {missing} in the "
                              "server's namespace)")
        for inner in self.gpu_pids:
            self.driver.resume(hosts[inner])
        self.gpu_pids, self._before_checkpoint = (), {}

    def _trim_stack(self, pid: int) -> None:
        """A process whose handshake thread runs (it announced itself in the signal folder) lowers its CUDA contexts'
        per-thread stack to `cuda_stack_bytes` before the driver's checkpoint, which then copies that much less
        (`handshake.trim_cuda_stack`). One that cannot, or does not answer in time, is checkpointed as it is."""
        inner = ns_pid(pid)
        if not self.cuda_stack_bytes or not (self.signals / f"{handshake.PARKS}.{inner}").exists():
            return
        answer = self._ask(inner, handshake.TRIM, handshake.TRIMMED, json.dumps({"bytes": self.cuda_stack_bytes}),
                           TRIM_TIMEOUT_SEC, "lowering its CUDA stack")
        if answer is None:
            report: dict[str, object] = {"error": f"no answer within {TRIM_TIMEOUT_SEC:g} s"}
        else:
            try:
                report = json.loads(answer.read_text())
            except (OSError, ValueError) as exc:
                report = {"error": f"its answer could not be read: {exc}"}
            answer.unlink(missing_ok=True)
        self.stack_trims[inner] = report
        if "error" in report:
            log.warning("%s: process %d keeps its CUDA stack: %s", self.name, pid, report["error"])

    def _ask(self, inner: int, request: str, response: str, body: str, timeout: float,
             doing: str) -> pathlib.Path | None:
        """Ask the handshake thread of the server's process `inner` (its PID in the server's namespace) to do
        something (`request`.PID holding `body`) and wait for its answer (`response`.PID): that file, or None when it
        did not come within `timeout` seconds (the request withdrawn). ServerError when the server dies meanwhile."""
        asked, answer = self.signals / f"{request}.{inner}", self.signals / f"{response}.{inner}"
        answer.unlink(missing_ok=True)
        contract.publish(self.signals, asked.name, body)
        deadline = time.perf_counter() + timeout
        while not answer.exists():
            self._alive_or_raise(doing)
            if time.perf_counter() > deadline:
                asked.unlink(missing_ok=True)
                return None
            time.sleep(0.001)
        return answer

    def _note_pages(self, pid: int) -> None:
        """A process that parks the driver's copy (it announced itself in the signal folder): its pages before the
        driver's checkpoint, to tell that copy by afterwards."""
        inner = ns_pid(pid)
        if self.parking.folder is None or not (self.signals / f"{handshake.PARKS}.{inner}").exists():
            return
        try:
            self._before_checkpoint[inner] = regions.presence(pid)
        except OSError as exc:
            log.warning("%s: the driver's copy of process %d stays in the image: %s", self.name, pid, exc)

    def _park_driver_copies(self) -> pathlib.Path | None:
        """Each checkpointed process that parks maps the pages the driver's checkpoint filled (and what an earlier
        restore left mapped from parked files that are going) from one new file beside the images, so that the image
        leaves them out: that file, or None where nothing was moved. A process that cannot move them leaves them in
        the image and says why (`driver_copies`); one that does not answer in time fails the freeze."""
        asking, self.driver_copies = self._before_checkpoint, {}
        folder = self.parking.folder
        if not asking or folder is None or self.pid is None:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        parked = folder / f"driver-copy-{os.urandom(4).hex()}.bin"
        parked.touch()
        hosts = {ns_pid(pid): pid for pid in process.tree(self.pid)}
        for inner, before in asking.items():  # each checkpointed by the driver (`_checkpoint_gpu` noted it)
            if inner in hosts:
                self.driver_copies[inner] = self._park_one(hosts[inner], inner, before, parked)
        if not any(report.get("bytes") for report in self.driver_copies.values()):
            parked.unlink()
            return None
        return parked

    def _parked_files_mapped(self) -> set[pathlib.Path]:
        """The parked files the tree maps: those its image will name."""
        folder = self.parking.folder
        if folder is None or not folder.is_dir() or self.pid is None:
            return set()
        prefix = str(folder.resolve()) + os.sep
        found: set[pathlib.Path] = set()
        for pid in process.tree(self.pid):
            with contextlib.suppress(OSError):  # a process that just exited maps nothing
                found |= {pathlib.Path(m.path) for m in regions.mappings(pid) if m.path.startswith(prefix)}
        return found

    def _park_one(self, pid: int, inner: int, before: regions.Presence, parked: pathlib.Path) -> dict[str, object]:
        try:
            moving, stale_bytes = gpu_freeze.to_park(pid, before, parked)
        except OSError as exc:
            return {"error": f"its pages could not be read: {exc}"}
        answer = self._ask(inner, handshake.PARK, handshake.PARKED,
                           json.dumps({"regions": [r.to_json() for r in moving], "file": str(parked)}),
                           PARK_TIMEOUT_SEC, "parking the driver's copy")
        if answer is None:
            raise ServerError(f"{self.name}: process {pid} did not park the driver's copy within "
                              f"{PARK_TIMEOUT_SEC:g} s")
        report = gpu_freeze.parked_report(answer, stale_bytes)
        if "error" in report:
            log.warning("%s: the driver's copy of process %d stays in the image: %s", self.name, pid, report["error"])
        return report

    def _dump_at_handshake(self, pid: int) -> criu.Image:
        """The handshake's image, the server left running: on a GPU its CUDA processes checkpointed by the driver
        for the dump and restored after it, so the image holds them checkpointed (a wake restores them)."""
        self._checkpoint_gpu()
        try:
            image = self.engine.dump(pid, self.name, leave_running=True)
        finally:
            self._handshake_gpu_pids = self.gpu_pids  # what every wake from this image restores
            self._resume_gpu()
        return image

    def warm(self) -> None:
        """HOT -> WARM on a GPU: the beforeCheckpoint hooks (vLLM's sleep); the process keeps its context."""
        with self._move():
            if self.tier is not Tier.HOT or self.pid is None or not self.can_warm:
                raise instance.IllegalTransition(f"{self.name}: WARM from {self.tier.value}"
                                                 + ("" if self.can_warm else " (needs a GPU and beforeCheckpoint "
                                                    "hooks)"))
            began = time.perf_counter()
            self._leave_hot()
            self._sleep_hooks()
            self.tier = Tier.WARM
            self._record(Tier.HOT, Tier.WARM, began)

    def suspend(self) -> None:
        """HOT or WARM -> SUSPENDED on a GPU: the hooks, then the driver checkpoints each CUDA process. A driver that
        cannot leaves the server as it was (its hooks undone)."""
        with self._move():
            if self.tier not in (Tier.HOT, Tier.WARM) or self.pid is None or self.driver is None:
                raise instance.IllegalTransition(f"{self.name}: SUSPENDED from {self.tier.value}"
                                                 + ("" if self.driver is not None else " (no GPU driver)"))
            if not cuda_processes(self.pid):
                raise ServerError(f"{self.name}: no process of the server holds a CUDA context (an open /dev/nvidia* "
                                  "file): SUSPENDED is for GPU servers; this one goes from HOT to FROZEN")
            began = time.perf_counter()
            source = self.tier
            if source is Tier.HOT:
                self._leave_hot()
            self._sleep_hooks()
            try:
                self._checkpoint_gpu()
            except cuda.DriverCheckpointError:
                if source is Tier.HOT:
                    self._undo_before_checkpoint()
                raise
            self.tier = Tier.SUSPENDED
            self._record(source, Tier.SUSPENDED, began)

    def freeze(self) -> None:
        """HOT, WARM or SUSPENDED -> FROZEN (see the module docstring); FreezeRefused leaves it as it was, Busy
        when a request runs."""
        with self._move():
            if self.tier not in (Tier.HOT, Tier.WARM, Tier.SUSPENDED) or self.pid is None:
                raise instance.IllegalTransition(f"{self.name}: freeze from {self.tier.value}")
            source = self.tier
            began = time.perf_counter()
            if source is Tier.HOT:
                self._leave_hot()
            if self.handshake_image:
                self._kill()
                self.slept, self.gpu_pids = "", ()
            else:
                refused = undumpable(self.pid)
                if refused:
                    raise FreezeRefused(f"{self.name}: CRIU cannot dump this server: " + "; ".join(refused))
                try:
                    self._sleep_hooks(freeze=True)
                    self._checkpoint_gpu()
                except (cuda.DriverCheckpointError, ServerError):
                    self._back_to(source)
                    raise
                old = self.image
                parked = None
                try:
                    close_connections = self._holds_connections()
                    self._all_pages_in()
                    parked = self._park_driver_copies()
                    mapped = self._parked_files_mapped()
                    self.image = self.engine.dump(self.pid, self.name, close_connections=close_connections)
                except (criu.CriuError, ServerError) as exc:
                    if parked is not None:
                        parked.unlink(missing_ok=True)  # no image maps it; the tree's mappings outlive the name
                    self._back_to(source)
                    if INET_REFUSED.search(str(exc)):
                        raise FreezeRefused(f"{self.name}: it holds TCP or UDP sockets, which this CRIU "
                                            f"({self.engine.criu}) cannot dump on this kernel (>= 6.16): install CRIU "
                                            "4.2 or newer (make criu), listen on a Unix socket (listen: unix), or "
                                            "take the image at the handshake (hooks.signalFiles)") from exc
                    raise
                process.reap(self.pid, timeout=10.0)
                self.pid = None
                self.parking.drop(keep=parked, mapped=mapped)  # the files the new image maps stay
                moved = [report for report in self.driver_copies.values() if "error" not in report]
                self.copies_parked = parked is not None and len(moved) == len(self.gpu_pids)
                if old is not None:
                    self.engine.remove(old)
            self.tier = Tier.FROZEN
            self._record(source, Tier.FROZEN, began)

    def _holds_connections(self) -> bool:
        """Whether the tree holds TCP connections open, after the hooks (which may have closed them): with
        `server.connections: refuse`, HoldsConnections names them; with `close`, the dump takes them, to be restored
        closed."""
        assert self.pid is not None
        deadline = time.monotonic() + CLOSING_WAIT_SEC
        held = tcp_connections(self.pid)
        while held and all(state in TCP_CLOSING for state, _ in held) and time.monotonic() < deadline:
            time.sleep(0.005)
            held = tcp_connections(self.pid)
        if held and self.server.connections is api.Connections.REFUSE:
            raise HoldsConnections(
                f"{self.name}: it holds TCP connections open, which CRIU cannot restore as they were: "
                f"{'; '.join(line for _, line in held)}. Close them before the checkpoint (in a beforeCheckpoint "
                "hook), or set server.connections: close (frozen with them; the woken server finds them closed and "
                "reconnects)")
        return bool(held)

    def _lazily(self, image: criu.Image, gpu: bool) -> bool:
        """Whether a wake restores `image` with lazy pages (`lazy_restore`; unset: with CUDA processes where each
        parked the driver's copy, without where the image is LAZY_MIN_BYTES or more)."""
        if self.lazy_restore is not None:
            wanted = self.lazy_restore
        else:
            wanted = self.copies_parked if gpu else image.size_bytes >= LAZY_MIN_BYTES
        return wanted and image.lazy_restorable

    def _all_pages_in(self) -> None:
        """A tree restored lazily is dumped only once it holds all of its memory again (its lazy-pages daemon done)."""
        if self._restored is not None:
            self._restored.wait_for_pages(self.engine.deadlines.for_bytes(
                self.image.size_bytes if self.image is not None else 0))  # CriuError when they do not all arrive
            self._restored = None

    def _back_to(self, source: Tier) -> None:
        """A freeze that failed leaves the server as it was before it: HOT with its hooks undone, WARM with the
        driver's checkpoint undone, SUSPENDED under the driver's checkpoint (taken again where the freeze had the
        driver restore it to call beforeFreeze). A WARM or SUSPENDED server the freeze woke goes back to sleep
        through beforeCheckpoint where it can still be called; one checkpointed after beforeFreeze stays asleep
        that way (its wake in place runs the same afterRestore hooks)."""
        if self.pid is None or not process.alive(self.pid):
            return
        with contextlib.suppress(cuda.DriverCheckpointError, ServerError):
            if source is not Tier.SUSPENDED:
                self._resume_gpu()
            if source is Tier.HOT:
                self._undo_before_checkpoint()
            elif not self.gpu_pids:
                self._sleep_hooks()
                if source is Tier.SUSPENDED:
                    self._checkpoint_gpu()

    def _undo_before_checkpoint(self) -> None:
        """A move down that failed leaves the server running: what beforeCheckpoint did (a sleep) is undone."""
        if self.slept and self.pid is not None and process.alive(self.pid):
            with contextlib.suppress(ServerError):
                self._wake_hooks()

    def wake(self) -> None:
        """FROZEN -> HOT through a restore (then the driver's restore and the hooks, where the freeze took them);
        a failed one falls back to a cold start."""
        with self._move():
            if self.tier is not Tier.FROZEN or self.image is None:
                raise instance.IllegalTransition(f"{self.name}: wake from {self.tier.value}")
            began = time.perf_counter()
            phases: dict[str, float] = {}
            lazy = False
            try:
                (self.signals / handshake.RESTORED).unlink(missing_ok=True)
                if self.unix:
                    self.socket_path.unlink(missing_ok=True)
                gpu = bool(self._handshake_gpu_pids if self.handshake_image else self.gpu_pids)
                lazy = self._lazily(self.image, gpu)
                restored = self.engine.restore(self.image, lazy=lazy, wake=True, gpu=gpu)
                self.pid, self._restored = restored.pid, restored
                phases["restore"] = restored.seconds
                mark = time.perf_counter()
                tree = process.tree(restored.pid)
                for pid in tree:  # its image kept each thread's nice: it may have yielded
                    priority.normalise(pid)
                if self.handshake_image:
                    self.gpu_pids = self._handshake_gpu_pids
                if gpu:  # the driver's copies mapped from the parked file: their page tables filled beside its restore
                    self.parking.premap(tree)
                phases["adopt"] = time.perf_counter() - mark
                self._back_up(began, phases, restored)
                mark = time.perf_counter()
                restored.release()  # awake: the lazy pages the wake did not ask for come now
                phases["release"] = time.perf_counter() - mark
            except (criu.CriuError, ServerError, instance.CanaryMismatch, OSError,
                    cuda.DriverCheckpointError) as exc:
                if lazy and isinstance(exc, cuda.DriverCheckpointError):
                    log.warning("%s: the driver could not restore it after a lazy restore: eager from now on",
                                self.name)
                    self.lazy_restore = False
                self._fall_back(Tier.FROZEN, exc)
                return
            self.tier = Tier.HOT
            self.last_used = time.monotonic()
            self._record(Tier.FROZEN, Tier.HOT, began, phases=phases)

    def wake_in_place(self) -> None:
        """WARM or SUSPENDED -> HOT: the driver's restore of each CUDA process, the afterRestore hooks, the canary;
        a failed one falls back to a cold start."""
        with self._move():
            source = self.tier
            if source not in (Tier.WARM, Tier.SUSPENDED) or self.pid is None:
                raise instance.IllegalTransition(f"{self.name}: wake in place from {source.value}")
            began = time.perf_counter()
            phases: dict[str, float] = {}
            try:
                self._back_up(began, phases)
            except (ServerError, instance.CanaryMismatch, OSError, cuda.DriverCheckpointError) as exc:
                self._fall_back(source, exc)
                return
            self.tier = Tier.HOT
            self.last_used = time.monotonic()
            self._record(source, Tier.HOT, began, phases=phases)

    def _back_up(self, began: float, phases: dict[str, float], restored: criu.Restored | None = None) -> None:
        """The wake's steps after the restore (`restored`, where there was one), each timed into `phases`."""
        mark = time.perf_counter()
        if self.gpu_pids:
            self._resume_gpu()
            phases["driver"] = time.perf_counter() - mark
            if restored is not None:  # what faulted until here is wanted first at the next wake
                restored.end_record()
            mark = time.perf_counter()
        if self.handshake_image and self.tier is Tier.FROZEN:
            self._go_on()
        self._await_ready(began)
        self._wake_hooks()
        self._check_canary()
        phases["wake"] = time.perf_counter() - mark

    def _fall_back(self, source: Tier, exc: BaseException) -> None:
        """A wake that failed: the server is started afresh (its image dropped), the move recorded as a fallback."""
        log.warning("%s: wake failed, cold start instead: %s", self.name, exc)
        self.restore_failures += 1
        self._kill()
        if self.image is not None and source is Tier.FROZEN:
            self.engine.keep_failure(self.image, self.name, (self.logfile,))
        if self.image is not None:
            self.engine.remove(self.image)
        self._drop_image()
        self.tier = Tier.COLD
        self.start()
        self.transitions[-1] = dataclasses.replace(self.transitions[-1], source=source, fallback=True,
                                                   detail=str(exc)[:500])
        if self.metrics is not None:
            self.metrics.restore_failures.labels(source.value, self.spec.model_id).inc()

    def settle(self, floor: Tier) -> None:
        """Bring a started server down to `floor` (WARM and SUSPENDED on a GPU only; a tier its tree cannot take
        is passed over, so a server holding no CUDA context goes from HOT to FROZEN)."""
        with self._lock:
            floor = self._reachable(floor)
            for tier in self._ladder():
                if _depth(tier) > _depth(floor) or _depth(tier) <= _depth(self.tier):
                    continue
                self._enter(tier)

    def _reachable(self, floor: Tier) -> Tier:
        """`floor`, or where its ladder lacks it (SUSPENDED for a server without a CUDA context), the next tier
        below it."""
        ladder = self._ladder()
        if floor is Tier.HOT or floor in ladder:
            return floor
        return next((t for t in ladder if _depth(t) > _depth(floor)), floor)

    def _ladder(self) -> list[Tier]:
        """The tiers below HOT this server can take, highest first."""
        cuda_context = self.driver is not None and self.pid is not None and (
            bool(self.gpu_pids) or bool(cuda_processes(self.pid)))
        return ([Tier.WARM] if self.can_warm else []) + ([Tier.SUSPENDED] if cuda_context else []) + [Tier.FROZEN]

    def _enter(self, tier: Tier) -> None:
        {Tier.WARM: self.warm, Tier.SUSPENDED: self.suspend, Tier.FROZEN: self.freeze}[tier]()

    def demote_if_idle(self, idle_sec: float, gpu_idle: tuple[float, float] | None = None,
                       floor: Tier = Tier.FROZEN) -> bool:
        """One step down its ladder when unused long enough and no request runs, never below `floor`; whether it
        moved (a floor its ladder lacks: the next tier below it). The waits are seconds since the last use, keyed by
        the tier entered: `idle_sec` before FROZEN, `gpu_idle` before WARM and before SUSPENDED (`IdleSettings`'
        hot_sec and warm_sec; both `idle_sec` unless given)."""
        with self._lock:
            floor = self._reachable(floor)
            if self.tier not in (Tier.HOT, Tier.WARM, Tier.SUSPENDED) or _depth(self.tier) >= _depth(floor):
                return False
            lower = [t for t in self._ladder() if _depth(t) > _depth(self.tier)]
            if not lower:
                return False
            after = {Tier.WARM: gpu_idle[0] if gpu_idle else idle_sec,
                     Tier.SUSPENDED: gpu_idle[1] if gpu_idle else idle_sec, Tier.FROZEN: idle_sec}
            step = lower[0]  # each wait counts from the last use, as `IdleSettings` says
            if _depth(step) > _depth(floor) or time.monotonic() - self.last_used < after[step]:
                return False
            try:
                self._enter(step)
            except Busy:
                return False
            return True

    def close(self) -> None:
        """Stop the server and drop its image: COLD."""
        with self._move():
            self._kill()
            if self.image is not None:
                self.engine.remove(self.image)
            self._drop_image()
            self.tier = Tier.COLD

    def _drop_image(self) -> None:
        """Forget the image (removed by the caller), its parked copies and what the tree was."""
        self.image, self.handshake_image = None, False
        self.parking.drop()
        self.copies_parked = False
        self.slept, self.gpu_pids, self._before_checkpoint = "", (), {}

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
        cwd = str(instance.server_folder(self.spec))
        command = [fill(arg) for arg in self.server.command]
        nsinit.become_subreaper()
        out = subprocess.run([sys.executable, "-m", "volga_agent.worker.nsinit", *self._namespace(), "--keep",
                              str(self.logfile), "--", *command], capture_output=True, text=True, check=False,
                             cwd=cwd, env=env)
        if out.returncode != 0:
            raise ServerError(f"{self.name}: could not start {command[0]!r}: {out.stderr.strip()}")
        self.pid = int(out.stdout.strip())

    def _namespace(self) -> list[str]:
        """nsinit's arguments for the tree's PID namespace. On a GPU none: the CUDA runtime fails inside a PID
        namespace whose /proc is the host's (`worker.nsinit`), so the tree keeps host PIDs, which a restore then needs
        free (a failed one falls back to a cold start). Elsewhere tini is the namespace's init, working in the
        instance's folder (criu's dump needs a writable one there, and the server's own may be read-only), and the
        server its child."""
        if self.driver is not None:
            return ["--no-pidns"]
        try:
            return ["--init", criu.find_init(self.engine.criu), str(self.workdir)]
        except criu.CriuError as exc:
            raise ServerError(f"{self.name}: {exc}") from exc

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
        differs = f"status {got.status}, expected {want.status}" if got.status != want.status else \
            canary.differs(got.body, want.body)
        if differs:
            raise instance.CanaryMismatch(f"{self.name}: the canary's answer: {differs}")

    def _kill(self) -> None:
        if self._restored is not None:
            self._restored.stop()
            self._restored = None
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
            if target is Tier.HOT and source in (Tier.FROZEN, Tier.SUSPENDED, Tier.WARM):
                self.metrics.restore_latency.labels(source.value, model).observe(move.seconds * 1000)
                for phase, seconds in move.phases.items():
                    self.metrics.wake_phase_latency.labels(source.value, phase, model).observe(seconds * 1000)


class Fleet:
    """Server instances by model id, leased by a gateway proxy of their own (`gateway.proxy.Servers`) with no pool:
    `volga bench server` and the tests of one server. A node runs its servers in the pool (`serverpool`)."""

    def __init__(self, instances: Iterable[ServerInstance] = ()) -> None:
        self.instances = {i.spec.model_id: i for i in instances}

    def serves(self, model_id: str) -> bool:
        return model_id in self.instances

    def speaks_grpc(self, model_id: str) -> bool:
        return self.instances[model_id].server.protocol is api.Protocol.OIP_GRPC

    def elsewhere(self, model_id: str) -> None:
        """One node: every server of the fleet is here."""
        return None

    def remote(self, gateway: str, http: str = "") -> None:
        """One node: there is no other gateway."""
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
            def give_back(done: asyncio.Future[instance.Transition | None]) -> None:
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
