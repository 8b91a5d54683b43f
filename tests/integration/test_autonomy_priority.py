"""The autonomy loop's CPU yield on real workers: a violation of the strict model lowers the tolerant model's worker
(every thread, and its session's scheduling group) to the configured nice; a worker frozen (real CRIU) while
yielding comes back from its image at normal priority, and is lowered again only by the loop; a calm spell, and
the loop's stop, give the priority back."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import shared_workers
from autonomy_stubs import NoProbe, RecordingGateway

from volga_agent.autonomy import decider, loop, window
from volga_agent.host import priority
from volga_agent.node import pool
from volga_agent.node.settings import Settings
from volga_core import api

Tier = api.Tier


@pytest.fixture
def two_workers(rundir: pathlib.Path, criu_engine, default_spec: api.ModelSpecSpec) -> Iterator[pool.Pool]:
    settings = Settings(autonomy_yield_nice=19, autonomy_yield_calm_windows=3, autonomy_debug=True,
                        autonomy_preload_below_pct=0)
    p = shared_workers.strict_and_loose(rundir, criu_engine.root, default_spec, settings)
    yield p
    p.close()


def test_a_violation_makes_the_tolerant_worker_yield_and_a_restored_worker_comes_back_at_normal_priority(
        two_workers: pool.Pool, caplog: pytest.LogCaptureFixture) -> None:
    p = two_workers
    normal = priority.normal()
    autonomy = loop.Loop(p, RecordingGateway(), probe=NoProbe())
    caplog.set_level("INFO", logger=loop.__name__)
    t = 0.0

    def step(strict_p99: float | None) -> decider.Decision:
        nonlocal t
        t += 0.1
        loads = {"loose": window.ModelWindow(5, 5, 1, 0, 1.0)}
        if strict_p99 is not None:
            loads["strict"] = window.ModelWindow(5, 5, 0, 0, strict_p99)
        return autonomy.step(window.Window(t - 0.1, t, 50.0, 90.0, False, loads))

    strict, loose = shared_workers.pid_of(p, "strict"), shared_workers.pid_of(p, "loose")
    assert set(priority.nice_of(loose)) == {normal}
    try:
        first = step(5.0)  # 5 ms against 1 ms x 1.1: at once, before any state changes
        assert first.state is decider.State.ACCEPT
        assert first.actions == (decider.LowerPriority("loose", 19),)
        assert set(priority.nice_of(loose)) == {19} and len(priority.nice_of(loose)) > 1
        assert priority.idle_threads_of(loose) == len(priority.nice_of(loose))  # preempted by any waking thread
        assert priority.group_nice_of(loose) in (None, 19)
        assert set(priority.nice_of(strict)) == {normal}
        assert step(5.0).actions == ()  # yielding already

        # Frozen while yielding, then woken: the image holds nice 19 for every thread; the instance gives the
        # restored worker its normal priority before it serves.
        assert p.move_to("l-0", Tier.FROZEN) is not None
        assert p.activate("loose").woke_from is Tier.FROZEN
        restored = shared_workers.pid_of(p, "loose")
        assert restored != loose
        assert set(priority.nice_of(restored)) == {normal} and priority.idle_threads_of(restored) == 0
        assert priority.group_nice_of(restored) in (None, 0)
        # The loop still has it yield: its next window lowers the restored worker (the views changed).
        step(5.0)
        assert set(priority.nice_of(restored)) == {19}

        # Calm: the state is ACCEPT, and after three windows without a violation the priority comes back.
        calm = [step(1.0) for _ in range(3)]
        assert calm[-1].state is decider.State.ACCEPT
        assert [decider.RestorePriority("loose") in d.actions for d in calm] == [False, False, True]
        assert set(priority.nice_of(restored)) == {normal} and priority.idle_threads_of(restored) == 0
        assert priority.group_nice_of(restored) in (None, 0)

        step(5.0)
        assert set(priority.nice_of(restored)) == {19}
    finally:
        autonomy.stop()
    # Stopping the loop gives every lowered worker its priority back.
    assert set(priority.nice_of(restored)) == {normal} and priority.idle_threads_of(restored) == 0
    registry = p.metrics.registry
    assert registry.get_sample_value("volga_autonomy_decisions_total", {"action": "LowerPriority"}) == 2
    assert registry.get_sample_value("volga_autonomy_decisions_total", {"action": "RestorePriority"}) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert any("autonomy decision" in m and "LowerPriority(model='loose', nice=19)" in m for m in lines)
    assert any(f"loose yields the CPU: worker {loose} at nice 19" in m for m in lines)
