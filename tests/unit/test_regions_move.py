"""`worker.regions` in this process: which pages of a region are resident, and a region moved to a file reads the
same, its writes leaving the file; a region is whole pages. CRIU leaving a moved region out of its image:
tests/integration/test_regions.py."""

from __future__ import annotations

import hashlib
import mmap
import pathlib

import numpy as np
import pytest

from volga_agent.worker import regions

MIB = 2**20
RW = mmap.PROT_READ | mmap.PROT_WRITE


def test_resident_names_only_the_touched_pages() -> None:
    region = mmap.mmap(-1, 16 * mmap.PAGESIZE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(region, dtype=np.uint8)
    try:
        for page in (1, 2, 3, 9):
            view[page * mmap.PAGESIZE] = 1
        start = view.ctypes.data
        assert regions.runs(regions.resident("self", start, start + 16 * mmap.PAGESIZE)) == [(1, 4), (9, 10)]
    finally:
        del view
        region.close()

def test_a_moved_region_reads_the_same_and_its_writes_leave_the_file(tmp_path: pathlib.Path) -> None:
    region = mmap.mmap(-1, 4 * MIB, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(region, dtype=np.uint8)
    try:
        view[: 3 * MIB] = np.arange(3 * MIB, dtype=np.uint64).astype(np.uint8)
        expected = hashlib.sha256(region).hexdigest()
        start = view.ctypes.data
        park = tmp_path / "parked.bin"
        park.write_bytes(b"weights")
        moved = regions.move([regions.Region(start, start + 4 * MIB, RW)], park)
        assert (moved.regions, moved.copied_bytes, moved.file_offset) == (1, 4 * MIB, mmap.PAGESIZE)
        (mapping,) = [m for m in regions.mappings() if m.start <= start < m.end]
        assert mapping.path == str(park) and mapping.private and mapping.rss == 0
        assert hashlib.sha256(region).hexdigest() == expected
        view[0] = 255  # copied on write: the file keeps what was moved
        with park.open("rb") as f:
            f.seek(moved.file_offset)
            assert f.read(1) == bytes([0])
        # Mapped from a file the next image will not keep, it is stale, and moves again whole.
        assert regions.stale("self", tmp_path, keep=park) == []
        written = hashlib.sha256(region).hexdigest()
        following = tmp_path / "next.bin"
        following.write_bytes(b"")
        (old,) = regions.stale("self", tmp_path, keep=following)
        assert (old.start, old.end) == (start, start + 4 * MIB)
        regions.move([old], following)
        assert [m.path for m in regions.mappings() if m.start <= start < m.end] == [str(following)]
        assert hashlib.sha256(region).hexdigest() == written
    finally:
        del view
        region.close()

def test_a_region_is_whole_pages() -> None:
    assert regions.Region.from_json([4096, 8192, RW]) == regions.Region(4096, 8192, RW)
    for bad in ([4096, 4096, RW], [4095, 8192, RW], [4096, 8192], "4096-8192", [4096, 8192.0, RW]):
        with pytest.raises(ValueError, match="region"):
            regions.Region.from_json(bad)


def test_a_request_to_park_moves_what_it_names_or_says_why_not(tmp_path: pathlib.Path) -> None:
    """The moving process's side of a park request (the worker's and a server's alike): the regions it names moved,
    their bytes told; a request that is not one, or names no whole pages, answered with the reason and nothing
    moved."""
    import json

    region = mmap.mmap(-1, 2 * MIB, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(region, dtype=np.uint8)
    try:
        view[:] = 7
        start = view.ctypes.data
        park = tmp_path / "parked.bin"
        park.touch()
        report = regions.move_as_named(json.dumps({"regions": [[start, start + 2 * MIB, RW]]}), park)
        assert (report["bytes"], report["regions"]) == (2 * MIB, 1) and "error" not in report
        assert park.stat().st_size == 2 * MIB and bytes(region[:4]) == b"\x07" * 4
        for bad, why in (("not json", "JSONDecodeError"), ('{"regions": [[1, 2, 3]]}', "ValueError"),
                         ("{}", "KeyError")):
            assert regions.move_as_named(bad, park)["error"].startswith(why)  # type: ignore[union-attr]
        assert park.stat().st_size == 2 * MIB
    finally:
        del view
        region.close()
