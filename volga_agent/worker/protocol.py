"""Frames between the agent (or a gateway) and a worker over an AF_UNIX stream socket.

A frame is a fixed 12-byte prefix (header length u32, payload length u64, little-endian), a JSON header
and a raw payload. Tensors travel in the payload, back to back, described by the header's `tensors` list
(name, dtype, shape, nbytes) in order, so no tensor is ever encoded as text.

One codec, two faces sharing the prefix layout and the size limits: `send_frame`/`recv_frame` on a blocking
socket (the worker, the agent's `WorkerClient`), and the parts a gateway's asyncio connection parses frames with
as they arrive (`encode_head`, `frame_sizes`, `decode_head`; `gateway.workers.Connection`). A frame over the
limits, a header that is not a JSON object or a stream that ends mid-frame is a `ProtocolError` on either face.

This module is imported by the worker, the process that gets frozen: it uses the standard library and
numpy only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import socket
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

PREFIX = struct.Struct("<IQ")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 34
_IOV_MAX = 1024  # the most buffers one sendmsg takes (Linux's UIO_MAXIOV)

# Open Inference Protocol dtype names <-> numpy: the tensor types Volga carries, end to end (the ModelSpec's
# api.DType names the same set; the gateway reads them little-endian off the wire).
NP_DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
DTYPE_NAMES = {v: k for k, v in NP_DTYPES.items()}
# One encoder for every header: json.dumps with any option builds a new encoder on each call.
_HEADER_ENCODER = json.JSONEncoder(separators=(",", ":"))


class ProtocolError(Exception):
    """The peer sent something that is not a frame, or went away mid-frame."""


class WorkerError(Exception):
    """The worker answered with an error. `code` is a gRPC status name such as INVALID_ARGUMENT."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_reply(cls, header: dict[str, Any]) -> WorkerError:
        kind = NotRun if header.get("unrun") else cls
        return kind(str(header.get("code", "INTERNAL")), str(header.get("message", "")))

    def reply(self) -> dict[str, Any]:
        return {"ok": False, "code": self.code, "message": self.message}


class NotRun(WorkerError):
    """The worker did not run the request: it sleeps in a lower tier (WARM, SUSPENDED) or is pausing for a
    checkpoint. Nothing happened, so the request can be sent again once the instance is woken."""

    def __init__(self, code: str = "UNAVAILABLE", message: str = "") -> None:
        super().__init__(code, message)

    def reply(self) -> dict[str, Any]:
        return {**super().reply(), "unrun": True}


# The last frame on every connection a worker closes for a checkpoint: whatever request the peer had sent on
# it was not run (the worker discarded it unread), so the peer may send it again once the model is awake.
GOODBYE = {**NotRun(message="the worker paused for a checkpoint before running this request").reply(),
           "goodbye": True}


@dataclasses.dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    payload: bytes | memoryview = b""


def encode_head(header: dict[str, Any], payload: Sequence[bytes | memoryview] = ()) -> bytes:
    """The prefix and the header of a frame; its payload parts follow as they are."""
    head = _HEADER_ENCODER.encode(header).encode()
    total = sum(memoryview(p).nbytes for p in payload) if payload else 0
    return PREFIX.pack(len(head), total) + head


def frame_sizes(buffer: bytes | bytearray | memoryview) -> tuple[int, int]:
    """Header and payload lengths from the prefix at the start of `buffer`, within the limits."""
    head_len, payload_len = PREFIX.unpack_from(buffer)
    if head_len > MAX_HEADER or payload_len > MAX_PAYLOAD:
        raise ProtocolError(f"frame too large: header {head_len} bytes, payload {payload_len} bytes")
    return int(head_len), int(payload_len)


