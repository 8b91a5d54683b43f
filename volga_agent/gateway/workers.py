"""Asynchronous connections from the gateway to co-located workers, with tensors in shared memory.

Each connection owns a shared-memory segment (a file in /dev/shm that both sides map). The worker names it
(`shm_token`: a random name for that connection alone), the gateway creates it, the worker maps it only if it
is that name, a regular file, and owned by the gateway's user (docs/security.md). The gateway writes
the request's tensors into it once, the worker reads them in place (no copy through the socket), writes
its outputs after them, and only a small JSON header crosses the socket. The segment file is unlinked as
soon as the worker has mapped it, so nothing is left behind if either side dies; the worker drops its
mapping when the connection closes, which it does before any checkpoint, so no image ever references it.

Tensors larger than the segment travel inline in the frame instead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import mmap
import os
import pathlib
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from volga_agent.worker import protocol

SHM_DIR = pathlib.Path("/dev/shm") if pathlib.Path("/dev/shm").is_dir() else pathlib.Path(tempfile.gettempdir())
SHM_PREFIX = "volga-shm-"  # the names workers give segments (worker/serve.py)


def share(fd: int, offer: dict[str, Any]) -> bool:
    """Let a worker of another user (it dropped to its own, docs/security.md) read and write a segment we own:
    through its group, which we must be root or a member of to give the file. Whether it can."""
    uid, gid = offer.get("uid"), offer.get("gid")
    if not isinstance(uid, int) or not isinstance(gid, int) or uid in (0, os.geteuid()):
        return True
    try:
        os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o660)
    except OSError:
        return False
    return True


class WorkerGone(ConnectionError):
    """The worker did not run the request (unreachable, or it said goodbye for a checkpoint): retry."""


class WorkerDied(ConnectionError):
    """The connection broke after the request was sent: the worker died with it, so this request fails."""


@dataclasses.dataclass(frozen=True)
class _Request:
    """How tensors of one set of names, dtypes and shapes travel in a connection's segment: the frame head that
    describes them and views of the segment to copy each into."""

    head: bytes
    views: tuple[tuple[str, np.ndarray], ...]


class Connection(asyncio.Protocol):
    """One connection to a worker, one request at a time: a frame out, the worker's reply back.

    Frames are parsed as the bytes arrive (no stream reader in between) and each reply resolves the one future its
    request waits on. What a request and a reply of the same layout looked like before (the frame head, the
    views of the segment) is kept, so that the same again is only copies.
    """

    LAYOUTS = 256  # per connection, of requests and of replies; past that they start again

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.segment: mmap.mmap | None = None
        self._buffer = bytearray()
        self._frames: collections.deque[tuple[bytes, bytes]] = collections.deque()  # replies nobody waits for yet
        self._waiter: asyncio.Future[tuple[bytes, bytes]] | None = None
        self._lost: Exception | None = None  # why the connection ended (read or written past it)
        self._writable: asyncio.Future[None] | None = None  # while the transport's buffer is full
        self._requests: dict[tuple[Any, ...], _Request | None] = {}
        self._replies: dict[bytes, tuple[tuple[str, np.ndarray], ...]] = {}

    @classmethod
    async def open(cls, path: str, shm_bytes: int) -> Connection:
        try:
            _, conn = await asyncio.get_running_loop().create_unix_connection(cls, path)
        except OSError as exc:
            raise WorkerGone(f"cannot connect to {path}: {exc.strerror or exc}") from exc
        if shm_bytes > 0:
            try:
                await conn._attach(shm_bytes)
            except WorkerDied as exc:  # e.g. connected while the worker paused for a dump: no request sent yet
                conn.close()
                raise WorkerGone(f"{path}: closed while attaching shared memory: {exc}") from exc
        return conn

    # -- asyncio.Protocol ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= protocol.PREFIX.size:
            try:
                head_len, payload_len = protocol.frame_sizes(buffer)
            except protocol.ProtocolError as exc:
                self._end(exc)
                return
            head_end = protocol.PREFIX.size + head_len
            end = head_end + payload_len
            if len(buffer) < end:
                return
            with memoryview(buffer) as view:  # one copy of each part, released before the buffer shrinks
                frame = bytes(view[protocol.PREFIX.size:head_end]), bytes(view[head_end:end]) if payload_len else b""
            del buffer[:end]
            waiter, self._waiter = self._waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_result(frame)
            else:
                self._frames.append(frame)

    def eof_received(self) -> bool:
        got = len(self._buffer)
        self._end(protocol.ProtocolError(f"connection closed after {got} bytes of a frame" if got
                                         else "connection closed"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc or protocol.ProtocolError("connection closed"))

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def _end(self, why: Exception) -> None:
        if self._lost is None:
            self._lost = why
        for future in (self._waiter, self._writable):
            if future is not None and not future.done():
                future.set_exception(self._lost)
                future.exception()  # retrieved: its caller may have given up already
        self._waiter = self._writable = None
        if self.transport is not None:
            self.transport.close()

    # -- frames -------------------------------------------------------------------------------------------------

    async def _attach(self, size: int) -> None:
        # The worker names the segment (a random name for this connection alone); we create it, it maps it.
        header, _ = await self.call({"op": "shm_token", "owner": os.getpid()})
        named = header.get("path")
        path = pathlib.Path(named) if header.get("ok") and isinstance(named, str) else None
        if path is None or path.parent != SHM_DIR or not path.name.startswith(SHM_PREFIX):
            return  # a worker that offers no segment here: tensors travel in the frames
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if not share(fd, header):
                path.unlink(missing_ok=True)
                return  # a worker of a group we cannot give the segment to: tensors travel in the frames
            os.ftruncate(fd, size)
            segment = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            header, _ = await self.call({"op": "attach_shm", "path": str(path), "size": size})
        except BaseException:
            segment.close()
            raise
        finally:
            path.unlink(missing_ok=True)
        if header.get("ok"):
            self.segment = segment
        else:
            segment.close()

    def usable(self) -> bool:
        """False once the worker closed its end (it does so before every checkpoint)."""
        return self._lost is None and self.transport is not None and not self.transport.is_closing()

    async def exchange(self, head: bytes, payload: Sequence[bytes | memoryview] = ()) -> tuple[bytes, bytes]:
        """Send a frame (`head`: its prefix and header, as `protocol.encode_head` makes them) and return the reply's
        header bytes and payload. WorkerGone when it could not be sent, WorkerDied when no reply came."""
        if not self.usable():
            raise WorkerGone(f"worker connection lost: {self._lost or 'closed'}")
        assert self.transport is not None
        if payload:
            self.transport.writelines([head, *payload])  # one writev where the socket takes it all
        else:
            self.transport.write(head)
        if self.transport.is_closing() and not self._frames:  # the write failed at once: the worker is gone
            raise WorkerGone(f"worker connection lost: {self._lost or 'closed while sending'}")
        if self._writable is not None:
            try:
                await self._writable
            except (OSError, protocol.ProtocolError) as exc:
                raise WorkerGone(f"worker connection lost: {exc}") from exc
        if self._frames:
            return self._frames.popleft()
        if self._lost is not None:
            raise self._died(self._lost)
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            return await self._waiter
        except (OSError, protocol.ProtocolError) as exc:
            raise self._died(exc) from exc

    @staticmethod
    def _died(exc: Exception) -> ConnectionError:
        """What a connection lost while a request was out means: a write that failed (EPIPE, the worker closed its
        end, as it does before a checkpoint) never reached it, so it may be sent again; else the worker had it."""
        if isinstance(exc, BrokenPipeError):
            return WorkerGone(f"worker connection lost: {exc}")
        return WorkerDied(f"worker connection lost mid-request: {exc}")

    async def call(self, header: dict[str, Any],
                   payload: list[memoryview] | None = None) -> tuple[dict[str, Any], bytes | memoryview]:
        head, body = await self.exchange(protocol.encode_head(header, payload or ()), payload or ())
        return self._reply(head), body

    def _reply(self, head: bytes) -> dict[str, Any]:
        """A reply's header; WorkerGone when the worker handed the request back unrun."""
        try:
            reply = protocol.decode_head(head)
        except protocol.ProtocolError as exc:
            self.close()
            raise WorkerDied(f"worker connection lost mid-request: {exc}") from exc
        if reply.get("unrun"):
            if reply.get("goodbye"):
                self.close()
            raise WorkerGone(str(reply.get("message", "the worker did not run the request")))
        return reply

    async def infer_shm(self, inputs: dict[str, np.ndarray], copied: Callable[[float], None] = lambda _: None
                        ) -> dict[str, np.ndarray] | None:
        """An inference with the tensors in the segment (inputs in its first half, the worker's outputs in the
        second): the outputs, copied out of it; None when this connection has no segment or the inputs do not fit.
        Outputs too large for the segment come inline; a refusal raises as `call` does. `copied` gets the
        milliseconds spent placing the inputs and reading the outputs."""
        segment = self.segment
        if segment is None:
            return None
        start = time.perf_counter()
        request_head = self._place(inputs, segment)
        if request_head is None:
            return None
        spent = time.perf_counter() - start
        head, body = await self.exchange(request_head)
        start = time.perf_counter()
        views = self._replies.get(head)
        if views is None:
            reply = self._reply(head)
            if not reply.get("ok"):
                raise protocol.WorkerError.from_reply(reply)
            if not reply.get("shm"):
                return protocol.unpack_tensors(reply["tensors"], body)
            views = tuple(protocol.unpack_shm_tensors(reply["tensors"], segment).items())
            if len(self._replies) >= self.LAYOUTS:
                self._replies.clear()
            self._replies[head] = views
        outputs = {name: view.copy() for name, view in views}
        copied((spent + time.perf_counter() - start) * 1e3)
        return outputs

    def _place(self, inputs: dict[str, np.ndarray], segment: mmap.mmap) -> bytes | None:
        """Copy `inputs` into the segment's first half and return the frame head that describes them (None: they
        do not fit). No view of the segment outlives this call: a request that fails in flight, its traceback kept
        by whoever handles it, must not keep the segment mapped after `close`."""
        key = tuple((name, array.dtype, array.shape) for name, array in inputs.items())
        request = self._requests[key] if key in self._requests else self._layout(key, inputs, segment)
        if request is None:
            return None
        for name, view in request.views:
            np.copyto(view, inputs[name], casting="no")
        return request.head

    def _layout(self, key: tuple[Any, ...], inputs: dict[str, np.ndarray], segment: mmap.mmap) -> _Request | None:
        """Where tensors like `inputs` go in the segment (None: they do not fit), remembered under `key`."""
        half = len(segment) // 2
        meta = protocol.shm_layout(inputs, half, 0)
        request = None
        if meta is not None:
            head = protocol.encode_head({"op": "infer", "tensors": meta, "shm": True, "out_offset": half})
            request = _Request(head, tuple(protocol.unpack_shm_tensors(meta, segment).items()))
        if len(self._requests) >= self.LAYOUTS:
            self._requests.clear()
        self._requests[key] = request
        return request

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self._requests.clear()  # their views first: a segment with views into it cannot be unmapped
        self._replies.clear()
        if self.segment is not None:
            with contextlib.suppress(BufferError):
                self.segment.close()
            self.segment = None


