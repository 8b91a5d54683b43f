"""Volga's lazy-pages server (`snapshot.lazypages`) against the real CRIU: a restored process that moves, unmaps,
discards and forks memory whose pages have not arrived yet sees exactly what it would have seen after an eager
restore.

The child fills four 16 MiB anonymous regions with known bytes and is frozen; restored lazily, it then:
moves region a elsewhere (mremap: the REMAP event), unmaps the second half of b (UNMAP), discards a quarter of c
(MADV_DONTNEED: REMOVE, after which those pages must read as zeros), and forks a child that reads d (FORK: the
child's own userfaultfd). Held, the background fill waits until the child has done all of it, so every page it
reads comes through a fault and every event moves pages still to come; not held, the fill races the child.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import procs
import pytest

from volga_agent.host import process
from volga_agent.snapshot import criu, lazypages
from volga_agent.worker import regions

MIB = 2**20
# What the test's child programs share: the folder the test and the child leave each other files in, anonymous
# memory, and digests of it.
PRELUDE = r"""
import ctypes, hashlib, json, mmap, os, pathlib, sys, time
folder = pathlib.Path(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MIB = 1 << 20
RW, ANON = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS

def put(name, value):
    (folder / (name + ".tmp")).write_text(json.dumps(value))
    (folder / (name + ".tmp")).rename(folder / name)

def wait(name):
    while not (folder / name).exists():
        time.sleep(0.005)

def digest(at, size):
    return hashlib.sha256(ctypes.string_at(at, size)).hexdigest()
"""
CHILD = PRELUDE + r"""
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MREMAP_MAYMOVE, MREMAP_FIXED, MADV_DONTNEED = 1, 2, 4

regions = {}
for name in "abcd":
    regions[name] = libc.mmap(None, 16 * MIB, RW, ANON, -1, 0)
    ctypes.memmove(regions[name], hashlib.shake_256(name.encode()).digest(16 * MIB), 16 * MIB)
a, b, c, d = (regions[n] for n in "abcd")
put("ready", {"a": digest(a, 16 * MIB), "b": digest(b, 8 * MIB),
              "c": [digest(c, 4 * MIB), digest(c + 8 * MIB, 8 * MIB)], "d": digest(d, 16 * MIB)})
wait("go")
target = libc.mmap(None, 16 * MIB, 0, ANON, -1, 0)  # PROT_NONE: a place to move to
moved = libc.mremap(a, 16 * MIB, 16 * MIB, MREMAP_MAYMOVE | MREMAP_FIXED, target)
assert moved == target, ctypes.get_errno()
libc.munmap(b + 8 * MIB, 8 * MIB)
libc.madvise(c + 4 * MIB, 4 * MIB, MADV_DONTNEED)
r, w = os.pipe()
kid = os.fork()
if kid == 0:
    os.write(w, digest(d, 16 * MIB).encode())
    os._exit(0)
os.waitpid(kid, 0)
put("done", {"a": digest(moved, 16 * MIB), "b": digest(b, 8 * MIB),
             "c": [digest(c, 4 * MIB), digest(c + 8 * MIB, 8 * MIB)],
             "c_discarded_zero": ctypes.string_at(c + 4 * MIB, 4 * MIB) == bytes(4 * MIB),
             "d_child": os.read(r, 64).decode(), "d": digest(d, 16 * MIB)})
time.sleep(60)
"""


def _hold_fill(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every server's background fill until the returned event is set: until then each page comes through a
    fault."""
    release = threading.Event()
    original = lazypages.Server._fill

    def held(self: lazypages.Server) -> None:
        release.wait(60)
        original(self)

    monkeypatch.setattr(lazypages.Server, "_fill", held)
    return release


def _sleeper() -> subprocess.Popen[bytes]:
    """A process to freeze that holds no file of this test run: output captured by pytest goes to files it has
    already deleted, which CRIU would carry as ghost files, and a second restore of one while the first's is still
    there fails ("Can't create ghost regfile: File exists")."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _frozen(engine: criu.CriuEngine, child: subprocess.Popen[bytes], name: str) -> criu.Image:
    """`child` (a `_sleeper`, given a moment to settle) dumped into an image of `name`; the child ends with it."""
    time.sleep(0.3)
    image = engine.dump(child.pid, name)
    child.wait(timeout=30)
    return image


def _run(program: str, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, subprocess.Popen[bytes]]:
    """Start `program` on the test's folder (where it and the test leave each other files), its output logged."""
    folder = pathlib.Path(os.path.realpath(tmp_path))
    log = tmp_path / "child.log"
    with log.open("w") as output:
        child = subprocess.Popen([sys.executable, "-c", program, str(folder)], start_new_session=True,
                                 stdin=subprocess.DEVNULL, stdout=output, stderr=output)
    return folder, log, child


def _wait(path: pathlib.Path, log: pathlib.Path, timeout: float = 30.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came; the child said:\n{log.read_text()}"
        time.sleep(0.01)
    return dict(json.loads(path.read_text()))


@pytest.mark.parametrize("fill", ["held", "racing"])
def test_pages_still_to_come_follow_the_process_through_its_events(fill: str, tmp_path: pathlib.Path,
                                                                    criu_engine: criu.CriuEngine,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    criu_engine.lazy_pages_server = "volga"
    release = _hold_fill(monkeypatch) if fill == "held" else threading.Event()
    folder, log, child = _run(CHILD, tmp_path)
    restored = None
    try:
        before = _wait(folder / "ready", log)
        image = criu_engine.dump(child.pid, f"events-{fill}")
        child.wait(timeout=30)
        restored = criu_engine.restore(image, lazy=True)
        pages = restored.lazy_pages
        assert pages is not None and pages.server is not None
        (folder / "go").write_text("")
        after = _wait(folder / "done", log)
        if fill == "held":  # nothing came but through faults, and the fill is still to come
            assert not pages.done.is_set() and pages.server.faults > 0
            # each read of faults timed: the wait for copies in flight (none yet) within the time to answer them
            reads = [read for read in pages.server.reads if read.faults]
            assert reads and all(0 <= read.gate_wait <= read.answered and read.address for read in reads), reads
        release.set()
        restored.wait_for_pages(30.0)
        assert pages.exit_code == 0, pages.server.error
        assert after["a"] == before["a"]  # moved before its pages came: they followed it
        assert after["b"] == before["b"]
        assert after["c"] == before["c"] and after["c_discarded_zero"] is True
        assert after["d"] == before["d"] and after["d_child"] == before["d"]  # the fork's child had its own
        assert len(pages.server.spaces) == 2
        if fill == "held":
            # the unmapped half of b and the discarded quarter of c never came; b's and c's bytes were in the image
            assert pages.server.dropped >= 12 * MIB
    finally:
        release.set()
        procs.end_restored(child, restored)


RESERVER = PRELUDE + r"""
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
MREMAP_MAYMOVE, MREMAP_FIXED, MAP_FIXED = 1, 2, 0x10
reserved = libc.mmap(None, 32 * MIB, 0, ANON, -1, 0)  # PROT_NONE, no pages: as a CUDA driver reserves addresses
a = libc.mmap(None, 16 * MIB, RW, ANON, -1, 0)
ctypes.memmove(a, hashlib.shake_256(b"a").digest(16 * MIB), 16 * MIB)
put("ready", {"reserved": reserved, "a": a, "a_digest": digest(a, 16 * MIB)})
wait("go")
mapped = libc.mmap(reserved, 8 * MIB, RW, ANON | MAP_FIXED, -1, 0)  # mapped over part of it
zeros = ctypes.string_at(mapped, 8 * MIB) == bytes(8 * MIB)
moved = libc.mremap(a, 16 * MIB, 16 * MIB, MREMAP_MAYMOVE | MREMAP_FIXED, reserved + 16 * MIB)  # pages to come in
assert moved == reserved + 16 * MIB, ctypes.get_errno()
put("done", {"zeros": zeros, "a": digest(moved, 16 * MIB)})
time.sleep(60)
"""


def _uffd_registered(pid: int, address: int) -> bool:
    """Whether the mapping of `pid` at `address` faults to a userfaultfd (VmFlags "um" in smaps)."""
    mapping = next((m for m in regions.mappings(pid) if m.start <= address < m.end), None)
    assert mapping is not None, f"no mapping at {address:#x} in process {pid}"
    return "um" in mapping.flags.split()


def test_mappings_with_no_pages_to_come_are_let_go_and_pages_moved_into_them_still_come(
        tmp_path: pathlib.Path, criu_engine: criu.CriuEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the restore finishes, the server unregisters the mappings that have no pages to come (a reservation of
    addresses): mapping over them no longer waits on the server, and a fault there is the kernel's zero page. A
    mapping with pages to come stays registered, and when the process moves such pages into a range let go
    (mremap), the moved mapping keeps faulting to the server: they arrive where they went."""
    criu_engine.lazy_pages_server = "volga"
    release = _hold_fill(monkeypatch)  # every page of a comes through a fault
    folder, log, child = _run(RESERVER, tmp_path)
    restored = None
    try:
        ready = _wait(folder / "ready", log)
        reserved, a = int(ready["reserved"]), int(ready["a"])  # type: ignore[call-overload]
        image = criu_engine.dump(child.pid, "reserver")
        child.wait(timeout=30)
        restored = criu_engine.restore(image, lazy=True)
        pages = restored.lazy_pages
        assert pages is not None and pages.server is not None
        deadline = time.monotonic() + 10
        while not any(lo <= reserved < hi for space in pages.server.spaces for lo, hi in space.let_go):
            assert time.monotonic() < deadline, "the reservation was not let go"
            time.sleep(0.01)
        assert not _uffd_registered(restored.pid, reserved)
        assert _uffd_registered(restored.pid, a)
        (folder / "go").write_text("")
        done = _wait(folder / "done", log)
        assert done["zeros"] is True
        assert done["a"] == ready["a_digest"]  # moved into the range let go before its pages came: they followed
        release.set()
        restored.wait_for_pages(30.0)
        assert pages.exit_code == 0, pages.server.error
    finally:
        release.set()
        procs.end_restored(child, restored)


def test_a_restore_that_fails_stops_its_server(tmp_path: pathlib.Path, criu_engine: criu.CriuEngine) -> None:
    """criu restore fails before it hands over its processes (a damaged image): the server does not wait out its
    deadline, and no socket is left in the image folder."""
    criu_engine.lazy_pages_server = "volga"
    child = _sleeper()
    try:
        image = _frozen(criu_engine, child, "fails")
        (image.path / f"core-{child.pid}.img").write_bytes(b"garbage")
        began = time.monotonic()
        with pytest.raises(criu.CriuError):
            criu_engine.restore(image, lazy=True)
        assert time.monotonic() - began < 20
        deadline = time.monotonic() + 5
        while (image.path / lazypages.SOCKET_NAME).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (image.path / lazypages.SOCKET_NAME).exists()
        assert criu_engine.lazy_daemon_failures == 0  # stopped on purpose, not failed
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_server_that_fails_takes_the_restored_process_with_it(tmp_path: pathlib.Path, criu_engine: criu.CriuEngine,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages the server cannot deliver would read as zeros once it has let go of the userfaultfd: the restored
    process must not run on. Here the images cannot be read (a stand-in for any failure of the server's): the
    restore fails, or the process is killed as soon as the failure is known, and the failure is counted."""
    criu_engine.lazy_pages_server = "volga"

    def unreadable(folder: pathlib.Path, pid: int, mappings: object = None) -> tuple[str, list[list[int]]]:
        raise lazypages.LazyPagesError(f"pagemap-{pid}.img cannot be read")

    monkeypatch.setattr(lazypages, "lazy_segments", unreadable)
    child = _sleeper()
    restored = None
    try:
        image = _frozen(criu_engine, child, "unserved")
        began = time.monotonic()
        try:  # criu stopped for it, or failing itself on the connection the server let go of
            restored = criu_engine.restore(image, lazy=True)
        except criu.CriuError:
            pass
        else:
            deadline = time.monotonic() + 10
            while process.alive(restored.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not process.alive(restored.pid)
        deadline = time.monotonic() + 10
        while criu_engine.lazy_daemon_failures == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert criu_engine.lazy_daemon_failures == 1
        assert criu_engine.timeouts == 0 and time.monotonic() - began < criu_engine.deadlines.floor_sec
    finally:
        procs.end_restored(child, restored)


WAKER = PRELUDE + r"""
def take(name):
    wait(name)
    (folder / name).unlink()

w = libc.mmap(None, 8 * MIB, RW, ANON, -1, 0)  # what every wake reads
z = libc.mmap(None, 32 * MIB, RW, ANON, -1, 0)  # what no wake reads
ctypes.memmove(w, hashlib.shake_256(b"w").digest(8 * MIB), 8 * MIB)
ctypes.memmove(z, hashlib.shake_256(b"z").digest(32 * MIB), 32 * MIB)
put("ready", {"w": [w, w + 8 * MIB], "z": [z, z + 32 * MIB], "w_digest": digest(w, 8 * MIB),
              "z_digest": digest(z, 32 * MIB)})
n = 0
while True:
    take("go")
    n += 1
    put(f"woke-{n}", {"w": digest(w, 8 * MIB)})
    take("check")
    put(f"checked-{n}", {"z": digest(z, 32 * MIB)})
"""


def test_a_wake_gets_first_what_the_last_wake_faulted_on(tmp_path: pathlib.Path, criu_engine: criu.CriuEngine,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore for a wake holds back the pages the wake does not touch until it is released, and records the
    ones it faulted on; the next wake's restore of the same instance (a new image of the restored process) brings
    those in before the process asks, and they fault no more."""
    criu_engine.lazy_pages_server, criu_engine.lazy_pages_fill = "volga", "after-wake"
    monkeypatch.setattr(criu, "LAZY_HOLD_SEC", 60.0)
    folder, log, child = _run(WAKER, tmp_path)
    restored = None
    try:
        ready = _wait(folder / "ready", log)
        w_lo, w_hi = ready["w"]  # type: ignore[misc]

        def in_w(ranges: list[lazypages.Range]) -> int:
            return sum(min(hi, w_hi) - max(lo, w_lo) for _, lo, hi in ranges if lo < w_hi and hi > w_lo)

        for n in (1, 2):
            image = criu_engine.dump(child.pid if n == 1 else restored.pid, "waker")  # type: ignore[union-attr]
            if n == 1:
                child.wait(timeout=30)
            else:
                process.reap(restored.pid)  # type: ignore[union-attr]
            restored = criu_engine.restore(image, lazy=True, wake=True)
            pages = restored.lazy_pages
            assert pages is not None and pages.server is not None
            server = pages.server
            assert server.fetched_first.wait(30)
            if n == 1:  # nothing known of this instance yet
                assert server.order == []
            else:  # all of w comes first, before the process is told to go on
                assert in_w(server.order) == w_hi - w_lo
            (folder / "go").write_text("")
            assert _wait(folder / f"woke-{n}", log)["w"] == ready["w_digest"]
            assert not pages.done.is_set()  # z is held back until the wake is done
            if n == 1:
                assert in_w(server.faulted) == w_hi - w_lo  # every page of w came through a fault
            else:
                assert in_w(server.faulted) == 0
            restored.release()
            restored.wait_for_pages(30.0)
            assert pages.exit_code == 0, server.error
            (folder / "check").write_text("")
            assert _wait(folder / f"checked-{n}", log)["z"] == ready["z_digest"]
            assert server.record is not None and in_w(server.record) == w_hi - w_lo
    finally:
        procs.end_restored(child, restored)


def test_only_what_faulted_before_end_record_comes_first_and_record_first_fills_at_once(
        tmp_path: pathlib.Path, criu_engine: criu.CriuEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wake records its faults only until `end_record` (a GPU process's driver restore): what it touches later
    is not brought first next time. A "record-first" restore (GPU processes) brings the record first and the rest
    at once, without waiting for the wake to be released."""
    criu_engine.lazy_pages_server, criu_engine.lazy_pages_fill = "volga", "after-wake"
    monkeypatch.setattr(criu, "LAZY_HOLD_SEC", 60.0)  # the first wake's pages come only through its faults
    folder, log, child = _run(WAKER, tmp_path)
    restored = None
    try:
        ready = _wait(folder / "ready", log)
        w_lo, w_hi = ready["w"]  # type: ignore[misc]
        z_lo, z_hi = ready["z"]  # type: ignore[misc]

        def within(ranges: list[lazypages.Range], lo: int, hi: int) -> int:
            return sum(min(b, hi) - max(a, lo) for _, a, b in ranges if a < hi and b > lo)

        image = criu_engine.dump(child.pid, "waker")
        child.wait(timeout=30)
        restored = criu_engine.restore(image, lazy=True, wake=True)
        pages = restored.lazy_pages
        assert pages is not None and pages.server is not None
        (folder / "go").write_text("")
        assert _wait(folder / "woke-1", log)["w"] == ready["w_digest"]
        restored.end_record()
        faults = pages.server.faults
        (folder / "check").write_text("")  # z, still held back, comes through faults that are not recorded
        assert _wait(folder / "checked-1", log)["z"] == ready["z_digest"]
        assert pages.server.faults > faults
        restored.release()
        record = pages.server.record
        assert record is not None and within(record, w_lo, w_hi) == w_hi - w_lo
        assert within(pages.server.faulted, z_lo, z_hi) == 0 and within(record, z_lo, z_hi) == 0
        restored.wait_for_pages(30.0)

        criu_engine.lazy_pages_fill = "record-first"
        image = criu_engine.dump(restored.pid, "waker")
        process.reap(restored.pid)
        restored = criu_engine.restore(image, lazy=True, wake=True, gpu=True)
        pages = restored.lazy_pages
        assert pages is not None and pages.server is not None
        server = pages.server
        assert server.hold == 0 and server.recording and server.record_bytes == lazypages.RECORD_FIRST_BYTES
        assert server.order == record  # the record first
        restored.wait_for_pages(30.0)  # and the rest without a release
        assert pages.exit_code == 0 and not server.released, server.error
        (folder / "go").write_text("")
        assert _wait(folder / "woke-2", log)["w"] == ready["w_digest"]
        (folder / "check").write_text("")
        assert _wait(folder / "checked-2", log)["z"] == ready["z_digest"]
    finally:
        procs.end_restored(child, restored)


def test_pages_held_for_a_wake_come_after_the_hold_when_nobody_releases_them(
        criu_engine: criu.CriuEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    criu_engine.lazy_pages_server, criu_engine.lazy_pages_fill = "volga", "after-wake"
    monkeypatch.setattr(criu, "LAZY_HOLD_SEC", 0.5)
    child = _sleeper()
    restored = None
    try:
        image = _frozen(criu_engine, child, "held")
        restored = criu_engine.restore(image, lazy=True, wake=True)
        restored.wait_for_pages(30.0)
        pages = restored.lazy_pages
        assert pages is not None and pages.server is not None and pages.exit_code == 0
        assert not pages.server.released and pages.server.copied > 0
        assert pages.finished is not None and pages.finished - restored.started >= 0.5
    finally:
        procs.end_restored(child, restored)
