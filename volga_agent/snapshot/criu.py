"""CRIU engine: freeze a worker's whole process tree into an image folder and restore it.

Facts this code is built on (measured on the target kernels; docs/architecture.md, Tiers):

- CRIU 4.x is needed (3.17 fails on current vDSO layouts), 4.2 for processes holding TCP or UDP sockets on kernels
  >= 6.16 (model servers, `node.server`). `scripts/install-criu.sh` installs 4.2.1 into a private root; this module
  finds it through `VOLGA_CRIU`, the install prefix, or PATH.
- onnxruntime holds file locks, so dumps and restores pass `--file-locks`.
- Each worker is the init of its own PID namespace (see `worker.nsinit`), so restores never collide on
  PIDs; CRIU recreates the namespace from the image.
- A dump is written into a temporary folder beside its final place and renamed when complete, so a
  reader never sees half an image; the engine owns its image folders and removes them.
- "RLIMIT_NOFILE ... Operation not permitted" in CRIU's log is harmless on unprivileged-resource kernels.
- What a failed restore leaves (the image, CRIU's logs, the worker's log) is kept under `failed/` for
  inspection, the newest few only (`keep_failed`).
- A damaged image can make criu hang for good (a truncated pages file leaves the restored task spinning in
  CRIU's restorer). Every call therefore has a deadline (`Deadlines`: a floor plus seconds per GiB of what
  it moves), after which its whole process tree is killed, criu's children included: the restored tree has
  left criu's process group by then, so the tree is found through /proc. `close` kills the calls in flight.
- The canary check misses damage to memory the canary input does not read (bytes flipped in embedding rows
  that only some inputs touch). With `checksums`, a dump records a CRC-32 of each 16 MiB of its pages files,
  from a few threads, in the background, and a restore checks them while criu runs: a damaged image fails the
  restore, and a truncated one stops criu as soon as the check is done (the agent turns it on:
  `verify_image_checksums`). Beside the CRCs the dump records each pages file's identity and change times
  (`Stamps`, taken before and after the CRC pass): a restore of an image this engine wrote whose files still
  carry those stamps (nothing wrote, truncated or replaced them since) skips the CRC pass, which on 2 shared
  cores cost a 98 MiB FROZEN wake 20-45 ms; a changed stamp, or an image from a shared store (no stamps), gets
  the full check. The canary still checks every restore.
- criu probes the kernel at the start of every call (~30 ms) unless /run/criu.kdat caches the result, which
  it keeps only on a tmpfs /run; `kdat.ensure` gives it that cache where /run is a disk.
- criu runs with a parent-death signal (through `setpriv`, where it is installed) and with the agent's owner
  token in its environment, so it dies with the agent, and what a killed agent leaves can be proven its own
  (see `process`). Image folders carry an owner marker; `sweep` removes those whose owner is dead.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import mmap
import os
import pathlib
import select
import shutil
import subprocess
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from volga_agent.host import process
from volga_agent.snapshot import kdat, lazypages
from volga_agent.worker import contract, nsinit

# Where scripts/install-criu.sh installs, under the home folder (read only when looking for CRIU: a process
# whose user has no home, such as a gateway running under a bare UID, imports this module too).
DEFAULT_PREFIX = pathlib.Path("~/.cache/volga/criu")
FAILED = "failed"
# The longest a lazy restore for a wake holds back the pages the wake did not ask for, when nobody says the wake
# is done (`Restored.release`).
LAZY_HOLD_SEC = 5.0
LAZY_PAGES_FILLS = ("auto", "after-wake", "record-first", "at-once")
# criu restore stops every restored thread at its last step (rt_sigreturn) before letting the tree go. By default it
# sets a hardware breakpoint there through ptrace: on the H200 machines criu's wait for those stops took 10-35 ms in
# a third of the restores of GPU workers (every other step of their restores under 3 ms); on a 2-CPU VM, in restores
# that ran with the kernel busy copying memory, 12-15 ms in 2 of 12, strace showing the tree's first breakpoint set in
# 12 ms. With FI_NO_BREAKPOINTS (130), a "fault" criu lists as not fatal, it traces each thread's system calls to
# that step instead, as it restores on machines without breakpoints: at most 1 ms in the same restores, and no
# slower where breakpoints cost nothing (bench/criu_last_stop.py; docs/snapshots.md, criu's last stop).
NO_BREAKPOINTS = {"CRIU_FAULT": "130"}
log = logging.getLogger(__name__)


class CriuError(RuntimeError):
    """A CRIU call failed; the message carries the end of CRIU's log."""


class CriuTimeout(CriuError):
    """A CRIU call ran past its deadline; its process tree was killed."""


