"""CRIU really freezes and restores a worker serving the default ONNX model on the CPU."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from procs import wait_for

from volga_agent.host import process
from volga_agent.node import instance
from volga_agent.snapshot import criu, kdat, lazypages
from volga_agent.worker import contract
from volga_core import api

Tier = api.Tier


@pytest.fixture
def inst(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
         criu_engine: criu.CriuEngine) -> Iterator[instance.Instance]:
    i = instance.Instance("ctr-a", default_spec, rundir, criu_engine)
    yield i
    i.close()
    assert not (criu_engine.root / "ctr-a").exists(), "images left behind"


def hot_reference(inst: instance.Instance, batch: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Sample inputs, and the answer of the instance made HOT to them (what it must answer after each wake)."""
    x = contract.sample_inputs(inst.config.inputs, batch=batch, seed=seed)
    inst.to(Tier.HOT)
    return x, inst.infer(x)["probability"]


def test_criu_is_4x(criu_engine: criu.CriuEngine) -> None:
    assert criu_engine.version().startswith("Version: 4.")
    criu_engine.check()


def test_criu_reads_its_kernel_probes_from_a_cache(criu_engine: criu.CriuEngine, tmp_path: pathlib.Path) -> None:
    # criu keeps the cache itself only on a tmpfs /run; where /run is a disk the engine gives it one.
    made = kdat.ensure(criu_engine.criu)
    assert (made is None) == (kdat.filesystem(kdat.RUN) == "tmpfs"), made
    log = tmp_path / "check.log"
    subprocess.run([criu_engine.criu, "check", "-v4", "-o", str(log)], capture_output=True, timeout=60)
    assert f"Loaded kdat cache from {kdat.RUN / kdat.CACHE_NAME}" in log.read_text()


def test_freeze_thaw_many_times_identical_outputs(inst: instance.Instance, criu_engine: criu.CriuEngine) -> None:
    x, reference = hot_reference(inst, batch=32, seed=5)
    pids = set()
    for cycle in range(6):
        frozen = inst.to(Tier.FROZEN)
        assert inst.tier is Tier.FROZEN and inst.pid is None
        assert inst.image is not None and inst.image.size_bytes > 50 * 2**20
        # Published atomically, one image per instance, no temporary folders left.
        assert [p.name for p in (criu_engine.root / "ctr-a").iterdir()] == [inst.image.snapshot_id]
        assert (inst.image.path / "pstree.img").exists()
        woke = inst.wake()
        assert not woke.fallback, woke.detail
        assert np.array_equal(inst.infer(x)["probability"], reference), f"cycle {cycle}"
        pids.add(inst.pid)
        assert frozen.seconds > 0 and woke.seconds > 0
    assert inst.restore_failures == 0
    moves = [(t.source, t.target) for t in inst.history]
    assert moves == [(Tier.COLD, Tier.HOT)] + [(Tier.HOT, Tier.FROZEN), (Tier.FROZEN, Tier.HOT)] * 6
    ping = inst.client().call("ping").header
    assert ping["restores"] == 6


def test_restored_worker_is_init_of_its_own_pid_namespace(inst: instance.Instance) -> None:
    inst.to(Tier.HOT)
    inst.to(Tier.FROZEN)
    inst.wake()
    assert inst.pid is not None
    assert inst.client().call("ping").header["pid"] == 1
    assert os.readlink(f"/proc/{inst.pid}/ns/pid") != os.readlink("/proc/self/ns/pid")


def test_no_inet_sockets_in_the_worker(inst: instance.Instance) -> None:
    inst.to(Tier.HOT)
    assert inst.pid is not None
    inodes = {os.readlink(f"/proc/{inst.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{inst.pid}/fd")}
    sockets = {i[len("socket:["):-1] for i in inodes if i.startswith("socket:[")}
    inet = set()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        for line in pathlib.Path(f"/proc/{inst.pid}/net/{table}").read_text().splitlines()[1:]:
            inet.add(line.split()[9])
    assert sockets and not (sockets & inet)


