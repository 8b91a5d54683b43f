"""The worker: the model-server process that Volga keeps in tiers and checkpoints.

It loads one model (`backends`), warms it up, and serves inference over an AF_UNIX socket with the frames
of `protocol`. It is the process CRIU freezes, so:

- it holds no INET socket, ever (kernels >= 6.16 refuse the socket options CRIU reads on INET sockets);
- before a CRIU dump it closes every connection (telling each peer, with a goodbye frame, that a request
  it had just sent was not run), writes `ready-for-checkpoint` in its signal folder and
  waits for `restore-complete` (the pause/resume hooks of Dynamo Snapshot); the process resumes inside
  that wait after a restore, re-seeds its RNGs when asked to, and goes back to serving;
- it imports nothing of the agent (only `volga_agent.worker`), and torch only for torch models, to stay
  small and start fast.

Run as `python -m volga_agent.worker.serve CONFIG.json`; the agent starts it through `nsinit` so that it
is the init of its own PID namespace, which CRIU restores with it and so never collides with other PIDs.
See docs/architecture.md.

It starts as the agent's user (root) and drops to its own (`WorkerConfig.uid`/`gid`, nobody by default) before
it loads the model, so model code never runs as root (docs/security.md). What it needs of root's it takes first:
its listening socket (bound where the agent said, owned as the agent would own it), its framework's modules,
an unlimited RLIMIT_MEMLOCK (pinned host memory), and its signal folder and the model's folder as open
descriptors named through /proc/self/fd, so that it reaches them whatever the folders above them allow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import mmap
import os
import pathlib
import random
import resource
import secrets
import selectors
import signal
import socket
import stat
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from volga_agent.worker import backends, contract, nsinit, protocol, regions, warmup

# Segments attached by gateways: files in SHM_DIR named by the worker (SHM_PREFIX + a random token).
SHM_DIR = pathlib.Path("/dev/shm") if pathlib.Path("/dev/shm").is_dir() else pathlib.Path(tempfile.gettempdir())
SHM_PREFIX = "volga-shm-"
# Ops that move the worker between tiers or change its model: the agent's alone (a peer of the same user, or
# root); a gateway under another user may only ask for inference.
CONTROL_OPS = frozenset({"prepare_checkpoint", "offload", "reload", "sleep", "wake", "swap"})


def _trusted(conn: socket.socket) -> bool:
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid in (0, os.geteuid())


class Worker:
    """One loaded model served on the config's socket until the process is killed (or frozen)."""

    def __init__(self, config: contract.WorkerConfig, listener: socket.socket | None = None) -> None:
        self.config = config
        self.signal_dir = pathlib.Path(config.signal_dir)
        self.started = time.time()
        self.load_seconds = 0.0
        self.backend = self._load()
        self.listener = listen(config.socket) if listener is None else listener
        self.conns: list[socket.socket] = []
        self.selector = selectors.PollSelector()
        # Shared-memory segments attached by co-located gateways, one per connection; dropped with it.
        self.shm: dict[socket.socket, mmap.mmap] = {}
        # The one segment path each connection may attach: named by this worker with a random token (shm_token).
        self.shm_offers: dict[socket.socket, pathlib.Path] = {}
        # Per connection with a segment: the layouts its requests and replies took before (`_Layouts`).
        self.layouts: dict[socket.socket, _Layouts] = {}
        self._conn: socket.socket | None = None
        self._head = b""  # the header bytes of the frame being served
        self.requests = 0
        self.restores = 0
        self.restore_warmups_done = 0
        self._rewarm = False  # restored since the last wake, with restore warm-ups to run
        self.generation = 0  # bumped when the process state changes in a way a snapshot must capture (swap)
        # The tier the agent put this worker in while its process stays up ("" when serving): requests that
        # reach it then are handed back unrun (NotRun), never half-run against offloaded or locked GPU state.
        self.asleep = ""
        self.ops: dict[str, Callable[[protocol.Frame], tuple[dict[str, Any] | bytes, list[memoryview]]]] = {
            "infer": self._op_infer,
            "ping": self._op_ping,
            "metadata": self._op_metadata,
            "warmup": lambda f: (self.report.to_wire(), []),
            "stats": self._op_stats,
            "offload": self._op_offload,
            "reload": self._op_reload,
            "sleep": self._op_sleep,
            "wake": self._op_wake,
            "canary": self._op_canary,
            "swap": self._op_swap,
            "shm_token": self._op_shm_token,
            "attach_shm": self._op_attach_shm,
            "rng": lambda f: ({"python": random.random(), "numpy": float(np.random.random())}, []),
        }

    def _load(self) -> Any:
        start = time.perf_counter()
        backend = backends.load_backend(self.config)
        self.warm, self.report = warmup.warm_up(backend.run, self.config)
        for finding in (self.report.skipped, self.report.mismatch):
            if finding:
                print(f"warm-up: {finding}", file=sys.stderr, flush=True)
        self.load_seconds = time.perf_counter() - start
        return backend

    def _op_offload(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        result = self.backend.offload()
        self.asleep = "WARM"
        return result, []

    def _op_reload(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        result = self.backend.reload()
        self.asleep = ""
        return result, []

    def _op_sleep(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        """Sent before the agent checkpoints the GPU state (SUSPENDED), so no request then waits on a lock; the
        backend makes the checkpoint smaller (`Backend.sleep`)."""
        self.asleep = str(frame.header.get("tier") or "asleep")
        return self.backend.sleep(), []

    def _op_wake(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        """Serve again; with `canary`, answer the canary first (the agent compares it before any request). After
        a restore, the restore warm-ups (warmupCacheRatio) run first."""
        self.backend.awake()
        if self._rewarm:
            warmup.run(self.backend.run, self.warm, self.config.restore_warmups)
            self.restore_warmups_done += self.config.restore_warmups
            self._rewarm = False
        self.asleep = ""
        header, _ = self._op_ping(frame)
        if frame.header.get("canary"):
            header["canary"] = self.canary()
        return header, []

    def _op_canary(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        return {"canary": self.canary(), "generation": self.generation}, []

    def canary(self) -> str:
        """A digest of the model's answer to the canary input: equal digests, equal model state."""
        if self.report.skipped:  # the canary input is the made-up sample the model refused
            raise protocol.WorkerError("FAILED_PRECONDITION", "no canary: the model refused the made-up warm-up "
                                       "inputs (declare runtime.warmup)")
        outputs = self.backend.run(warmup.canary(self.config))
        digest = hashlib.sha256()
        for name in sorted(outputs):
            array = np.asarray(outputs[name])
            digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()

    def _op_ping(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        return {"pid": os.getpid(), "restores": self.restores, "generation": self.generation}, []

    def _op_infer(self, frame: protocol.Frame) -> tuple[dict[str, Any] | bytes, list[memoryview]]:
        if self.asleep:
            raise protocol.NotRun(message=f"the instance is {self.asleep}; wake it first")
        segment = self.shm.get(self._conn) if frame.header.get("shm") and self._conn else None
        if frame.header.get("shm") and segment is None:
            raise protocol.WorkerError("FAILED_PRECONDITION", "no shared memory attached to this connection")
        if segment is None:
            inputs = protocol.unpack_tensors(frame.header.get("tensors", []), frame.payload)
            contract.check_inputs(self.config.inputs, inputs, self.config.max_batch_size)
            return self._inline(self._run(inputs))
        out_offset = int(frame.header.get("out_offset", 0))
        inputs = protocol.unpack_shm_tensors(frame.header.get("tensors", []), segment)
        contract.check_inputs(self.config.inputs, inputs, self.config.max_batch_size)
        assert self._conn is not None
        # The same header again means the same tensors at the same places: views, checks and all hold.
        layouts = self.layouts.setdefault(self._conn, _Layouts(segment))
        layouts.remember(self._head, _Request(inputs, out_offset))
        return self._infer_shm(layouts, layouts.requests[self._head])

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs: dict[str, np.ndarray] = self.backend.run(inputs)
        self.requests += 1
        return outputs

    @staticmethod
    def _inline(outputs: dict[str, np.ndarray]) -> tuple[dict[str, Any], list[memoryview]]:
        meta, parts = protocol.pack_tensors(outputs)
        return {"tensors": meta}, parts

    def _infer_shm(self, layouts: _Layouts, request: _Request) -> tuple[dict[str, Any] | bytes, list[memoryview]]:
        """A request whose inputs are in the connection's segment; the outputs go there too when they fit, into the
        places the same outputs took before (the reply's header then is the one encoded then)."""
        if self.asleep:
            raise protocol.NotRun(message=f"the instance is {self.asleep}; wake it first")
        outputs = self._run(request.inputs)
        key = (request.out_offset, *((name, a.dtype, a.shape) for name, a in outputs.items()))
        reply = layouts.replies.get(key)
        if reply is None:
            meta = protocol.write_shm_tensors(outputs, layouts.segment, request.out_offset)
            if meta is None:
                return self._inline(outputs)
            head = protocol.encode_head({"ok": True, "tensors": meta, "shm": True})
            views = protocol.unpack_shm_tensors(meta, layouts.segment)
            layouts.replies[key] = reply = _Reply(head, tuple(views.items()))
            return reply.head, []
        for name, view in reply.views:
            np.copyto(view, outputs[name])
        return reply.head, []

    def _op_shm_token(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        """Name the segment this connection may attach: a fresh random name in SHM_DIR, for the peer to create."""
        if self._conn is None:
            raise protocol.WorkerError("INTERNAL", "no connection")
        owner = frame.header.get("owner", 0)  # the peer's PID, so that its segments are easy to tell apart
        if not isinstance(owner, int) or isinstance(owner, bool) or owner < 0:
            raise protocol.WorkerError("INVALID_ARGUMENT", "shm_token: owner must be a non-negative integer")
        path = SHM_DIR / f"{SHM_PREFIX}{owner}-{secrets.token_hex(16)}"
        self.shm_offers[self._conn] = path
        # The peer keeps the segment; a worker of another user reads and writes it through its group.
        return {"path": str(path), "uid": os.geteuid(), "gid": os.getegid()}, []

    def _op_attach_shm(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        """Map the segment named by this connection's shm_token: a regular file (no link followed) that the
        peer owns and that is at least `size` bytes. Anything else is refused before a byte is mapped."""
        path, size = frame.header.get("path"), frame.header.get("size")
        if not isinstance(path, str) or not isinstance(size, int) or size <= 0:
            raise protocol.WorkerError("INVALID_ARGUMENT", "attach_shm needs a path and a positive size")
        if self._conn is None:
            raise protocol.WorkerError("INTERNAL", "no connection")
        offered = self.shm_offers.pop(self._conn, None)
        if offered is None or path != str(offered):
            raise protocol.WorkerError("PERMISSION_DENIED", f"attach_shm: {path!r} is not the segment this "
                                       "connection was given (shm_token)")
        _, peer_uid, _ = struct.unpack("3i", self._conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
        # Judged before it is opened (an unprivileged worker could not open most files to look), then again open.
        try:
            named = os.lstat(path)
        except OSError as exc:
            raise protocol.WorkerError("INVALID_ARGUMENT", f"attach_shm: {path}: {exc.strerror}") from None
        for code, kind in ((errno.ELOOP, stat.S_ISLNK), (errno.EISDIR, stat.S_ISDIR)):
            if kind(named.st_mode):
                raise protocol.WorkerError("INVALID_ARGUMENT", f"attach_shm: {path}: {os.strerror(code)}")
        refusal = protocol.WorkerError("PERMISSION_DENIED", f"attach_shm: {path}: not a regular file of {size} "
                                       f"bytes or more owned by the peer (uid {peer_uid})")
        if not stat.S_ISREG(named.st_mode) or named.st_uid != peer_uid or named.st_size < size:
            raise refusal
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise protocol.WorkerError("INVALID_ARGUMENT", f"attach_shm: {path}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) != (named.st_dev, named.st_ino) or not stat.S_ISREG(info.st_mode) \
                    or info.st_uid != peer_uid or info.st_size < size:
                raise refusal
            self._detach(self._conn)
            self.shm[self._conn] = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return {"size": size}, []

    def _detach(self, conn: socket.socket) -> None:
        self.shm_offers.pop(conn, None)
        self.layouts.pop(conn, None)  # its views first: a segment with views into it stays mapped
        segment = self.shm.pop(conn, None)
        if segment is not None:
            with contextlib.suppress(BufferError):  # a view is still alive; the mapping goes with the process
                segment.close()

    def close_conn(self, conn: socket.socket) -> None:
        self._detach(conn)
        if conn in self.conns:
            self.conns.remove(conn)
            self.selector.unregister(conn)
        conn.close()

    def _op_metadata(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        decl = [dataclasses.asdict(t) for t in self.config.inputs], [dataclasses.asdict(t) for t in self.config.outputs]
        return {"model_id": self.config.model_id, "framework": self.config.framework,
                "inputs": decl[0], "outputs": decl[1], "device": self.config.device}, []

    def _op_stats(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        return {"requests": self.requests, "restores": self.restores, "load_seconds": self.load_seconds,
                "restore_warmups": self.restore_warmups_done,
                **self.backend.stats()}, []

    def _op_swap(self, frame: protocol.Frame) -> tuple[dict[str, Any], list[memoryview]]:
        path = frame.header.get("path")
        if not isinstance(path, str) or not os.path.exists(path):
            raise protocol.WorkerError("INVALID_ARGUMENT", f"swap: path {path!r} does not exist")
        start = time.perf_counter()
        self.backend.swap(path)
        self.generation += 1
        return {"seconds": time.perf_counter() - start, "generation": self.generation}, []

    def handle(self, conn: socket.socket) -> bool:
        """Serve one frame; False when the connection is gone or the worker paused for a checkpoint."""
        try:
            head, payload = protocol.recv_raw(conn)
        except (protocol.ProtocolError, OSError):
            return False
        layouts = self.layouts.get(conn)
        request = layouts.requests.get(head) if layouts is not None else None
        if layouts is not None and request is not None:  # an inference request this connection sent before
            reply = self._reply(lambda: self._infer_shm(layouts, request))
        else:
            try:
                frame = protocol.Frame(protocol.decode_head(head), payload)
            except protocol.ProtocolError:
                return False
            op = frame.header.get("op")
            if op in CONTROL_OPS and not _trusted(conn):
                try:
                    protocol.send_frame(conn, protocol.WorkerError(
                        "PERMISSION_DENIED", f"{op}: only the agent's user may move this worker").reply())
                except OSError:
                    return False
                return True
            if op == "prepare_checkpoint":
                protocol.send_frame(conn, {"ok": True})
                self.pause_for_checkpoint(str(frame.header.get("park") or ""))
                return False
            handler = self.ops.get(str(op))
            self._conn, self._head = conn, head
            if handler is None:
                reply = [protocol.encode_head(protocol.WorkerError("UNIMPLEMENTED", f"unknown op {op!r}").reply())]
            else:
                reply = self._reply(lambda: handler(frame))
        try:
            protocol.send_parts(conn, reply)
        except OSError:
            return False
        return True

    @staticmethod
    def _reply(run: Callable[[], tuple[dict[str, Any] | bytes, list[memoryview]]]) -> list[bytes | memoryview]:
        """The frame answering a request: `run`'s header (a dict, or bytes encoded before) and payload, or the
        error it raised."""
        try:
            header, parts = run()
            if isinstance(header, bytes):
                return [header, *parts]
            header = {"ok": True, **header}
        except protocol.WorkerError as exc:
            header, parts = exc.reply(), []
        except Exception as exc:  # the framework failed on this request: report it, keep serving
            header, parts = {"ok": False, "code": "INTERNAL", "message": f"{type(exc).__name__}: {exc}"}, []
        return [protocol.encode_head(header, parts), *parts]

    def pause_for_checkpoint(self, park: str = "") -> None:
        """Close every connection, say we are ready, and wait for the agent's restore-complete signal.

        A CRIU dump taken now holds only the listener and files. After a restore the process continues
        here; when the dump was abandoned the agent sends the same signal and nothing else happens. With
        `park` (a file path the agent chose), GPU weights wait in that file instead of the image.
        """
        for conn in list(self.conns):
            protocol.say_goodbye(conn)
            self.close_conn(conn)
        # With its weights parked, the worker maps the driver's copy from the same file once the agent names it.
        copy_to_park = bool(park) and self.backend.park(park)
        if not copy_to_park:
            self.backend.drop_host_copy()
        driver_done = self.signal_dir / contract.DRIVER_CHECKPOINTED
        done = self.signal_dir / contract.RESTORE_COMPLETE
        # CRIU would restore an armed parent-death signal while criu is the parent, and its exit would kill us.
        armed = nsinit.release_parent()
        (self.signal_dir / contract.READY_FOR_CHECKPOINT).write_text(str(os.getpid()))
        waits = 0
        while not done.exists():
            signal.sigtimedwait([contract.WAKE_SIGNAL], 0.05)
            waits += 1
            if copy_to_park and driver_done.exists():
                self._park_driver_copy(park, driver_done)
                copy_to_park = False
            if armed and waits % 20 == 0 and not contract.agent_alive(self.signal_dir / contract.AGENT):
                # Our agent died while we waited (the dump's window): no one is left to resume us.
                print(f"the agent named in {self.signal_dir / contract.AGENT} is gone; exiting", file=sys.stderr,
                      flush=True)
                os._exit(1)
        agent = done.read_text().strip()
        if armed:  # the agent writes its PID there: die with it again
            nsinit.die_with(int(agent) if agent.isdigit() else nsinit.host_ppid())
        done.unlink(missing_ok=True)
        (self.signal_dir / contract.READY_FOR_CHECKPOINT).unlink(missing_ok=True)
        self.backend.unpark()
        self.restores += 1
        if self.config.reset_rng_on_restore:
            reseed_rngs()
        # At the wake that follows (`_op_wake`): a worker restored asleep may have its weights in host memory.
        self._rewarm = self.config.restore_warmups > 0

    def _park_driver_copy(self, park: str, named: pathlib.Path) -> None:
        """The driver has checkpointed us: map the regions the agent named in `named` (what the checkpoint filled,
        and what an earlier restore left mapped from parked files that are going) from the parked file `park`,
        so that the image leaves them out (`regions`); then say how much, or why not (they stay in the image)."""
        try:
            report = regions.move_as_named(contract.read_signal(named), park)
        except OSError as exc:
            report = {"error": f"{type(exc).__name__}: {exc}"}
        if "error" in report:
            print(f"the driver's copy stays in the image: {report['error']}", file=sys.stderr, flush=True)
        contract.publish(self.signal_dir, contract.DRIVER_COPY_PARKED, json.dumps(report))

    def serve(self) -> None:
        ready = {"pid": os.getpid(), "load_seconds": self.load_seconds}
        (self.signal_dir / contract.READY).write_text(json.dumps(ready))
        # poll(2), not epoll: the selector holds no kernel object, so a checkpoint has none to carry.
        self.selector.register(self.listener, selectors.EVENT_READ)
        while True:
            for key, _ in self.selector.select():
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    conn, _ = self.listener.accept()
                    self.conns.append(conn)
                    self.selector.register(conn, selectors.EVENT_READ)
                elif sock in self.conns and not self.handle(sock):
                    self.close_conn(sock)


@dataclasses.dataclass(frozen=True)
class _Request:
    """An inference request's inputs as views into a connection's segment (checked against the contract), and
    where its outputs go."""

    inputs: dict[str, np.ndarray]
    out_offset: int


@dataclasses.dataclass(frozen=True)
class _Reply:
    """A reply's encoded frame head, and the views of the segment its outputs are copied into."""

    head: bytes
    views: tuple[tuple[str, np.ndarray], ...]


@dataclasses.dataclass
class _Layouts:
    """What a connection's requests (by their header bytes) and replies (by their outputs' names, dtypes and shapes)
    looked like, so that the same again costs no decoding, checking or encoding. A gateway sends the same few
    layouts (batch sizes) over and over; past `LIMIT` of either, they start again."""

    LIMIT: ClassVar[int] = 256
    segment: mmap.mmap
    requests: dict[bytes, _Request] = dataclasses.field(default_factory=dict)
    replies: dict[tuple[Any, ...], _Reply] = dataclasses.field(default_factory=dict)

    def remember(self, head: bytes, request: _Request) -> None:
        if len(self.requests) >= self.LIMIT or len(self.replies) >= self.LIMIT:
            self.requests.clear()
            self.replies.clear()
        self.requests[head] = request


def listen(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pathlib.Path(path).unlink(missing_ok=True)
    listener.bind(path)
    listener.listen(64)
    return listener


def _through_descriptor(path: str) -> tuple[str, int]:
    """A file named through an open descriptor (/proc/self/fd/N), which reaches it whatever the folders above it
    allow (the file itself must still be readable); the descriptor."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}", fd


def _may(info: os.stat_result, uid: int, gid: int, bits: int) -> bool:
    """Whether `uid`/`gid` (root when both are 0) holds every permission in `bits` (r=4, w=2, x=1) on a file."""
    if uid == 0 and gid == 0:
        return True
    shift = 6 if info.st_uid == uid else 3 if info.st_gid == gid else 0
    return (info.st_mode >> shift) & bits == bits


def _model_folder(reached: str, where: int, uid: int, gid: int) -> int | None:
    """An O_PATH descriptor of the folder holding the model file `where` (reached at `reached`), where the worker's
    user may reach that folder (onnxruntime resolves it to its real path, every folder above included) and read
    the file: loading the model through it lets the framework find the files beside the model (an ONNX model's
    external data, whose pages then stay file-backed: out of CRIU images). None where the user may not (a
    root-only folder) or the name no longer holds the file checked."""
    folder = os.open(os.path.dirname(reached), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        named = os.stat(os.path.basename(reached), dir_fd=folder, follow_symlinks=False)
        checked = os.fstat(where)
        above = pathlib.PurePath(reached).parents
        if ((named.st_dev, named.st_ino) == (checked.st_dev, checked.st_ino) and _may(checked, uid, gid, 4)
                and all(_may(os.stat(path), uid, gid, 1) for path in above)):
            return folder
    except OSError:
        pass
    os.close(folder)
    return None


def _open_model(path: str, roots: tuple[str, ...], uid: int = 0, gid: int = 0) -> tuple[str, int]:
    """The model file, once the file actually reached is known to be a regular file inside `roots` (any regular
    file when empty): the agent checked the path earlier (admission.check_source), and a file or folder swapped
    for a link since then must not make the worker load another file. ValueError naming spec.source and the file
    reached otherwise. The path names the file through a descriptor of its folder where the worker's user may
    enter it (`_model_folder`), else through a descriptor of the file itself (`_through_descriptor`); the
    descriptor is returned to be closed once the model is loaded."""
    where = os.open(path, os.O_PATH | os.O_CLOEXEC)  # names the file without opening it (a FIFO, a device)
    try:
        reached = os.readlink(f"/proc/self/fd/{where}")
        if roots and not any(pathlib.PurePath(reached).is_relative_to(root) for root in roots):
            raise ValueError(f"spec.source: {path}: the worker opened {reached}, outside the model roots "
                             f"({', '.join(roots)}): the file or a folder above it was replaced after the agent "
                             "checked it; model files must live under settings.model_roots")
        if not stat.S_ISREG(os.fstat(where).st_mode):
            raise ValueError(f"spec.source: {path}: the worker opened {reached}, which is not a regular file")
        folder = _model_folder(reached, where, uid, gid)
        if folder is not None:
            return f"/proc/self/fd/{folder}/{os.path.basename(reached)}", folder
        return _through_descriptor(f"/proc/self/fd/{where}")  # the very file checked
    finally:
        os.close(where)


def mapped_outside(roots: tuple[str, ...], before: set[str]) -> list[str]:
    """Files this process maps now, and did not map in `before` (`contract.mapped_files()`), that lie outside
    `roots` and are not shared libraries: what a model's loading mapped from elsewhere (an ONNX external-data file
    swapped for a link out of the model roots). [] when `roots` is empty."""
    if not roots:
        return []
    return sorted(f for f in contract.mapped_files() - before
                  if ".so" not in os.path.basename(f) and not f.startswith(("/dev/", "/proc/", "/sys/"))
                  and not any(pathlib.PurePath(f).is_relative_to(root) for root in roots))


def open_as_agent(config: contract.WorkerConfig) -> tuple[contract.WorkerConfig, socket.socket, list[int]]:
    """What the worker takes while it is the agent's user: the config naming its signal folder, model and warm-up
    file through descriptors; its bound listener; the descriptors to close once the model is loaded."""
    signal_dir = f"/proc/self/fd/{os.open(config.signal_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)}"
    transient = []
    path, fd = _open_model(config.path, config.model_roots, config.uid, config.gid)
    transient.append(fd)
    warmup_file = config.warmup_file
    if warmup_file:
        warmup_file, fd = _through_descriptor(warmup_file)
        transient.append(fd)
    loading = dataclasses.replace(config, signal_dir=signal_dir, path=path, warmup_file=warmup_file)
    return loading, listen(config.socket), transient


def drop_privileges(uid: int, gid: int) -> None:
    """Become `uid`/`gid` for good (no capabilities left, none to gain through exec), keeping the right to pin
    host memory (WARM). (0, 0), or a worker that is not root, stays as it is."""
    if not (uid or gid) or os.geteuid() != 0:
        return
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (OSError, ValueError):  # no CAP_SYS_RESOURCE (a container's bounding set): as much as it may have
        hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    nsinit.no_new_privileges()


def reseed_rngs() -> None:
    """A restored process would replay the RNG stream it was frozen with; give every copy its own."""
    seed = int.from_bytes(os.urandom(8), "little")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m volga_agent.worker.serve CONFIG.json", file=sys.stderr)
        return 2
    # Block the wake signal before any framework thread exists, so every thread inherits the mask and
    # sigtimedwait in the main thread receives it.
    signal.pthread_sigmask(signal.SIG_BLOCK, [contract.WAKE_SIGNAL])
    # As the init of its PID namespace the worker ignores SIGTERM unless it handles it.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    config = contract.WorkerConfig.from_json(pathlib.Path(argv[0]).read_text())
    # A change of user disarms the parent-death signal nsinit armed: armed again against the same agent after it.
    agent = nsinit.host_ppid() if nsinit.parent_death_signal() else 0
    source = config.path
    try:
        config, listener, transient = open_as_agent(config)
        backends.preload(config.framework)
        drop_privileges(config.uid, config.gid)
        if agent:
            nsinit.die_with(agent)
        before = contract.mapped_files() if config.framework == "onnx" and config.model_roots else set()
        worker = Worker(config, listener)
        outside = mapped_outside(config.model_roots, before) if before else []
        if outside:
            raise ValueError(f"spec.source: {source}: loading the model mapped {', '.join(outside)}, outside "
                             f"the model roots ({', '.join(config.model_roots)}): a file beside the model (ONNX "
                             "external data) leads out of them")
        for fd in transient:
            os.close(fd)
    except Exception as exc:
        # Written whole, then renamed: the agent reads the reason as soon as the file exists.
        failed = pathlib.Path(config.signal_dir) / contract.FAILED
        failed.with_suffix(".tmp").write_text(f"{type(exc).__name__}: {exc}")
        failed.with_suffix(".tmp").replace(failed)
        raise
    worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
