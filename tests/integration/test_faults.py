"""Faults an operator meets, on the real parts: a damaged image whose restore hangs, a restore killed by SIGTERM,
agents killed with SIGKILL mid-wake and mid-dump, workers that must die with their agent."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from procs import wait_for

from volga_agent.app import defaultmodel
from volga_agent.host import process
from volga_agent.node import instance, pool
from volga_agent.node.settings import Settings
from volga_agent.snapshot import criu
from volga_agent.worker import contract
from volga_bench import faults, harness
from volga_core import api, planner

Tier = api.Tier


def test_an_owner_is_gone_only_when_proven_dead(tmp_path: pathlib.Path) -> None:
    me = process.me()
    assert not me.gone() and process.Owner.parse(me.token) == me
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process.start_time(child.pid)
    child.wait()
    assert start is not None
    dead = process.Owner(me.boot_id, me.pid_ns, child.pid, start)
    assert dead.gone()
    assert process.Owner("another-boot", me.pid_ns, me.pid, me.start).gone()
    assert not process.Owner(me.boot_id, "4026000000", child.pid, start).gone(), "another PID namespace: unknown"
    assert process.Owner.parse("volga") is None

    unmarked, mine, theirs = (tmp_path / name for name in ("unmarked", "mine", "theirs"))
    for folder in (unmarked, mine, theirs):
        folder.mkdir()
    process.claim(mine)
    (theirs / process.OWNER_FILE).write_text(dead.token)
    assert process.remove_abandoned(tmp_path.iterdir()) == [theirs]
    assert unmarked.exists() and mine.exists() and not theirs.exists()


def _criu_processes() -> list[int]:
    return [pid for pid in process.tree(os.getpid())[1:] if "criu" in faults.cmdline(pid) and faults.running(pid)]


def test_a_truncated_pages_file_costs_a_cold_start_not_a_hang(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                                            criu_engine: criu.CriuEngine) -> None:
    """criu restore of a truncated pages file never ends (its restored task spins): the deadline kills the whole
    tree, the failure is counted in the restore-failure metric, keeps its image under failed/, and a cold start
    answers."""
    # Without checksums, which would refuse the truncated image before criu runs.
    settings = Settings(criu_timeout_floor_sec=3.0, criu_timeout_sec_per_gib=0.0, verify_image_checksums=False)
    node = pool.Pool("n1", rundir / "work", criu_engine.root, settings)
    try:
        node.apply([planner.Desired("t-0", "ms", default_spec.model_id, "n1", Tier.FROZEN)], {"ms": default_spec})
        node.wait_converged(120)
        inst = node.slots["t-0"].inst
        assert inst.tier is Tier.FROZEN and inst.image is not None
        [pages] = inst.image.path.glob("pages-*.img")
        os.truncate(pages, pages.stat().st_size // 2)
        act = node.activate(default_spec.model_id)
        assert act.fallback and act.woke_from is Tier.FROZEN and act.instance.tier is Tier.HOT
        assert "deadline" in inst.history[-1].detail, inst.history[-1].detail
        x = contract.sample_inputs(inst.config.inputs, batch=3, seed=7)
        reference = harness_reference(default_spec, x)
        assert np.array_equal(inst.infer(x)["probability"], reference)
        failures = node.metrics.registry.get_sample_value(
            "volga_snapshot_restore_failures_total", {"tier": "FROZEN", "model": default_spec.model_id})
        assert failures == 1
        assert node.criu is not None and node.criu.timeouts == 1
        [kept] = (criu_engine.root / criu.FAILED).iterdir()
        assert (kept / "restore.log").exists()
        assert not _criu_processes(), "criu or the tree it was restoring outlived the deadline"
    finally:
        node.close()


def harness_reference(spec: api.ModelSpecSpec, x: dict[str, np.ndarray]) -> np.ndarray:
    """The model's answer from onnxruntime directly, configured as the worker configures it."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = spec.runtime.intra_op_threads or 1
    session = onnxruntime.InferenceSession(str(spec.source_path), options, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["probability"], x)[0])


def test_a_failed_image_is_never_reused(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                        criu_engine: criu.CriuEngine) -> None:
    """A restore that failed drops its image: the next freeze dumps anew even where a fresh image would be reused."""
    inst = instance.Instance("reuse-failed", default_spec, rundir, criu_engine, reuse_image_sec=600)
    try:
        inst.to(Tier.HOT)
        inst.to(Tier.FROZEN)
        assert inst.image is not None
        failed = inst.image
        (failed.path / "pstree.img").write_bytes(b"garbage")
        assert inst.wake().fallback
        again = inst.to(Tier.FROZEN)
        assert again.detail != "image reused"
        assert inst.image is not None and inst.image.snapshot_id != failed.snapshot_id
        assert not inst.wake().fallback
    finally:
        inst.close()


