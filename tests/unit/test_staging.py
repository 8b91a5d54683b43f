"""worker.staging's threads, pieces, readers and kept buffers, with numpy standing in for torch and the GPU through
the torch engine (the driver engine and the copies to a device are measured by bench/stage_rate.py and tested by
tests/gpu on a GPU machine)."""

from __future__ import annotations

import contextlib
import os
import pathlib
from typing import Any

import numpy as np
import pytest

from volga_agent.worker import staging


class FakeTensor:
    device = "cuda:0"

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __getitem__(self, key: slice) -> FakeTensor:
        return FakeTensor(self.array[key])

    def copy_(self, other: FakeTensor, non_blocking: bool = False) -> None:
        self.array[:] = other.array

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)


class FakeCuda:
    registered: list[int] = []

    class Stream:
        def __init__(self, device: Any) -> None:
            pass

        def synchronize(self) -> None:
            pass

    class Event:
        def record(self, stream: Any) -> None:
            pass

        def synchronize(self) -> None:
            pass

    class _Cudart:
        def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
            FakeCuda.registered.append(nbytes)
            return 0

        def cudaHostUnregister(self, address: int) -> int:
            return 0

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def cudart() -> FakeCuda._Cudart:
        return FakeCuda._Cudart()


class FakeTorch:
    uint8 = np.uint8
    cuda = FakeCuda

    @staticmethod
    def frombuffer(buffer: Any, dtype: Any) -> FakeTensor:
        return FakeTensor(np.frombuffer(buffer, dtype=np.uint8))


def _source(nbytes: int) -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_file_copy_is_exact_with_uneven_pieces_and_ranges(tmp_path: pathlib.Path, threads: int) -> None:
    nbytes = 5 * 2**20 + 12345  # not a multiple of the chunk
    source = _source(nbytes)
    path = tmp_path / "parked.bin"
    path.write_bytes(source.tobytes())
    target = FakeTensor(np.zeros(nbytes + 4096, dtype=np.uint8))  # larger than the weights, as a VMM range is
    ready = [(off, 2**21) for off in range(0, nbytes + 4096, 2**21)]  # chunks as they are mapped
    fd = os.open(path, os.O_RDONLY)
    try:
        info = staging.copy(FakeTorch, target, staging.file_reader(fd), nbytes, threads=threads, chunk=2**20,
                            ready=iter(ready), engine="torch")
    finally:
        os.close(fd)
    assert np.array_equal(target.array[:nbytes], source)
    assert not target.array[nbytes:].any()
    # The slowest thread's pinning, split into faulting its buffers in and registering them.
    assert info["staging_alloc_s"] >= info["staging_populate_s"] + info["staging_register_s"] - 1e-6
    assert info["staging_populate_s"] >= 0 and info["staging_register_s"] >= 0


def test_memory_copy_with_shared_buffers() -> None:
    nbytes = 3 * 2**20 + 7
    source = _source(nbytes)
    target = FakeTensor(np.zeros(nbytes, dtype=np.uint8))
    buffers = staging.Buffers(FakeTorch, 4, 2**20)
    try:
        staging.copy(FakeTorch, target, staging.memory_reader(int(source.ctypes.data)), nbytes, buffers=buffers,
                     threads=16, engine="torch")
    finally:
        buffers.close()
    assert np.array_equal(target.array, source)


def test_a_short_parked_file_fails_the_copy(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 1000)
    target = FakeTensor(np.zeros(4 * 2**20, dtype=np.uint8))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(staging.StagingError, match="ends early"):
            staging.copy(FakeTorch, target, staging.file_reader(fd), 4 * 2**20, threads=4, chunk=2**20,
                         engine="torch")
    finally:
        os.close(fd)


def test_threads_follow_the_cpus_the_worker_may_use() -> None:
    assert 1 <= staging.threads_for(64) <= len(os.sched_getaffinity(0))
    assert staging.threads_for(1) == 1


def test_kept_buffers_are_pinned_once_and_reused_until_closed() -> None:
    nbytes = 6 * 2**20 + 99
    source = _source(nbytes)
    read = staging.memory_reader(int(source.ctypes.data))
    kept = staging.Kept()
    FakeCuda.registered.clear()
    for _ in range(2):
        target = FakeTensor(np.zeros(nbytes, dtype=np.uint8))
        info = staging.copy(FakeTorch, target, read, nbytes, threads=3, chunk=2**20, engine="torch", kept=kept)
        assert np.array_equal(target.array, source)
    assert FakeCuda.registered == [2 * 2**20] * 3  # the second copy pinned nothing
    assert info["staging_alloc_s"] == 0 and kept.nbytes == 6 * 2**20
    staging.copy(FakeTorch, FakeTensor(np.zeros(nbytes, dtype=np.uint8)), read, nbytes, threads=3, chunk=2**19,
                 engine="torch", kept=kept)  # another chunk size: the kept ones go, new ones are kept
    assert kept.chunk == 2**19 and kept.nbytes == 3 * 2**20
    kept.close()
    assert kept.nbytes == 0 and not kept.sets


def test_an_unknown_engine_is_refused() -> None:
    target = FakeTensor(np.zeros(16, dtype=np.uint8))
    with pytest.raises(staging.StagingError, match="unknown staging engine 'cupy'"):
        staging.copy(FakeTorch, target, staging.memory_reader(0), 16, engine="cupy")


def _bytes_read() -> int:
    for line in pathlib.Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.parametrize("way", staging.READY_WAYS)
def test_a_parked_file_is_readied_whole_and_left_as_it_was(tmp_path: pathlib.Path, way: str) -> None:
    nbytes = 3 * staging.CHUNK_BYTES + 4097  # pieces that do not divide evenly among the threads
    data = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    path = tmp_path / "parked"
    path.write_bytes(data)
    before = _bytes_read()
    staging.ready_file(str(path), nbytes, way, threads=5)
    read = _bytes_read() - before
    assert path.read_bytes() == data
    if way == "read":
        assert read >= nbytes  # every byte read once, by the threads
    else:
        assert read < nbytes  # populate faults pages into a mapping; none does nothing


def test_readying_a_parked_file_refuses_an_unknown_way(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "parked"
    path.write_bytes(b"x" * 4096)
    with pytest.raises(staging.StagingError, match="unknown way of readying a parked file 'touch'"):
        staging.ready_file(str(path), 4096, "touch")
    with pytest.raises(FileNotFoundError):
        staging.ready_file(str(tmp_path / "gone"), 4096, "read")
