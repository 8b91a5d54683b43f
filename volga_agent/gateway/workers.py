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
import contextlib
import mmap
import os
import pathlib
import tempfile
import time
from collections.abc import Callable
from typing import Any

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


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.segment: mmap.mmap | None = None

    @classmethod
    async def open(cls, path: str, shm_bytes: int) -> Connection:
        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=2**20)
        except OSError as exc:
            raise WorkerGone(f"cannot connect to {path}: {exc.strerror or exc}") from exc
        conn = cls(reader, writer)
        if shm_bytes > 0:
            try:
                await conn._attach(shm_bytes)
            except WorkerDied as exc:  # e.g. connected while the worker paused for a dump: no request sent yet
                conn.close()
                raise WorkerGone(f"{path}: closed while attaching shared memory: {exc}") from exc
        return conn

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
        return not self.reader.at_eof() and not self.writer.is_closing()

    async def call(self, header: dict[str, Any],
                   payload: list[memoryview] | None = None) -> tuple[dict[str, Any], bytes | memoryview]:
        try:
            await protocol.write_frame(self.writer, header, payload or ())
        except OSError as exc:
            raise WorkerGone(f"worker connection lost: {exc}") from exc
        try:
            frame = await protocol.read_frame(self.reader)
        except (OSError, protocol.ProtocolError) as exc:
            raise WorkerDied(f"worker connection lost mid-request: {exc}") from exc
        reply, body = frame.header, frame.payload
        if reply.get("unrun"):
            if reply.get("goodbye"):
                self.writer.close()
            raise WorkerGone(str(reply.get("message", "the worker did not run the request")))
        return reply, body

    def close(self) -> None:
        self.writer.close()
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

    async def infer(self, socket_path: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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
        segment = conn.segment
        if segment is not None:
            # Inputs in the first half of the segment, the worker's outputs in the second.
            half = len(segment) // 2
            start = time.perf_counter()
            with memoryview(segment) as whole, whole[:half] as first_half:
                meta = protocol.write_shm_tensors(inputs, first_half, 0)
            spent = time.perf_counter() - start
            if meta is not None:
                reply, body = await conn.call({"op": "infer", "tensors": meta, "shm": True, "out_offset": half})
                if reply.get("ok") and reply.get("shm"):
                    start = time.perf_counter()
                    outputs = {k: v.copy() for k, v in protocol.unpack_shm_tensors(reply["tensors"], segment).items()}
                    self.on_zero_copy((spent + time.perf_counter() - start) * 1e3)
                    return outputs
                return self._unpack(reply, body)
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
