"""The tier state machine's rules, without processes."""

from __future__ import annotations

import pathlib

import pytest

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.snapshot import cuda
from volga_core import api

Tier = api.Tier


def test_every_tier_can_reach_cold_and_hot() -> None:
    for tier in Tier:
        if tier is not Tier.COLD:
            assert Tier.COLD in instance.LEGAL[tier]
        if tier is not Tier.HOT:
            assert Tier.HOT in instance.LEGAL[tier]


@pytest.mark.parametrize("source, target", [(Tier.COLD, Tier.FROZEN), (Tier.COLD, Tier.WARM),
                                            (Tier.WARM, Tier.FROZEN), (Tier.COLD, Tier.SUSPENDED)])
def test_illegal_moves_refused(default_spec: api.ModelSpecSpec, rundir: pathlib.Path, source: Tier,
                               target: Tier) -> None:
    inst = instance.Instance("x", default_spec, rundir, None)
    inst.tier = source
    with pytest.raises(instance.IllegalTransition, match="not a legal move"):
        inst.to(target)
    assert inst.history == []


def test_gpu_tiers_need_a_gpu(default_spec: api.ModelSpecSpec, rundir: pathlib.Path) -> None:
    inst = instance.Instance("x", default_spec, rundir, None)
    inst.tier = Tier.HOT
    with pytest.raises(instance.IllegalTransition, match="needs a GPU"):
        inst.to(Tier.WARM)


def test_missing_model_file(default_spec: api.ModelSpecSpec, rundir: pathlib.Path) -> None:
    spec = default_spec.model_copy(update={"source": str(rundir / "nope.onnx")})
    with pytest.raises(FileNotFoundError, match=r"spec\.source: model file .*nope\.onnx does not exist"):
        instance.Instance("x", spec, rundir, None)


def test_socket_path_too_long(default_spec: api.ModelSpecSpec, tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        instance.Instance("x", default_spec, tmp_path / ("d" * 120), None)


def test_driver_checkpoint_unsupported_is_clear() -> None:
    with pytest.raises(cuda.DriverCheckpointUnsupported, match=r"cannot load libcuda-none\.so"):
        cuda.DriverCheckpoint("libcuda-none.so")


def test_the_faults_of_a_driver_restore_are_counted_from_proc() -> None:
    """`DriverCheckpoint.resume` records the process's minor faults during the restore; they are read from
    /proc/PID/stat (`process.minor_faults`), which counts the pages this test touches, and a process that is gone
    reads None."""
    import mmap
    import os

    from volga_agent.host import process

    before = process.minor_faults(os.getpid())
    with mmap.mmap(-1, 64 * mmap.PAGESIZE) as m:
        for page in range(64):
            m[page * mmap.PAGESIZE] = 1
    after = process.minor_faults(os.getpid())
    assert before is not None and after is not None and after - before >= 64
    assert process.minor_faults(2**22 + 1) is None  # above the kernel's largest pid


def test_driver_structs_match_the_header() -> None:
    import ctypes

    assert ctypes.sizeof(cuda._LockArgs) == 64
    assert ctypes.sizeof(cuda._RestoreArgs) == 64
    assert ctypes.sizeof(cuda._GpuPair) == 32
    assert cuda._uuid_bytes("GPU-12345678-1234-1234-1234-123456789abc")[:4] == bytes.fromhex("12345678")


def test_the_agent_proto_names_tiers_as_the_api_does() -> None:
    """server.tier_pb and the gateway's link convert tiers by name."""
    from volga_agent.app import server
    from volga_agent.rpc.volga.v1 import agent_pb2

    assert set(agent_pb2.Tier.keys()) - {"TIER_UNSPECIFIED"} == {t.value for t in Tier}
    assert agent_pb2.Tier.Name(server.tier_pb(Tier.SUSPENDED)) == "SUSPENDED"


def test_node_reset_rng_default_applies_whatever_the_modelspec_says(tmp_path: pathlib.Path) -> None:
    spec = defaultmodel.ensure().spec
    quiet = spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"reset_rng_on_restore": False})})
    assert instance.worker_config(quiet, tmp_path, "cpu", reset_rng_on_restore=True).reset_rng_on_restore
    assert not instance.worker_config(quiet, tmp_path, "cpu", reset_rng_on_restore=False).reset_rng_on_restore
    assert instance.worker_config(spec, tmp_path, "cpu", reset_rng_on_restore=False).reset_rng_on_restore
