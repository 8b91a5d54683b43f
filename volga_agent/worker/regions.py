"""Anonymous memory a worker hands to CRIU by reference instead of by content.

The CUDA driver's checkpoint copies the device memory of a process into anonymous host memory: the driver's
copy (the context's own allocations; the weights too unless they were parked). A CRIU image carries anonymous
memory page by page, and a restore brings it back at the machine's page-fault rate (about 1.3 GB/s on the H200
machine; with lazy pages one fault at a time through criu's daemon, while the driver's restore reads it). A
private mapping of a file whose pages were never written is different: CRIU records it by path and dumps no
pages of it. `move` copies regions into a file and maps that file privately over them, at the same addresses
with the same contents, so that the image leaves them out and a restore maps them from the file's page cache
(read faults map 16 pages at a time). A write to such a page copies it first: the file, which every later restore
of the image maps, never changes.

Which regions: the agent reads the paused worker's pages before the driver's checkpoint (`presence`) and after it
(`filled`: runs of pages that only the checkpoint made resident), while the worker idles in its pause loop, so
that no page the worker's own Python is using can be among them (a new mapping of the driver's may sit right
beside one of the interpreter's, and the kernel merges the two). `stale` adds regions an earlier `move` left
mapped from files the next image will not keep. The worker then moves them (`serve.Worker.pause_for_checkpoint`);
docs/architecture.md tells the whole sequence. Linux only: /proc/PID/smaps and /proc/PID/pagemap.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import errno
import json
import mmap
import os
import pathlib
import threading
import time

import numpy as np

PAGE = mmap.PAGESIZE
MAP_FIXED = 0x10  # not in Python's mmap module; the same on every Linux architecture Volga runs on
# A mapping counts as filled by the driver's checkpoint when the checkpoint made this much of it resident, and
# runs of such pages shorter than RUN_BYTES stay where they are (each run moved is a mapping of its own).
FILLED_BYTES = 8 * 2**20
RUN_BYTES = 2**20
_CHUNK = 16 * 2**20  # bytes one copying thread takes at a time
_RESIDENT = np.uint64((1 << 63) | (1 << 62))  # pagemap: present, or swapped
# `premap`: the threads that fault a restored process's parked copies in (VOLGA_PREMAP_THREADS; 0: none), and the
# bytes each reads at a time.
def _premap_threads() -> int:
    raw = os.environ.get("VOLGA_PREMAP_THREADS", "8")
    if not raw.isdigit():
        raise ValueError(f"VOLGA_PREMAP_THREADS must be a whole number of threads (0: none), not {raw!r}")
    return int(raw)


PREMAP_THREADS = _premap_threads()
_PREMAP_CHUNK = 2 * 2**20


@dataclasses.dataclass(frozen=True)
class Mapping:
    """One mapping of /proc/PID/smaps, with its resident bytes, the private part of them and its VmFlags."""

    start: int
    end: int
    perms: str
    path: str  # "" for anonymous memory; " (deleted)" stripped
    rss: int = 0
    deleted: bool = False
    private_bytes: int = 0  # Private_Clean + Private_Dirty: what a CRIU image would carry of it
    flags: str = ""

    @property
    def private(self) -> bool:
        return self.perms.endswith("p")

    @property
    def prot(self) -> int:
        return ((mmap.PROT_READ if "r" in self.perms else 0) | (mmap.PROT_WRITE if "w" in self.perms else 0)
                | (mmap.PROT_EXEC if "x" in self.perms else 0))


@dataclasses.dataclass(frozen=True)
class Region:
    """An address range to map from a file, with the protection it has."""

    start: int
    end: int
    prot: int

    def to_json(self) -> list[int]:
        return [self.start, self.end, self.prot]

    @classmethod
    def from_json(cls, raw: object) -> Region:
        if not (isinstance(raw, list) and len(raw) == 3 and all(isinstance(x, int) for x in raw)):
            raise ValueError(f"a region is [start, end, prot], not {raw!r}")
        start, end, prot = raw
        if start % PAGE or end % PAGE or end <= start:
            raise ValueError(f"region [{start:#x}, {end:#x}) is not a range of whole pages")
        return cls(start, end, prot)


@dataclasses.dataclass(frozen=True)
class Moved:
    """What `move` did: the bytes it copied, and where in the file they start."""

    regions: int
    copied_bytes: int
    file_offset: int


# Per private anonymous mapping (by its range), which of its pages were resident.
Presence = dict[tuple[int, int], np.ndarray]


def mappings(pid: int | str = "self") -> list[Mapping]:
    """The process's mappings with their resident bytes (/proc/PID/smaps)."""
    out: list[Mapping] = []
    head: list[str] = []
    fields_of: dict[str, list[str]] = {}

    def flush() -> None:
        if head:
            start, end = (int(x, 16) for x in head[0].split("-"))
            path = " ".join(head[5:])
            kib = {key: int(fields_of[key][0]) * 1024 for key in ("Rss:", "Private_Clean:", "Private_Dirty:")
                   if key in fields_of}
            out.append(Mapping(start, end, head[1], path.removesuffix(" (deleted)"), kib.get("Rss:", 0),
                               path.endswith(" (deleted)"),
                               kib.get("Private_Clean:", 0) + kib.get("Private_Dirty:", 0),
                               " ".join(fields_of.get("VmFlags:", []))))

    for line in pathlib.Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields:
            continue
        if fields[0].endswith(":"):
            fields_of[fields[0]] = fields[1:]
            continue
        flush()
        head, fields_of = fields, {}
    flush()
    return out


