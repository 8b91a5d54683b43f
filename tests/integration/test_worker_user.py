"""Workers drop to their own unprivileged user where their tiers allow it (docs/security.md), with real workers."""

from __future__ import annotations

import os
import pathlib
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

from volga_agent.app import defaultmodel
from volga_agent.host import process
from volga_agent.node import instance
from volga_agent.node.settings import Settings, worker_ids
from volga_agent.snapshot import criu
from volga_agent.worker import contract, protocol
from volga_core import api


def status(pid: int) -> dict[str, str]:
    lines = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


@pytest.fixture
def root_only() -> Iterator[pathlib.Path]:
    """A folder only root may enter, holding a model and a file root owns."""
    with tempfile.TemporaryDirectory(dir="/tmp") as path:
        folder = pathlib.Path(path)
        os.chmod(folder, 0o700)
        defaultmodel.build_onnx(folder / "model.onnx", rows=1000)
        (folder / "secret").write_text("root's")
        yield folder


def start(spec: api.ModelSpecSpec, rundir: pathlib.Path, name: str, **kwargs: object) -> instance.Instance:
    inst = instance.Instance(name, spec, rundir / name, None, **kwargs)  # type: ignore[arg-type]
    inst.to(api.Tier.HOT)
    return inst


def attach_root_file(inst: instance.Instance) -> str:
    """Have the worker map, for writing, a segment root owns and keeps to itself: 'ok' or the refusal."""
    with protocol.WorkerClient(inst.config.socket) as client:
        offered = pathlib.Path(client.call("shm_token", owner=os.getpid()).header["path"])
        fd = os.open(offered, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, 4096)
            client.call("attach_shm", path=str(offered), size=4096)
            return "ok"
        except protocol.WorkerError as exc:
            return exc.message
        finally:
            os.close(fd)
            offered.unlink()


def test_a_worker_runs_as_nobody_and_reaches_no_root_file(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                                          root_only: pathlib.Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root (as CI runs): the agent starts workers as root", pytrace=False)
    inst = start(default_spec, rundir, "nobody")
    try:
        assert inst.pid is not None and inst.root_reason == ""
        seen = status(inst.pid)
        assert seen["Uid"].split() == [str(contract.NOBODY[0])] * 4
        assert seen["Gid"].split() == [str(contract.NOBODY[1])] * 4
        assert int(seen["CapEff"], 16) == 0 and int(seen["CapPrm"], 16) == 0
        assert seen["NoNewPrivs"] == "1"
        x = contract.sample_inputs(inst.config.inputs, batch=2, seed=1)
        served = inst.infer(x)["probability"]
        # A file in a root-only folder is out of its reach, and a root-owned file cannot be opened for writing.
        with pytest.raises(protocol.WorkerError, match="does not exist"):
            inst.client().call("swap", path=str(root_only / "model.onnx"))
        assert "Permission denied" in attach_root_file(inst)
        assert np.array_equal(inst.infer(x)["probability"], served)
    finally:
        inst.close()


def test_worker_user_root_keeps_workers_root(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                             root_only: pathlib.Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root (as CI runs): the agent starts workers as root", pytrace=False)
    inst = start(default_spec, rundir, "root", worker_user=worker_ids("root"))
    try:
        assert inst.pid is not None
        assert status(inst.pid)["Uid"].split() == ["0"] * 4
        x = contract.sample_inputs(inst.config.inputs, batch=2, seed=1)
        before = inst.infer(x)["probability"]
        inst.client().call("swap", path=str(root_only / "model.onnx"))
        assert not np.array_equal(inst.infer(x)["probability"], before)
        assert attach_root_file(inst) == "ok"
    finally:
        inst.close()


def test_worker_user_setting() -> None:
    assert Settings().worker_ids() == contract.NOBODY
    assert Settings(worker_user="root").worker_ids() == (0, 0)
    assert Settings(worker_user="1234:5678").worker_ids() == (1234, 5678)
    with pytest.raises(ValueError, match=r"settings\.worker_user: no such user or group here: 'no-such-user'"):
        Settings.from_mapping({"worker_user": "no-such-user"})


def test_a_worker_in_its_own_pid_namespace_that_criu_dumps_stays_root(default_spec: api.ModelSpecSpec,
                                                                      rundir: pathlib.Path,
                                                                      criu_engine: criu.CriuEngine) -> None:
    assert "settings.unprivileged_snapshots is off" in process.must_stay_root(False, True)
    inst = instance.Instance("pidns", default_spec, rundir, criu_engine, unprivileged_snapshots=True)
    try:
        assert "PID namespace" in inst.root_reason and inst.config.uid == 0
        inst.to(api.Tier.HOT)
        assert inst.pid is not None and status(inst.pid)["Uid"].split() == ["0"] * 4
    finally:
        inst.close()


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_frozen_unprivileged_worker_wakes_answering_the_same(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                                                criu_engine: criu.CriuEngine, lazy: bool) -> None:
    reason = process.must_stay_root(False, True, unprivileged_snapshots=True)
    if reason:
        pytest.skip(f"workers stay root on this machine: {reason}")
    inst = instance.Instance("frozen", default_spec, rundir, criu_engine, pid_namespace=False, lazy_restore=lazy,
                             unprivileged_snapshots=True)
    try:
        inst.to(api.Tier.HOT)
        x = contract.sample_inputs(inst.config.inputs, batch=2, seed=2)
        before = inst.infer(x)["probability"]
        inst.to(api.Tier.FROZEN)
        inst.to(api.Tier.HOT)
        assert inst.pid is not None and status(inst.pid)["Uid"].split() == [str(contract.NOBODY[0])] * 4
        assert np.array_equal(inst.infer(x)["probability"], before)
    finally:
        inst.close()

