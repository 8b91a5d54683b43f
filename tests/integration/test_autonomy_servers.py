"""The autonomy loop's decisions applied to real model servers (`framework: server`: the FastAPI app of
volga_bench/servers/stream_app.py under uvicorn) in a real pool, frozen and restored by real CRIU: a Preload wakes a
FROZEN server whose arrivals accelerate, a Demote freezes it again once it is idle beside a busy, less tolerant
server, and a server that yields the CPU has every thread of its tree lowered (and a wake from an image taken while it
yielded sets them back). The loop is stepped window by window (`Loop.step`), so the decisions do not depend on
timing; the decisions on stubbed server moves are in tests/unit/test_autonomy_server_steps.py."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib
import sys
from collections.abc import Iterator

import pytest
from autonomy_stubs import NoProbe, RecordingGateway, Windows
from procs import wait_for

from volga_agent.autonomy import decider, loop, window
from volga_agent.host import priority, process, throttle
from volga_agent.node import pool
from volga_agent.node.settings import Settings
from volga_agent.snapshot import criu
from volga_core import api, planner

if not all(importlib.util.find_spec(name) for name in ("fastapi", "uvicorn")):
    pytest.skip("FastAPI and uvicorn come with the peers extra (make setup)", allow_module_level=True)

Tier = api.Tier
ROOT = pathlib.Path(__file__).resolve().parents[2]


def server_spec(model_id: str, tolerance: float) -> api.ModelSpecSpec:
    """The stream app on a Unix socket (`--loop asyncio`: uvloop's io_uring cannot be dumped)."""
    return api.ModelSpecSpec.model_validate({
        "modelId": model_id, "framework": "server", "source": str(ROOT),
        "slo": {"interferenceTolerancePct": tolerance},
        "server": {"command": [sys.executable, "-m", "uvicorn", "volga_bench.servers.stream_app:app",
                               "--no-access-log", "--loop", "asyncio", "--uds", "{socket}"],
                   "listen": "unix", "readiness": {"path": "/health"}}})


@pytest.fixture
def servers(rundir: pathlib.Path, criu_engine: criu.CriuEngine) -> Iterator[pool.Pool]:
    """`strict` (tolerance 10 %) HOT, `loose` (200 %) FROZEN, on a node whose autonomy changes state after one
    window and calls a model idle after one window without requests."""
    settings = Settings(autonomy_hysteresis_windows=1, autonomy_idle_windows=1)
    p = pool.Pool("n1", rundir / "work", criu_engine.root, settings)
    p.servers.commands_allowed = True
    specs = {"strict": server_spec("strict", 10), "loose": server_spec("loose", 200)}
    p.apply([planner.Desired("strict-0", "strict", "strict", "n1", Tier.HOT),
             planner.Desired("loose-0", "loose", "loose", "n1", Tier.FROZEN)], specs)
    p.wait_converged(120)
    tiers = {i.name: i.tier for i in p.instances()}
    if p.servers.failed or any(s.reason for s in p.servers.slots.values()):
        pytest.fail(f"the servers did not start: {p.servers.failed} "
                    f"{ {n: s.reason for n, s in p.servers.slots.items()} }")
    assert tiers == {"strict-0": Tier.HOT, "loose-0": Tier.FROZEN}
    yield p
    p.close()


def test_the_loop_wakes_a_frozen_server_and_freezes_it_again_when_idle(servers: pool.Pool,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    loose = servers.servers.slots["loose-0"].inst
    autonomy = loop.Loop(servers, RecordingGateway(), probe=NoProbe())
    step = Windows(autonomy, cpu=10.0)

    try:
        # Memory low (PRELOAD), `loose`'s arrivals rising faster and faster: the loop wakes it (a CRIU restore).
        for n in (1, 1, 1, 2, 4, 8):
            step(30.0, loose=window.ModelWindow(n, 0, 0, 0, None))
        assert any(decider.Preload("loose") in d.actions for d in autonomy.decisions)
        # HOT comes within the wake, the wake's activation is given back after it: no activation is left held
        slot = servers.servers.slots["loose-0"]
        wait_for("the loop to wake `loose` and give its activation back",
                 lambda: loose.tier is Tier.HOT and loose.in_flight == 0 and slot.leases == [], timeout=120, every=0.05)
        woke = loose.transitions[-1]
        assert (woke.source, woke.target, woke.fallback) == (Tier.FROZEN, Tier.HOT, False)
        answer = loose.call("POST", "/v1/generate", json.dumps({"prompt": "volga"}).encode())
        assert answer.status == 200
        # Memory past the optimize watermark, `strict` busy, `loose` idle: the loop freezes `loose` (a CRIU dump).
        for _ in range(3):
            step(80.0, strict=window.ModelWindow(5, 5, 0, 0, 1.0))
        assert any(decider.Demote("loose", Tier.FROZEN) in d.actions for d in autonomy.decisions)
        wait_for("the loop to freeze `loose`", lambda: loose.tier is Tier.FROZEN, timeout=120, every=0.05)
    finally:
        autonomy.stop()
    assert loose.pid is None and loose.image is not None
    assert servers.servers.slots["strict-0"].inst.tier is Tier.HOT  # the least tolerant model stays as it was
    assert servers.activations == 1
    assert not [r.getMessage() for r in caplog.records if r.name == loop.__name__]  # no failed decision
    # What the loop froze, a request wakes again.
    assert servers.activate("loose").woke_from is Tier.FROZEN
    servers.release("loose-0")


def test_a_yielding_server_lowers_its_whole_tree_and_a_wake_from_its_image_gives_it_back(servers: pool.Pool) -> None:
    strict = servers.servers.slots["strict-0"].inst
    actuator = loop.PoolActuator(servers)
    normal = priority.normal()

    def nices() -> set[int]:
        assert strict.pid is not None
        return {n for pid in process.tree(strict.pid) for n in priority.nice_of(pid)}

    try:
        assert nices() == {normal}
        own_group = priority.group_nice_of(os.getpid())
        loop.apply(decider.LowerPriority("strict", 19), actuator)
        assert nices() == {19}
        # The server's tree is a session of its own (nsinit): its scheduling group is lowered, this process's is not.
        assert priority.group_nice_of(os.getpid()) == own_group
        loop.apply(decider.RestorePriority("strict"), actuator)
        assert nices() == {normal}
        # Frozen while it yields: its image keeps each thread's nice, and the wake from it sets them back to normal.
        loop.apply(decider.LowerPriority("strict", 19), actuator)
        assert nices() == {19}
        servers.move_to("strict-0", Tier.FROZEN)
        assert strict.pid is None and strict.image is not None
        actuator.refresh()  # the lowered processes are gone: forgotten
        servers.move_to("strict-0", Tier.HOT)
        assert strict.transitions[-1].source is Tier.FROZEN and not strict.transitions[-1].fallback
        assert nices() == {normal}
        actuator.refresh()  # still yielding: the woken tree is lowered again at the next window
        assert nices() == {19}
    finally:
        actuator.close()
    assert nices() == {normal}  # the loop's end gives every lowered process its priority back


def test_a_throttled_servers_tree_is_stopped_and_never_moved_or_dumped_stopped(servers: pool.Pool) -> None:
    """Throttled, a HOT server's processes (its process group: all of its tree but the namespace's init, tini, which
    only waits) are stopped for their share of every period; a freeze waits for them to be continued and no stop
    comes while it runs, so the image restores a running tree, which the cycle stops again; unthrottled, the tree
    runs and stays running."""
    strict = servers.servers.slots["strict-0"].inst
    actuator = loop.PoolActuator(servers)
    actuator.cycle = throttle.DutyCycle(0.05)  # 50 ms periods: stops a test sees quickly

    def stopped_once() -> bool:
        return strict.pid is not None and all(throttle.stopped(pid) for pid in process.tree(strict.pid)[1:])

    try:
        loop.apply(decider.Throttle("strict", 0.8), actuator)
        wait_for("the throttled tree stopped", stopped_once, timeout=30, every=0.002)
        stops = actuator.cycle.stops
        servers.move_to("strict-0", Tier.FROZEN)
        assert strict.pid is None and strict.image is not None
        servers.move_to("strict-0", Tier.HOT)
        woke = strict.transitions[-1]
        assert (woke.source, woke.fallback) == (Tier.FROZEN, False), woke.detail
        actuator.refresh()
        wait_for("the woken tree stopped again", stopped_once, timeout=30, every=0.002)
        assert actuator.cycle.stops > stops
        loop.apply(decider.Unthrottle("strict"), actuator)
        assert strict.pid is not None and not any(throttle.stopped(pid) for pid in process.tree(strict.pid))
        with strict.serving():
            assert strict.call("GET", "/health").status == 200
    finally:
        actuator.close()