def test_rng_reseeded_after_restore(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                    criu_engine: criu.CriuEngine) -> None:
    """Two restores of one image draw different random numbers only when resetRngOnRestore is set."""
    results = {}
    for reset in (True, False):
        spec = default_spec.model_copy(update={"runtime": default_spec.runtime.model_copy(
            update={"reset_rng_on_restore": reset})})
        i = instance.Instance(f"rng-{reset}", spec, rundir / str(reset), criu_engine)
        try:
            i.to(Tier.HOT)
            i.to(Tier.FROZEN)
            draws = []
            for _ in range(2):
                i.wake()
                draws.append(i.client().call("rng").header["numpy"])
                i._kill()  # drop the restored process, keep the image: restore the same image again
                i.tier = Tier.FROZEN
        finally:
            i.close()
        results[reset] = draws
    assert results[True][0] != results[True][1]
    assert results[False][0] == results[False][1]


def test_broken_image_falls_back_to_cold_start(inst: instance.Instance) -> None:
    x, reference = hot_reference(inst, batch=2, seed=1)
    inst.to(Tier.FROZEN)
    assert inst.image is not None
    (inst.image.path / "pstree.img").write_bytes(b"garbage")
    woke = inst.wake()
    assert woke.fallback and woke.target is Tier.HOT
    assert "criu restore" in woke.detail
    assert inst.restore_failures == 1
    assert np.array_equal(inst.infer(x)["probability"], reference)


def test_failed_dump_keeps_the_worker_serving(inst: instance.Instance, monkeypatch: pytest.MonkeyPatch) -> None:
    x, reference = hot_reference(inst, batch=2, seed=1)
    assert inst.criu is not None
    monkeypatch.setattr(inst.criu, "criu", "/bin/false")
    with pytest.raises(criu.CriuError, match="criu dump of pid"):
        inst.to(Tier.FROZEN)
    assert inst.tier is Tier.HOT
    assert np.array_equal(inst.infer(x)["probability"], reference)


def test_frozen_to_cold_removes_the_image(inst: instance.Instance, criu_engine: criu.CriuEngine) -> None:
    inst.to(Tier.HOT)
    inst.to(Tier.FROZEN)
    assert inst.image is not None
    path = inst.image.path
    inst.to(Tier.COLD)
    assert not path.exists() and inst.image is None


def test_fresh_image_is_reused_until_the_worker_changes(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                                        criu_engine: criu.CriuEngine, tmp_path: pathlib.Path) -> None:
    from volga_agent.app import defaultmodel

    inst = instance.Instance("reuse", default_spec, rundir, criu_engine, reuse_image_sec=300)
    try:
        x, reference = hot_reference(inst, batch=2, seed=8)
        first = inst.to(Tier.FROZEN)
        image = inst.image
        assert first.detail == ""
        for _ in range(3):
            inst.wake()
            assert np.array_equal(inst.infer(x)["probability"], reference)
            again = inst.to(Tier.FROZEN)
            assert again.detail == "image reused" and inst.image is image and inst.pid is None
        inst.wake()
        inst.client().call("swap", path=str(defaultmodel.build_onnx(tmp_path / "v2.onnx", rows=1000)))
        swapped = inst.infer(x)["probability"]
        assert inst.to(Tier.FROZEN).detail == "" and inst.image is not image  # state changed: dumped anew
        inst.wake()
        assert np.array_equal(inst.infer(x)["probability"], swapped)
    finally:
        inst.close()


@pytest.mark.parametrize("server", ["volga", "criu"])
def test_lazy_restore_answers_the_same(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                       criu_engine: criu.CriuEngine, server: str) -> None:
    """CRIU lazy pages (userfaultfd): the restored worker pulls its pages on demand and answers the same, its
    pages served by Volga's server or by criu's daemon."""
    criu_engine.lazy_pages_server = server
    inst = instance.Instance("lazy", default_spec, rundir, criu_engine, lazy_restore=True)
    try:
        x, reference = hot_reference(inst, batch=16, seed=3)
        for _ in range(3):
            inst.to(Tier.FROZEN)
            assert inst.image is not None
            woke = inst.wake()
            assert not woke.fallback, woke.detail
            assert np.array_equal(inst.infer(x)["probability"], reference)
            # The server delivers every page and stops; how long after criu started that was is known (it can be
            # before criu's own exit is seen: the last pages may go in while criu ends).
            assert inst.restored is not None and inst.restored.lazy_pages is not None
            delivered = inst.restored.pages_seconds(30.0)
            assert delivered is not None and delivered > 0 and inst.restored.seconds > 0
            served = inst.restored.lazy_pages.server
            if server == "criu":
                assert served is None and (inst.image.path / "lazy-pages.log").exists()
                continue
            # Every lazy page of the image went in once: copied, or dropped because the worker let it go first.
            assert served is not None and served.faults > 0
            lazy = sum(end - start for _, segs in [lazypages.lazy_segments(inst.image.path, s.pid)
                                                   for s in served.spaces] for start, end, _ in segs)
            assert served.copied > lazy // 2
            assert served.copied + served.dropped + served.skipped == lazy, (served.copied, served.dropped,
                                                                             served.skipped, lazy)
    finally:
        inst.close()


