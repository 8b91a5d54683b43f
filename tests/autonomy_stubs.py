"""Test doubles for the autonomy loop's tests: a gateway that records what the loop asks of it, a probe the loop
never reads (for a loop stepped window by window), windows for such a loop, and a decider fed windows by hand."""

from __future__ import annotations

import threading
from typing import Any

from volga_agent.autonomy import decider, window
from volga_agent.node.settings import Settings

STEP = 0.1  # seconds per window


class RecordingGateway:
    """What the loop asks of a gateway, recorded; the load it reports is scripted, one entry per sample."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.script: list[dict[str, window.ModelLoad]] = []
        self.drains = 0
        self.lock = threading.Lock()

    def set_batch_cap(self, model: str, cap: int | None) -> None:
        self.calls.append(("set_batch_cap", model, cap))

    def shed(self, model: str, retry_after_ms: int) -> None:
        self.calls.append(("shed", model, retry_after_ms))

    def unshed(self, model: str) -> None:
        self.calls.append(("unshed", model))

    def drain_load(self) -> dict[str, window.ModelLoad]:
        with self.lock:
            self.drains += 1
            return self.script.pop(0) if self.script else {}


class NoProbe:
    """The probe of a loop driven window by window (`Loop.step`): never read."""

    def sample(self, now: float) -> window.NodeSample:
        raise AssertionError("not sampled")

    def close(self) -> None:
        pass


class Windows:
    """Windows of STEP seconds one after another, each given to `autonomy.step` (a stepped `loop.Loop`) with the
    node's memory as the call says and its CPU at `cpu` percent."""

    def __init__(self, autonomy: Any, cpu: float) -> None:
        self.autonomy, self.cpu, self.t = autonomy, cpu, 0.0

    def __call__(self, memory: float, **loads: window.ModelWindow) -> decider.Decision:
        self.t += STEP
        decision: decider.Decision = self.autonomy.step(
            window.Window(self.t - STEP, self.t, memory, self.cpu, False, loads))
        return decision


class Run:
    """Feeds windows of STEP seconds to one decider."""

    def __init__(self, views: list[decider.ModelView], **settings: Any) -> None:
        self.decider = decider.Decider(Settings(**settings))
        self.views = {v.model: v for v in views}
        self.t = 0.0

    def window(self, memory: float = 50.0, util: float = 0.0, **models: window.ModelWindow) -> decider.Decision:
        built = window.Window(self.t, self.t + STEP, memory, util, False, models)
        self.t += STEP
        return self.decider.decide(built, self.views, explain=True)

    def windows(self, n: int, **kwargs: Any) -> list[decider.Decision]:
        return [self.window(**kwargs) for _ in range(n)]
