from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from volga_agent.worker import protocol


def test_tensors_roundtrip_without_copies() -> None:
    tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([[1, 2]], dtype=np.int64),
               "c": np.zeros((0, 5), dtype=np.float16)}
    meta, parts = protocol.pack_tensors(tensors)
    payload = b"".join(bytes(p) for p in parts)
    back = protocol.unpack_tensors(meta, payload)
    for name, array in tensors.items():
        assert back[name].dtype == array.dtype and np.array_equal(back[name], array)


@pytest.mark.parametrize("bad, reason", [
    ({"name": "x", "dtype": "FP32", "shape": [2, 2], "nbytes": 15}, "needs 16"),
    ({"name": "x", "dtype": "FP128", "shape": [1], "nbytes": 16}, "unknown dtype"),
    ({"name": "x", "dtype": "FP32", "shape": "2x2", "nbytes": 16}, "not a list of sizes"),
    ({"name": "x", "dtype": "FP32"}, "lacks name/dtype/shape/nbytes"),
    ({"name": "x", "dtype": "FP32", "shape": [8], "nbytes": 32}, "needs 32"),  # payload too short
])
def test_inconsistent_tensor_metadata(bad: dict, reason: str) -> None:
    with pytest.raises(protocol.WorkerError, match=reason) as err:
        protocol.unpack_tensors([bad], b"\0" * 16)
    assert err.value.code == "INVALID_ARGUMENT"


def test_unsupported_dtype_rejected() -> None:
    with pytest.raises(protocol.WorkerError, match="not supported"):
        protocol.pack_tensors({"s": np.array(["a"])})


def test_frames_over_a_socket_pair() -> None:
    left, right = socket.socketpair(socket.AF_UNIX)
    payload = [memoryview(np.arange(1000, dtype=np.float64)).cast("B")]
    thread = threading.Thread(target=protocol.send_frame, args=(left, {"op": "x", "n": 1}, payload))
    thread.start()
    frame = protocol.recv_frame(right)
    thread.join()
    assert frame.header == {"op": "x", "n": 1}
    assert np.array_equal(np.frombuffer(frame.payload, dtype=np.float64), np.arange(1000))
    left.close()
    with pytest.raises(protocol.ProtocolError, match="closed"):
        protocol.recv_frame(right)


def test_oversized_or_garbled_frames() -> None:
    left, right = socket.socketpair(socket.AF_UNIX)
    left.sendall(protocol.PREFIX.pack(protocol.MAX_HEADER + 1, 0))
    with pytest.raises(protocol.ProtocolError, match="too large"):
        protocol.recv_frame(right)
    left.sendall(protocol.PREFIX.pack(3, 0) + b"{{{")
    with pytest.raises(protocol.ProtocolError, match="not JSON"):
        protocol.recv_frame(right)



def test_the_gateway_face_shares_the_layout_and_the_limits() -> None:
    """Frames the gateway's connection sends read back on a blocking socket and the other way round; a frame over
    the limits, a header that is not a JSON object or a stream that ends mid-frame ends that connection."""
    import asyncio

    from volga_agent.gateway import workers

    async def connected() -> tuple[workers.Connection, socket.socket]:
        mine, theirs = socket.socketpair(socket.AF_UNIX)
        _, conn = await asyncio.get_running_loop().create_unix_connection(workers.Connection, sock=mine)
        return conn, theirs

    async def scenario() -> None:
        conn, theirs = await connected()
        payload = [memoryview(np.arange(100, dtype=np.int32)).cast("B")]

        def answer() -> None:
            frame = protocol.recv_frame(theirs)
            assert frame.header == {"op": "y"} and bytes(frame.payload) == bytes(payload[0])
            protocol.send_frame(theirs, {"ok": True}, payload)

        (back, body), _ = await asyncio.gather(conn.call({"op": "y"}, payload), asyncio.to_thread(answer))
        assert back == {"ok": True} and np.array_equal(np.frombuffer(body, np.int32), np.arange(100))
        conn.close()
        for bad, match in ((protocol.PREFIX.pack(3, 0) + b"[1]", "not a JSON object"),
                           (protocol.PREFIX.pack(0, protocol.MAX_PAYLOAD + 1), "too large"),
                           (protocol.PREFIX.pack(10, 0) + b"{}", "closed after 14 bytes of a frame")):
            conn, theirs = await connected()

            def answer_badly(sock: socket.socket = theirs, reply: bytes = bad) -> None:
                protocol.recv_frame(sock)
                sock.sendall(reply)
                sock.close()

            replied = asyncio.ensure_future(asyncio.to_thread(answer_badly))
            with pytest.raises(workers.WorkerDied, match=match):
                await conn.call({"op": "y"})
            await replied
            assert not conn.usable()
            conn.close()

    asyncio.run(scenario())


def test_modelspec_dtypes_are_the_ones_workers_and_gateways_carry() -> None:
    """A type the ModelSpec accepts but a worker cannot carry would fail only at the first cold start."""
    from volga_agent.gateway import oip
    from volga_core import api

    assert {t.value for t in api.DType} == set(protocol.NP_DTYPES) == set(oip.NUMPY_DTYPES)