def test_warmup_cache_ratio_warms_again_after_each_restore(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                                           criu_engine: criu.CriuEngine) -> None:
    runtime_options = default_spec.runtime.model_copy(update={"warmup_cache_ratio": 0.4, "warmup_iterations": 5})
    spec = default_spec.model_copy(update={"runtime": runtime_options})
    inst = instance.Instance("rewarm", spec, rundir, criu_engine)
    try:
        inst.to(Tier.HOT)
        assert inst.client().call("stats").header["restore_warmups"] == 0
        for restores in (1, 2):
            inst.to(Tier.FROZEN)
            inst.wake()
            assert inst.client().call("stats").header["restore_warmups"] == 2 * restores  # round(0.4 * 5)
    finally:
        inst.close()
    node_default = instance.worker_config(default_spec, rundir, "cpu", warmup_cache_ratio=1.0)
    assert node_default.restore_warmups == default_spec.runtime.warmup_iterations


def test_connection_opened_during_a_freeze_is_handed_back(inst: instance.Instance) -> None:
    """A gateway that connects while the worker is paused for its dump never got its request in: it is told
    to retry (WorkerGone), not that the worker died with its request."""
    import asyncio

    from volga_agent.gateway import workers

    inst.to(Tier.HOT)
    generation = inst._generation()
    inst._pause()

    async def connect_then_dump() -> None:
        opening = asyncio.create_task(workers.Connection.open(inst.config.socket, shm_bytes=2**20))
        await asyncio.sleep(0.2)  # connected (the listener's backlog), waiting for the paused worker
        assert not opening.done()
        await asyncio.to_thread(inst._dump, generation)  # the worker's process ends with the dump
        with pytest.raises(workers.WorkerGone):
            await opening

    asyncio.run(connect_then_dump())
    assert inst.image is not None and inst.pid is None


def _constant_weight_model(path: pathlib.Path, value: float) -> api.ModelSpecSpec:
    """y = x @ W with every weight equal to `value`: its bytes are easy to find in a CRIU pages file."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(np.full((256, 256), value, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "constant",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 256])], [weights])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return api.ModelSpecSpec.model_validate({
        "modelId": "constant", "framework": "onnx", "source": f"file://{path}",
        "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, 256]}],
        "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, 256]}],
        "runtime": {"warmupIterations": 1, "intraOpThreads": 1}})


def _damage_weights(image: criu.Image, value: float, replacement: float) -> int:
    """Overwrite every page-long run of `value` in the image's memory pages; returns the pages changed."""
    old, new = np.float32(value).tobytes() * 1024, np.float32(replacement).tobytes() * 1024
    changed = 0
    for pages in image.path.glob("pages-*.img"):
        data = bytearray(pages.read_bytes())
        start = data.find(old)
        while start >= 0:
            data[start:start + len(old)] = new
            changed += 1
            start = data.find(old, start + len(old))
        pages.write_bytes(bytes(data))
    return changed


