"""The autonomy loop's decisions on model servers (`framework: server`), through the pool's seams: a server instance
whose moves record themselves instead of running a process and CRIU (the real ones are in
tests/integration/test_autonomy_servers.py). A Demote takes it down its ladder (`Pool.move_to` handing it to
`ServerPool.move_to`), a Preload wakes it and holds no activation (`Pool.wake`), the decider's views count it,
Shed and Unshed reach the gateway as a built-in model's do, and what does not apply to a server (batch caps,
throttling) is skipped."""

from __future__ import annotations

import logging
import pathlib
import time

import pytest
from autonomy_stubs import NoProbe, RecordingGateway
from procs import wait_for

from volga_agent.autonomy import decider, loop, window
from volga_agent.node import instance, pool, server, serverpool
from volga_agent.node.settings import Settings
from volga_core import api

Tier = api.Tier


class _Server(server.ServerInstance):
    """A server instance whose moves only record themselves (the ladder, `settle` and the leases are the real ones)."""

    refuse = False

    def _moved(self, target: Tier) -> None:
        self.transitions.append(instance.Transition(self.tier, target, 0.01, time.time()))
        self.tier = target

    def start(self) -> None:
        self.pid = 1 << 22  # no such process: nothing here signals it
        self._moved(Tier.HOT)

    def ensure_hot(self) -> None:
        if self.tier is not Tier.HOT:
            self.wake() if self.tier is Tier.FROZEN else self.start()

    def wake(self) -> None:
        self._moved(Tier.HOT)

    def freeze(self) -> None:
        self._leave_hot()  # Busy while a request runs, as the real one
        if self.refuse:
            raise server.FreezeRefused(f"{self.name}: CRIU cannot dump this server: io_uring")
        self._moved(Tier.FROZEN)


def server_pool(rundir: pathlib.Path, model: api.ModelSpecSpec, settings: Settings | None = None,
                tier: Tier = Tier.HOT, tolerance: float = 200.0) -> tuple[pool.Pool, _Server]:
    """A pool with a strict built-in model (`model`'s, HOT, no worker) and a tolerant model server `srv` at `tier`."""
    p = pool.Pool("n1", rundir, None, settings)
    slo = model.slo.model_copy(update={"interference_tolerance_pct": 10, "baseline_latency_ms": {"1": 1.0}})
    strict = model.model_copy(update={"model_id": "strict", "slo": slo})
    p.slots["strict"] = pool.Slot(instance.Instance("strict", strict, rundir / "strict", None, None, "cpu"),
                                  Tier.COLD)
    p.slots["strict"].inst.tier = Tier.HOT
    spec = api.ModelSpecSpec.model_validate({"modelId": "srv", "framework": "server", "source": "/srv",
                                             "slo": {"interferenceTolerancePct": tolerance},
                                             "server": {"command": ["app", "{port}"]}})
    inst = _Server(spec, rundir / "srv-0", None, "srv-0")  # type: ignore[arg-type]  # no CRIU: moves recorded
    if tier is not Tier.COLD:
        inst.start()
    if tier is Tier.FROZEN:
        inst.freeze()
    p.servers.slots["srv-0"] = serverpool.ServerSlot(inst, Tier.FROZEN)
    return p, inst


def test_move_to_hands_a_servers_name_to_the_server_pool(rundir: pathlib.Path, default_spec: api.ModelSpecSpec) -> None:
    p, inst = server_pool(rundir, default_spec)
    try:
        moved = p.move_to("srv-0", Tier.WARM)  # no driver here: WARM rests FROZEN, the next tier its ladder has
        assert moved is not None and (moved.source, moved.target) == (Tier.HOT, Tier.FROZEN)
        assert inst.tier is Tier.FROZEN
        assert p.move_to("srv-0", Tier.FROZEN) is None  # there already
        woken = p.move_to("srv-0", Tier.HOT)
        assert woken is not None and woken.source is Tier.FROZEN and inst.tier is Tier.HOT and inst.in_flight == 0
        with pytest.raises(Exception, match="no instance 'srv-9'"):
            p.move_to("srv-9", Tier.FROZEN)
    finally:
        p.close()