class CriuCancelled(CriuError):
    """The engine was closed (the agent is stopping) while the call ran; its process tree was killed."""


@dataclasses.dataclass(frozen=True)
class Deadlines:
    """How long a CRIU call may take: `floor_sec` plus `sec_per_gib` for each GiB it moves (an image restored,
    a process dumped)."""

    floor_sec: float = 10.0
    sec_per_gib: float = 10.0

    def for_bytes(self, size: int) -> float:
        return self.floor_sec + self.sec_per_gib * size / 2**30


@dataclasses.dataclass(frozen=True)
class Image:
    """A published CRIU image folder."""

    path: pathlib.Path
    snapshot_id: str
    size_bytes: int
    dump_seconds: float
    # (pages file, CRC-32) of each pages file, computed in the background after the dump; None when not recorded.
    checksums: concurrent.futures.Future[Checksums] | None = None
    # The pages files' stamps the CRCs were computed under (None inside: they changed during the pass); None when
    # not recorded, as for images from a shared store.
    stamps: concurrent.futures.Future[Stamps | None] | None = None
    # Files the process mapped from the folders `dump` was told to watch, with their identity then: CRIU records a
    # file mapping by path, not by content, so a restore after one changed would mix the old process with the new
    # file (an ONNX model's external data replaced by new weights). `restore` refuses then.
    mapped: tuple[tuple[str, Identity], ...] = ()
    # False when a lazy restore of this image is known to fail, so its owner restores it eagerly (a GPU worker
    # that held pinned memory at the driver's checkpoint: `gpu_freeze.Freeze.capture_all`).
    lazy_restorable: bool = True


class LazyPages:
    """The page server of one lazy restore: Volga's own (`lazypages.Server`, the default) or a `criu lazy-pages`
    daemon. Until it has delivered every page and stopped, part of the process's memory exists only in the
    image: a dump taken then would miss those pages (the kernel reports them as never touched) and the next
    restore would bring them back as zeros."""

    def __init__(self, daemon: subprocess.Popen[Any] | None = None, server: lazypages.Server | None = None,
                 keep: Callable[[list[lazypages.Range]], None] | None = None) -> None:
        self.daemon = daemon
        self.server = server
        self._keep = keep  # takes the record of the wake it served (`release`)
        self.done = server.done if server is not None else threading.Event()
        self._exit_code: int | None = None
        self.pid: int | None = None  # the restored tree's root, once criu has restored it, and its start time
        self.pid_started: int | None = None
        self.abort: concurrent.futures.Future[str] | None = None  # stops the criu restore it serves
        self._stopped = False  # killed by us: the process it served is gone
        self._finished: float | None = None  # time.perf_counter() when it exited

    @property
    def exit_code(self) -> int | None:
        return self.server.exit_code if self.server is not None else self._exit_code

    @property
    def stopped(self) -> bool:
        return self.server.stopped if self.server is not None else self._stopped

    @property
    def finished(self) -> float | None:
        return self.server.finished if self.server is not None else self._finished

    def exited(self, code: int) -> None:
        """The daemon's reaper: it exited with `code`."""
        self._finished = time.perf_counter()
        self._exit_code = code
        self.done.set()

    @property
    def failed(self) -> bool:
        """It ended without delivering every page, and not because it was told to stop."""
        return self.exit_code not in (None, 0) and not self.stopped

    def kill_restored(self) -> None:
        """Kill the tree it served, if restored and still that tree: it runs with pages missing (zeros)."""
        if self.pid is not None and process.start_time(self.pid) == self.pid_started:
            log.warning("killing pid %d: its memory is incomplete", self.pid)
            process.kill_tree(self.pid)

    @property
    def error(self) -> str:
        """Why serving failed, as far as it is known."""
        if self.server is not None:
            return self.server.error
        return f"criu lazy-pages exited with {self.exit_code}" if self.exit_code else ""

    def wait(self, pid: int, timeout: float) -> None:
        if not self.done.wait(timeout):
            self.stop()
            raise CriuTimeout(f"pid {pid}: the lazy-pages server has not delivered every page after {timeout:g} s")
        if self.exit_code != 0:
            raise CriuError(f"pid {pid}: the lazy-pages server failed ({self.error}): pages may be missing")

    def end_record(self) -> None:
        """Faults from now on are not kept for the next restore (`lazypages.Server.end_record`)."""
        if self.server is not None:
            self.server.end_record()

    def release(self) -> None:
        """The wake it served is done: the pages held back until then come now (`lazypages.Server.release`), and
        the ranges this wake faulted on are kept for the next restore of the same process."""
        if self.server is not None:
            record = self.server.release()
            if record is not None and self._keep is not None:
                self._keep(record)

    def stop(self) -> None:
        """Stop serving if it still does (a daemon is killed; its reaper thread collects it)."""
        if self.server is not None:
            self.server.stop()
        elif not self.done.is_set():
            self._stopped = True
            with contextlib.suppress(ProcessLookupError):
                self.daemon.kill()  # type: ignore[union-attr]


