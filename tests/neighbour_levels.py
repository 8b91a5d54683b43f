"""Levels for the neighbours' tests: a level source that says what it is told, a level built by hand, and a
coroutine run on a loop of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from volga_agent import neighbours


def run(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run on a loop of its own, leaving the thread's event loop as it was (asyncio.run would unset it, and tests
    after this one build gRPC channels outside a loop)."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(coroutine)
    finally:
        loop.close()


class Fixed:
    """A level source that says what it is told."""

    def __init__(self, level: neighbours.Level) -> None:
        self.current = level

    def state(self) -> str:
        return self.current.state

    def level(self) -> neighbours.Level:
        return self.current


def level(node: str, load: float = 0.0, state: str = "ACCEPT", memory: float = 10.0, sequence: int = 1,
          **models: str) -> neighbours.Level:
    """models: model id -> 'hot', 'cold' or 'shed'."""
    return neighbours.Level(node, state, memory, load,
                            tuple(neighbours.ModelLevel(m, how == "hot", how == "shed") for m, how in models.items()),
                            sequence, f"{node}.gw:8001")