@pytest.fixture
def spec_file(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """The default model with one HOT instance (a worker spawned, not restored)."""
    document = defaultmodel.spec_document(defaultmodel.ensure().spec.source_path)
    document["spec"]["pool"] = {"hot": 1}  # type: ignore[index]
    path = tmp_path / "hot.yaml"
    path.write_text(yaml.safe_dump(document))
    yield path


def _infer(address: str, seed: int = 3) -> np.ndarray:
    spec = defaultmodel.ensure().spec
    decls = instance.decls(spec.inputs)
    client = grpcclient.InferenceServerClient(address)
    try:
        x = contract.sample_inputs(decls, batch=2, seed=seed)
        return np.asarray(client.infer(spec.model_id, harness.triton_inputs(decls, x)).as_numpy("probability"))
    finally:
        client.close()


def _infer_in_background(address: str) -> None:
    """A request that the test's fault interrupts: its error is expected and not checked."""
    def send() -> None:
        with contextlib.suppress(Exception):  # the agent stops or dies under it
            _infer(address)
    threading.Thread(target=send, daemon=True).start()


def _workers(pid: int) -> list[int]:
    return faults.workers(pid)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["spawned", "restored"])
def test_workers_die_with_a_killed_up(spec_file: pathlib.Path, how: str) -> None:
    """PR_SET_PDEATHSIG: a spawned worker, and a worker CRIU restored (which disarms it for the dump and arms
    it again against the agent after the restore), die when `volga up` is killed with SIGKILL."""
    up = faults.UpRun(["-f", str(spec_file)] if how == "spawned" else [])
    try:
        if how == "restored":
            up.wait_tier("FROZEN")
        _infer(up.grpc_address)
        # A lazily restored worker's command line is in pages that may still be on their way (/proc reads it
        # from the process's memory, and reads nothing there until they came).
        found = wait_for("the worker", lambda: _workers(up.pid), timeout=10, every=0.02)
        assert found
        if how == "restored":
            assert up.instance().last_wake_ms > 0
    finally:
        up.kill()
    wait_for("the workers to die with their agent", lambda: not any(faults.running(w) for w in found), timeout=30,
             every=0.05)