@dataclasses.dataclass(frozen=True)
class Restored:
    pid: int
    seconds: float
    lazy_pages: LazyPages | None = None
    started: float = 0.0  # time.perf_counter() when criu was started

    def pages_seconds(self, timeout: float) -> float | None:
        """Seconds from the restore's start until the lazy-pages daemon had delivered every page, waiting up to
        `timeout` for it; None for an eager restore or a daemon still running."""
        if self.lazy_pages is None or not self.lazy_pages.done.wait(timeout) or self.lazy_pages.finished is None:
            return None
        return self.lazy_pages.finished - self.started

    def wait_for_pages(self, timeout: float) -> None:
        """Return once the restored process holds all of its memory (at once for eager restores)."""
        if self.lazy_pages is not None:
            self.lazy_pages.wait(self.pid, timeout)

    def end_record(self) -> None:
        """The part of the wake the next restore should have ready is over (a GPU process's driver restore): what
        faults from now on is not brought first next time."""
        if self.lazy_pages is not None:
            self.lazy_pages.end_record()

    def release(self) -> None:
        """The restored process has woken: its lazy pages held back for the wake come now."""
        if self.lazy_pages is not None:
            self.lazy_pages.release()

    def stop(self) -> None:
        """The restored process is gone: a lazy-pages daemon still serving it goes too."""
        if self.lazy_pages is not None:
            self.lazy_pages.stop()


def _installed() -> str:
    try:
        return str(pathlib.Path(os.environ.get("VOLGA_CRIU_PREFIX", DEFAULT_PREFIX)).expanduser() / "bin" / "criu")
    except RuntimeError:  # no home folder
        return ""


def find_criu() -> str:
    candidates = [os.environ.get("VOLGA_CRIU", ""),
                  _installed(),
                  shutil.which("criu") or ""]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise CriuError("criu not found: run scripts/install-criu.sh (installs CRIU 4.2 into "
                    f"{DEFAULT_PREFIX}) or set VOLGA_CRIU to the criu binary")


def find_init(criu: str) -> str:
    """tini, the init a model server's PID namespace runs under (`worker.nsinit --init`): VOLGA_TINI, the one
    scripts/install-criu.sh puts beside `criu` (Debian's static build), or one on PATH."""
    installed = _installed()
    candidates = [os.environ.get("VOLGA_TINI", ""), str(pathlib.Path(criu).parent / "tini"),
                  str(pathlib.Path(installed).parent / "tini") if installed else "",
                  shutil.which("tini-static") or "", shutil.which("tini") or ""]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise CriuError("tini not found: a model server runs under tini as the init of its PID namespace; "
                    "scripts/install-criu.sh installs it beside criu, or set VOLGA_TINI to a tini binary")


@functools.lru_cache(maxsize=8)
def command(criu: str) -> tuple[str, ...]:
    """How to start `criu`. A relocatable install (scripts/install-criu.sh: a wrapper script in `bin/` beside a private
    root of criu and its libraries, glibc's loader included) is started through that loader straight, as the wrapper
    would start it, without the shell and the two programs the wrapper runs to find its root: 3 ms less for every
    dump and restore on a 2-CPU VM (docs/snapshots.md, What the snapshot code is built on). Any other criu is
    started as it is."""
    found = pathlib.Path(criu).resolve()
    root = found.parent.parent / "root"
    binary = root / "usr" / "sbin" / "criu"
    loaders = sorted(root.glob("usr/lib/*/ld-linux*.so.*"))
    try:
        with found.open("rb") as f:
            wrapper = f.read(2) == b"#!"
    except OSError:
        return (criu,)
    if not wrapper or len(loaders) != 1 or not binary.is_file():
        return (criu,)
    return str(loaders[0]), "--library-path", str(loaders[0].parent), str(binary)


def _tree_size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# Per pages file of an image: its name and a CRC-32 of each CHECKSUM_CHUNK bytes.
Checksums = tuple[tuple[str, tuple[int, ...]], ...]
CHECKSUM_CHUNK = 16 * 2**20
CHECKSUM_THREADS = max(1, min(4, os.cpu_count() or 1))


