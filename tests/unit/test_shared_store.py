"""Shared snapshot storage without workers: the store (two publishers at once, keys, collection, the budget, parked
weights published and fetched back), the settings, the planner's preference and the ModelSpec status. Two nodes
sharing one snapshot folder with real workers: tests/integration/test_shared_snapshots.py."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import shutil
import threading

import pytest

from volga_agent import cli
from volga_agent.node import instance
from volga_agent.node.settings import Settings
from volga_agent.snapshot import criu, shared
from volga_core import api, nodes, planner
from volga_operator import reconcile

# -- the store, without workers ---------------------------------------------------------------------


def fake_image(folder: pathlib.Path, fill: bytes, size: int = 1 << 20) -> criu.Image:
    folder.mkdir(parents=True)
    (folder / "pages-1.img").write_bytes(fill * size)
    (folder / "core-1.img").write_bytes(fill * 64)
    (folder / "restore.log").write_text("local only")
    sums = concurrent.futures.Future[tuple[tuple[str, int], ...]]()
    sums.set_result(criu._checksums(folder))
    return criu.Image(folder, folder.name, size + 64, 0.1, sums)


def key(version: str = "1", input_hash: str = "abc", model: str = "m") -> shared.Key:
    return shared.NodeFacts("criu 4.1").key(model, version, input_hash, "onnx", gpu=False)


def test_two_publishers_at_once_leave_exactly_one_complete_image(tmp_path: pathlib.Path) -> None:
    for round_ in range(5):
        store = shared.Store(tmp_path / f"shared-{round_}")
        log = tmp_path / f"worker-{round_}.log"
        log.write_text("started\n")
        images = {node: fake_image(tmp_path / f"{node}-{round_}", fill) for node, fill in (("a", b"A"), ("b", b"B"))}
        barrier = threading.Barrier(2)

        def publish(node: str, store: shared.Store = store, images: dict[str, criu.Image] = images,
                    log: pathlib.Path = log, barrier: threading.Barrier = barrier) -> shared.Entry | None:
            barrier.wait()
            return store.publish(images[node], key(), node, "canary", 3, log)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(publish, ["a", "b"]))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1
        entries = store.entries()
        assert [e.digest for e in entries] == [key().digest]
        assert sorted(p.name for p in store.root.iterdir()) == [key().digest]  # the loser's copy is gone
        fill = winners[0].manifest.node.upper().encode()
        assert (entries[0].path / "pages-1.img").read_bytes() == fill * (1 << 20)  # whole, and the winner's
        assert not (entries[0].path / "restore.log").exists()
        assert [(name, tuple(crcs)) for name, crcs in entries[0].manifest.checksums] == list(
            criu._checksums(entries[0].path))


def test_keys_differ_in_everything_a_restore_depends_on() -> None:
    base = key()
    assert key(input_hash="other").digest != base.digest
    assert key(version="2").digest != base.digest
    assert shared.NodeFacts("criu 4.2").key("m", "1", "abc", "onnx", False).digest != base.digest
    assert shared.NodeFacts("criu 4.1", cpu_flags="sse4_2").key("m", "1", "abc", "onnx", False).digest != \
        shared.NodeFacts("criu 4.1", cpu_flags="sse4_2,avx2").key("m", "1", "abc", "onnx", False).digest
    gpu = shared.NodeFacts("criu 4.1", "NVIDIA H200", "580.65")
    assert gpu.key("m", "1", "abc", "onnx", True).digest != \
        shared.NodeFacts("criu 4.1", "NVIDIA H200", "575.1").key("m", "1", "abc", "onnx", True).digest
    assert gpu.key("m", "1", "abc", "onnx", False).digest == base.digest  # a CPU worker ignores the GPU
    facts = shared.NodeFacts("criu 4.1")
    assert facts.key("m", "1", "abc", "onnx", False, "/run/volga/m-0").digest != \
        facts.key("m", "1", "abc", "onnx", False, "/run/volga/m-1").digest
    assert facts.key("m", "1", "abc", "onnx", True, "/run/volga/m-0", "/dev/shm/volga/.parked/m-0").digest != \
        facts.key("m", "1", "abc", "onnx", True, "/run/volga/m-0", "/var/volga/.parked/m-0").digest
    assert shared.cpu_flags("processor: 0\nflags\t\t: fpu sse4_2 avx2 avx512f ht\n") == "sse4_2,avx2,avx512f"


def test_collect_removes_gone_versions_after_the_grace_and_keeps_the_budget(tmp_path: pathlib.Path) -> None:
    store = shared.Store(tmp_path / "shared")
    log = tmp_path / "worker.log"
    log.write_text("x")
    for i, (model, version) in enumerate([("m", "1"), ("m", "2"), ("other", "1"), ("n", "1")]):
        store.publish(fake_image(tmp_path / f"i{i}", b"x"), key(version, model=model), "a", "c", 1, log)
    digests = {(m, v): key(v, model=m).digest for m, v in [("m", "1"), ("m", "2"), ("other", "1"), ("n", "1")]}
    live, served = [("m", "2"), ("n", "1")], ["m", "n"]
    assert store.collect(live, served, grace_sec=60, budget_bytes=0, now=1000.0) == []  # within the grace
    assert store.collect(live, served, grace_sec=60, budget_bytes=0, now=1061.0) == [digests[("m", "1")]]
    # A model this node does not serve is not its to judge; the budget removes the least recently used.
    assert store.entry(digests[("other", "1")]) is not None
    os.utime(store.root / digests[("n", "1")] / shared.USED, (10, 10))
    size = store.entries()[0].manifest.size_bytes
    assert store.collect(live, served, grace_sec=60, budget_bytes=2 * size, now=1062.0) == [digests[("n", "1")]]
    assert len(store.entries()) == 2


def test_settings_make_shared_storage_opt_in() -> None:
    assert Settings().shared.folder == ""
    assert Settings.from_mapping({"sharedSnapshots": "/mnt/shared"}).shared.folder == "/mnt/shared"
    with pytest.raises(ValueError, match="shared_snapshot_budget_bytes"):
        Settings.from_mapping({"shared_snapshot_budget_bytes": -1})


def parked_weights(folder: pathlib.Path, size: int = 3 * criu.CHECKSUM_CHUNK // 2) -> pathlib.Path:
    """A file like the one a GPU worker parks its weights in (under <snapshot root>/.parked/<instance>/)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "weights-4-0a1b2c3d.bin"
    path.write_bytes(os.urandom(size))
    path.chmod(0o600)
    return path


