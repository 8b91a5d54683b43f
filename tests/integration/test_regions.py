"""Anonymous memory mapped from a file by `worker.regions` leaves CRIU's image and comes back the same.

On a GPU node the worker does this with the CUDA driver's copy of its device memory (tests/gpu/test_gpu_tiers.py proves
that path on the H200); here a child process fills a region the way the driver's checkpoint does while this test
plays the agent (reads the child's pages before and after, names the filled runs), and the real CRIU freezes and
restores the child, eagerly and lazily.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import pathlib
import re
import subprocess
import sys
import time

import procs
import pytest

from volga_agent.snapshot import criu
from volga_agent.worker import regions

MIB = 2**20
RW = mmap.PROT_READ | mmap.PROT_WRITE
# The child: once told to fill, writes 40 MiB of a 48 MiB region (its last 8 MiB never touched) and hashes it;
# then maps the regions it is given from `parked.bin` behind 5000 bytes that stand for parked weights; once told
# to go on (after its restore), hashes the region again and writes to its first page.
CHILD = r"""
import hashlib, json, mmap, pathlib, sys, time
from volga_agent.worker import regions
folder = pathlib.Path(sys.argv[1])
def put(name, text):  # whole or not at all: written aside, then renamed
    (folder / (name + ".tmp")).write_text(text)
    (folder / (name + ".tmp")).rename(folder / name)
def wait(name):
    while not (folder / name).exists():
        time.sleep(0.005)
    return (folder / name).read_text()
