"""The pages of a lazy restore, served from the image by the agent itself: many pages a fault, on several threads.

`criu restore --lazy-pages` leaves a process's private anonymous memory out of the restore and registers it with
userfaultfd; a page server fills it in as the process touches it, and in the background. CRIU's own server
(`criu lazy-pages`) answers every fault with one 4 KiB page and fills the rest from one thread, reading each
page into a buffer before copying it in: a model server whose first request touches a thousand scattered pages
of its heap waits for a thousand round trips, and a GiB of memory takes about as long to arrive lazily as an
eager restore takes to read it (docs/servers.md, An LLM server on the H200). This server speaks the same
protocol to `criu restore` and does three things differently:

- a fault brings in the `FAULT_BYTES` around it (what a heap touches next is mostly close by);
- the background fill runs on `threads` threads at once, each copying `FILL_BYTES` at a time;
- the pages are copied straight from the image file's page cache (mapped read-only), not read into a buffer.

The protocol, as `criu restore --lazy-pages` speaks it (CRIU 4.x, criu/uffd.c): it connects to
`lazy-pages.socket` in the image folder; for each process of the tree it sends the process's PID (an int) and
then its userfaultfd (SCM_RIGHTS, one byte of data), or only the negated PID for a zombie; when the whole tree
is restored, the int `RESTORE_FINISHED`. Which pages are lazy comes from the images: each process's pagemap
entries flagged lazy (`PE_LAZY`), cut at its mappings' ends (one copy cannot span two mappings), their bytes in
the pages file in pagemap order. The kernel reports the process's own changes to that memory as events, which
move the pages still to come: `UNMAP` and `REMOVE` (munmap, MADV_DONTNEED) drop them, `REMAP` (mremap) moves
them, `FORK` gives a child its own copy of them and its own userfaultfd.

Correctness rests on one kernel rule: while such an event is not yet read, every copy into that process fails
with EAGAIN (`mmap_changing`). A copy issued after the event was read but before the pages to come were moved
would use the old addresses; so each process has a gate (`_Gate`) that copies pass through together and that
the event thread takes alone while it reads messages and applies them. A copy refused with EAGAIN goes back
to the front of the queue with its addresses as they are then.

A wake touches few of a process's lazy pages, and many of them are the same from one restore of the process to
the next (its code's objects, the libraries' state), at the same addresses, since a restored process keeps its
layout. Faults are round trips, and a fill beside the wake competes with it. So a restore for a wake may be given
`order`, the ranges that faulted in the last wake of the same process (its `record`, merged where they touch), and
`hold`: the fillers bring the ranges of `order` in first, as soon as criu has finished, and the rest once
`release()` says the wake is done (at most `hold` seconds); the faults until then are the next record (`record`).
Holding pays where what a wake touches is mostly in its record (CPU workers and servers), not where the wake writes
memory its allocator hands out afresh each time, which then faults one window at a time (GPU processes). Those are
filled at once, their record first; what they record is only what faulted before `end_record()`, the driver's
restore of their CUDA context, which touches the same host memory at the same addresses each time
(docs/snapshots.md, Lazy pages).

Every page is delivered before `done` is set (or the process is gone); until then a dump of the process would
miss the pages not yet there, as with CRIU's server (`criu.LazyPages`).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import pathlib
import select
import socket
import struct
import threading
import time
import typing
from collections.abc import Iterator, Sequence

from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
SOCKET_NAME = "lazy-pages.socket"
RESTORE_FINISHED = 0x52535446  # "RSTF", criu/uffd.c's LAZY_PAGES_RESTORE_FINISHED
FAULT_BYTES = 64 * 1024
FILL_BYTES = 512 * 1024
# Fillers: one per BYTES_PER_THREAD of lazy pages, at most THREADS. More threads bring a large heap in sooner but
# slow what runs beside them in the same process (a GPU process's driver restore: docs/snapshots.md, Lazy pages).
THREADS = 4
BYTES_PER_THREAD = 256 * 2**20
# The most a record of a wake's faults keeps (its merged ranges, in the order of first need): a wake that touches
# more than this is no longer a few pages, and the fill brings the rest.
RECORD_BYTES = 512 * 2**20
# The most a record keeps where the rest is filled at once beside it: every byte of it comes before the rest.
RECORD_FIRST_BYTES = 64 * 2**20
READS_KEPT = 4096  # how many reads of a process's messages a server keeps the times of (`Read`, for the benches)
PREFETCH_BYTES = 2 * 2**20  # the longest piece of a record one filler takes at a time

# A range of one process's memory: (its PID in the image, start, end).
Range = tuple[int, int, int]


class Read(typing.NamedTuple):
    """One read of a process's messages that held faults or events: when it began (time.perf_counter()), the
    seconds it waited for the copies in flight (the gate) and until its faults were answered (from its start), how
    many faults and events it held, and the first address its faults wanted (0: none)."""

    at: float
    gate_wait: float
    answered: float
    faults: int
    events: int
    address: int


# CRIU's image files: a common magic, the file's own magic, then (u32 size, protobuf message) entries.
_MAGIC_COMMON = 0x54564319
_PE_PARENT, _PE_LAZY, _PE_PRESENT = 1, 2, 4
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_LOCKED = 0x02, 0x20, 0x2000

# linux/userfaultfd.h
_EVENT_PAGEFAULT, _EVENT_FORK, _EVENT_REMAP, _EVENT_REMOVE, _EVENT_UNMAP = 0x12, 0x13, 0x14, 0x15, 0x16
_MSG = struct.Struct("=BBHI24s")  # event, reserved, reserved, reserved, arg
_MSG_PAGEFAULT = struct.Struct("=QQ8x")  # flags, address
_MSG_FORK = struct.Struct("=I20x")  # the child's userfaultfd, installed in this process by the read
_MSG_REMAP = struct.Struct("=QQQ")  # from, to, len
_MSG_RANGE = struct.Struct("=QQ8x")  # start, end


def _iowr(nr: int, size: int, write: bool = True) -> int:
    return ((3 if write else 2) << 30) | (size << 16) | (0xAA << 8) | nr


class _Copy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("copy", ctypes.c_int64)]


class _Zero(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("zeropage", ctypes.c_int64)]


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Register(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


_MODE_MISSING = 1
_REGISTER = _iowr(0x00, ctypes.sizeof(_Register))
_UNREGISTER = _iowr(0x01, ctypes.sizeof(_Range), write=False)
_WAKE = _iowr(0x02, ctypes.sizeof(_Range), write=False)
_COPY = _iowr(0x03, ctypes.sizeof(_Copy))
_ZEROPAGE = _iowr(0x04, ctypes.sizeof(_Zero))


class LazyPagesError(Exception):
    """The images cannot be served lazily by this server, or the restore broke the protocol."""


class _RestoreGone(LazyPagesError):
    """criu restore let go of the connection before the restore finished: it failed, and says so itself."""


def _messages() -> tuple[type[message.Message], ...]:
    """CRIU's pstree_entry, pagemap_head, pagemap_entry and mm_entry (only the fields read here), as protobuf
    classes built from their field numbers (images/*.proto in CRIU's source)."""
    fields = {
        "pstree_entry": [("pid", 1, "uint32")],
        "pagemap_head": [("pages_id", 1, "uint32")],
        "pagemap_entry": [("vaddr", 1, "uint64"), ("compat_nr_pages", 2, "uint32"), ("in_parent", 3, "bool"),
                          ("flags", 4, "uint32"), ("nr_pages", 5, "uint64")],
        "vma_entry": [("start", 1, "uint64"), ("end", 2, "uint64"), ("flags", 6, "uint32")],
    }
    kinds = {"uint32": descriptor_pb2.FieldDescriptorProto.TYPE_UINT32,
             "uint64": descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
             "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL}
    proto = descriptor_pb2.FileDescriptorProto(name="volga_criu_images.proto", package="volga_criu_images",
                                               syntax="proto2")
    for name, its in fields.items():
        msg = proto.message_type.add(name=name)
        for field, number, kind in its:
            msg.field.add(name=field, number=number, type=kinds[kind],
                          label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    mm = proto.message_type.add(name="mm_entry")
    mm.field.add(name="vmas", number=14, type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
                 type_name=".volga_criu_images.vma_entry", label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"volga_criu_images.{name}"))
                 for name in ("pstree_entry", "pagemap_head", "pagemap_entry", "mm_entry"))


_PSTREE, _PAGEMAP_HEAD, _PAGEMAP_ENTRY, _MM = _messages()


def _entries(path: pathlib.Path) -> Iterator[bytes]:
    data = path.read_bytes()
    if len(data) < 8 or struct.unpack_from("=I", data)[0] != _MAGIC_COMMON:
        raise LazyPagesError(f"{path} is not a CRIU image")
    at = 8
    while at < len(data):
        (size,) = struct.unpack_from("=I", data, at)
        at += 4
        if at + size > len(data):
            raise LazyPagesError(f"{path} ends inside an entry")
        yield data[at:at + size]
        at += size


def processes(folder: pathlib.Path) -> int:
    """How many processes the image's tree holds (each gets one PID, and most one userfaultfd)."""
    return sum(1 for _ in _entries(folder / "pstree.img"))


def _mappings(folder: pathlib.Path, pid: int) -> Sequence[typing.Any]:
    """The mappings (vma_entry) of process `pid` in the image."""
    return _MM.FromString(next(_entries(folder / f"mm-{pid}.img"))).vmas  # type: ignore[no-any-return]


def registered(mappings: Sequence[typing.Any]) -> list[tuple[int, int]]:
    """Of a process's mappings in the image (`_mappings`), those `criu restore --lazy-pages` registers with its
    userfaultfd (private anonymous, not locked: criu's vma_entry_can_be_lazy): [start, end), sorted."""
    return sorted((vma.start, vma.end) for vma in mappings
                  if vma.flags & _MAP_ANONYMOUS and vma.flags & _MAP_PRIVATE and not vma.flags & _MAP_LOCKED)


def lazy_segments(folder: pathlib.Path, pid: int,
                  mappings: Sequence[typing.Any] | None = None) -> tuple[str, list[list[int]]]:
    """The pages file of process `pid` and its lazy pages: [start, end, offset in the pages file], sorted, each
    within one mapping of the image. `mappings`: the image's, when read already."""
    entries = _entries(folder / f"pagemap-{pid}.img")
    head = _PAGEMAP_HEAD.FromString(next(entries))
    vmas = _mappings(folder, pid) if mappings is None else mappings
    ends = [vma.end for vma in vmas]
    out: list[list[int]] = []
    offset = 0
    for raw in entries:
        pe = _PAGEMAP_ENTRY.FromString(raw)
        flags = pe.flags if pe.HasField("flags") else (_PE_PARENT if pe.in_parent else _PE_PRESENT)
        size = (pe.nr_pages if pe.HasField("nr_pages") else pe.compat_nr_pages) * PAGE
        if flags & _PE_PARENT:
            raise LazyPagesError(f"pagemap-{pid}.img has pages in a parent image, which this server does not read")
        if flags & _PE_LAZY:
            if not flags & _PE_PRESENT:
                raise LazyPagesError(f"pagemap-{pid}.img has lazy pages that are not in its pages file")
            start, end, at = pe.vaddr, pe.vaddr + size, offset
            i = bisect.bisect_right(ends, start)
            while start < end:  # cut at the ends of the mappings the entry spans
                cut = min(end, ends[i]) if i < len(ends) else end
                out.append([start, cut, at])
                at += cut - start
                start = cut
                i += 1
        if flags & _PE_PRESENT:
            offset += size
    return f"pages-{head.pages_id}.img", sorted(out)


def coalesce(ranges: Sequence[Range]) -> list[Range]:
    """`ranges` (in the order they were wanted) with those that touch or overlap merged, each merged range at the
    place of the earliest of its parts: one copy where a wake faulted on neighbouring windows one by one."""
    runs: list[list[int]] = []  # [earliest index, pid, start, end]
    for at, (pid, lo, hi) in sorted(enumerate(ranges), key=lambda e: e[1]):
        if runs and runs[-1][1] == pid and runs[-1][3] >= lo:
            runs[-1][0] = min(runs[-1][0], at)
            runs[-1][3] = max(runs[-1][3], hi)
        else:
            runs.append([at, pid, lo, hi])
    return [(pid, lo, hi) for _, pid, lo, hi in sorted(runs)]


class _Gate:
    """Copies into one process pass together; applying its events to the pages to come waits for the copies in
    flight and holds new ones back (module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._copies = 0
        self._changing = False

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        with self._cond:
            while self._changing:
                self._cond.wait()
            self._copies += 1
        try:
            yield
        finally:
            with self._cond:
                self._copies -= 1
                if not self._copies:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        with self._cond:
            self._changing = True
            while self._copies:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._changing = False
                self._cond.notify_all()


class _Libc:
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.ioctl = libc.ioctl
        self.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        self.ioctl.restype = ctypes.c_int
        self.mmap = libc.mmap
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        self.mmap.restype = ctypes.c_void_p
        self.munmap = libc.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


_libc = _Libc()


class _Source:
    """A pages file mapped read-only: the copies' source, shared by a process and the children it forks."""

    def __init__(self, path: pathlib.Path) -> None:
        self.size = path.stat().st_size
        self.address = 0
        if self.size:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                got = _libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            finally:
                os.close(fd)
            if got in (None, ctypes.c_void_p(-1).value):
                code = ctypes.get_errno()
                raise OSError(code, f"mapping {path}: {os.strerror(code)}")
            self.address = got
        self.users = 1

    def close(self) -> None:
        self.users -= 1
        if not self.users and self.address:
            _libc.munmap(self.address, self.size)
            self.address = 0


class _Space:
    """One restored process: its userfaultfd, its pages still to come, the copies in flight."""

    def __init__(self, pid: int, uffd: int, source: _Source, pending: list[list[int]],
                 registered: list[tuple[int, int]] | None = None) -> None:
        self.pid = pid
        self.uffd = uffd
        self.source = source
        self.pending = pending  # [start, end, offset], sorted by start, disjoint
        self.urgent: list[list[int]] = []  # refused copies, tried again first
        self.inflight: list[tuple[int, int]] = []
        self.waiting: list[int] = []  # faults whose copy was refused: answered again after the events
        self.registered = registered or []  # the image's mappings criu registers, for `Server._let_go`
        self.let_go: list[tuple[int, int]] = []  # those with no pages to come, unregistered
        self.gate = _Gate()
        self.lock = threading.Lock()
        self.gone = False
        self.forked = False  # a child forked after the restore: no process of the image, not in a record
        # Bytes copied in, dropped (the process unmapped or discarded them first), or found there already or
        # unmapped (`skipped`); faults answered, events read. Under self.lock: fillers count at once.
        self.copied = 0
        self.dropped = 0
        self.skipped = 0
        self.faults = 0
        self.events = 0

    # --- the pages to come, under self.lock ---

    def _find(self, address: int) -> int:
        i = bisect.bisect_right(self.pending, [address, float("inf")]) - 1
        return i if i >= 0 and self.pending[i][0] <= address < self.pending[i][1] else -1

    def take_around(self, address: int, size: int) -> list[int] | None:
        """The pages to come in the `size`-aligned window around `address`, within its segment."""
        for k, seg in enumerate(self.urgent):
            if seg[0] <= address < seg[1]:
                return self.urgent.pop(k)
        i = self._find(address)
        if i < 0:
            return None
        start, end, _ = self.pending[i]
        lo = max(start, address - address % size)
        return self._split(i, lo, min(end, lo + size))

    def _split(self, i: int, lo: int, hi: int) -> list[int]:
        """Take [lo, hi), which lies within segment i, out of the pages to come."""
        start, end, offset = self.pending[i]
        parts = []
        if start < lo:
            parts.append([start, lo, offset])
        if hi < end:
            parts.append([hi, end, offset + hi - start])
        self.pending[i:i + 1] = parts
        return [lo, hi, offset + lo - start]

    def take_within(self, lo: int, hi: int, size: int) -> list[int] | None:
        """At most `size` bytes of the pages to come in [lo, hi), from the first segment there."""
        i = bisect.bisect_right(self.pending, [lo, float("inf")]) - 1
        if i < 0 or self.pending[i][1] <= lo:
            i += 1
        if i >= len(self.pending) or self.pending[i][0] >= hi:
            return None
        start, end, _ = self.pending[i]
        first = max(start, lo)
        return self._split(i, first, min(end, hi, first + size))

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether any page to come lies in [lo, hi)."""
        i = bisect.bisect_right(self.pending, [lo, float("inf")]) - 1
        if i >= 0 and self.pending[i][1] > lo:
            return True
        return i + 1 < len(self.pending) and self.pending[i + 1][0] < hi

    def take_next(self, size: int) -> list[int] | None:
        if self.urgent:
            return self.urgent.pop(0)
        if not self.pending:
            return None
        start, end, offset = self.pending[0]
        if end - start <= size:
            return self.pending.pop(0)
        self.pending[0] = [start + size, end, offset + size]
        return [start, start + size, offset]

    def give_back(self, seg: list[int]) -> None:
        self.urgent.append(seg)

    def queued(self, address: int) -> bool:
        return any(lo <= address < hi for lo, hi in self.inflight)

    def left(self) -> bool:
        return bool(self.pending or self.urgent or self.inflight)

    # --- events, under the gate taken alone and self.lock ---

    def drop(self, lo: int, hi: int) -> int:
        """Forget the pages to come in [lo, hi); how many bytes those were."""
        before = _size(self.pending) + _size(self.urgent)
        self.pending = _cut(self.pending, lo, hi)
        self.urgent = _cut(self.urgent, lo, hi)
        return before - _size(self.pending) - _size(self.urgent)

    def move(self, frm: int, to: int, length: int) -> None:
        def moved(segs: list[list[int]]) -> list[list[int]]:
            out = _cut(segs, frm, frm + length)
            inside = [[max(s, frm), min(e, frm + length), o + max(s, frm) - s] for s, e, o in segs
                      if s < frm + length and e > frm]
            return sorted(out + [[s - frm + to, e - frm + to, o] for s, e, o in inside])
        self.pending = moved(self.pending)
        self.urgent = moved(self.urgent)

    def child(self, uffd: int) -> _Space:
        self.source.users += 1
        kid = _Space(self.pid, uffd, self.source, sorted([list(s) for s in self.pending + self.urgent]))
        kid.forked = True
        return kid


def _size(segs: list[list[int]]) -> int:
    return sum(end - start for start, end, _ in segs)


def _cut(segs: list[list[int]], lo: int, hi: int) -> list[list[int]]:
    """`segs` without what lies in [lo, hi)."""
    out = []
    for start, end, offset in segs:
        if end <= lo or start >= hi:
            out.append([start, end, offset])
            continue
        if start < lo:
            out.append([start, lo, offset])
        if hi < end:
            out.append([hi, end, offset + hi - start])
    return out


class Server:
    """Serves one lazy restore of the image in `folder`: call `listen` before starting `criu restore
    --lazy-pages -D folder`, then `start`. `done` is set once every process has all its pages (or is gone), or
    the server failed (`exit_code` 1, `error`) or was stopped. With `order` (module docstring), the ranges of
    `order` come first, and with `hold` the rest after `release()`; with `record`, the faults until `release()` or
    `end_record()` are the next order (`release` returns it)."""

    def __init__(self, folder: str | pathlib.Path, threads: int | None = None, fault_bytes: int = FAULT_BYTES,
                 fill_bytes: int = FILL_BYTES, order: Sequence[Range] = (), hold: float = 0.0,
                 record: bool = False, record_bytes: int = RECORD_BYTES, let_go_empty: bool = True) -> None:
        self.folder = pathlib.Path(folder)
        self.order = list(order)
        self.hold = hold
        # Whether this wake's faults are recorded for the next, and the most a record keeps.
        self.recording = record
        self.record_bytes = record_bytes
        self.let_go_empty = let_go_empty  # unregister the mappings with no pages to come (`_let_go`)
        self.let_go_seconds = 0.0  # what that took, before the fill began
        self.released = False  # the wake is done (`release`): its faults are recorded until then
        self.record_ended = False  # or until `end_record`, where that came first
        self.record: list[Range] | None = None  # the ranges a wake wanted first, once released
        # the fault windows of the processes of the image, in order, while recording
        self.faulted: list[Range] = []
        self.fetched_first = threading.Event()  # every range of `order` is in (or the server ends)
        # When that was (time.perf_counter()) and how many faults had come by then; the faults until released.
        self.fetched_first_at: float | None = None
        self.faults_first = 0
        self.faults_held = 0
        self.reads: list[Read] = []  # the first READS_KEPT reads that held faults or events
        self._pieces: list[Range] = []  # `order` cut to PREFETCH_BYTES, shared out among the fillers
        self._order_at = 0  # the next of them a filler takes
        self._prefetching = 0  # fillers still copying ranges of `order`
        self._processes = processes(self.folder)
        self.threads = threads if threads and threads > 0 else None
        self.fault_bytes = fault_bytes
        self.fill_bytes = fill_bytes
        self.done = threading.Event()
        self.exit_code: int | None = None
        self.error = ""
        self.stopped = False
        self.finished: float | None = None
        self.spaces: list[_Space] = []
        self._restore_finished = threading.Event()
        # stop() and a failing filler write to it; a filler that finds nothing left writes "w" (the event thread
        # then sees whether the restore is complete)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._failure = ""  # a filler's error, for the event thread to raise
        self._ending = False  # the event thread is done: fillers leave
        self._listener: socket.socket | None = None
        self._work = threading.Condition()

    # What the spaces counted, summed (`_Space`): for the benches and tests.
    copied = property(lambda self: sum(space.copied for space in self.spaces))
    dropped = property(lambda self: sum(space.dropped for space in self.spaces))
    skipped = property(lambda self: sum(space.skipped for space in self.spaces))
    faults = property(lambda self: sum(space.faults for space in self.spaces))
    events = property(lambda self: sum(space.events for space in self.spaces))
    let_go_bytes = property(lambda self: sum(hi - lo for space in self.spaces for lo, hi in space.let_go))

    def listen(self) -> None:
        path = self.folder / SOCKET_NAME
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        # A long image path does not fit a socket address; the folder's descriptor through /proc always does.
        folder_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            listener.bind(f"/proc/self/fd/{folder_fd}/{SOCKET_NAME}")
        finally:
            os.close(folder_fd)
        listener.listen(1)
        self._listener = listener

    def start(self, deadline: float) -> None:
        """Serve in the background; `deadline` (seconds) bounds the wait for criu's connection and its
        processes' userfaultfds."""
        threading.Thread(target=self._serve, args=(deadline,), name=f"lazy-pages-{self.folder.name}",
                         daemon=True).start()

    def end_record(self) -> None:
        """What faults from now on is not kept in the record (the wake's own allocations after the driver's
        restore, at other addresses each time)."""
        self.record_ended = True

    def release(self) -> list[Range] | None:
        """The wake is done: fill the rest, if held. Returns the record of this wake (the ranges of `order` that
        were lazy in this image and the windows that faulted, merged where they touch, in the order of first need,
        at most `record_bytes`), or None when it was released already or recorded nothing."""
        with self._work:
            if self.released:
                return None
            self.released = True
            self.faults_held = self.faults
            self._work.notify_all()
        if not self.recording:
            return None
        record, size = [], 0
        for pid, lo, hi in coalesce(self.order + list(self.faulted)):
            if size + hi - lo > self.record_bytes:
                break
            record.append((pid, lo, hi))
            size += hi - lo
        self.record = record
        return record

    def stop(self) -> None:
        """Give up serving (the restored process is gone, or the agent stops); `done` follows."""
        with self._work:
            if self.exit_code is not None:
                return  # finished, or failed: a failure stays one
            self.stopped = True
        self._poke(b"s")

    def _poke(self, what: bytes) -> None:
        with self._work:  # never to a descriptor closed (and perhaps reused) since
            if self._wake_w >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, what)

    def close(self) -> None:
        """Let go of what a server that never started holds (`_serve` does it for one that did)."""
        with self._work:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _fail(self, why: str) -> None:
        self._failure = self._failure or why
        self._poke(b"f")

    # --- the event thread ---

    def _serve(self, deadline: float) -> None:
        fillers: list[threading.Thread] = []
        try:
            until = time.monotonic() + deadline
            client = self._accept(until)
            with client:
                self._receive(client, until)
                ours = {space.pid: space for space in self.spaces}
                self.order = [(pid, lo, hi) for pid, lo, hi in self.order
                              if pid in ours and ours[pid].overlaps(lo, hi)]
                # the fillers share the ranges out one at a time: none longer than PREFETCH_BYTES
                self._pieces = [(pid, at, min(hi, at + PREFETCH_BYTES)) for pid, lo, hi in self.order
                                for at in range(lo, hi, PREFETCH_BYTES)]
                if self.threads is None:
                    lazy = sum(_size(space.pending) for space in self.spaces)
                    self.threads = min(THREADS, max(1, -(-lazy // BYTES_PER_THREAD)))
                self._prefetching = self.threads
                fillers = [threading.Thread(target=self._fill, name=f"lazy-fill-{self.folder.name}-{n}",
                                            daemon=True) for n in range(self.threads)]
                for thread in fillers:
                    thread.start()
                self._events(client)
            with self._work:
                self.exit_code = 0
        except Exception as exc:
            with self._work:
                self.error = f"{type(exc).__name__}: {exc}"
                # Stopped, or criu gone: the restore's failure is criu's to report (its owner stops us anyway).
                self.stopped = self.stopped or isinstance(exc, _RestoreGone)
                self.exit_code = 0 if self.stopped else 1
            if not self.stopped:
                log.warning("lazy pages of %s: %s", self.folder, self.error)
        finally:
            self._ending = True
            with self._work:
                self._restore_finished.set()
                self._work.notify_all()
            for thread in fillers:
                thread.join()
            self.fetched_first.set()
            for space in self.spaces:
                with contextlib.suppress(OSError):
                    os.close(space.uffd)
                space.source.close()
            self.close()
            with contextlib.suppress(OSError):
                (self.folder / SOCKET_NAME).unlink()
            self.finished = time.perf_counter()
            self.done.set()

    def _wait_readable(self, fd: int, until: float) -> None:
        left = until - time.monotonic()
        ready, _, _ = select.select([fd, self._wake_r], [], [], max(0.0, left))
        if self._wake_r in ready:
            raise LazyPagesError("stopped")
        if not ready:
            raise LazyPagesError("criu restore did not hand over its processes in time")

    def _accept(self, until: float) -> socket.socket:
        assert self._listener is not None, "listen() first"
        self._wait_readable(self._listener.fileno(), until)
        client, _ = self._listener.accept()
        self._listener.close()
        self._listener = None
        client.setblocking(True)
        return client

    def _receive(self, client: socket.socket, until: float) -> None:
        sources: dict[str, _Source] = {}
        for _ in range(self._processes):
            self._wait_readable(client.fileno(), until)
            raw = client.recv(4, socket.MSG_WAITALL)
            if len(raw) != 4:
                raise _RestoreGone("criu restore closed the connection before handing over every process")
            (pid,) = struct.unpack("=i", raw)
            if pid < 0:
                continue  # a zombie: no memory
            self._wait_readable(client.fileno(), until)
            data, fds, _, _ = socket.recv_fds(client, 1, 1)
            if not data and not fds:
                raise _RestoreGone(f"criu restore closed the connection before handing over process {pid}")
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise LazyPagesError(f"criu restore sent no userfaultfd for process {pid}")
            try:
                mappings = _mappings(self.folder, pid)
                name, segments = lazy_segments(self.folder, pid, mappings)
                empty = registered(mappings) if self.let_go_empty else []
                if name not in sources:
                    sources[name] = _Source(self.folder / name)
                else:
                    sources[name].users += 1
            except BaseException:
                os.close(fds[0])
                raise
            self.spaces.append(_Space(pid, fds[0], sources[name], segments, empty))

    def _events(self, client: socket.socket) -> None:
        poller = select.epoll()
        try:
            poller.register(self._wake_r, select.EPOLLIN)
            poller.register(client.fileno(), select.EPOLLIN)
            by_fd = {}
            for space in self.spaces:
                poller.register(space.uffd, select.EPOLLIN)
                by_fd[space.uffd] = space
            while True:
                if self._restore_finished.is_set() and not any(s.left() for s in self.spaces if not s.gone):
                    return
                for fd, _ in poller.poll(0.05 if any(s.waiting for s in self.spaces) else 1.0):
                    if fd == self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 64)
                        if self._failure:
                            raise LazyPagesError(self._failure)
                        if self.stopped:
                            raise LazyPagesError("stopped")
                        continue
                    if fd == client.fileno():
                        self._control(client, poller)
                        continue
                    owner = by_fd.get(fd)
                    if owner is not None:
                        for kid in self._read(owner):
                            poller.register(kid.uffd, select.EPOLLIN)
                            by_fd[kid.uffd] = kid
                for space in self.spaces:
                    if space.waiting and not space.gone:
                        waiting, space.waiting = space.waiting, []
                        for address in waiting:
                            self._fault(space, address)
        finally:
            poller.close()

    def _control(self, client: socket.socket, poller: select.epoll) -> None:
        raw = client.recv(4)
        if not raw:  # criu hung up: after RESTORE_FINISHED as it should, or having failed
            poller.unregister(client.fileno())
            if not self._restore_finished.is_set():
                raise _RestoreGone("criu restore hung up before the restore finished")
            return
        if len(raw) < 4:
            raw += client.recv(4 - len(raw), socket.MSG_WAITALL)
        if struct.unpack("=I", raw)[0] != RESTORE_FINISHED:
            raise LazyPagesError(f"unexpected message from criu restore: {raw.hex()}")
        if self.let_go_empty:
            began = time.perf_counter()
            for space in list(self.spaces):
                self._let_go(space)
            self.let_go_seconds = time.perf_counter() - began
        with self._work:
            self._restore_finished.set()
            self._work.notify_all()

    def _let_go(self, space: _Space) -> None:
        """Unregister the process's mappings that have no pages to come: a fault there is the kernel's zero page
        as it would be ours, and the process's mmap, munmap and madvise there no longer wait for this thread to
        read their events (a CUDA driver's restore maps its device memory over such reservations: 30 times in each
        restore of an LLM server, docs/snapshots.md). Called as criu reports the restore finished, which it does
        before it lets the tree go on: a mapping the tree unmapped meanwhile is no longer there to unregister (its
        event, read later, drops nothing); a mapping it moved (mremap) keeps its registration, and should it have
        moved pages still to come into a range unregistered after the move, `_read` registers that range again as
        it reads the move."""
        with space.gate.changing(), space.lock:
            busy = [(lo, hi) for lo, hi, _ in space.urgent] + space.inflight
            empty = [(lo, hi) for lo, hi in space.registered if not space.overlaps(lo, hi) and
                     not any(a < hi and b > lo for a, b in busy)]
            runs: list[list[int]] = []  # neighbours in one call
            for lo, hi in empty:
                if runs and runs[-1][1] == lo:
                    runs[-1][1] = hi
                else:
                    runs.append([lo, hi])
            for lo, hi in runs:
                if self._ioctl(space, _UNREGISTER, _Range(lo, hi - lo)) == 0:
                    space.let_go.append((lo, hi))
                    continue
                for a, b in empty:  # one of them is no longer what the image had: each alone
                    if lo <= a < hi and self._ioctl(space, _UNREGISTER, _Range(a, b - a)) == 0:
                        space.let_go.append((a, b))

    def _read(self, space: _Space) -> list[_Space]:
        """Read the process's messages with its gate taken alone, apply its events, answer its faults."""
        faults, kids = [], []
        began = time.perf_counter()
        with space.gate.changing():
            gated = time.perf_counter()
            try:
                data = os.read(space.uffd, _MSG.size * 64)
            except BlockingIOError:
                return []
            for at in range(0, len(data) - _MSG.size + 1, _MSG.size):
                event, _, _, _, arg = _MSG.unpack_from(data, at)
                if event == _EVENT_PAGEFAULT:
                    faults.append(_MSG_PAGEFAULT.unpack(arg)[1])
                    continue
                with space.lock:
                    if event == _EVENT_FORK:
                        kid = space.child(_MSG_FORK.unpack(arg)[0])
                        self.spaces.append(kid)
                        kids.append(kid)
                    elif event == _EVENT_REMAP:
                        frm, to, length = _MSG_REMAP.unpack(arg)
                        space.move(frm, to, length)
                        moved = space.overlaps(to, to + length) or \
                            any(lo < to + length and hi > to for lo, hi, _ in space.urgent)
                        if moved and any(lo < to + length and hi > to for lo, hi in space.let_go):
                            # pages to come moved into a range let go: it must fault to us again
                            code = self._ioctl(space, _REGISTER, _Register(_Range(to, length), _MODE_MISSING, 0))
                            if code:
                                log.warning("lazy pages of %s: process %d moved pages still to come to %#x, which "
                                            "could not be registered again: %s", self.folder, space.pid, to,
                                            os.strerror(code))
                    elif event in (_EVENT_REMOVE, _EVENT_UNMAP):
                        lo, hi = _MSG_RANGE.unpack(arg)
                        space.dropped += space.drop(lo, hi)
                        if event == _EVENT_REMOVE:  # later faults there are the kernel's zero pages
                            self._ioctl(space, _UNREGISTER, _Range(lo, hi - lo))
                    else:
                        raise LazyPagesError(f"unexpected userfaultfd event {event:#x} from process {space.pid}")
        events = len(data) // _MSG.size - len(faults)
        with space.lock:
            space.faults += len(faults)
            space.events += events
        for address in faults:
            self._fault(space, address - address % PAGE)
        if len(self.reads) < READS_KEPT:
            self.reads.append(Read(began, gated - began, time.perf_counter() - began, len(faults), events,
                                   faults[0] if faults else 0))
        return kids

    def _fault(self, space: _Space, address: int) -> None:
        with space.gate.copying():
            with space.lock:
                if space.gone or space.queued(address):
                    return  # a filler copies it now and wakes the thread
                seg = space.take_around(address, self.fault_bytes)
                if seg is not None:
                    space.inflight.append((seg[0], seg[1]))
                    if self.recording and not (self.released or self.record_ended or space.forked):
                        self.faulted.append((space.pid, seg[0], seg[1]))
            if seg is None:  # not among the pages to come: a hole of the image, or already in
                self._zero(space, address)
                return
            if not self._copy(space, seg):
                with space.lock:
                    space.waiting.append(address)

    # --- copies ---

    def _ioctl(self, space: _Space, request: int, arg: ctypes.Structure) -> int:
        if _libc.ioctl(space.uffd, request, ctypes.byref(arg)) == 0:
            return 0
        return ctypes.get_errno()

    def _copy(self, space: _Space, seg: list[int]) -> bool:
        """Copy `seg` in (taken from the pages to come and marked in flight, under the gate); what the kernel
        refuses for now goes back. False when some of it went back."""
        start, end, offset = seg
        try:
            while start < end:
                arg = _Copy(start, space.source.address + offset, end - start, 0, 0)
                code = self._ioctl(space, _COPY, arg)
                done = arg.copy if arg.copy > 0 else 0
                with space.lock:
                    space.copied += done
                start, offset = start + done, offset + done
                if code == 0 or start >= end:
                    return True
                if code == errno.EAGAIN and done:
                    continue  # part copied: go on with the rest
                if code == errno.EEXIST or -arg.copy == errno.EEXIST:
                    start, offset = start + PAGE, offset + PAGE  # that page is in already
                    with space.lock:
                        space.skipped += PAGE
                    continue
                if code == errno.EAGAIN:
                    with space.lock:  # the mapping changes: again once its event is read
                        space.give_back([start, end, offset])
                    return False
                if code in (errno.ESRCH, errno.ENOSPC):
                    with space.lock:
                        space.gone = True  # the process exited
                    return True
                if code == errno.ENOENT:
                    if end - start > PAGE:  # a mapping split since the dump: page by page from here
                        if not self._copy(space, [start, start + PAGE, offset]):
                            with space.lock:
                                space.give_back([start + PAGE, end, offset + PAGE])
                            return False
                        start, offset = start + PAGE, offset + PAGE
                        continue
                    with space.lock:
                        space.skipped += end - start
                    return True  # no registered mapping there any more: nothing to fill
                raise OSError(code, f"copying {end - start} bytes into process {space.pid} at {start:#x}: "
                                    f"{os.strerror(code)}")
            return True
        finally:
            with space.lock, contextlib.suppress(ValueError):
                space.inflight.remove((seg[0], seg[1]))

    def _zero(self, space: _Space, address: int) -> None:
        code = self._ioctl(space, _ZEROPAGE, _Zero(address, PAGE, 0, 0))
        if code == errno.EEXIST:
            self._ioctl(space, _WAKE, _Range(address, PAGE))
        elif code == errno.EAGAIN:
            with space.lock:
                space.waiting.append(address)
        elif code in (errno.ESRCH, errno.ENOSPC):
            space.gone = True
        elif code == errno.ENOENT:  # the mapping went while a thread waited on it: let it see that
            self._ioctl(space, _WAKE, _Range(address, PAGE))
        elif code != 0:
            raise OSError(code, f"zero page into process {space.pid} at {address:#x}: {os.strerror(code)}")

    def _fill(self) -> None:
        """A background filler: once criu has finished, copies the ranges of `order`, then (released, or after
        `hold` seconds) the rest of the pages to come, `fill_bytes` at a time."""
        with self._work:
            while not self._restore_finished.is_set():
                self._work.wait()
        fetched = self._prefetch()
        with self._work:
            self._prefetching -= 1
            if not self._prefetching:
                self.fetched_first_at, self.faults_first = time.perf_counter(), self.faults
                self.fetched_first.set()
        if not fetched:
            return
        with self._work:  # the rest once the wake is done
            self._work.wait_for(lambda: self.released or self.hold <= 0 or self.stopped or self._failure or
                                self._ending, timeout=self.hold)
        turn = 0
        while not (self.stopped or self._failure or self._ending):
            spaces = [s for s in self.spaces if not s.gone]
            copied = False
            for k in range(len(spaces)):
                space = spaces[(turn + k) % len(spaces)]
                with space.gate.copying():
                    with space.lock:
                        seg = None if space.gone else space.take_next(self.fill_bytes)
                        if seg is not None:
                            space.inflight.append((seg[0], seg[1]))
                    if seg is None:
                        continue
                    try:
                        copied = self._copy(space, seg)
                    except OSError as exc:
                        self._fail(str(exc))
                        return
                break
            turn += 1
            if not copied:
                if not any(s.left() for s in spaces):
                    self._poke(b"w")
                    return
                time.sleep(0.0005)  # what is left is in flight, or refused until an event is read

    def _prefetch(self) -> bool:
        """Copy the ranges of `order` in, shared out among the fillers one range at a time; False when the
        server failed or stops."""
        ours = {space.pid: space for space in self.spaces if not space.forked}
        while not (self.stopped or self._failure or self._ending):
            with self._work:
                if self._order_at >= len(self._pieces):
                    return True
                pid, lo, hi = self._pieces[self._order_at]
                self._order_at += 1
            space = ours[pid]
            while True:
                with space.gate.copying():
                    with space.lock:
                        seg = None if space.gone else space.take_within(lo, hi, self.fill_bytes)
                        if seg is not None:
                            space.inflight.append((seg[0], seg[1]))
                    if seg is None:
                        break
                    try:
                        if not self._copy(space, seg):
                            break  # refused until an event is read: the rest fill takes it from there
                    except OSError as exc:
                        self._fail(str(exc))
                        return False
        return False