@pytest.mark.parametrize("verify", [True, False])
def test_a_damaged_image_is_caught_by_the_canary(rundir: pathlib.Path, criu_engine: criu.CriuEngine,
                                                 tmp_path: pathlib.Path, verify: bool) -> None:
    """A restore that succeeds but brings back other weights never answers: its canary answer differs, the
    wake counts as failed and a cold start answers. Without verification the same image answers wrongly."""
    spec = _constant_weight_model(tmp_path / "constant.onnx", 0.25)
    inst = instance.Instance("damaged", spec, rundir, criu_engine, verify_restores=verify)
    try:
        x = np.ones((2, 256), dtype=np.float32)
        inst.to(Tier.HOT)
        reference = inst.infer({"x": x})["y"]
        assert np.all(reference == 64.0)
        inst.to(Tier.FROZEN)
        assert inst.image is not None
        assert _damage_weights(inst.image, 0.25, 0.5) > 0
        woke = inst.wake()
        answer = inst.infer({"x": x})["y"]
        if verify:
            assert woke.fallback and "canary" in woke.detail, woke.detail
            assert inst.restore_failures == 1
            assert np.array_equal(answer, reference)
            kept = list((criu_engine.root / criu.FAILED).iterdir())
            assert len(kept) == 1 and (kept[0] / "worker.log").exists() and (kept[0] / "pstree.img").exists()
        else:
            assert not woke.fallback
            assert not np.array_equal(answer, reference)
    finally:
        inst.close()


def test_failed_restores_kept_are_bounded(inst: instance.Instance, criu_engine: criu.CriuEngine) -> None:
    criu_engine.keep_failed = 2
    inst.to(Tier.HOT)
    for _ in range(3):
        inst.to(Tier.FROZEN)
        assert inst.image is not None
        (inst.image.path / "pstree.img").write_bytes(b"garbage")
        assert inst.wake().fallback
    kept = sorted((criu_engine.root / criu.FAILED).iterdir())
    assert len(kept) == 2
    assert all((k / "restore.log").exists() and (k / "worker.log").exists() for k in kept)
    assert inst.restore_failures == 3