def test_a_server_answering_a_request_is_not_moved_down(rundir: pathlib.Path, default_spec: api.ModelSpecSpec) -> None:
    p, inst = server_pool(rundir, default_spec)
    try:
        p.activate("srv")  # a request's lease
        with pytest.raises(server.Busy):
            p.move_to("srv-0", Tier.FROZEN)
        with pytest.raises(server.Busy):
            p.move_to("srv-0", Tier.COLD)
        assert inst.tier is Tier.HOT
        p.release("srv-0")
        assert p.move_to("srv-0", Tier.COLD) is None and inst.tier is Tier.COLD
    finally:
        p.close()


def test_a_server_criu_cannot_dump_stays_hot(rundir: pathlib.Path, default_spec: api.ModelSpecSpec) -> None:
    p, inst = server_pool(rundir, default_spec)
    inst.refuse = True
    try:
        assert p.move_to("srv-0", Tier.FROZEN) is None
        slot = p.servers.slots["srv-0"]
        assert inst.tier is Tier.HOT and slot.refused and slot.reason.startswith("FreezeRefused")
        assert p.move_to("srv-0", Tier.FROZEN) is None  # not tried again
    finally:
        p.close()


def test_wake_brings_a_frozen_server_hot_and_holds_no_activation(rundir: pathlib.Path,
                                                                 default_spec: api.ModelSpecSpec) -> None:
    p, inst = server_pool(rundir, default_spec, tier=Tier.FROZEN)
    try:
        woken = p.wake("srv")
        assert woken.woke_from is Tier.FROZEN and woken.instance.name == "srv-0"
        assert inst.tier is Tier.HOT and inst.in_flight == 0 and p.servers.slots["srv-0"].leases == []
        assert p.activations == 1
    finally:
        p.close()


def test_the_views_hold_a_server_awake_while_it_is_hot(rundir: pathlib.Path, default_spec: api.ModelSpecSpec) -> None:
    p, inst = server_pool(rundir, default_spec, tier=Tier.FROZEN)
    try:
        views = loop.Views(p)
        assert views()["srv"].awake is False and views()["srv"].slo.interference_tolerance_pct == 200
        inst.wake()
        assert views()["srv"].awake is True and views()["srv"].gpu is False
    finally:
        p.close()


def test_the_loop_demotes_an_idle_tolerant_server(rundir: pathlib.Path, default_spec: api.ModelSpecSpec) -> None:
    settings = Settings(autonomy_hysteresis_windows=1, autonomy_idle_windows=1)
    p, inst = server_pool(rundir, default_spec, settings)
    autonomy = loop.Loop(p, RecordingGateway(), probe=NoProbe())
    try:
        for k in range(3):  # memory above the optimize watermark, the strict model busy, the server idle
            autonomy.step(window.Window(k * 0.1, (k + 1) * 0.1, 80.0, 10.0, False,
                                                   {"strict": window.ModelWindow(5, 5, 0, 0, 0.5)}))
        assert any(decider.Demote("srv", Tier.FROZEN) in d.actions for d in autonomy.decisions)
        wait_for("the server frozen", lambda: inst.tier is Tier.FROZEN, timeout=30, every=0.01)
    finally:
        autonomy.stop()
        p.close()
    assert p.servers.slots == {} and [t.target for t in inst.transitions] == [Tier.HOT, Tier.FROZEN]


def test_the_loop_preloads_a_server_whose_arrivals_accelerate(rundir: pathlib.Path,
                                                              default_spec: api.ModelSpecSpec) -> None:
    settings = Settings(autonomy_preload_below_pct=100, autonomy_optimize_above_pct=100,
                        autonomy_emergency_above_pct=100)
    p, inst = server_pool(rundir, default_spec, settings, tier=Tier.FROZEN)
    autonomy = loop.Loop(p, RecordingGateway(), probe=NoProbe())
    try:
        for k, n in enumerate((1, 1, 1, 1, 2, 4, 8, 16)):
            autonomy.step(window.Window(k * 0.1, (k + 1) * 0.1, 50.0, 10.0, False,
                                        {"srv": window.ModelWindow(n, n, 0, 0, 1.0)}))
        assert any(decider.Preload("srv") in d.actions for d in autonomy.decisions)
        wait_for("the server woken", lambda: inst.tier is Tier.HOT, timeout=30, every=0.01)
    finally:
        autonomy.stop()
    try:
        assert inst.in_flight == 0 and p.servers.slots["srv-0"].leases == []  # idle: back to its floor in time
    finally:
        p.close()


