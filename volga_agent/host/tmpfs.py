"""A tmpfs of transparent huge pages for the GPU weights FROZEN instances park.

A FROZEN GPU instance keeps its weights, and the CUDA driver's copy of its context, in files under `<snapshot
root>/.parked` (docs/snapshots.md, Freezing a GPU worker), and every wake reads them back: the driver's restore
through a mapping of the file, the worker's staged copy with pread. On a tmpfs mounted as /dev/shm is (no huge
pages) each 4 KiB of those files is a page of its own to look up and map; on one mounted with `huge=always` a 2
MiB page. Side by side on an H200 a 2 GiB model's FROZEN wake was 20 ms faster at p50 that way, the driver's
restore and the worker's read each quicker (docs/measurements.md, Parked weights on huge pages).

`mount_huge` mounts such a tmpfs over the folder where it is itself on tmpfs (the storage class stays memory) and
the process may mount (root with CAP_SYS_ADMIN, as the agent's DaemonSet runs); elsewhere, and where a huge tmpfs
is there already, the folder stays as it is. `unmount` takes it away again, lazily (MNT_DETACH): a file some
process still maps keeps its pages until it lets go.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import pathlib
import re
import typing
from collections.abc import Iterator

log = logging.getLogger(__name__)

MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2
OPTIONS = "huge=always,mode=0755"


class Mount(typing.NamedTuple):
    point: str
    kind: str  # the file system type
    options: frozenset[str]


def mount_of(path: str | pathlib.Path) -> Mount | None:
    """The mount that holds `path`, from this process's mount table: the deepest mount point above it, the last one
    mounted there (None where the table cannot be read)."""
    target = os.path.realpath(path)
    found: Mount | None = None
    try:
        lines = pathlib.Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # \040 is a space
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (found is None or len(point) >= len(found.point)):
            found = Mount(point, fields[2], frozenset(fields[3].split(",")))
    return found


def _huge(mount: Mount | None) -> bool:
    return mount is not None and mount.kind == "tmpfs" and bool({"huge=always", "huge=within_size"} & mount.options)


def huge(folder: str | pathlib.Path) -> bool:
    """Whether `folder` is on a tmpfs that gives its files huge pages."""
    return _huge(mount_of(folder))


def mount_huge(folder: str | pathlib.Path) -> bool:
    """Mount a tmpfs of huge pages at `folder` (made where missing) where the folder is on tmpfs, empty and not on
    huge pages already; True when this call mounted it. A mount refused (no privilege) leaves the folder as it is
    and says so in the log."""
    folder = pathlib.Path(folder)
    mount = mount_of(folder)
    if _huge(mount):
        return False
    if mount is None or mount.kind != "tmpfs":
        log.info("%s is on %s, not tmpfs: parked weights stay on its pages", folder, mount.kind if mount else "?")
        return False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if any(folder.iterdir()):
            log.warning("%s is not empty: parked weights stay on 4 KiB pages", folder)
            return False
    except OSError as exc:
        log.warning("parked weights stay on 4 KiB pages: %s", exc)
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
    if libc.mount(b"tmpfs", os.fsencode(folder), b"tmpfs", MS_NOSUID | MS_NODEV, OPTIONS.encode()) != 0:
        log.info("parked weights stay on 4 KiB pages: mounting a tmpfs of huge pages at %s: %s", folder,
                 os.strerror(ctypes.get_errno()))
        return False
    log.info("parked weights on huge pages: a tmpfs (%s) at %s", OPTIONS, folder)
    return True


def unmount(folder: str | pathlib.Path) -> None:
    """Take away the tmpfs `mount_huge` put at `folder` (the files in it go with it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
    if libc.umount2(os.fsencode(folder), MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more), or gone
            log.warning("cannot unmount the parked weights' tmpfs at %s: %s", folder, os.strerror(code))


@contextlib.contextmanager
def huge_while(folder: str | pathlib.Path, wanted: bool = True) -> Iterator[bool]:
    """`mount_huge` for the block (where `wanted`), unmounted after it where it mounted; yields whether `folder`
    is on huge pages."""
    mounted = mount_huge(folder) if wanted else False
    try:
        yield huge(folder)
    finally:
        if mounted:
            unmount(folder)
