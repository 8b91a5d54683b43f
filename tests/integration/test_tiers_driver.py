"""A SUSPENDED instance frozen where the driver cannot give the worker its CUDA context back, on a real process (a
stand-in for the worker): what the instance does with it by the state the driver leaves it in."""

from __future__ import annotations

import pathlib

import pytest

from volga_agent.node import gpu_freeze, instance
from volga_agent.snapshot import cuda
from volga_core import api

Tier = api.Tier


class _DriverThatCannotRestore:
    """The driver's side of a SUSPENDED -> FROZEN freeze whose restore of the context fails, the process left in
    `state` afterwards."""

    def __init__(self, state: cuda.ProcessState) -> None:
        self._state = state

    def resume(self, pid: int) -> float:
        raise cuda.DriverCheckpointError("cuCheckpointProcessRestore", pid, 2, "CUDA_ERROR_OUT_OF_MEMORY")

    def state(self, pid: int) -> cuda.ProcessState:
        return self._state


@pytest.mark.parametrize("state", list(cuda.ProcessState))
def test_a_freeze_from_suspended_without_the_context_back(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                                          state: cuda.ProcessState) -> None:
    """Where the driver cannot give a SUSPENDED worker its context back for the freeze, a process still checkpointed
    is frozen with it all in its image; one in any other state is not trusted any more: killed, and COLD."""
    import subprocess

    inst = instance.Instance("x", default_spec, rundir, None, _DriverThatCannotRestore(state),  # type: ignore[arg-type]
                             "cuda:0")
    child = subprocess.Popen(["sleep", "60"])
    inst.pid, inst.tier = child.pid, Tier.SUSPENDED
    try:
        if state is cuda.ProcessState.CHECKPOINTED:
            assert gpu_freeze.Freeze(inst, 0).context_back() is False
            assert inst.pid == child.pid and inst.tier is Tier.SUSPENDED
        else:
            with pytest.raises(cuda.DriverCheckpointError, match="CUDA_ERROR_OUT_OF_MEMORY"):
                gpu_freeze.Freeze(inst, 0).context_back()
            assert inst.pid is None and inst.tier is Tier.COLD and child.poll() is not None
            assert "the driver's restore before the freeze failed" in inst.history[-1].detail
    finally:
        child.kill()
        child.wait()