def test_the_loop_leaves_a_server_answering_a_request_hot(rundir: pathlib.Path, default_spec: api.ModelSpecSpec,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    p, inst = server_pool(rundir, default_spec)
    actuator = loop.PoolActuator(p)
    caplog.set_level(logging.INFO, logger=loop.__name__)
    try:
        p.activate("srv")  # a request that came after the window that found the server idle
        actuator.demote("srv", Tier.FROZEN)
        wait_for("the demotion tried", lambda: any("not demoted" in r.getMessage() for r in caplog.records),
                 timeout=30, every=0.01)
        assert inst.tier is Tier.HOT and inst.in_flight == 1
    finally:
        actuator.close()
        p.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_violation_lowers_a_built_in_models_batch_cap_never_a_servers(rundir: pathlib.Path,
                                                                         default_spec: api.ModelSpecSpec) -> None:
    p, _ = server_pool(rundir, default_spec, tolerance=300.0)
    slo = default_spec.slo.model_copy(update={"interference_tolerance_pct": 100})
    mid = default_spec.model_copy(update={"model_id": "mid", "slo": slo})
    p.slots["mid"] = pool.Slot(instance.Instance("mid", mid, rundir / "mid", None, None, "cpu"), Tier.COLD)
    p.slots["mid"].inst.tier = Tier.HOT
    gateway = RecordingGateway()
    autonomy = loop.Loop(p, gateway, settings=Settings(autonomy_hysteresis_windows=1), probe=NoProbe())
    try:
        assert autonomy.views()["srv"].max_batch == 1
        for k in range(3):  # `strict` past its limit; `srv` is the most tolerant, `mid` the one a cap reaches
            autonomy.step(window.Window(k * 0.1, (k + 1) * 0.1, 50.0, 50.0, False,
                                        {"strict": window.ModelWindow(10, 10, 0, 0, 5.0),
                                         "srv": window.ModelWindow(10, 10, 0, 0, 1.0),
                                         "mid": window.ModelWindow(10, 10, 0, 0, 1.0)}))
    finally:
        autonomy.stop()
        p.close()
    assert [c for c in gateway.calls if c[0] == "set_batch_cap"][:1] == [("set_batch_cap", "mid", 128)]
    assert all(c[1] != "srv" for c in gateway.calls)


def test_what_does_not_apply_to_a_server_is_skipped(rundir: pathlib.Path, default_spec: api.ModelSpecSpec,
                                                caplog: pytest.LogCaptureFixture) -> None:
    p, _ = server_pool(rundir, default_spec)
    gateway = RecordingGateway()
    actuator = loop.PoolActuator(p, gateway)
    caplog.set_level(logging.DEBUG, logger=loop.__name__)
    try:
        for action in (decider.LowerBatchCap("srv", 4), decider.RestoreBatchCap("srv")):
            loop.apply(action, actuator)
        loop.apply(decider.LowerBatchCap("strict", 4), actuator)  # a built-in model's still reaches the gateway
    finally:
        actuator.close()
        p.close()
    assert gateway.calls == [("set_batch_cap", "strict", 4)]
    skipped = [r.getMessage() for r in caplog.records if "is a model server" in r.getMessage()]
    assert len(skipped) == 2 and all("batch cap" in m for m in skipped)


def test_the_loop_sheds_a_server_through_the_gateway_and_unsheds_it(rundir: pathlib.Path,
                                                                     default_spec: api.ModelSpecSpec) -> None:
    settings = Settings(autonomy_hysteresis_windows=1, autonomy_shed_retry_after_ms=1500)
    p, _ = server_pool(rundir, default_spec, settings)
    gateway = RecordingGateway()
    autonomy = loop.Loop(p, gateway, probe=NoProbe())
    traffic = {"strict": window.ModelWindow(5, 5, 0, 0, 0.5), "srv": window.ModelWindow(5, 5, 0, 0, 1.0)}
    try:
        for k in range(3):  # memory past the emergency watermark: the most tolerant model with traffic is shed
            autonomy.step(window.Window(k * 0.1, (k + 1) * 0.1, 95.0, 10.0, False, traffic))
        assert any(decider.Shed("srv", 1500) in d.actions for d in autonomy.decisions)
        for k in range(3, 40):  # calm again: unshed once the loop leaves EMERGENCY
            autonomy.step(window.Window(k * 0.1, (k + 1) * 0.1, 20.0, 10.0, False, traffic))
    finally:
        autonomy.stop()
        p.close()
    shedding = [c for c in gateway.calls if c[0] in ("shed", "unshed")]
    assert shedding == [("shed", "srv", 1500), ("unshed", "srv")]  # `strict`, the least tolerant, never
