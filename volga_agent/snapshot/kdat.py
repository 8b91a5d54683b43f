"""A cache of CRIU's kernel probes where CRIU would not keep one itself.

Every criu call starts by probing what the kernel supports (`kerndat`), about 30 ms of a restore that otherwise
takes 20 ms on the default model. CRIU saves the result in /run/criu.kdat, but only where /run is a tmpfs, so
that a reboot (a new kernel) clears it. Where /run is an ordinary disk, as in many containers (the agent's
image among them), it probes again on every call.

`ensure` gives criu the same cache under the same rule: it lets criu probe once in a private mount namespace
whose /run is a fresh tmpfs, keeps the file in a private folder on a tmpfs that a reboot clears too (/dev/shm),
and points /run/criu.kdat at it. criu reads the cache through the link; a cache it finds stale (another criu
release) it removes and probes again, as it would without one. Where any step is not possible (no tmpfs, no
right to make a mount namespace, /run not writable) nothing changes and criu probes on every call, as before.
A container with a read-only root filesystem has a read-only /run: the chart mounts a tmpfs there for the agent, so
criu keeps its own cache (without it every FROZEN wake in the agent's pod paid the probes, ~40 ms, measured in
docs/measurements.md, "Helm install on a real node").
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pathlib
import shutil
import stat
import subprocess

from volga_agent.host import tmpfs

RUN = pathlib.Path("/run")
CACHE_NAME = "criu.kdat"
STORE = pathlib.Path("/dev/shm")
log = logging.getLogger(__name__)


def filesystem(path: pathlib.Path) -> str:
    """The type of the filesystem `path` lies on, from this process's mount table ("" when unknown)."""
    mount = tmpfs.mount_of(path)
    return mount.kind if mount is not None else ""


def _private_folder(store: pathlib.Path) -> pathlib.Path | None:
    """A folder only this user can write in, on `store` (None when someone else holds the name)."""
    folder = store / f"volga-criu-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        log.warning("criu's kernel-probe cache not kept: %s is not a private folder of this user", folder)
        return None
    return folder


def _probe(criu: str, target: pathlib.Path) -> bool:
    """Let criu probe the kernel with a tmpfs at /run in a mount namespace of its own; copy its cache out."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    script = ('mount -t tmpfs -o size=1m,mode=0755 volga-criu-kdat /run && "$1" check >/dev/null 2>&1; '
              f'cp /run/{CACHE_NAME} "$2"')
    try:
        done = subprocess.run([unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh", criu,
                               str(target)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.info("criu's kernel-probe cache not made: %s", exc)
        return False
    if done.returncode != 0 or not target.is_file():
        log.info("criu's kernel-probe cache not made (exit %s): %s", done.returncode, done.stderr.strip()[-300:])
        return False
    return True


@functools.cache
def ensure(criu: str, run: pathlib.Path = RUN, store: pathlib.Path = STORE) -> pathlib.Path | None:
    """Make criu's kernel probes cached across calls; returns the cache file, or None where criu keeps its own
    (a tmpfs /run) or none can be kept. Once per process and criu binary: a kernel changes only with a reboot."""
    if filesystem(run) == "tmpfs":
        return None
    if filesystem(store) != "tmpfs":
        log.info("criu's kernel-probe cache not kept: neither %s nor %s is a tmpfs", run, store)
        return None
    try:
        folder = _private_folder(store)
        if folder is None:
            return None
        fresh = folder / f".{CACHE_NAME}.{os.getpid()}"
        if not _probe(criu, fresh):
            fresh.unlink(missing_ok=True)
            return None
        cache = folder / CACHE_NAME
        fresh.rename(cache)
        link = run / f".{CACHE_NAME}.volga.{os.getpid()}"
        link.unlink(missing_ok=True)
        link.symlink_to(cache)
        link.rename(run / CACHE_NAME)  # atomic: a criu starting now sees the old cache or the new one
    except OSError as exc:
        # A read-only /run (a container's read-only root filesystem) lands here: mount a tmpfs on /run.
        log.warning("criu's kernel-probe cache not kept (criu probes the kernel again in every dump and restore, "
                    "~40 ms each; a tmpfs on /run lets criu keep it): %s", exc)
        return None
    log.info("criu's kernel probes are cached in %s (linked from %s)", cache, run / CACHE_NAME)
    return cache
