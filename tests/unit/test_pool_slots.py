"""A node's pool without workers: which instance a device hint picks, an instance that cannot be created, NUMA
affinity."""

from __future__ import annotations

import pathlib

import pytest
from pools import desired

from volga_agent import errors
from volga_agent.node import instance, pool
from volga_core import api

Tier = api.Tier


def test_device_hint_picks_the_matching_instance(default_spec: api.ModelSpecSpec, rundir: pathlib.Path) -> None:
    p = pool.Pool("n1", rundir, None)
    cpu = instance.Instance("a", default_spec, rundir / "a", None, None, "cpu")
    gpu = instance.Instance("b", default_spec, rundir / "b", None, None, "cuda:1")
    p.slots = {"a": pool.Slot(cpu, Tier.COLD), "b": pool.Slot(gpu, Tier.COLD)}
    cpu.tier = Tier.FROZEN
    assert p.pick(default_spec.model_id).inst.name == "a"  # faster to wake
    assert p.pick(default_spec.model_id, device_hint="cuda:1").inst.name == "b"
    with pytest.raises(errors.UnknownModel, match="no instance of model 'nope'"):
        p.pick("nope")

def test_an_instance_that_cannot_be_created_is_reported(rundir: pathlib.Path,
                                                        default_spec: api.ModelSpecSpec) -> None:
    p = pool.Pool("n1", rundir, None)
    broken = default_spec.model_copy(update={"source": str(rundir / "missing.onnx")})
    p.apply([desired("bad-0", "bad", "bad", Tier.FROZEN)], {"bad": broken})
    assert "does not exist" in p.failed["bad-0"] and p.instances() == []
    p.close()

def test_numa_affinity_pins_to_the_gpus_node(default_spec: api.ModelSpecSpec, rundir: pathlib.Path) -> None:
    from volga_agent.host import gpus

    gpu = gpus.GpuInfo(0, "GPU-x", "NVIDIA H200", 1, 0, "580", "0000:00:06.0", 0)
    p = pool.Pool("n1", rundir, None, gpus=[gpu])
    hardware = default_spec.hardware.model_copy(update={"numa_affinity": True})
    numa = default_spec.model_copy(update={"hardware": hardware})
    assert p._cpus(numa, 0) == gpus.numa_cpus(0) != ()
    assert p._cpus(default_spec, 0) == ()  # not asked for
    assert p._cpus(numa, None) == ()  # a CPU instance has no GPU to be near
    p.close()
