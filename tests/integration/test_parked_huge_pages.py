"""The tmpfs of huge pages the agent mounts for the weights FROZEN GPU instances park (`host.tmpfs`): a real mount
(the tests run as root, as the agent does), files on it mapped with 2 MiB pages, and the folders it must leave
alone left alone."""

from __future__ import annotations

import mmap
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from procs import huge_tmpfs_unavailable

from volga_agent.host import tmpfs
from volga_agent.host.gpus import GpuInfo
from volga_agent.node import instance
from volga_agent.node.pool import Pool
from volga_agent.node.settings import Settings


@pytest.fixture
def shm() -> Iterator[pathlib.Path]:
    why = huge_tmpfs_unavailable()
    if why:
        pytest.skip(why)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="volga-huge-", dir="/dev/shm"))
    yield folder
    tmpfs.unmount(folder / instance.PARKED)
    shutil.rmtree(folder, ignore_errors=True)


def _pmd_mapped_kib(name: str) -> int:
    """ShmemPmdMapped of this process's mapping of a file called `name`: its part mapped with 2 MiB pages."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", pathlib.Path("/proc/self/smaps").read_text()):
        if entry.splitlines()[0].endswith(name):
            return int(re.search(r"ShmemPmdMapped:\s+(\d+) kB", entry).group(1))  # type: ignore[union-attr]
    raise AssertionError(f"{name} is not mapped")


def test_a_tmpfs_of_huge_pages_mounted_and_taken_away(shm: pathlib.Path) -> None:
    parked = shm / instance.PARKED
    assert not tmpfs.huge(parked)
    assert tmpfs.mount_huge(parked) and tmpfs.huge(parked) and tmpfs.huge(parked / "a" / "b")
    assert not tmpfs.mount_huge(parked), "mounted twice"
    weights = parked / "weights.bin"
    weights.write_bytes(os.urandom(8 << 20))
    with open(weights, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
        assert sum(view[i] for i in range(0, len(view), 4096)) >= 0  # every page touched
        if pathlib.Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().find("[deny]") < 0:
            assert _pmd_mapped_kib("weights.bin") == 8 << 10
    tmpfs.unmount(parked)
    assert not tmpfs.huge(parked) and parked.is_dir() and not any(parked.iterdir()), "its files go with it"


def test_folders_it_must_not_take_are_left_as_they_are(shm: pathlib.Path) -> None:
    on_disk = pathlib.Path(tempfile.mkdtemp(prefix="volga-huge-", dir=os.getcwd()))
    try:
        if tmpfs.huge(on_disk) or tmpfs.mount_of(on_disk).kind == "tmpfs":  # type: ignore[union-attr]
            pytest.skip("the working folder is on tmpfs here")
        assert not tmpfs.mount_huge(on_disk / instance.PARKED) and not (on_disk / instance.PARKED).exists()
    finally:
        shutil.rmtree(on_disk, ignore_errors=True)
    busy = shm / instance.PARKED
    busy.mkdir()
    (busy / "weights.bin").write_bytes(b"parked before")
    assert not tmpfs.mount_huge(busy) and (busy / "weights.bin").read_bytes() == b"parked before"


@pytest.mark.parametrize("gpus", [1, 0])
def test_a_gpu_nodes_pool_parks_on_huge_pages_while_it_runs(shm: pathlib.Path, gpus: int) -> None:
    """The agent's pool mounts it under its snapshot root on a GPU node (none on a CPU node) and takes it away when
    it closes; `parked_huge_pages: false` leaves the folder as it is."""
    gpu = GpuInfo(0, "GPU-0", "NVIDIA H200", 141 << 30, 0, "580.159.04", "0000:17:00.0", -1)
    work = pathlib.Path(tempfile.mkdtemp(prefix="volga-huge-work-"))
    try:
        for wanted in (True, False):
            pool = Pool("node", work, shm / "snapshots", Settings(parked_huge_pages=wanted), gpus=[gpu] * gpus)
            try:
                assert tmpfs.huge(shm / "snapshots" / instance.PARKED) is (wanted and gpus > 0)
            finally:
                pool.close()
            assert not tmpfs.huge(shm / "snapshots" / instance.PARKED)
    finally:
        shutil.rmtree(work, ignore_errors=True)
