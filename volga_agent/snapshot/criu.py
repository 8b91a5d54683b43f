"""CRIU engine: freeze a worker's whole process tree into an image folder and restore it.

Facts this code is built on (measured on the target kernels; docs/architecture.md, Tiers):

- CRIU 4.x is needed (3.17 fails on current vDSO layouts). `scripts/install-criu.sh` installs it into a
  private root; this module finds it through `VOLGA_CRIU`, the install prefix, or PATH.
- onnxruntime holds file locks, so dumps and restores pass `--file-locks`.
- Each worker is the init of its own PID namespace (see `worker.nsinit`), so restores never collide on
  PIDs; CRIU recreates the namespace from the image.
- A dump is written into a temporary folder beside its final place and renamed when complete, so a
  reader never sees half an image; the engine owns its image folders and removes them.
- "RLIMIT_NOFILE ... Operation not permitted" in CRIU's log is harmless on unprivileged-resource kernels.
- What a failed restore leaves (the image, CRIU's logs, the worker's log) is kept under `failed/` for
  inspection, the newest few only (`keep_failed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import shutil
import subprocess
import threading
import time
import uuid

# Where scripts/install-criu.sh installs, under the home folder (read only when looking for CRIU: a process
# whose user has no home, such as a gateway running under a bare UID, imports this module too).
DEFAULT_PREFIX = pathlib.Path("~/.cache/volga/criu")
FAILED = "failed"
log = logging.getLogger(__name__)


class CriuError(RuntimeError):
    """A CRIU call failed; the message carries the end of CRIU's log."""


@dataclasses.dataclass(frozen=True)
class Image:
    """A published CRIU image folder."""

    path: pathlib.Path
    snapshot_id: str
    size_bytes: int
    dump_seconds: float