def test_an_image_that_maps_parked_weights_is_published_with_them_and_fetched_back_to_their_path(
        tmp_path: pathlib.Path) -> None:
    store = shared.Store(tmp_path / "shared")
    log = tmp_path / "worker.log"
    log.write_text("started\n")
    parked_dir = tmp_path / "snapshots" / instance.PARKED / "m-0"
    parked = parked_weights(parked_dir)
    weights = parked.read_bytes()
    image = fake_image(tmp_path / "image", b"x")
    entry = store.publish(image, key(), "node-a", "canary", 4, log, parked)
    assert entry is not None and entry.manifest.parked is not None
    assert entry.manifest.parked.path == str(parked.resolve())
    assert entry.manifest.parked.size_bytes == len(weights) and len(entry.manifest.parked.checksums) == 2
    assert (entry.path / shared.PARKED).read_bytes() == weights  # a copy in the entry, published with it
    assert entry.size_bytes == image.size_bytes + len(weights) == entry.ref().size_bytes
    assert store.entry(entry.digest) == entry  # the manifest reads back

    # The publishing node goes: its parked file with it. Another node (the same paths) fetches the image.
    shutil.rmtree(tmp_path / "snapshots")
    fetched = store.fetch(entry, tmp_path / "snapshots" / "m-0" / "shared-1", parked_dir)
    assert shared.PARKED not in {p.name for p in fetched.path.iterdir()}  # not part of CRIU's folder
    assert parked.read_bytes() == weights and parked.stat().st_mode & 0o777 == 0o600
    assert os.path.samefile(parked, entry.path / shared.PARKED)  # hard-linked: one filesystem here
    assert sorted(p.name for p in parked_dir.iterdir()) == [parked.name]  # no partial file left

    # A file already at that path (a restore before) is replaced whole.
    parked.unlink()
    parked.write_bytes(b"stale")
    store.fetch(entry, tmp_path / "snapshots" / "m-0" / "shared-2", parked_dir)
    assert parked.read_bytes() == weights


