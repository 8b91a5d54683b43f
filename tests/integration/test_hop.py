"""The gateway-to-worker hop with real workers: what each connection keeps of the layouts it carried (frame heads,
views of its shared-memory segment) serves every request of that layout with its own values, and goes with the
connection, so neither side keeps the segment mapped (a checkpoint must find no mapping of it)."""

from __future__ import annotations

import asyncio
import pathlib
import time

import numpy as np
import pytest

from volga_agent.gateway import workers
from volga_agent.node import instance
from volga_agent.worker import contract

SIZE = 1 << 20


def segments_mapped(pid: int | str) -> list[str]:
    return [line for line in pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines() if workers.SHM_PREFIX in line]


def test_repeated_layouts_carry_each_requests_values_and_go_with_the_connection(hot: instance.Instance) -> None:
    assert hot.pid is not None
    # Batches 1, 3 and 2, each layout several times with new values: the layouts remembered after the first of
    # each must carry the values of the request at hand, in and out.
    requests = [contract.sample_inputs(hot.config.inputs, batch=b, seed=i) for i, b in enumerate([1, 3, 1, 3, 2, 1, 2])]
    expected = [hot.infer(x)["probability"] for x in requests]  # inline frames, on the agent's own connection
    assert not np.array_equal(expected[0], expected[2])

    async def scenario() -> None:
        earlier = set(segments_mapped("self"))  # other tests' gateways in this process may still hold theirs
        conn = await workers.Connection.open(hot.config.socket, SIZE)
        try:
            assert conn.segment is not None
            for x, want in zip(requests, expected, strict=True):
                got = await conn.infer_shm(x)
                assert got is not None and np.array_equal(got["probability"], want)
            mine = set(segments_mapped("self")) - earlier
            assert mine and segments_mapped(hot.pid or 0)
        finally:
            conn.close()
        # Closed: the gateway's views went first, so its mapping could go.
        assert not mine & set(segments_mapped("self"))

    asyncio.run(scenario())
    deadline = time.monotonic() + 10
    while segments_mapped(hot.pid) and time.monotonic() < deadline:  # the worker sees the close at its next poll
        time.sleep(0.01)
    assert not segments_mapped(hot.pid), segments_mapped(hot.pid)
    assert hot.client().call("ping").header["ok"]


def test_a_request_that_failed_in_flight_keeps_no_view_of_a_closed_connections_segment(
        hot: instance.Instance, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever handles a failed request may keep its exception, and with it the frames it went through: none of
    them may hold a view of the segment, or closing the connection could not unmap it."""
    x = contract.sample_inputs(hot.config.inputs, batch=2, seed=7)

    async def scenario() -> BaseException:
        earlier = set(segments_mapped("self"))
        conn = await workers.Connection.open(hot.config.socket, SIZE)
        mine = set(segments_mapped("self")) - earlier
        assert mine

        async def lost(head: bytes, payload: object = ()) -> tuple[bytes, bytes]:
            raise workers.WorkerDied("worker connection lost mid-request: test")

        monkeypatch.setattr(conn, "exchange", lost)
        try:
            await conn.infer_shm(x)
        except workers.WorkerDied as exc:
            kept = exc  # its traceback holds infer_shm's frame
        conn.close()
        assert not mine & set(segments_mapped("self"))
        return kept

    assert asyncio.run(scenario()).__traceback__ is not None