class LazyPages:
    """The lazy-pages daemon of one restore. Until it has delivered every page and exited, part of the process's
    memory exists only in the image: a dump taken then would miss those pages (the kernel reports them as never
    touched) and the next restore would bring them back as zeros."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.exit_code: int | None = None

    def wait(self, pid: int, timeout: float) -> None:
        if not self.done.wait(timeout):
            raise CriuError(f"pid {pid}: the lazy-pages daemon has not delivered every page after {timeout:g} s")
        if self.exit_code != 0:
            raise CriuError(f"pid {pid}: the lazy-pages daemon failed (exit {self.exit_code}): pages may be missing")


@dataclasses.dataclass(frozen=True)
class Restored:
    pid: int
    seconds: float
    lazy_pages: LazyPages | None = None

    def wait_for_pages(self, timeout: float) -> None:
        """Return once the restored process holds all of its memory (at once for eager restores)."""
        if self.lazy_pages is not None:
            self.lazy_pages.wait(self.pid, timeout)


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
    raise CriuError("criu not found: run scripts/install-criu.sh (installs CRIU 4.x into "
                    f"{DEFAULT_PREFIX}) or set VOLGA_CRIU to the criu binary")


def _tree_size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _log_tail(log: pathlib.Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = [line for line in text if "Error" in line and "RLIMIT_NOFILE" not in line]
    return "\n".join((errors or text)[-lines:])


class CriuEngine:
    """Dumps and restores process trees under one snapshot root folder."""

    def __init__(self, root: str | pathlib.Path, criu: str | None = None, keep_failed: int = 3) -> None:
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.criu = criu or find_criu()
        self.keep_failed = keep_failed
        # Lazy-pages daemons that exited with an error: the process they served may have missed pages.
        self.lazy_daemon_failures = 0

    def version(self) -> str:
        out = subprocess.run([self.criu, "--version"], capture_output=True, text=True, check=False)
        return out.stdout.strip().splitlines()[0] if out.stdout else "unknown"

    def check(self) -> None:
        out = subprocess.run([self.criu, "check"], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise CriuError(f"criu check failed: {out.stdout}{out.stderr}")

    def dump(self, pid: int, name: str, leave_running: bool = False) -> Image:
        """Dump the tree rooted at `pid` (killing it unless leave_running) into a new image of `name`."""
        if name == FAILED:
            raise ValueError(f"{FAILED!r} is the folder of failed restores, not an image name")
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        snapshot_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        tmp = folder / f".tmp-{snapshot_id}"
        tmp.mkdir()
        args = [self.criu, "dump", "-t", str(pid), "-D", str(tmp), "-o", "dump.log", "-v2",
                "--file-locks", "--shell-job"]
        if leave_running:
            args.append("--leave-running")
        start = time.perf_counter()
        out = subprocess.run(args, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        if out.returncode != 0:
            detail = _log_tail(tmp / "dump.log")
            shutil.rmtree(tmp, ignore_errors=True)
            raise CriuError(f"criu dump of pid {pid} failed (exit {out.returncode}):\n{detail}")
        final = folder / snapshot_id
        os.rename(tmp, final)
        return Image(final, snapshot_id, _tree_size(final), seconds)

    def restore(self, image: Image, lazy: bool = False) -> Restored:
        """Restore an image detached; the restored root is re-parented to our child subreaper.

        With `lazy`, a `criu lazy-pages` daemon serves the memory pages through userfaultfd: the process runs
        as soon as its tree is rebuilt, pages arrive when first touched (and in the background), and the
        daemon exits once every page is delivered.
        """
        pidfile = image.path / "restore.pid"
        pidfile.unlink(missing_ok=True)
        args = [self.criu, "restore", "-D", str(image.path), "-o", "restore.log", "-v2", "--file-locks",
                "--shell-job", "--restore-detached", "--pidfile", str(pidfile)]
        start = time.perf_counter()
        daemon = self._lazy_pages(image) if lazy else None
        if daemon is not None:
            args.append("--lazy-pages")
        out = subprocess.run(args, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        if out.returncode != 0:
            if daemon is not None:
                daemon.kill()
                daemon.wait()
            raise CriuError(f"criu restore of {image.path} failed (exit {out.returncode}):\n"
                            f"{_log_tail(image.path / 'restore.log')}")
        pages = None
        if daemon is not None:
            pages = LazyPages()
            threading.Thread(target=self._reap_lazy_pages, args=(daemon, image, pages), name="lazy-pages-reaper",
                             daemon=True).start()
        return Restored(int(pidfile.read_text().strip()), seconds, pages)

    def _reap_lazy_pages(self, daemon: subprocess.Popen[bytes], image: Image, pages: LazyPages) -> None:
        code = daemon.wait()
        pages.exit_code = code
        pages.done.set()
        if code != 0:
            self.lazy_daemon_failures += 1
            log.warning("criu lazy-pages for %s exited with %d:\n%s", image.path, code,
                        _log_tail(image.path / "lazy-pages.log"))

    def _lazy_pages(self, image: Image) -> subprocess.Popen[bytes]:
        """Start the page server of a lazy restore and wait until it listens (its --status-fd says so)."""
        (image.path / "lazy-pages.socket").unlink(missing_ok=True)
        ready, status = os.pipe()
        try:
            daemon = subprocess.Popen([self.criu, "lazy-pages", "-D", str(image.path), "-o", "lazy-pages.log", "-v2",
                                       "--status-fd", str(status)], pass_fds=[status],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.close(status)
            status = -1
            if not os.read(ready, 1):
                daemon.wait()
                raise CriuError(f"criu lazy-pages for {image.path} did not start:\n"
                                f"{_log_tail(image.path / 'lazy-pages.log')}")
            return daemon
        finally:
            os.close(ready)
            if status >= 0:
                os.close(status)

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
        shutil.copytree(image.path, folder, copy_function=link)
        for path in extra:
            with contextlib.suppress(OSError):
                shutil.copy2(path, folder / path.name)
        for old in sorted(failed.iterdir(), key=lambda p: p.stat().st_mtime)[:-self.keep_failed]:
            shutil.rmtree(old, ignore_errors=True)
        return folder

    def remove(self, image: Image) -> None:
        shutil.rmtree(image.path, ignore_errors=True)

    def remove_all(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)
