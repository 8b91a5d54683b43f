"""The CUDA driver's process checkpoint API, called from another process through ctypes.

`cuCheckpointProcessLock/Checkpoint/Restore/Unlock/GetState` (driver API 12.8+, driver >= 570; measured on
580.159) move a process's whole GPU state (contexts, streams, device memory, mappings) into that process's
host memory and back. After a checkpoint the process has closed its /dev/nvidia* descriptors and holds no
GPU memory; CRIU can then dump it like any CPU process. CUDA graphs captured before a checkpoint replay
after restore. A restore may target other GPUs of the same chip type through GPU UUID pairs.

NULL argument structs are accepted by the driver; the structs are still defined so that a lock timeout and
GPU pairs can be passed.

The driver restores one context at a time, device-wide (16 restores called at once take 2.2-2.5 s on an H200,
the first back after 0.8-1.4 s; one after another ~275 ms each). `DriverCheckpoint(restores_at_once=K)` lets at
most K restores into the driver at a time, in the order they were asked for (`RestoreGate`): the first comes back
after one restore's time, the last later than with all at once. With `lead`, a restore asked for while none is
under way goes in alone and the ones asked for meanwhile go in together after it.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import enum
import threading
import time
import uuid as uuidlib
from collections.abc import Sequence

from volga_agent.host import process

KEEP_TIMINGS = 64  # processes whose last driver phases `DriverCheckpoint.timings` keeps


class DriverCheckpointUnsupported(RuntimeError):
    """libcuda is missing or too old for the checkpoint API."""


class DriverCheckpointError(RuntimeError):
    def __init__(self, call: str, pid: int, code: int, name: str) -> None:
        super().__init__(f"{call}(pid {pid}) failed: {name} ({code})")
        self.call, self.pid, self.code, self.name = call, pid, code, name


class ProcessState(enum.IntEnum):
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 16)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", _Uuid), ("newUuid", _Uuid)]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * (64 - ctypes.sizeof(ctypes.c_void_p) - ctypes.sizeof(ctypes.c_uint)))]


assert ctypes.sizeof(_LockArgs) == 64 and ctypes.sizeof(_RestoreArgs) == 64


@dataclasses.dataclass(frozen=True)
class GpuPair:
    """Restore state checkpointed on GPU `old` onto GPU `new` (UUIDs as NVML prints them, 'GPU-...')."""

    old: str
    new: str


def _uuid_bytes(text: str) -> bytes:
    return uuidlib.UUID(text.removeprefix("GPU-")).bytes


_SYMBOLS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
            "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState")


class RestoreGate:
    """At most `limit` holders at a time (0: no limit), let in strictly in the order they asked. With `lead`, one
    that asks while the gate is empty (no holder, none waiting) goes in alone, and those that ask meanwhile go in
    together once it is out: a storm's first restore is not slowed by the others, and the rest still overlap.
    Thread-safe."""

    def __init__(self, limit: int = 0, lead: bool = False) -> None:
        if limit < 0:
            raise ValueError(f"restores_at_once: must be >= 0 (0: no limit), got {limit}")
        self.limit, self.lead = limit, lead
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()
        self._inside = 0
        self._alone = False  # a leader is inside: nobody joins it

    def __enter__(self) -> RestoreGate:
        if not self.limit and not self.lead:
            return self
        ticket = object()
        with self._cond:
            if self.lead and not self._inside and not self._queue:
                self._inside, self._alone = 1, True
                return self
            self._queue.append(ticket)
            self._cond.wait_for(lambda: self._queue[0] is ticket and not self._alone
                                and (not self.limit or self._inside < self.limit))
            self._queue.popleft()
            self._inside += 1
            self._cond.notify_all()  # the next in line may fit too
        return self

    def counts(self) -> tuple[int, int]:
        """(holders inside, callers waiting), as of now."""
        with self._cond:
            return self._inside, len(self._queue)

    def __exit__(self, *_: object) -> None:
        if not self.limit and not self.lead:
            return
        with self._cond:
            self._inside -= 1
            self._alone = False
            self._cond.notify_all()


class DriverCheckpoint:
    def __init__(self, library: str = "libcuda.so.1", restores_at_once: int = 0, lead: bool = False) -> None:
        self.gate = RestoreGate(restores_at_once, lead)
        try:
            self.lib = ctypes.CDLL(library)
        except OSError as exc:
            raise DriverCheckpointUnsupported(f"cannot load {library}: {exc} (no NVIDIA driver here)") from None
        version = ctypes.c_int(0)
        self.lib.cuDriverGetVersion(ctypes.byref(version))
        self.driver_api = version.value
        missing = [s for s in _SYMBOLS if not hasattr(self.lib, s)]
        if missing:
            raise DriverCheckpointUnsupported(
                f"CUDA driver API {self.driver_api} lacks {', '.join(missing)}: the checkpoint API needs "
                "driver >= 570 (API 12.8); SUSPENDED and GPU FROZEN tiers are unavailable")
        self._check("cuInit", 0, self.lib.cuInit(0))
        # The last suspend/resume of the most recent processes, by phase (benchmarks read it); bounded, since
        # an agent sees a new process at every cold start.
        self.timings: dict[int, dict[str, float]] = {}

    def _name(self, code: int) -> str:
        ptr = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(ptr))
        return ptr.value.decode() if ptr.value else "CUDA_ERROR_UNKNOWN"

    def _check(self, call: str, pid: int, code: int) -> None:
        if code != 0:
            raise DriverCheckpointError(call, pid, code, self._name(code))

    def state(self, pid: int) -> ProcessState:
        out = ctypes.c_int(-1)
        self._check("cuCheckpointProcessGetState", pid, self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(out)))
        return ProcessState(out.value)

    def lock(self, pid: int, timeout_ms: int = 10_000) -> None:
        """Block new CUDA work in the process and wait (up to timeout_ms) for running work to finish."""
        args = _LockArgs(timeoutMs=timeout_ms)
        self._check("cuCheckpointProcessLock", pid, self.lib.cuCheckpointProcessLock(pid, ctypes.byref(args)))

    def checkpoint(self, pid: int) -> None:
        self._check("cuCheckpointProcessCheckpoint", pid, self.lib.cuCheckpointProcessCheckpoint(pid, None))

    def restore(self, pid: int, gpu_pairs: Sequence[GpuPair] = ()) -> None:
        if not gpu_pairs:
            self._check("cuCheckpointProcessRestore", pid, self.lib.cuCheckpointProcessRestore(pid, None))
            return
        pairs = (_GpuPair * len(gpu_pairs))(*[
            _GpuPair(_Uuid(_uuid_bytes(p.old)), _Uuid(_uuid_bytes(p.new))) for p in gpu_pairs])
        args = _RestoreArgs(gpuPairs=pairs, gpuPairsCount=len(gpu_pairs))
        self._check("cuCheckpointProcessRestore", pid, self.lib.cuCheckpointProcessRestore(pid, ctypes.byref(args)))

    def unlock(self, pid: int) -> None:
        self._check("cuCheckpointProcessUnlock", pid, self.lib.cuCheckpointProcessUnlock(pid, None))

    def suspend(self, pid: int, lock_timeout_ms: int = 10_000) -> float:
        """Lock + checkpoint: the process keeps running on the CPU, its GPU state now in host memory."""
        start = time.perf_counter()
        self.lock(pid, lock_timeout_ms)
        locked = time.perf_counter()
        try:
            self.checkpoint(pid)
        except DriverCheckpointError:
            self.unlock(pid)
            raise
        end = time.perf_counter()
        self.timings.pop(pid, None)
        self.timings[pid] = {"lock_ms": (locked - start) * 1e3, "checkpoint_ms": (end - locked) * 1e3}
        while len(self.timings) > KEEP_TIMINGS:
            del self.timings[next(iter(self.timings))]
        return end - start

    def resume(self, pid: int, gpu_pairs: Sequence[GpuPair] = ()) -> float:
        """Restore + unlock; the restore waits its turn at the gate (`restores_at_once`), counted in restore_ms."""
        start = time.perf_counter()
        with self.gate:
            before = process.minor_faults(pid)
            self.restore(pid, gpu_pairs)
            after = process.minor_faults(pid)
        restored = time.perf_counter()
        self.unlock(pid)
        end = time.perf_counter()
        timings = self.timings.setdefault(pid, {})
        timings.update(restore_ms=(restored - start) * 1e3, unlock_ms=(end - restored) * 1e3)
        if before is not None and after is not None:  # its page faults meanwhile: the restore reading host memory
            timings["restore_minflt"] = after - before
        return end - start