def test_a_failed_lazy_restore_is_retried_eagerly(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                                  criu_engine: criu.CriuEngine,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The image is fine when only the lazy-pages machinery fails: an eager restore of it serves, no cold start."""
    inst = instance.Instance("lazyfail", default_spec, rundir, criu_engine, lazy_restore=True)
    try:
        x, reference = hot_reference(inst, batch=2, seed=4)
        inst.to(Tier.FROZEN)

        def no_daemon(image: criu.Image, wake: bool, gpu: bool) -> None:
            raise criu.CriuError("criu lazy-pages did not start")
        monkeypatch.setattr(criu_engine, "_lazy_pages", no_daemon)
        woke = inst.wake()
        assert not woke.fallback and "eager restore instead" in woke.detail
        assert inst.restore_failures == 0 and inst.lazy_restore_failures == 1
        assert inst.client().call("ping").header["restores"] == 1
        assert np.array_equal(inst.infer(x)["probability"], reference)
    finally:
        inst.close()


@pytest.mark.slow
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_many_wakes_under_load_never_fall_back(default_spec: api.ModelSpecSpec, rundir: pathlib.Path,
                                               criu_engine: criu.CriuEngine, lazy: bool) -> None:
    """100 FROZEN wakes in a row, the second half with two CPU-bound processes beside them: every wake is a
    restore (no cold start), and every answer is the first one."""
    inst = instance.Instance("stress", default_spec, rundir, criu_engine, lazy_restore=lazy)
    load: list[subprocess.Popen[bytes]] = []
    try:
        x, reference = hot_reference(inst, batch=4, seed=9)
        for cycle in range(100):
            if cycle == 50:
                load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
            inst.to(Tier.FROZEN)
            woke = inst.wake()
            assert not woke.fallback and not woke.detail, f"wake {cycle}: {woke.detail}"
            assert np.array_equal(inst.infer(x)["probability"], reference), f"wake {cycle}"
        assert inst.restore_failures == 0 and inst.lazy_restore_failures == 0
        assert criu_engine.lazy_daemon_failures == 0
    finally:
        for process in load:
            process.kill()
            process.wait()
        inst.close()


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one for the worker, one starved")
@pytest.mark.parametrize("server", ["volga", "criu"])
def test_a_lazily_restored_worker_is_frozen_only_with_all_its_pages(default_spec: api.ModelSpecSpec,
                                                                     rundir: pathlib.Path,
                                                                     criu_engine: criu.CriuEngine,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     server: str) -> None:
    """The lazy-pages server streams a restored worker's memory in the background. A freeze that dumped the
    worker before it had every page made an image without them, whose restore then crashed in CPython's
    allocator. Here the background fill is held back (Volga's server: its fillers wait; criu's daemon: starved,
    SCHED_IDLE on a CPU that a busy process holds, the worker on another), so the freeze right after the lazy
    wake comes while pages are still pending."""
    criu_engine.lazy_pages_server = server
    starved, worker_cpu = sorted(os.sched_getaffinity(0))[:2]
    started: list[criu.LazyPages] = []
    lazy_pages = criu_engine._lazy_pages
    release = threading.Event()

    def held_lazy_pages(image: criu.Image, wake: bool, gpu: bool) -> criu.LazyPages:
        pages = lazy_pages(image, wake, gpu)
        if pages.daemon is not None:
            os.sched_setaffinity(pages.daemon.pid, {starved})
            os.sched_setscheduler(pages.daemon.pid, os.SCHED_IDLE, os.sched_param(0))
        started.append(pages)
        return pages

    fill = lazypages.Server._fill

    def held_fill(self: lazypages.Server) -> None:
        release.wait()
        fill(self)

    monkeypatch.setattr(criu_engine, "_lazy_pages", held_lazy_pages)
    monkeypatch.setattr(lazypages.Server, "_fill", held_fill)
    inst = instance.Instance("pending", default_spec, rundir, criu_engine, lazy_restore=True, cpus=(worker_cpu,))
    busy = f"import os; os.sched_setaffinity(0, {{{starved}}})\nwhile True: pass"
    hog = subprocess.Popen([sys.executable, "-c", busy])
    try:
        x, reference = hot_reference(inst, batch=4, seed=12)
        for _ in range(5):
            inst.to(Tier.FROZEN)
            assert not inst.wake().fallback
            if started and not started[-1].done.is_set():
                break  # pages still pending: the freeze below comes while the page server streams
            # Its first answer touches most of the worker's pages, so a page server that gets any CPU at all (a
            # busy machine may schedule even an idle-class one) can be done already: freeze and wake again.
        else:
            pytest.fail("the held page server had delivered every page by the end of each of 5 wakes")
        await_pages = inst._await_pages

        def unheld_await_pages() -> None:
            # Once the freeze waits for the pages, the page server may go on: a machine busy with other work
            # would otherwise leave an idle-class daemon no time at all.
            release.set()
            if started[-1].daemon is not None:
                os.sched_setscheduler(started[-1].daemon.pid, os.SCHED_OTHER, os.sched_param(0))
            await_pages()

        monkeypatch.setattr(inst, "_await_pages", unheld_await_pages)
        inst.to(Tier.FROZEN)  # waits for the remaining pages
        assert started[-1].done.is_set() and started[-1].exit_code == 0
        hog.kill()
        inst.lazy_restore = False
        woke = inst.wake()
        assert not woke.fallback, woke.detail
        for seed in range(20):  # allocate and collect: a heap with zeroed pages crashes here
            inst.infer(contract.sample_inputs(inst.config.inputs, batch=64, seed=seed))
        assert np.array_equal(inst.infer(x)["probability"], reference)
        assert inst.restore_failures == 0
    finally:
        hog.kill()
        hog.wait()
        inst.close()


def test_failures_kept_by_many_instances_at_once_never_break_their_fallbacks(tmp_path: pathlib.Path) -> None:
    """A wake storm: many instances keep (and prune) their failed restores at the same moment. Folders vanish
    while others look at them; each keep must still succeed and the bound hold."""
    engine = criu.CriuEngine(tmp_path / "snapshots", keep_failed=3)
    images = []
    for k in range(16):
        folder = engine.root / f"m{k}" / "image"
        folder.mkdir(parents=True)
        (folder / "pages-1.img").write_bytes(b"p" * 4096)
        (folder / "restore.log").write_text("failed")
        images.append(criu.Image(folder, f"m{k}", 4096, 0.0))
    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(16) as threads:
            kept = list(threads.map(lambda k: engine.keep_failure(images[k], f"m{k}"), range(16)))
        assert all(k is not None for k in kept)
    assert len(list((engine.root / criu.FAILED).iterdir())) == 3


_THREADS = """import os, sys, threading, time
count = [0]
def spin():
    while True:
        count[0] += 1
        time.sleep(0.001)
for _ in range(4):
    threading.Thread(target=spin, daemon=True).start()
while True:
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(count[0]))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(0.02)
"""


@pytest.mark.parametrize("breakpoints", [False, True], ids=["traced-to-its-last-step", "criu-breakpoints"])
def test_restored_threads_are_stopped_without_hardware_breakpoints(monkeypatch: pytest.MonkeyPatch,
                                                                   breakpoints: bool) -> None:
    """criu restore stops each restored thread at its last step by tracing its system calls (`criu.NO_BREAKPOINTS`)
    rather than with a hardware breakpoint, unless VOLGA_CRIU_BREAKPOINTS=1; either way the tree comes back with
    every thread running."""
    monkeypatch.setenv("VOLGA_CRIU_BREAKPOINTS", "1" if breakpoints else "0")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="volga-bp-", dir="/dev/shm"))
    engine = criu.CriuEngine(folder, log_level=4)  # criu says which way it stops them at -v4
    beat = folder / "beat"
    child = subprocess.Popen([sys.executable, "-c", _THREADS, str(beat)], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    restored = None
    try:
        wait_for("the threads' first beat", beat.exists, timeout=10)
        image = engine.dump(child.pid, "threads")
        child.wait(timeout=10)
        restored = engine.restore(image)
        assert len(os.listdir(f"/proc/{restored.pid}/task")) == 5
        counted = int(beat.read_text() or 0)
        wait_for("the restored threads to count on", lambda: int(beat.read_text() or 0) > counted, timeout=10)
        log = (image.path / "restore.log").read_text()
        assert ("Force no-breakpoints restore" in log) is not breakpoints
    finally:
        if restored is not None:
            process.kill_tree(restored.pid)
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_relocatable_criu_is_started_through_its_own_loader(criu_engine: criu.CriuEngine) -> None:
    """The installed criu (scripts/install-criu.sh: a wrapper script beside a private root) is started through its
    root's loader straight, and is the same criu the wrapper starts."""
    wrapper = pathlib.Path(criu_engine.criu).resolve()
    if wrapper.read_bytes()[:2] != b"#!":
        pytest.skip(f"{wrapper} is not the relocatable install's wrapper")
    root = wrapper.parent.parent / "root"
    assert criu_engine.argv[0].startswith(str(root)) and "ld-linux" in criu_engine.argv[0], criu_engine.argv
    assert criu_engine.argv[-1] == str(root / "usr" / "sbin" / "criu")
    through_wrapper = subprocess.run([criu_engine.criu, "--version"], capture_output=True, text=True, timeout=30)
    assert criu_engine.version() == through_wrapper.stdout.splitlines()[0]