class WorkerClients:
    """Idle connections per worker socket; a request takes one, uses it alone, gives it back."""

    def __init__(self, shm_bytes: int = 16 * 2**20, per_worker: int = 4,
                 on_zero_copy: Callable[[float], None] = lambda _: None) -> None:
        self.shm_bytes = shm_bytes
        self.per_worker = per_worker
        self.on_zero_copy = on_zero_copy
        self._idle: dict[str, list[Connection]] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._busy: dict[str, int] = {}  # requests this gateway has at (or waiting for) each worker

    def least_busy(self, sockets: Sequence[str]) -> str:
        """Of the workers of one model's HOT instances, the one this gateway has the fewest requests at (the
        first of those tied): each answers one request at a time, so that is the one likely to answer soonest."""
        return min(sockets, key=lambda path: self._busy.get(path, 0))

    async def infer(self, socket_path: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._busy[socket_path] = self._busy.get(socket_path, 0) + 1
        try:
            return await self._infer_at(socket_path, inputs)
        finally:
            self._busy[socket_path] -= 1
            if not self._busy[socket_path]:
                del self._busy[socket_path]  # sockets of instances long gone do not pile up

    async def _infer_at(self, socket_path: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # A worker answers one request at a time: a few connections keep it busy, more only queue there.
        slots = self._slots.setdefault(socket_path, asyncio.Semaphore(self.per_worker))
        async with slots:
            idle = self._idle.setdefault(socket_path, [])
            while idle and not idle[-1].usable():
                idle.pop().close()
            if idle:
                try:
                    return await self._on(idle.pop(), idle, inputs)
                except WorkerGone:
                    # The worker closed its pooled connections since their last use (a checkpoint: it said
                    # goodbye, unread until now): drop them all and try once on a fresh connection, which
                    # reaches the worker if it is back, and fails at once if it is not.
                    self.forget(socket_path)
            return await self._on(await Connection.open(socket_path, self.shm_bytes), idle, inputs)

    async def _on(self, conn: Connection, idle: list[Connection], inputs: dict[str, np.ndarray]
                  ) -> dict[str, np.ndarray]:
        try:
            outputs = await self._infer(conn, inputs)
        except BaseException:
            conn.close()
            raise
        idle.append(conn)
        return outputs

    async def _infer(self, conn: Connection, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = await conn.infer_shm(inputs, self.on_zero_copy)
        if outputs is not None:
            return outputs
        meta, parts = protocol.pack_tensors(inputs)
        reply, body = await conn.call({"op": "infer", "tensors": meta}, parts)
        return self._unpack(reply, body)

    @staticmethod
    def _unpack(reply: dict[str, Any], body: bytes | memoryview) -> dict[str, np.ndarray]:
        if not reply.get("ok"):
            raise protocol.WorkerError.from_reply(reply)
        return protocol.unpack_tensors(reply["tensors"], body)

    def forget(self, socket_path: str) -> None:
        """Close the idle connections to a worker that went away. Requests still on connections to it keep
        its slots and give their connections back to the same list, where the next taker drops them."""
        idle = self._idle.get(socket_path, [])
        for conn in idle:
            conn.close()
        idle.clear()

    def close(self) -> None:
        for path in list(self._idle):
            self.forget(path)
        self._idle.clear()
        self._slots.clear()