def _anonymous(found: list[Mapping]) -> list[Mapping]:
    """Private anonymous mappings without a name ([heap], [stack] and the like keep theirs)."""
    return [m for m in found if m.private and not m.path]


def resident(pid: int | str, start: int, end: int) -> np.ndarray:
    """Which pages of [start, end) are resident (or swapped out) in the process, one bool a page."""
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap:
        raw = os.pread(pagemap.fileno(), (end - start) // PAGE * 8, start // PAGE * 8)
    pages: np.ndarray = (np.frombuffer(raw, dtype=np.uint64) & _RESIDENT) != 0
    return pages


def runs(pages: np.ndarray) -> list[tuple[int, int]]:
    """The [first, last + 1) page index ranges where `pages` is true."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], pages.astype(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def presence(pid: int | str) -> Presence:
    """Which pages of each private anonymous mapping that holds any are resident now."""
    return {(m.start, m.end): resident(pid, m.start, m.end) for m in _anonymous(mappings(pid)) if m.rss}


def filled(pid: int | str, before: Presence, least: int = FILLED_BYTES, run: int = RUN_BYTES) -> list[Region]:
    """The runs of pages resident now that `before` saw absent (or outside any mapping), of `run` bytes or more,
    in private anonymous mappings where such pages make up `least` bytes or more."""
    out = []
    for m in _anonymous(mappings(pid)):
        if m.rss < least:
            continue
        fresh = resident(pid, m.start, m.end)
        for (start, end), was in before.items():
            lo, hi = max(start, m.start), min(end, m.end)
            if lo < hi:
                fresh[(lo - m.start) // PAGE:(hi - m.start) // PAGE] &= ~was[(lo - start) // PAGE:(hi - start) // PAGE]
        if int(fresh.sum()) * PAGE < least:
            continue
        out += [Region(m.start + a * PAGE, m.start + b * PAGE, m.prot) for a, b in runs(fresh) if (b - a) * PAGE >= run]
    return out


def stale(pid: int | str, folder: str | pathlib.Path, keep: str | pathlib.Path | None = None) -> list[Region]:
    """Private mappings of files in `folder` other than `keep`: regions an earlier `move` mapped from a file that
    the next image will not keep (CRIU could carry a deleted file's pages only as a ghost file in its image)."""
    prefix = str(pathlib.Path(folder)) + os.sep
    kept = str(keep) if keep is not None else None
    return [Region(m.start, m.end, m.prot) for m in mappings(pid)
            if m.private and m.path.startswith(prefix) and (m.deleted or m.path != kept)]


def mapped_from(pid: int | str, folder: str | pathlib.Path) -> list[Region]:
    """The private mappings of files in `folder`: in a restored process, the driver's copies `move` parked there,
    mapped again by the restore and not yet read (the weights a worker parks are a shared mapping, read by the wake
    with pread)."""
    prefix = str(pathlib.Path(folder)) + os.sep
    out = []
    for line in pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines():  # maps, not smaps: no page walk
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[1].endswith("p") and fields[5].startswith(prefix):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append(Region(start, end, Mapping(start, end, fields[1], fields[5]).prot))
    return out


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                                      ctypes.c_ulong, ctypes.c_ulong]
    return libc


class Premap:
    """Another process's file mappings faulted into its page tables by threads of this one (`premap`).

    A restored process maps the driver's parked copy afresh, and the driver's restore then reads it one fault at a
    time from a single thread: a fault maps 16 pages of the page cache, 0.8 GiB takes 13,000 faults, and a sampled
    restore spent a quarter to a third of that thread's time in them (docs/snapshots.md, Freezing a GPU worker;
    docs/measurements.md, The parked copy mapped before the driver's restore). Reading the same pages
    through process_vm_readv faults them in the process's page tables the same way (read-only: a private mapping's
    pages stay the file's), from several threads at once, while the driver's restore starts. It only reads: a
    process that exits or unmaps a range meanwhile ends or skips that part, and nothing else changes."""

    def __init__(self, pid: int, ranges: list[Region], threads: int, chunk: int = _PREMAP_CHUNK) -> None:
        self.pid = pid
        self.bytes = sum(r.end - r.start for r in ranges)
        self.read = 0  # bytes read (mapped) so far, under self._lock
        self.seconds: float | None = None  # how long it took, once done
        self.error = ""  # why it stopped early, where it did (the process gone, or not readable by this one)
        # first to last, as the driver's restore reads them: the threads stay ahead of it
        self._jobs = collections.deque((c, min(chunk, r.end - c)) for r in ranges for c in range(r.start, r.end, chunk))
        self._lock = threading.Lock()
        self._chunk = chunk
        self._began = time.perf_counter()
        self._left = min(threads, len(self._jobs))  # threads still reading, under self._lock
        self.done = threading.Event()
        if self._left:
            self._start()
        else:
            self._finish()

    def _start(self) -> None:
        # One thread started here, which starts the others: the caller, on a wake's path, waits for one thread to
        # come up rather than for each (a start waits for the new thread to take the GIL, which the readers started
        # before it and any busy thread of the agent hold in turn; bench/premap_start.py).
        threading.Thread(target=self._launch, name=f"premap-{self.pid}", daemon=True).start()

    def _launch(self) -> None:
        for _ in range(self._left - 1):
            threading.Thread(target=self._read, name=f"premap-{self.pid}", daemon=True).start()
        self._read()

    def _finish(self) -> None:
        self.seconds = time.perf_counter() - self._began
        self.done.set()

    def _read(self) -> None:
        libc = _libc()
        buffer = ctypes.create_string_buffer(self._chunk)  # overwritten by each read: only the faults matter
        local = _IoVec(ctypes.cast(buffer, ctypes.c_void_p), self._chunk)
        try:
            while True:
                with self._lock:
                    if not self._jobs:
                        return
                    start, size = self._jobs.popleft()
                while size > 0:
                    remote = _IoVec(start, size)
                    local.len = size
                    got = libc.process_vm_readv(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
                    if got < 0 and ctypes.get_errno() != errno.EFAULT:
                        with self._lock:  # the process is gone (ESRCH), or not ours to read (EPERM): no more
                            self.error = self.error or os.strerror(ctypes.get_errno())
                            self._jobs.clear()
                        return
                    step = got if got > 0 else PAGE  # a page that cannot be read (unmapped since): the next one
                    start, size = start + step, size - step
                    if got > 0:
                        with self._lock:
                            self.read += got
        finally:
            with self._lock:
                self._left -= 1
                last = not self._left
            if last:
                self._finish()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


def premap(pid: int, ranges: list[Region], threads: int = PREMAP_THREADS) -> Premap | None:
    """Start faulting `ranges` of process `pid` into its page tables on `threads` threads (`Premap`); None where
    there is nothing to do or `threads` is 0."""
    if threads <= 0 or not ranges:
        return None
    return Premap(pid, ranges, threads)


def move(regions: list[Region], path: str | pathlib.Path, threads: int = 8) -> Moved:
    """In this process: append `regions`' contents to the file at `path` (after what it holds, from a page
    boundary) and map the file privately over each region, at its address.

    The copy runs on `threads` threads, since one thread fills fresh pages at well under the memory's bandwidth.
    Nothing may write the regions meanwhile: they are pages the driver's checkpoint filled, which nothing
    touches until the driver restores the process.
    """
    if not regions:
        return Moved(0, 0, 0)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        offset = -(-os.fstat(fd).st_size // PAGE) * PAGE
        total = sum(r.end - r.start for r in regions)
        os.ftruncate(fd, offset + total)
        try:  # the space now, or an error now: a full disk under a shared mapping is a SIGBUS in the copy
            os.posix_fallocate(fd, offset, total)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                os.ftruncate(fd, offset)
                raise
        at, copies = 0, []
        for r in regions:
            copies += [(at + c - r.start, c, min(_CHUNK, r.end - c)) for c in range(r.start, r.end, _CHUNK)]
            at += r.end - r.start
        window = mmap.mmap(fd, total, mmap.MAP_SHARED, offset=offset)
        base = ctypes.c_char.from_buffer(window)
        try:
            address = ctypes.addressof(base)
            with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:  # memmove lets go of the GIL
                list(pool.map(lambda job: ctypes.memmove(address + job[0], job[1], job[2]), copies))
        finally:
            del base
            window.close()
        libc, at = _libc(), offset
        for r in regions:
            got = libc.mmap(r.start, r.end - r.start, r.prot, mmap.MAP_PRIVATE | MAP_FIXED, fd, at)
            if got != r.start:
                code = ctypes.get_errno()
                raise OSError(code, f"mapping {r.end - r.start} bytes of {path} at {r.start:#x}: "
                                    f"{os.strerror(code)}")
            at += r.end - r.start
        return Moved(len(regions), total, offset)
    finally:
        os.close(fd)


def move_as_named(request: str, path: str | pathlib.Path) -> dict[str, object]:
    """The moving process's side of a request to park the driver's copy (JSON {"regions": [[start, end, prot],
    ...]}): move them into `path` and say how much ({"bytes", "regions", "seconds"}), or why not ({"error"}: the
    pages stay where they are, and in the image)."""
    began = time.perf_counter()
    try:
        moving = [Region.from_json(r) for r in json.loads(request)["regions"]]
        moved = move(moving, path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"bytes": moved.copied_bytes, "regions": moved.regions, "seconds": round(time.perf_counter() - began, 4)}
