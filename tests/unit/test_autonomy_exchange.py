"""The exchange between the sidecar gateway and the agent's loop, without either process: the agent's side sums the
load pushed to it and gives the directives in full; the gateway's side changes only what differs."""

from __future__ import annotations

import asyncio
from typing import Any

from volga_agent import errors
from volga_agent.autonomy import exchange, window
from volga_agent.gateway import links


class RecordingPlane:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.load: dict[str, window.ModelLoad] = {}

    def drain_load(self) -> dict[str, window.ModelLoad]:
        load, self.load = self.load, {}
        return load

    def set_batch_cap(self, model: str, cap: int | None) -> None:
        if model == "unknown":
            raise errors.UnknownModel(model)
        self.calls.append(("cap", model, cap))

    def shed(self, model: str, retry_after_ms: int) -> None:
        self.calls.append(("shed", model, retry_after_ms))

    def unshed(self, model: str) -> None:
        self.calls.append(("unshed", model))


def test_the_exchange_sums_pushed_load_and_gives_the_directives_in_full() -> None:
    ex = exchange.Exchange()
    ex.set_batch_cap("a", 8)
    ex.shed("b", 500)
    first = ex.push({"a": window.ModelLoad(3, 2, 4, (1.0, 2.0), 0)})
    ex.push({"a": window.ModelLoad(1, 1, 2, (5.0,), 0), "b": window.ModelLoad(2, 0, 0, (), 2)})
    assert (dict(first.batch_caps), dict(first.shed_retry_after_ms)) == ({"a": 8}, {"b": 500})
    assert ex.drain_load() == {"a": window.ModelLoad(4, 3, 2, (1.0, 2.0, 5.0), 0),
                               "b": window.ModelLoad(2, 0, 0, (), 2)}
    assert ex.drain_load() == {}
    ex.set_batch_cap("a", None)
    ex.unshed("b")
    assert (dict(ex.directives().batch_caps), dict(ex.directives().shed_retry_after_ms)) == ({}, {})


def test_the_exchanger_changes_only_what_differs_and_skips_models_it_does_not_know() -> None:
    plane = RecordingPlane()

    async def exchange() -> None:
        # The link's grpc.aio channel belongs to a loop (never connected here): one of its own, closed after.
        link = links.GrpcAgentLink("127.0.0.1:1")
        try:
            ex = links.Exchanger(plane, link)
            ex.apply(links.Directives(True, {"a": 8, "unknown": 2}, {"b": 500}, 50))
            ex.apply(links.Directives(True, {"a": 8}, {"b": 500}, 50))
            ex.apply(links.Directives(True, {"a": 4}, {}, 50))
            ex.apply(links.Directives(True, {}, {}, 50))
        finally:
            await link.channel.close()

    asyncio.run(exchange())
    assert plane.calls == [("cap", "a", 8), ("shed", "b", 500), ("cap", "a", 4), ("unshed", "b"), ("cap", "a", None)]