def decode_head(head: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A frame's header (the JSON between the prefix and the payload) as a dict."""
    try:
        header = json.loads(bytes(head))
    except ValueError as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    return header


# -- blocking sockets ------------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ProtocolError(f"connection closed after {got} of {size} bytes")
        got += n
    return buf


def send_frame(sock: socket.socket, header: dict[str, Any], payload: Sequence[bytes | memoryview] = ()) -> None:
    send_parts(sock, [encode_head(header, payload), *payload])


def send_parts(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Send the parts back to back, with one sendmsg (one system call) for as many of them as the socket takes."""
    if len(parts) == 1:
        sock.sendall(parts[0])
        return
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if views and sent:
            views[0] = views[0][sent:]


def say_goodbye(sock: socket.socket) -> None:
    """Hand back a connection whose peer may still be sending: nothing it sent is run, and it is told so.

    Shutting the read side first makes the peer's further writes fail at once (EPIPE); what it wrote before
    is read and discarded, so the close that follows leaves nothing unread and the peer sees GOODBYE and an
    orderly end of stream instead of a connection reset.
    """
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while sock.recv(1 << 16):
                pass
        sock.settimeout(1.0)
        send_frame(sock, GOODBYE)


def recv_frame(sock: socket.socket) -> Frame:
    head, payload = recv_raw(sock)
    return Frame(decode_head(head), payload)


def recv_raw(sock: socket.socket) -> tuple[bytes, memoryview]:
    """One frame's header bytes (undecoded) and payload: the prefix, then the rest in one read."""
    head_len, payload_len = frame_sizes(_recv_exact(sock, PREFIX.size))
    rest = memoryview(_recv_exact(sock, head_len + payload_len))
    return bytes(rest[:head_len]), rest[head_len:]


# -- tensors ---------------------------------------------------------------------------------------------


def contiguous(array: np.ndarray) -> np.ndarray:
    """C-contiguous, keeping the shape: np.ascontiguousarray turns a rank-0 (scalar) array into shape (1,)."""
    array = np.asarray(array)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _describe(name: str, array: np.ndarray) -> dict[str, Any]:
    """A tensor's descriptor in a frame's header (its place, `offset`, added where it goes into a segment)."""
    dtype = DTYPE_NAMES.get(array.dtype)
    if dtype is None:
        raise WorkerError("INVALID_ARGUMENT", f"tensor {name!r}: dtype {array.dtype} is not supported")
    return {"name": name, "dtype": dtype, "shape": list(array.shape), "nbytes": array.nbytes}


def pack_tensors(tensors: dict[str, np.ndarray]) -> tuple[list[dict[str, Any]], list[memoryview]]:
    meta, parts = [], []
    for name, array in tensors.items():
        array = contiguous(array)
        meta.append(_describe(name, array))
        flat: Any = array.reshape(-1)
        parts.append(memoryview(flat).cast("B") if array.size else memoryview(b""))
    return meta, parts


def _tensor(item: Any, view: memoryview, offset: int) -> tuple[str, np.ndarray]:
    """One described tensor: a view of `view` from `offset` on. WorkerError(INVALID_ARGUMENT) when inconsistent."""
    try:
        name, dtype_name, shape, nbytes = item["name"], item["dtype"], item["shape"], int(item["nbytes"])
    except (KeyError, TypeError, ValueError):
        raise WorkerError("INVALID_ARGUMENT", f"tensor descriptor {item!r} lacks name/dtype/shape/nbytes") from None
    dtype = NP_DTYPES.get(dtype_name)
    if dtype is None:
        raise WorkerError("INVALID_ARGUMENT", f"tensor {name!r}: unknown dtype {dtype_name!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WorkerError("INVALID_ARGUMENT", f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    expected = math.prod(shape) * dtype.itemsize
    if expected != nbytes or offset + nbytes > view.nbytes:
        raise WorkerError("INVALID_ARGUMENT",
                          f"tensor {name!r}: {nbytes} bytes given, shape {shape} of {dtype_name} needs {expected}")
    return name, np.frombuffer(view, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).reshape(shape)


def unpack_tensors(meta: list[dict[str, Any]], payload: bytes | memoryview) -> dict[str, np.ndarray]:
    """Views into the payload, no copies. Raises WorkerError(INVALID_ARGUMENT) on inconsistent metadata."""
    out: dict[str, np.ndarray] = {}
    offset = 0
    view = memoryview(payload)
    for item in meta:
        name, array = _tensor(item, view, offset)
        out[name] = array
        offset += array.nbytes
    return out


def unpack_shm_tensors(meta: list[dict[str, Any]], segment: Any) -> dict[str, np.ndarray]:
    """Views into a shared-memory segment (zero-copy); each descriptor carries its `offset`."""
    out: dict[str, np.ndarray] = {}
    view = memoryview(segment)
    size = view.nbytes
    for item in meta:
        try:
            offset = int(item["offset"])
        except (KeyError, TypeError, ValueError):
            raise WorkerError("INVALID_ARGUMENT", f"tensor descriptor {item!r} lacks an offset") from None
        nbytes = int(item.get("nbytes", -1))
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise WorkerError("INVALID_ARGUMENT", f"tensor {item.get('name')!r}: bytes {offset}..{offset + nbytes} "
                              f"are outside the {size}-byte segment")
        name, array = _tensor(item, view, offset)
        out[name] = array
    return out


def write_shm_tensors(tensors: dict[str, np.ndarray], segment: Any, offset: int) -> list[dict[str, Any]] | None:
    """Copy tensors into the segment from `offset` on; None when they do not fit (send them inline)."""
    meta, parts = pack_tensors(tensors)
    if not _place(meta, len(segment), offset):
        return None
    view = memoryview(segment)
    for item, part in zip(meta, parts, strict=True):
        view[item["offset"]:item["offset"] + item["nbytes"]] = part
    return meta


def shm_layout(tensors: dict[str, np.ndarray], size: int, offset: int) -> list[dict[str, Any]] | None:
    """The descriptors `write_shm_tensors` would write for tensors of these names, dtypes and shapes (their values
    do not matter), without copying anything; None when they do not fit."""
    meta = [_describe(name, array) for name, array in tensors.items()]
    return meta if _place(meta, size, offset) else None


def _place(meta: list[dict[str, Any]], size: int, offset: int) -> bool:
    """Give each descriptor its `offset` in a segment of `size` bytes, from `offset` on, 64-byte aligned; False
    (leaving them unplaced) when they do not fit."""
    aligned = [-(-m["nbytes"] // 64) * 64 for m in meta]
    if offset < 0 or offset + sum(aligned) > size:
        return False
    for item, step in zip(meta, aligned, strict=True):
        item["offset"] = offset
        offset += step
    return True


class WorkerClient:
    """A blocking connection to one worker. Not thread-safe: one request at a time per client."""

    def __init__(self, path: str, timeout: float | None = 30.0) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def call(self, op: str, payload: Sequence[bytes | memoryview] = (), **fields: Any) -> Frame:
        send_frame(self.sock, {"op": op, **fields}, payload)
        reply = recv_frame(self.sock)
        if not reply.header.get("ok", False):
            raise WorkerError.from_reply(reply.header)
        return reply

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        meta, parts = pack_tensors(inputs)
        reply = self.call("infer", parts, tensors=meta)
        return unpack_tensors(reply.header["tensors"], reply.payload)
