"""A pool on one node holding two real workers of the default model, a strict one (10 % tolerance) and a loose one
(300 %), for the tests of what the autonomy loop does to a co-runner's worker (priority, throttle)."""

from __future__ import annotations

import pathlib

from volga_agent.node import pool
from volga_agent.node.settings import Settings
from volga_core import api, planner

Tier = api.Tier


def spec_of(base: api.ModelSpecSpec, model: str, tolerance: float) -> api.ModelSpecSpec:
    slo = base.slo.model_copy(update={"interference_tolerance_pct": tolerance, "baseline_latency_ms": {"1": 1.0}})
    return base.model_copy(update={"model_id": model, "slo": slo})


def strict_and_loose(rundir: pathlib.Path, snapshot_root: pathlib.Path, default_spec: api.ModelSpecSpec,
                     settings: Settings) -> pool.Pool:
    """The pool, both workers HOT; the caller closes it."""
    p = pool.Pool("n1", rundir / "work", snapshot_root, settings)
    specs = {"s": spec_of(default_spec, "strict", 10.0), "l": spec_of(default_spec, "loose", 300.0)}
    p.apply([planner.Desired("s-0", "s", "strict", "n1", Tier.HOT),
             planner.Desired("l-0", "l", "loose", "n1", Tier.HOT)], specs)
    p.wait_converged(180)
    assert {i.model_id: i.tier for i in p.instances()} == {"strict": Tier.HOT, "loose": Tier.HOT}
    return p


def pid_of(p: pool.Pool, model: str) -> int:
    pid = next(s.inst.pid for s in p.slots.values() if s.inst.spec.model_id == model)
    assert pid is not None
    return pid
