"""The autonomy loop's use of status.calibrated: a model without baselines of its own is held to the entry of the
node's device kind and its current version and input hash."""

from __future__ import annotations

import pathlib

from volga_agent.autonomy import loop
from volga_agent.node import instance, pool
from volga_core import api


def test_the_loop_holds_a_model_to_the_calibrated_entry_of_its_device_and_version(
        default_spec: api.ModelSpecSpec, rundir: pathlib.Path) -> None:
    """Without baselines of its own, a model is held to the status.calibrated entry of the node's device kind and
    its current version and input hash (what the agent hands the loop in a cluster), and to nothing else."""
    node_pool = pool.Pool("n1", rundir, None)
    node_pool.slots["m"] = pool.Slot(instance.Instance("m", default_spec, rundir / "m", None, None, "cpu"),
                                     api.Tier.COLD)

    def entry(device: str, version: str, p99: float) -> api.Calibration:
        return api.Calibration(device=device, version=version, input_hash=default_spec.input_hash(), batches=[
            api.BatchProfile(batch_size=8, p50_ms=1.0, p99_ms=p99 * 2, memory_bytes=1, throughput_per_sec=1.0),
            api.BatchProfile(batch_size=1, p50_ms=1.0, p99_ms=p99, memory_bytes=1, throughput_per_sec=1.0)])

    measured: dict[str, tuple[api.Calibration, ...]] = {}
    views = loop.Views(node_pool, lambda: measured)
    try:
        assert default_spec.slo.baseline_latency_ms == {}
        assert views()["ctr-default"].baselines == ()
        measured = {"ctr-default": (entry("NVIDIA H200", "1", 5.0), entry("cpu", "0", 7.0))}
        assert views()["ctr-default"].baselines == ()  # another device kind; another version
        measured = {"ctr-default": (entry("NVIDIA H200", "1", 5.0), entry("cpu", "1", 3.0))}
        first = views()
        assert first["ctr-default"].baselines == ((1, 3.0), (8, 6.0))
        assert views() is first  # the same mapping while nothing changed
        own = default_spec.model_copy(update={"slo": default_spec.slo.model_copy(
            update={"baseline_latency_ms": {"1": 9.0}})})
        node_pool.slots["m"].inst.spec = own
        assert views()["ctr-default"].baselines == ((1, 9.0),)  # the spec's own baselines come first
    finally:
        node_pool.close()