def test_only_a_wrapper_beside_a_private_root_is_bypassed(tmp_path: pathlib.Path) -> None:
    lib = tmp_path / "root" / "usr" / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "ld-linux-x86-64.so.2").write_bytes(b"\x7fELF")
    (tmp_path / "root" / "usr" / "sbin").mkdir()
    (tmp_path / "root" / "usr" / "sbin" / "criu").write_bytes(b"\x7fELF")
    (tmp_path / "bin").mkdir()
    wrapper = tmp_path / "bin" / "criu"
    wrapper.write_text("#!/bin/sh\n")
    loader = (str(lib / "ld-linux-x86-64.so.2"), "--library-path", str(lib), str(tmp_path / "root/usr/sbin/criu"))
    assert criu.command(str(wrapper)) == loader
    criu.command.cache_clear()
    (tmp_path / "elsewhere").symlink_to(wrapper)  # a link to the wrapper finds the root as the wrapper does
    assert criu.command(str(tmp_path / "elsewhere")) == loader
    wrapper.write_bytes(b"\x7fELF")  # a criu binary is started as it is
    criu.command.cache_clear()
    assert criu.command(str(wrapper)) == (str(wrapper),)
    wrapper.write_text("#!/bin/sh\n")
    (lib / "ld-linux-x86-64.so.2").unlink()  # no loader to start it with
    criu.command.cache_clear()
    assert criu.command(str(wrapper)) == (str(wrapper),)
    assert criu.command(str(tmp_path / "missing")) == (str(tmp_path / "missing"),)