@pytest.mark.slow
def test_sigterm_during_a_hung_restore_stops_promptly(tmp_path: pathlib.Path) -> None:
    """A restore that hangs (truncated pages, a deadline far away) does not hold up SIGTERM: the criu call is
    killed, `volga up` stops cleanly, and no criu process is left."""
    up = faults.UpRun(["--criu-timeout-sec", "900", "--set", "verifyImageChecksums=false"])
    try:
        up.wait_tier("FROZEN")
        [pages] = up.image().glob("pages-*.img")
        os.truncate(pages, pages.stat().st_size // 2)
        _infer_in_background(up.grpc_address)
        restore = faults.wait_for_child(up.pid, ("criu", "restore"), timeout=60)
        assert restore is not None
        time.sleep(1.0)  # criu is spinning now
        assert faults.running(restore)
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0
    finally:
        if up.proc.poll() is None:
            up.kill()
    assert "stopped." in "".join(up.output)
    wait_for("criu to be gone", lambda: not faults.running(restore), timeout=30, every=0.05)
    assert not faults.carrying(up.token)


@pytest.mark.slow
@pytest.mark.parametrize("during", ["restore", "dump"])
def test_the_next_start_cleans_up_after_a_killed_up(during: str) -> None:
    """`volga up` killed with SIGKILL while criu restores or dumps its worker: the next start leaves no process,
    temporary image or work folder of the killed run."""
    up = faults.UpRun(faults.FRESH_DUMPS)
    try:
        up.wait_tier("FROZEN")
        if during == "restore":
            _infer_in_background(up.grpc_address)
            found = faults.wait_for_child(up.pid, ("criu", during), timeout=60)
        else:
            _infer(up.grpc_address)
            found = up.release_until_dump(timeout=60)
        assert found is not None, f"criu {during} was not seen"
    finally:
        up.kill()
    assert all(folder.exists() for folder in up.folders)
    nxt = faults.UpRun()
    try:
        assert not faults.carrying(up.token), "processes of the killed run are left"
        assert not any(folder.exists() for folder in up.folders), "folders of the killed run are left"
        assert np.all((_infer(nxt.grpc_address) > 0) & (_infer(nxt.grpc_address) < 1))
    finally:
        nxt.stop()


def test_a_snapshot_folder_that_cannot_be_written_keeps_the_worker_serving(
        default_spec: api.ModelSpecSpec, rundir: pathlib.Path, criu_engine: criu.CriuEngine) -> None:
    """A dump that cannot even create its folder (a full or read-only disk; here a file where the instance's folder
    goes) is abandoned like a failed dump: the paused worker serves again, and nothing half-written is left."""
    inst = instance.Instance("unwritable", default_spec, rundir, criu_engine)
    try:
        x = contract.sample_inputs(inst.config.inputs, batch=2, seed=5)
        inst.to(Tier.HOT)
        reference = inst.infer(x)["probability"]
        (criu_engine.root / "unwritable").write_text("not a folder")
        with pytest.raises(criu.CriuError, match="cannot write"):
            inst.to(Tier.FROZEN)
        assert inst.tier is Tier.HOT
        assert np.array_equal(inst.infer(x)["probability"], reference)
        assert not list(criu_engine.root.rglob(".tmp-*"))
        (criu_engine.root / "unwritable").unlink()
    finally:
        inst.close()


def test_flipped_bytes_the_canary_does_not_read_fail_the_checksum(
        default_spec: api.ModelSpecSpec, rundir: pathlib.Path, criu_engine: criu.CriuEngine) -> None:
    """Bytes flipped across the pages file can miss everything the canary input reads and still change answers:
    the checksums taken at the dump refuse the image, and a cold start answers exactly as onnxruntime does."""
    criu_engine.checksums = True  # as the agent's pool sets it (verify_image_checksums)
    inst = instance.Instance("flipped", default_spec, rundir, criu_engine)
    try:
        inst.to(Tier.HOT)
        inst.to(Tier.FROZEN)
        assert inst.image is not None and inst.image.checksums is not None
        inst.image.checksums.result(timeout=60)  # taken in the background after the dump: damage comes later
        faults.flip_pages(inst.image.path)
        woke = inst.wake()
        assert woke.fallback and "checksums" in woke.detail, woke.detail
        x = contract.sample_inputs(inst.config.inputs, batch=8, seed=11)
        assert np.array_equal(inst.infer(x)["probability"], harness_reference(default_spec, x))
    finally:
        inst.close()



def test_an_untouched_image_of_its_own_is_restored_without_a_crc_pass(
        default_spec: api.ModelSpecSpec, rundir: pathlib.Path, criu_engine: criu.CriuEngine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRC pass over the pages files is off the wake path while they keep the stamps they had when the CRCs
    were taken; a file written since (the same bytes written back: nothing to find) is checked in full again."""
    criu_engine.checksums = True
    passes: list[pathlib.Path] = []
    crcs = criu._checksums

    def counted(folder: pathlib.Path) -> criu.Checksums:
        passes.append(folder)
        return crcs(folder)

    monkeypatch.setattr(criu, "_checksums", counted)
    inst = instance.Instance("stamped", default_spec, rundir, criu_engine)
    try:
        inst.to(Tier.HOT)
        for rewrite in (False, True):
            inst.to(Tier.FROZEN)
            assert inst.image is not None and inst.image.checksums is not None
            inst.image.checksums.result(timeout=60)
            assert inst.image.stamps is not None and inst.image.stamps.result() is not None
            pages = next(inst.image.path.glob("pages-*.img"))
            if rewrite:
                with pages.open("r+b") as f:
                    first = f.read(4096)
                    f.seek(0)
                    f.write(first)
            passes.clear()
            woke = inst.wake()
            assert not woke.fallback, woke.detail
            assert passes == ([inst.image.path] if rewrite else []), passes
            x = contract.sample_inputs(inst.config.inputs, batch=8, seed=11)
            assert np.array_equal(inst.infer(x)["probability"], harness_reference(default_spec, x))
    finally:
        inst.close()

PAUSED_AGENT = """
import pathlib, sys, time
from volga_agent.app import defaultmodel
from volga_agent.node import instance
inst = instance.Instance("paused", defaultmodel.ensure().spec, pathlib.Path(sys.argv[1]), None)
inst.to(instance.Tier.HOT)
inst._pause()  # the worker disarms its parent-death signal for the dump that never comes
print(inst.pid, flush=True)
time.sleep(600)
"""


def test_a_worker_paused_for_a_dump_dies_with_its_agent(rundir: pathlib.Path) -> None:
    """Between prepare_checkpoint and the dump a worker's parent-death signal is off (CRIU would restore it armed
    against criu): if the agent dies in that window, the worker sees its agent gone and exits."""
    agent = subprocess.Popen([sys.executable, "-c", PAUSED_AGENT, str(rundir)], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None
        worker = int(agent.stdout.readline())
        assert faults.running(worker) and (rundir / "signals" / contract.READY_FOR_CHECKPOINT).exists()
    finally:
        agent.kill()
        agent.wait()
    wait_for("the paused worker to exit", lambda: not faults.running(worker), timeout=30, every=0.05)


def test_a_restored_worker_waits_for_a_slow_resume_of_its_live_agent(default_spec: api.ModelSpecSpec,
                                                                       rundir: pathlib.Path,
                                                                       criu_engine: criu.CriuEngine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU restores a worker into a time namespace, where /proc shows every start time shifted: a worker that
    waits long for its restore-complete signal (a loaded node, a GPU's driver restore) must still recognise its
    live agent, not take it for gone and exit."""
    inst = instance.Instance("slowresume", default_spec, rundir, criu_engine)
    resume = inst._resume_worker

    def slowly(pid: int) -> None:
        time.sleep(2.5)  # the worker checks on its agent once a second while it waits
        resume(pid)
    try:
        x = contract.sample_inputs(inst.config.inputs, batch=2, seed=3)
        inst.to(api.Tier.HOT)
        reference = inst.infer(x)["probability"]
        inst.to(api.Tier.FROZEN)
        monkeypatch.setattr(inst, "_resume_worker", slowly)
        woke = inst.wake()
        assert not woke.fallback, woke.detail
        assert np.array_equal(inst.infer(x)["probability"], reference)
    finally:
        inst.close()
