"""`volga bench tiers` on the CPU, as the docs run it: the default model cold-started, frozen by a real CRIU and woken
eagerly and with lazy pages, every answer compared with the first cold start's; each wake's time split into the move's
phases, the agent's own steps around them and the first answer after it."""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import pytest

from volga_agent.app import defaultmodel
from volga_agent.snapshot import criu
from volga_bench import tiers
from volga_core import api


def test_the_cpu_tier_bench_splits_each_wake_and_compares_every_answer(tmp_path: pathlib.Path) -> None:
    try:
        criu.find_criu()
    except criu.CriuError as exc:
        pytest.skip(str(exc))
    snapshots = pathlib.Path(tempfile.mkdtemp(prefix="volga-bench-tiers-", dir="/dev/shm"))
    try:
        report = tiers.bench_tiers(defaultmodel.ensure().spec, tmp_path / "w", snapshots, [api.Tier.FROZEN], 3,
                                   cold_n=1, lazy=True)
    finally:
        shutil.rmtree(snapshots, ignore_errors=True)
    assert report["outputs_match"] and report["restore_fallbacks"] == 0, report
    for name in ("frozen", "frozen_lazy"):
        run = report["tiers"][name]
        assert run["n"] == 3 and run["mismatches"] == 0
        phases = run["phases_ms"]
        parts_of = {"criu_restore_ms", "adopt_ms", "resume_ms", "worker_wake_ms", "release_ms", "agent_steps_ms",
                    "answer_ms"}
        assert parts_of <= phases.keys() and parts_of - {"agent_steps_ms", "answer_ms"} <= set(
            tiers.WAKE_PHASES.values()), phases
        for i, wake in enumerate(run["wakes_ms"]):  # the parts add up to the wake
            parts = sum(phases[key][i] for key in parts_of)
            assert parts == pytest.approx(wake, abs=0.05), (name, i, parts, wake)