put("ready", "")
wait("fill")
region = mmap.mmap(-1, 48 << 20, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
seed = hashlib.sha256(b"driver").digest()
for offset in range(0, 40 << 20, 1 << 20):
    region[offset:offset + (1 << 20)] = hashlib.shake_256(seed + offset.to_bytes(8, "little")).digest(1 << 20)
import ctypes
address = ctypes.addressof(ctypes.c_char.from_buffer(region))
put("filled.json", json.dumps({"digest": hashlib.sha256(region).hexdigest(), "at": address}))
moving = [regions.Region.from_json(r) for r in json.loads(wait("regions.json"))]
park = folder / "parked.bin"
park.write_bytes(b"w" * 5000)
moved = regions.move(moving, park)
put("moved.json", json.dumps({"bytes": moved.copied_bytes, "offset": moved.file_offset}))
wait("go")
after = hashlib.sha256(region).hexdigest()
region[:4096] = b"\0" * 4096
put("restored.json", json.dumps({"digest": after}))
time.sleep(60)
"""


def _put(path: pathlib.Path, text: str) -> None:
    """Write a file whole or not at all (aside, then renamed): the other side reads it as soon as it exists."""
    aside = path.with_name(path.name + ".tmp")
    aside.write_text(text)
    aside.rename(path)


def _smaps_of(pid: int, start: int) -> str:
    """The lines /proc/PID/smaps holds for the mapping that starts at `start`."""
    text = pathlib.Path(f"/proc/{pid}/smaps").read_text()
    at = text.index(f"{start:x}-")
    following = text.find("VmFlags:", at)
    return text[at:following]


def _wait(path: pathlib.Path, log: pathlib.Path, timeout: float = 30.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came; the child said:\n{log.read_text()}"
        time.sleep(0.01)
    return dict(json.loads(path.read_text() or "{}"))


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_criu_leaves_a_filled_region_out_of_the_image_and_restores_it(lazy: bool, tmp_path: pathlib.Path,
                                                                      criu_engine: criu.CriuEngine) -> None:
    folder = pathlib.Path(os.path.realpath(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
    log = tmp_path / "child.log"
    with log.open("w") as output:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder)], env=env, start_new_session=True,
                                 stdin=subprocess.DEVNULL, stdout=output, stderr=output)
    restored = None
    try:
        _wait(folder / "ready", log)
        before = regions.presence(child.pid)
        _put(folder / "fill", "")
        filled = _wait(folder / "filled.json", log)
        at = int(filled["at"])  # type: ignore[call-overload]
        found = regions.filled(child.pid, before)
        # The 40 MiB written, and the rest, which hashing it mapped to the zero page: the whole region, as one run
        # (the child's interpreter, busy meanwhile, may have filled pages of its own; they are not moved here).
        region = regions.Region(at, at + 48 * MIB, RW)
        assert region in found, found
        for r in found:  # and never a page the child held before
            for (start, end), was in before.items():
                lo, hi = max(start, r.start), min(end, r.end)
                assert lo >= hi or not was[(lo - start) // mmap.PAGESIZE:(hi - start) // mmap.PAGESIZE].any()
        _put(folder / "regions.json", json.dumps([region.to_json()]))
        moved = _wait(folder / "moved.json", log)
        image = criu_engine.dump(child.pid, f"regions-{'lazy' if lazy else 'eager'}")
        child.wait(timeout=30)
        # The child's interpreter and its 40 MiB region: without the move the image would hold the region's pages.
        assert image.size_bytes < 40 * MIB, image.size_bytes
        restored = criu_engine.restore(image, lazy=lazy)
        # The restore maps the region from the file afresh: none of it in the child's page tables until something
        # reads it. `premap` reads it from here, and the child's page tables hold all of it, still the file's pages.
        assert regions.mapped_from(restored.pid, folder) == [region]
        assert not regions.resident(restored.pid, region.start, region.end).any()
        premapped = regions.premap(restored.pid, [region], threads=3)
        assert premapped is not None and premapped.wait(30) and premapped.read == 48 * MIB
        assert regions.resident(restored.pid, region.start, region.end).all()
        mapping = next(m for m in regions.mappings(restored.pid) if m.start == region.start)
        assert (mapping.path, mapping.rss) == (str(folder / "parked.bin"), 48 * MIB)
        assert re.search(r"^Anonymous:\s+0 kB$", _smaps_of(restored.pid, region.start), re.M)  # no copy of a page
        _put(folder / "go", "")
        after = _wait(folder / "restored.json", log)
        assert after["digest"] == filled["digest"]
        # The child's write after its restore went to its own copy of the page: the file still holds the region.
        with (folder / "parked.bin").open("rb") as f:
            f.seek(int(moved["offset"]))  # type: ignore[call-overload]
            assert hashlib.sha256(f.read(40 * MIB) + bytes(8 * MIB)).hexdigest() == filled["digest"]
    finally:
        procs.end_restored(child, restored)


def test_a_file_that_cannot_grow_leaves_the_region_as_it_was(tmp_path: pathlib.Path) -> None:
    """Out of space for the copy (here a file size limit), `move` raises before it maps anything: the region stays
    anonymous memory with its contents, and the worker reports why (the copy then stays in the image)."""
    script = r"""
import hashlib, mmap, pathlib, resource, sys
from volga_agent.worker import regions
region = mmap.mmap(-1, 4 << 20, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
region[:] = b"\x07" * (4 << 20)
before = hashlib.sha256(region).hexdigest()
park = pathlib.Path(sys.argv[1])
park.write_bytes(b"w")
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
import ctypes
start = ctypes.addressof(ctypes.c_char.from_buffer(region))
try:
    regions.move([regions.Region(start, start + (4 << 20), mmap.PROT_READ | mmap.PROT_WRITE)], park)
except OSError as exc:
    print("refused", exc.errno)
mapped = [m.path for m in regions.mappings() if m.start <= start < m.end]
print(mapped == [""], hashlib.sha256(region).hexdigest() == before, park.stat().st_size)
"""
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "parked.bin")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    refused, kept = out.stdout.splitlines()
    assert refused == f"refused {errno.EFBIG}"
    assert kept == "True True 1"


def test_premap_skips_what_it_cannot_read_and_stops_where_the_process_is_gone() -> None:
    """Pages no longer mapped are skipped (the process may unmap meanwhile), and a process that has gone ends the
    threads at once with the reason, not a walk of the whole range page by page."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import ctypes, mmap, time; m = mmap.mmap(-1, 2 << 20); "
                                "m.write(b'y' * (2 << 20)); "
                                "print(ctypes.addressof(ctypes.c_char.from_buffer(m)), flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, text=True)
    try:
        start = int(sleeper.stdout.readline()) if sleeper.stdout else 0
        # 2 MiB mapped, read; 1 MiB at the bottom of the address space, below the lowest address a process may map
        unmapped = regions.Region(2 * mmap.PAGESIZE, 2 * mmap.PAGESIZE + MIB, RW)
        live = regions.premap(sleeper.pid, [regions.Region(start, start + 2 * MIB, RW), unmapped], threads=2)
        assert live is not None and live.wait(30) and live.read == 2 * MIB and not live.error
    finally:
        sleeper.kill()
        sleeper.wait()
    gone = regions.premap(sleeper.pid, [regions.Region(start, start + 64 * MIB, RW)], threads=2)
    assert gone is not None and gone.wait(30) and gone.read == 0 and gone.error == os.strerror(errno.ESRCH)