def _checksums(folder: pathlib.Path) -> Checksums:
    """A CRC-32 per 16 MiB of each pages file, computed from several threads (zlib releases the GIL)."""
    sums: list[tuple[str, tuple[int, ...]]] = []
    for pages in sorted(folder.glob("pages-*.img")):
        with pages.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                sums.append((pages.name, ()))
                continue
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as data, memoryview(data) as view, \
                    concurrent.futures.ThreadPoolExecutor(CHECKSUM_THREADS) as pool:
                crcs = tuple(pool.map(lambda at: zlib.crc32(view[at:at + CHECKSUM_CHUNK]),
                                      range(0, size, CHECKSUM_CHUNK)))
        sums.append((pages.name, crcs))
    return tuple(sums)


# A file's device, inode, size, modification and change times (ns): any write, truncation or replacement through
# the filesystem changes one of them.
Identity = tuple[int, int, int, int, int]
Stamps = tuple[tuple[str, int, int, int, int, int], ...]  # per pages file of an image: its name and identity


def identity(path: str | pathlib.Path) -> Identity | None:
    """What tells a file's contents unchanged since (None when it is gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _stamps(folder: pathlib.Path) -> Stamps:
    stamps = []
    for pages in sorted(folder.glob("pages-*.img")):
        found = identity(pages)
        if found is not None:
            stamps.append((pages.name, *found))
    return tuple(stamps)


def _mapped(pid: int, folders: Sequence[pathlib.Path]) -> tuple[tuple[str, Identity], ...]:
    """The files process `pid` maps from inside `folders`, each with its identity now."""
    if not folders:
        return ()
    found = []
    for path in sorted(contract.mapped_files(pid)):
        if any(pathlib.PurePath(path).is_relative_to(folder) for folder in folders):
            now = identity(path)
            if now is not None:
                found.append((path, now))
    return tuple(found)


def _record(folder: pathlib.Path, sums: concurrent.futures.Future[Checksums],
            stamps: concurrent.futures.Future[Stamps | None]) -> None:
    """Settle the checksums of a fresh image and the stamps its files had throughout the CRC pass."""
    try:
        before = _stamps(folder)
        crcs = _checksums(folder)
        stamps.set_result(before if _stamps(folder) == before else None)
    except Exception as exc:  # an unreadable image is a damaged one; the reader of the future decides
        stamps.set_result(None)
        sums.set_exception(exc)
        return
    sums.set_result(crcs)


def _settle(future: concurrent.futures.Future[Any], compute: Callable[[], Any]) -> None:
    try:
        future.set_result(compute())
    except Exception as exc:  # an unreadable image is a damaged one; the reader of the future decides
        future.set_exception(exc)


def _offer(future: concurrent.futures.Future[str], reason: str) -> None:
    """Give `future` its first non-empty reason."""
    if reason:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            future.set_result(reason)


def _log_tail(log: pathlib.Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = [line for line in text if "Error" in line and "RLIMIT_NOFILE" not in line]
    return "\n".join((errors or text)[-lines:])


def resolve_fill(fill: str, gpu: bool) -> str:
    """`fill` (`LAZY_PAGES_FILLS`) for a process that holds a CUDA context (`gpu`) or not: "auto" holds the fill
    until after the wake on the CPU only, and fills a GPU process at once with its record first (docs/snapshots.md,
    Lazy pages)."""
    if fill != "auto":
        return fill
    return "record-first" if gpu else "after-wake"


class CriuEngine:
    """Dumps and restores process trees under one snapshot root folder."""

    def __init__(self, root: str | pathlib.Path, criu: str | None = None, keep_failed: int = 3,
                 deadlines: Deadlines | None = None, checksums: bool = False, lazy_pages_server: str | None = None,
                 lazy_pages_threads: int | None = None, lazy_pages_fill: str | None = None,
                 log_level: int | None = None) -> None:
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.criu = criu or find_criu()
        self.keep_failed = keep_failed
        self.deadlines = deadlines or Deadlines()
        self.checksums = checksums
        # Lazy-pages servers that failed: the process they served may have missed pages.
        self.lazy_daemon_failures = 0
        # Who serves a lazy restore's pages: "volga" (`lazypages.Server`, in this process, `lazy_pages_threads`
        # filling in the background; None: by the image's size) or "criu" (a `criu lazy-pages` daemon). Where the
        # caller does not say, the environment may (the benches: VOLGA_LAZY_PAGES_SERVER, _THREADS, _FILL_KIB,
        # _FAULT_KIB, _FILL, _LET_GO).
        self.lazy_pages_server = lazy_pages_server or os.environ.get("VOLGA_LAZY_PAGES_SERVER", "volga")
        if self.lazy_pages_server not in ("volga", "criu"):
            raise ValueError(f"lazy pages server {self.lazy_pages_server!r}: it is 'volga' or 'criu'")
        threads = os.environ.get("VOLGA_LAZY_PAGES_THREADS", "")
        self.lazy_pages_threads = lazy_pages_threads or (int(threads) if threads else None)
        self.lazy_pages_fill_bytes = 1024 * int(os.environ.get("VOLGA_LAZY_PAGES_FILL_KIB",
                                                               lazypages.FILL_BYTES // 1024))
        self.lazy_pages_fault_bytes = 1024 * int(os.environ.get("VOLGA_LAZY_PAGES_FAULT_KIB",
                                                                lazypages.FAULT_BYTES // 1024))
        # Whether the mappings with no pages to come are unregistered as the restore finishes (`lazypages`).
        self.lazy_pages_let_go = os.environ.get("VOLGA_LAZY_PAGES_LET_GO", "1") != "0"
        # How much criu's logs (dump.log, restore.log, lazy-pages.log beside each image) say: 2 (errors and warnings,
        # the default), 4 (every step, each line timestamped: what the benches that follow a restore read).
        self.log_level = log_level or int(os.environ.get("VOLGA_CRIU_LOG_LEVEL") or 2)
        if self.log_level not in range(5):
            raise ValueError(f"criu log level {self.log_level}: it is 0 to 4")
        # Whether criu restore stops each restored thread at its last step with a hardware breakpoint (criu's
        # default) or by tracing its system calls to it (`NO_BREAKPOINTS`, the default here).
        self.breakpoints = os.environ.get("VOLGA_CRIU_BREAKPOINTS", "0") == "1"
        # How the agent's server fills a wake's pages: "after-wake" (first those the last wake of the same process
        # faulted on, the rest once the wake is done: `lazypages`), "record-first" (first those the last wake
        # faulted on before `Restored.end_record`, the rest at once beside them), "at-once" (all from the start,
        # in address order, nothing recorded), or "auto": after the wake on the CPU, record first for a process
        # holding a CUDA context (docs/snapshots.md, Lazy pages).
        self.lazy_pages_fill = lazy_pages_fill or os.environ.get("VOLGA_LAZY_PAGES_FILL", "auto")
        if self.lazy_pages_fill not in LAZY_PAGES_FILLS:
            raise ValueError(f"lazy pages fill {self.lazy_pages_fill!r}: it is one of {', '.join(LAZY_PAGES_FILLS)}")
        # Per folder of an instance's images: the ranges its last lazy wake faulted on (`lazypages.Server.record`).
        # A restored process keeps its addresses, so they hold from one image of it to the next.
        self._records: dict[pathlib.Path, list[lazypages.Range]] = {}
        self.timeouts = 0  # calls killed at their deadline
        self._lock = threading.Lock()
        self._failures_lock = threading.Lock()  # keep_failure's copy and prune, one instance at a time
        self._calls: set[subprocess.Popen[Any]] = set()
        self._daemons: set[LazyPages] = set()
        self._closed = False
        nsinit.become_subreaper()  # restored trees and the children of killed criu calls come back to us
        kdat.ensure(self.criu)
        self.sweep()

    def sweep(self) -> list[pathlib.Path]:
        """Remove the images (finished or half-written) of agents that are dead; failed/ is kept on purpose."""
        removed = []
        for folder in self.root.iterdir() if self.root.is_dir() else ():
            if folder.name != FAILED and folder.is_dir() and not folder.is_symlink():
                removed += process.remove_abandoned(folder.iterdir())
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only when it is empty
        for path in removed:
            log.warning("removed %s, left by an agent that is gone", path)
        return removed

    def close(self) -> None:
        """Refuse new calls and kill the ones in flight (they raise CriuCancelled), lazy-pages daemons included."""
        with self._lock:
            self._closed = True
            calls, daemons = list(self._calls), list(self._daemons)
        for call in calls:
            process.kill_tree(call.pid, reap_root=False)
        for daemon in daemons:
            daemon.stop()

    @property
    def argv(self) -> tuple[str, ...]:
        """What starts criu (`command`)."""
        return command(self.criu)

    def _command(self, args: list[str]) -> list[str]:
        # criu dies with the agent rather than finish a dump or a restore nobody waits for.
        return process.dying_with_parent([*self.argv, *args])

    def _popen(self, args: list[str], **options: Any) -> subprocess.Popen[Any]:
        env = process.owned_env()
        if args[:1] == ["restore"] and not self.breakpoints:
            env.update(NO_BREAKPOINTS)
        with self._lock:
            if self._closed:
                raise CriuCancelled(f"criu {args[0]}: the snapshot engine is closed")
            proc: subprocess.Popen[Any] = subprocess.Popen(self._command(args), env=env, start_new_session=True,
                                                           **options)
            self._calls.add(proc)
        return proc

    def _run(self, args: list[str], timeout: float, abort: concurrent.futures.Future[str] | None = None
             ) -> subprocess.CompletedProcess[str]:
        """Run criu with `args`; CriuTimeout (its tree killed) after `timeout` s, CriuCancelled when closed, and
        CriuError (its tree killed) as soon as `abort` gives a reason."""
        proc = self._popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    out, err = proc.communicate(timeout=max(0.0, min(0.02, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    reason = abort.result() if abort is not None and abort.done() else ""
                    if not reason and time.monotonic() < deadline:
                        continue
                    process.kill_tree(proc.pid, reap_root=False)
                    proc.communicate()
                    if reason:
                        raise CriuError(f"criu {args[0]} stopped: {reason}") from None
                    self.timeouts += 1
                    raise CriuTimeout(f"criu {args[0]} passed its deadline of {timeout:.1f} s and was killed "
                                      "with its whole process tree") from None
        finally:
            with self._lock:
                self._calls.discard(proc)
        if self._closed and proc.returncode < 0:  # killed by close()
            raise CriuCancelled(f"criu {args[0]} was stopped: the agent is stopping")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def version(self) -> str:
        out = self._run(["--version"], self.deadlines.floor_sec)
        return out.stdout.strip().splitlines()[0] if out.stdout else "unknown"

    def check(self) -> None:
        out = self._run(["check"], self.deadlines.floor_sec)
        if out.returncode != 0:
            raise CriuError(f"criu check failed: {out.stdout}{out.stderr}")

    def dump(self, pid: int, name: str, leave_running: bool = False, watch: Sequence[pathlib.Path] = (),
             close_connections: bool = False) -> Image:
        """Dump the tree rooted at `pid` (killing it unless leave_running) into a new image of `name`, recording
        the files it maps from the folders in `watch` (`Image.mapped`); with `close_connections`, its open TCP
        connections too, to be restored closed (criu's --tcp-close). CriuTimeout after the deadline for the tree's
        resident memory; the tree may then be left half-dumped."""
        if name == FAILED:
            raise ValueError(f"{FAILED!r} is the folder of failed restores, not an image name")
        folder = self.root / name
        snapshot_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        tmp = folder / f".tmp-{snapshot_id}"
        args = ["dump", "-t", str(pid), "-D", str(tmp), "-o", "dump.log", f"-v{self.log_level}", "--file-locks",
                "--shell-job"]
        if leave_running:
            args.append("--leave-running")
        if close_connections:
            args.append("--tcp-close")
        mapped = _mapped(pid, watch)
        start = time.perf_counter()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            process.claim(tmp)
            out = self._run(args, self.deadlines.for_bytes(sum(process.rss(p) for p in process.tree(pid))))
        except CriuError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except OSError as exc:  # a full or read-only snapshot disk: the dump is abandoned like a failed one
            shutil.rmtree(tmp, ignore_errors=True)
            raise CriuError(f"criu dump of pid {pid}: cannot write {tmp}: {exc}") from exc
        seconds = time.perf_counter() - start
        if out.returncode != 0:
            detail = _log_tail(tmp / "dump.log")
            shutil.rmtree(tmp, ignore_errors=True)
            raise CriuError(f"criu dump of pid {pid} failed (exit {out.returncode}):\n{detail}")
        final = folder / snapshot_id
        os.rename(tmp, final)
        sums = stamps = None
        if self.checksums:
            sums, stamps = concurrent.futures.Future[Checksums](), concurrent.futures.Future[Stamps | None]()
            threading.Thread(target=_record, args=(final, sums, stamps), name="image-checksums", daemon=True).start()
        return Image(final, snapshot_id, _tree_size(final), seconds, sums, stamps, mapped)

    def damage(self, image: Image) -> str:
        """Why the image's pages files are not the ones its dump wrote ("" when they are, or are not recorded)."""
        if image.checksums is None or image.checksums.exception() is not None:
            return ""
        try:
            stamps = image.stamps.result() if image.stamps is not None else None
            if stamps is not None and stamps == _stamps(image.path):
                return ""  # untouched since the CRCs were taken from it
            if image.checksums.result() == _checksums(image.path):
                return ""
        except OSError as exc:
            return f"image {image.path} is damaged: cannot read its pages files: {exc}"
        return f"image {image.path} is damaged: its pages files do not match the checksums taken at its dump"

    def restore(self, image: Image, lazy: bool = False, wake: bool = False, gpu: bool = False) -> Restored:
        """Restore an image detached; the restored root is re-parented to our child subreaper.

        With `lazy`, a page server (`lazy_pages_server`) serves the memory pages through userfaultfd: the process
        runs as soon as its tree is rebuilt, pages arrive when first touched (and in the background), and the
        server stops once every page is delivered. With `wake` too (the restored process is to serve at once),
        where `lazy_pages_fill` says so for it (`gpu`: it holds a CUDA context), the agent's server fills first
        the pages the last wake of this instance faulted on and ("after-wake") holds the rest back until
        `Restored.release()` (at most `LAZY_HOLD_SEC`), which records this wake's faults for the next (those
        until `Restored.end_record()`, where that is called). A server that fails stops criu
        (CriuError), or, once the restore is done, kills the restored tree: its memory would read as zeros where
        pages did not come.

        CriuTimeout when criu has not finished within the deadline for the image's size: criu, the tree it was
        restoring and the lazy-pages server are killed. CriuError, before criu runs, when a file the image maps
        changed since the dump (`Image.mapped`).
        """
        for path, then in image.mapped:
            if identity(path) != then:
                raise CriuError(f"{path}, which the image maps, changed since the snapshot")
        check = concurrent.futures.Future[str]()
        abort = concurrent.futures.Future[str]()  # a reason to stop criu: damage found, or pages not served
        check.add_done_callback(lambda done: _offer(abort, "" if done.exception() else done.result()))
        threading.Thread(target=_settle, args=(check, lambda: self.damage(image)), name="image-check",
                         daemon=True).start()
        pidfile = image.path / "restore.pid"
        pidfile.unlink(missing_ok=True)
        args = ["restore", "-D", str(image.path), "-o", "restore.log", f"-v{self.log_level}", "--file-locks",
                "--shell-job", "--restore-detached", "--pidfile", str(pidfile),
                # An image dumped with open TCP connections (`dump(close_connections=True)`) is restored only so:
                # they come back closed. No other image has any.
                "--tcp-close"]
        timeout = self.deadlines.for_bytes(image.size_bytes)
        start = time.perf_counter()
        pages = None
        if lazy:
            pages = self._lazy_pages(image, wake, gpu)
            pages.abort = abort
            with self._lock:
                self._daemons.add(pages)
            threading.Thread(target=self._reap_lazy_pages, args=(pages, image), name="lazy-pages-reaper",
                             daemon=True).start()
            args.append("--lazy-pages")
        try:
            out = self._run(args, max(0.0, timeout - (time.perf_counter() - start)), abort=abort)
            damaged = check.result() if out.returncode == 0 else ""
            if damaged:  # restored from a damaged image: it goes before it serves
                process.kill_tree(int(pidfile.read_text().strip()))
                raise CriuError(damaged)
        except CriuError:
            if pages is not None:
                pages.stop()
            raise
        seconds = time.perf_counter() - start
        if out.returncode != 0:
            if pages is not None:
                pages.stop()
            raise CriuError(f"criu restore of {image.path} failed (exit {out.returncode}):\n"
                            f"{_log_tail(image.path / 'restore.log')}")
        pid = int(pidfile.read_text().strip())
        if pages is not None:
            pages.pid, pages.pid_started = pid, process.start_time(pid)
            if pages.failed:  # before we knew the tree: its reaper could not kill it
                pages.kill_restored()
                raise CriuError(f"the lazy pages of {image.path} could not be served: {pages.error}")
        return Restored(pid, seconds, pages, start)

    def _reap_lazy_pages(self, pages: LazyPages, image: Image) -> None:
        if pages.daemon is not None:
            pages.exited(pages.daemon.wait())
        else:
            pages.done.wait()
        with self._lock:
            if pages.daemon is not None:
                self._calls.discard(pages.daemon)
            self._daemons.discard(pages)
        if pages.failed:
            self.lazy_daemon_failures += 1
            why = pages.error if pages.server is not None else \
                f"{pages.error}:\n{_log_tail(image.path / 'lazy-pages.log')}"
            log.warning("the lazy pages of %s could not all be served: %s", image.path, why)
            if pages.abort is not None:
                _offer(pages.abort, f"its lazy pages could not be served: {pages.error}")
            pages.kill_restored()

    def _lazy_pages(self, image: Image, wake: bool, gpu: bool) -> LazyPages:
        """Start the page server of a lazy restore (`lazy_pages_server`) and return once it listens."""
        timeout = self.deadlines.for_bytes(image.size_bytes)
        if self.lazy_pages_server == "volga":
            with self._lock:
                if self._closed:
                    raise CriuCancelled("lazy pages: the snapshot engine is closed")
                fill = self.fill_for(gpu) if wake else "at-once"
                recorded = fill in ("after-wake", "record-first")
                order = self._records.get(image.path.parent, []) if recorded else []
            try:
                server = lazypages.Server(
                    image.path, threads=self.lazy_pages_threads, fill_bytes=self.lazy_pages_fill_bytes,
                    fault_bytes=self.lazy_pages_fault_bytes, order=order,
                    hold=LAZY_HOLD_SEC if fill == "after-wake" else 0.0, record=recorded,
                    record_bytes=lazypages.RECORD_BYTES if fill == "after-wake" else lazypages.RECORD_FIRST_BYTES,
                    let_go_empty=self.lazy_pages_let_go)
            except (OSError, lazypages.LazyPagesError) as exc:
                raise CriuError(f"cannot serve the lazy pages of {image.path}: {exc}") from exc
            try:
                server.listen()
            except OSError as exc:
                server.close()
                raise CriuError(f"cannot serve the lazy pages of {image.path}: {exc}") from exc
            # criu's own deadline decides a restore that hangs (CriuTimeout: no eager retry); the server's wait for
            # criu's connection only guards against one that never comes, so it is given longer.
            server.start(2 * timeout)
            return LazyPages(server=server, keep=functools.partial(self._keep_record, image.path.parent))
        (image.path / "lazy-pages.socket").unlink(missing_ok=True)
        ready, status = os.pipe()
        try:
            daemon = self._popen(["lazy-pages", "-D", str(image.path), "-o", "lazy-pages.log", f"-v{self.log_level}",
                                  "--status-fd", str(status)], pass_fds=[status],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.close(status)
            status = -1
            listening, _, _ = select.select([ready], [], [], timeout)
            if not listening or not os.read(ready, 1):
                process.kill_tree(daemon.pid, reap_root=False)
                daemon.wait()
                with self._lock:
                    self._calls.discard(daemon)
                if self._closed:
                    raise CriuCancelled("criu lazy-pages was stopped: the agent is stopping")
                late = "" if listening else f" within {timeout:.1f} s"
                raise (CriuError if listening else CriuTimeout)(
                    f"criu lazy-pages for {image.path} did not start{late}:\n"
                    f"{_log_tail(image.path / 'lazy-pages.log')}")
            return LazyPages(daemon=daemon)
        finally:
            os.close(ready)
            if status >= 0:
                os.close(status)

    def fill_for(self, gpu: bool) -> str:
        """When a wake's lazy pages that its record does not hold come (`lazy_pages_fill` with "auto" resolved)."""
        return resolve_fill(self.lazy_pages_fill, gpu)

    def _keep_record(self, folder: pathlib.Path, record: list[lazypages.Range]) -> None:
        with self._lock:
            if folder.is_dir():  # not for an instance whose images are gone (remove_all)
                self._records[folder] = record

    def keep_failure(self, image: Image, name: str, extra: tuple[pathlib.Path, ...] = ()) -> pathlib.Path | None:
        """Keep what a failed restore of `image` leaves, as hard links under failed/ (so removing the image
        later costs the copy nothing), with `extra` files such as the worker's log; only the newest
        `keep_failed` failures stay. Returns the folder, or None when failures are not kept."""
        if self.keep_failed <= 0 or not image.path.is_dir():
            return None
        failed = self.root / FAILED
        folder = failed / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"

        def link(source: str, target: str) -> None:
            if not pathlib.Path(source).is_socket():
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copy2(source, target)
        with self._failures_lock:
            shutil.copytree(image.path, folder, copy_function=link)
            for path in extra:
                with contextlib.suppress(OSError):
                    shutil.copy2(path, folder / path.name)
            os.utime(folder)  # copytree gave it the image's time; the newest failures are the ones kept
            # Agents sharing this root keep and prune too: folders may vanish while this looks at them.
            kept: list[tuple[float, pathlib.Path]] = []
            for other in failed.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    kept.append((other.stat().st_mtime, other))
            for _, old in sorted(kept)[:-self.keep_failed]:
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
        return folder

    def remove(self, image: Image) -> None:
        shutil.rmtree(image.path, ignore_errors=True)
        with self._lock, contextlib.suppress(OSError):
            if not any(image.path.parent.iterdir()):  # its instance's last image: its last wake's record goes too
                self._records.pop(image.path.parent, None)

    def remove_all(self, name: str) -> None:
        with self._lock:
            self._records.pop(self.root / name, None)
        shutil.rmtree(self.root / name, ignore_errors=True)