def test_damaged_parked_weights_fail_the_fetch_and_leave_nothing_behind(tmp_path: pathlib.Path) -> None:
    store = shared.Store(tmp_path / "shared")
    log = tmp_path / "worker.log"
    log.write_text("x")
    parked_dir = tmp_path / "snapshots" / instance.PARKED / "m-0"
    parked = parked_weights(parked_dir)
    entry = store.publish(fake_image(tmp_path / "image", b"x"), key(), "node-a", "canary", 4, log, parked)
    assert entry is not None
    parked.unlink()
    with open(entry.path / shared.PARKED, "r+b") as f:  # one byte flipped in the second chunk
        f.seek(criu.CHECKSUM_CHUNK + 10)
        byte = f.read(1)
        f.seek(criu.CHECKSUM_CHUNK + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    folder = tmp_path / "snapshots" / "m-0" / "shared-1"
    with pytest.raises(shared.SharedImageError, match="parked weights do not match"):
        store.fetch(entry, folder, parked_dir)
    assert not folder.exists() and list(parked_dir.iterdir()) == []


def test_parked_weights_go_back_only_into_the_fetching_instance_s_own_folder(tmp_path: pathlib.Path) -> None:
    store = shared.Store(tmp_path / "shared")
    log = tmp_path / "worker.log"
    log.write_text("x")
    parked = parked_weights(tmp_path / "snapshots" / instance.PARKED / "m-0")
    entry = store.publish(fake_image(tmp_path / "image", b"x"), key(), "node-a", "canary", 4, log, parked)
    assert entry is not None
    other = tmp_path / "snapshots" / instance.PARKED / "m-1"
    for parked_dir in (other, None):
        with pytest.raises(shared.SharedImageError, match="outside this instance's folder"):
            store.fetch(entry, tmp_path / "snapshots" / "m-1" / "shared-1", parked_dir)
    assert not other.exists()


def test_the_budget_counts_parked_weights(tmp_path: pathlib.Path) -> None:
    store = shared.Store(tmp_path / "shared")
    log = tmp_path / "worker.log"
    log.write_text("x")
    plain = store.publish(fake_image(tmp_path / "i0", b"x"), key(model="plain"), "a", "c", 1, log)
    parked = parked_weights(tmp_path / "snapshots" / instance.PARKED / "gpu-0", size=1 << 20)
    gpu = store.publish(fake_image(tmp_path / "i1", b"y"), key(model="gpu"), "a", "c", 1, log, parked)
    assert plain is not None and gpu is not None
    os.utime(plain.path / shared.USED, (10, 10))
    images = plain.manifest.size_bytes + gpu.manifest.size_bytes
    # The two images alone fit the budget; with the parked weights they do not: the least recently used goes.
    budget = images + parked.stat().st_size // 2
    assert store.collect([], [], grace_sec=60, budget_bytes=budget) == [plain.digest]
    assert [e.digest for e in store.entries()] == [gpu.digest]


# -- the operator ---------------------------------------------------------------------------------


def test_the_planner_prefers_nodes_that_can_restore_a_published_image(default_spec: api.ModelSpecSpec) -> None:
    gpu_spec = default_spec.model_copy(update={"hardware": default_spec.hardware.model_copy(update={"gpu": True})})
    same = nodes.NodeProfile("b-same", 1, "NVIDIA H200", 2**37, gpu_driver="580.65")
    other = nodes.NodeProfile("a-other-driver", 1, "NVIDIA H200", 2**37, gpu_driver="575.1")
    image = planner.SharedImage("NVIDIA H200", "580.65")
    assert planner.restorable(same, [image]) and not planner.restorable(other, [image])
    assert planner.restorable(other, [planner.SharedImage()])  # a CPU image restores anywhere
    bonus = planner.score(gpu_spec, same, 0, 1, (), 0, True) - planner.score(gpu_spec, same, 0, 1, (), 0)
    assert bonus == planner.SCORE_SHARED_IMAGE < planner.SCORE_LOAD  # small: load still wins over it
    # Equal nodes: without images the name breaks the tie (a-...), with one the node that can restore wins.
    assert planner.plan({"s": gpu_spec}, [same, other]).desired[0].node == "a-other-driver"
    assert planner.plan({"s": gpu_spec}, [same, other], shared={"s": [image]}).desired[0].node == "b-same"


def test_model_spec_status_lists_the_shared_images_its_instances_report() -> None:
    ref = {"key": "k1", "node": "node-a", "sizeBytes": 100, "publishedAt": "2026-01-01T00:00:00Z",
           "gpuProduct": "", "gpuDriver": ""}
    emis = [reconcile.EmiRecord("ns", "s-0", {"node": "node-a"}, {"sharedSnapshot": {**ref, "role": "published"}}),
            reconcile.EmiRecord("ns", "s-1", {"node": "node-b"}, {"sharedSnapshot": {**ref, "role": "restored"}}),
            reconcile.EmiRecord("ns", "s-2", {"node": "node-c"}, {"tier": "COLD"})]
    listed = reconcile.shared_snapshots(emis)
    assert listed == [ref]
    api.ModelSpecStatus.model_validate({"sharedSnapshots": listed})  # the CRD's schema accepts it
    api.EmiStatus.model_validate({"sharedSnapshot": {**ref, "role": "restored"}})


def test_volga_up_takes_a_shared_snapshot_folder() -> None:
    args = cli.build_parser().parse_args(["up", "--shared-snapshots", "/mnt/shared", "--workdir", "/run/volga"])
    assert cli.settings_from(args).shared.folder == "/mnt/shared" and args.workdir == "/run/volga"
    assert cli.settings_from(cli.build_parser().parse_args(["up"])).shared.folder == ""
