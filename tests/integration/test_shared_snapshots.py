"""Shared snapshot storage: two nodes (each a process with its own pool and work folder, mounted on one common
path in its own mount namespace) share one snapshot folder; images are published once, restored elsewhere,
verified, collected and listed."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from volga_agent.host import process
from volga_agent.node import instance
from volga_agent.snapshot import criu, shared
from volga_bench import shared as shared_bench
from volga_core import api

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for the two nodes")


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[tuple[pathlib.Path, dict[str, object]]]:
    """Node A has cold-started, answered, frozen and published; yields the run folder and A's report."""
    base = pathlib.Path(tempfile.mkdtemp(prefix="vss-", dir="/tmp"))
    a = shared_bench.run_node("node-a", base / "a", base / "node", base / "shared", "first,freeze")
    yield base, a
    shutil.rmtree(base, ignore_errors=True)


def first(report: dict[str, object]) -> dict[str, object]:
    steps = report["steps"]
    assert isinstance(steps, list)
    step: dict[str, object] = steps[0]
    return step


def assert_restored_from_a(base: pathlib.Path, a: dict[str, object], b: dict[str, object]) -> None:
    """Node B's first request was answered from node A's published image, as A answered it."""
    digest = shared.Store(base / "shared").entries()[0].digest
    assert first(b)["detail"] == f"restored from shared image {digest} of node node-a"
    assert first(b)["shared_snapshot_role"] == "restored" and not first(b)["fallback"]
    assert first(b)["outputs"] == first(a)["outputs"]
    assert b["shared"] == {"restores": 1.0, "restore_failures": 0.0, "publishes": 0.0}


def test_node_a_publishes_after_its_first_freeze(two_nodes: tuple[pathlib.Path, dict[str, object]]) -> None:
    base, a = two_nodes
    assert first(a)["woke_from"] == "COLD" and first(a)["detail"] == ""  # nothing to restore yet: a cold start
    assert a["shared"] == {"restores": 0.0, "restore_failures": 0.0, "publishes": 1.0}
    entries = shared.Store(base / "shared").entries()
    assert len(entries) == 1 and entries[0].manifest.node == "node-a" and entries[0].manifest.canary
    assert a["steps"][1]["shared_snapshot"] == entries[0].digest  # type: ignore[index]
    assert a["steps"][1]["shared_snapshot_role"] == "published"  # type: ignore[index]


def test_node_b_answers_its_first_request_from_node_a_image(
        two_nodes: tuple[pathlib.Path, dict[str, object]]) -> None:
    base, a = two_nodes
    b = shared_bench.run_node("node-b", base / "b", base / "node", base / "shared", "first")
    assert_restored_from_a(base, a, b)


def test_a_replica_of_another_name_restores_node_a_image_in_the_same_slot(
        two_nodes: tuple[pathlib.Path, dict[str, object]]) -> None:
    """Node A's `shared-bench-0` published; scale-out replica `shared-bench-1`, alone on node B, holds the same
    slot (the same work and parked-weights folders) and so restores A's image."""
    base, a = two_nodes
    b = shared_bench.run_node("node-b", base / "b-replica", base / "node", base / "shared", "first",
                              instance=f"{shared_bench.MODEL_NAME}-1")
    assert_restored_from_a(base, a, b)


def test_an_incompatible_key_cold_starts_and_publishes_its_own(
        two_nodes: tuple[pathlib.Path, dict[str, object]], tmp_path: pathlib.Path) -> None:
    base, a = two_nodes
    folder = tmp_path / "shared"
    shutil.copytree(base / "shared", folder)
    b = shared_bench.run_node("node-b", base / "b-v2", base / "node", folder, "first,freeze", version="2")
    assert first(b)["detail"] == "" and first(b)["shared_snapshot_role"] == ""  # a cold start
    assert first(b)["outputs"] == first(a)["outputs"]
    assert b["shared"] == {"restores": 0.0, "restore_failures": 0.0, "publishes": 1.0}
    assert sorted(str(e.version) for e in shared.Store(folder).entries()) == ["1", "2"]


def test_a_damaged_shared_image_fails_verification_and_node_b_cold_starts(
        two_nodes: tuple[pathlib.Path, dict[str, object]], tmp_path: pathlib.Path) -> None:
    base, a = two_nodes
    folder = tmp_path / "shared"
    shutil.copytree(base / "shared", folder)
    entry = shared.Store(folder).entries()[0]
    pages = max(entry.path.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:  # bytes flipped in the middle of the largest pages file
        f.seek(pages.stat().st_size // 2)
        chunk = f.read(4096)
        f.seek(pages.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    b = shared_bench.run_node("node-b", base / "b-bad", base / "node", folder, "first")
    assert f"shared image {entry.digest} failed" in str(first(b)["detail"])
    assert "damaged" in str(first(b)["detail"])
    assert first(b)["outputs"] == first(a)["outputs"]  # answered by a cold start
    assert b["shared"] == {"restores": 0.0, "restore_failures": 1.0, "publishes": 0.0}
    assert shared.Store(folder).entry(entry.digest) is None  # removed: no other node tries it


def test_instances_at_other_paths_do_not_take_each_other_s_images(
        default_spec: api.ModelSpecSpec, rundir: pathlib.Path, criu_engine: criu.CriuEngine) -> None:
    """A restored worker needs its work folder's paths: an instance of the same model under another name
    (another folder) neither restores nor discards the image of the first; it cold-starts and publishes its own."""
    engine = criu.CriuEngine(criu_engine.root, checksums=True)
    store = shared.Store(rundir / "shared")
    context = shared.Context(store, "node-a", shared.NodeFacts(engine.version()))
    first_ = instance.Instance("m-0", default_spec, rundir / "m-0", engine, shared_store=context)
    second = instance.Instance("m-1", default_spec, rundir / "m-1", engine, shared_store=context)
    try:
        first_.to(api.Tier.HOT)
        first_.to(api.Tier.FROZEN)
        assert first_.shared_publishes == 1
        assert first_.shared_key is not None and second.shared_key is not None
        assert first_.shared_key.digest != second.shared_key.digest
        woke = second.to(api.Tier.HOT)
        assert woke.detail == "" and not woke.fallback and second.shared_restore_failures == 0
        second.to(api.Tier.FROZEN)
        assert second.shared_publishes == 1
        assert sorted(e.digest for e in store.entries()) == sorted(
            [first_.shared_key.digest, second.shared_key.digest])
        # The first instance, gone COLD, restores its own image again.
        first_.to(api.Tier.COLD)
        woke = first_.to(api.Tier.HOT)
        assert woke.detail.startswith(f"restored from shared image {first_.shared_key.digest}")
    finally:
        first_.close()
        second.close()


@pytest.mark.parametrize("folder_owner", ["live", "dead"])
def test_a_restored_worker_with_another_agents_token_is_an_orphan_only_once_its_adopter_is_gone(
        folder_owner: str, tmp_path: pathlib.Path) -> None:
    """The token in a worker restored from node A's image names A (gone); its work folder names the agent that
    restored it."""
    dead = process.Owner("another-boot", "pid:[1]", 1, 1).token
    (tmp_path / process.OWNER_FILE).write_text(process.me().token if folder_owner == "live" else dead)
    worker = subprocess.Popen(["sleep", "60"], cwd=tmp_path, env={**os.environ, process.OWNER_ENV: dead})
    try:
        assert (worker.pid in process.orphans()) == (folder_owner == "dead")
    finally:
        worker.kill()
        worker.wait()
