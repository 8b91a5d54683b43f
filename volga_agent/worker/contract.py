"""What the agent and a worker agree on: the worker's configuration, its tensors, and its signal files.

The agent writes a `WorkerConfig` as JSON and starts the worker with it; the two then talk through frames
(`protocol`) and through files in the worker's signal folder, named here. Inputs are checked against the
declared tensors (`check_inputs`) by the worker and by the gateway, before they reach a framework.

Like everything under `volga_agent.worker`, this imports nothing of the agent: the worker is the process
that gets frozen (see docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import numpy as np

from volga_agent.worker import nsinit, protocol

# Files in the signal folder: the worker writes READY once loaded (or FAILED with the reason) and
# READY_FOR_CHECKPOINT when paused; the agent writes RESTORE_COMPLETE and sends WAKE_SIGNAL to resume it.
READY = "ready"
FAILED = "failed"
READY_FOR_CHECKPOINT = "ready-for-checkpoint"
RESTORE_COMPLETE = "restore-complete"
# A paused GPU worker whose weights were parked: once the driver has checkpointed it, the agent writes
# DRIVER_CHECKPOINTED, JSON {"regions": [[start, end, prot], ...]} (`regions.filled`, `regions.stale`), and sends
# WAKE_SIGNAL; the worker maps those regions from its parked file (`regions.move`) and writes DRIVER_COPY_PARKED,
# JSON {"bytes": N, "regions": N, "seconds": S} or {"error": "..."}.
DRIVER_CHECKPOINTED = "driver-checkpointed"
DRIVER_COPY_PARKED = "driver-copy-parked"
# The agent a paused worker waits for ("PID START", written before each pause and restore): a worker whose agent
# is gone while it waits (its parent-death signal is disarmed for the dump) exits instead of waiting forever.
AGENT = "agent"
# The canary: a fixed input whose answer the agent records before a snapshot and compares after each restore,
# so that a damaged image is caught before it answers a request.
CANARY_SEED = 0x5EED
WAKE_SIGNAL = nsinit.WAKE_SIGNAL
# The user and group workers drop to unless told otherwise: nobody and nogroup.
NOBODY = (65534, 65534)


def _boottime_offset_ticks() -> int:
    """This process's time-namespace boot-time offset in clock ticks. CRIU restores a process into a time
    namespace whose clocks carry on from the dump; /proc shows every process's start time shifted by the
    reader's offset, so the same agent reads differently before and after a restore."""
    try:
        lines = pathlib.Path("/proc/self/timens_offsets").read_text().splitlines()
    except OSError:  # no time namespaces here: no offset
        return 0
    for line in lines:
        clock, seconds, nanoseconds = line.split()
        if clock in ("boottime", "7"):  # CLOCK_BOOTTIME
            return (int(seconds) * 10**9 + int(nanoseconds)) * os.sysconf("SC_CLK_TCK") // 10**9
    return 0


def publish(folder: pathlib.Path, name: str, text: str) -> None:
    """Write a signal file whole (a temporary file, then a rename), never through a link: the signal folder
    belongs to an unprivileged worker, and the agent that writes here is root."""
    tmp = folder / f".{name}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, folder / name)


def read_signal(path: pathlib.Path) -> str:
    """A signal file's text, never through a link (a worker could plant one naming a file only root may read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, errors="replace") as source:
        return source.read(1 << 16)


def process_identity(pid: int) -> str:
    """A process's PID and start time (clock ticks since the host's boot, whatever time namespace reads it): a
    PID that was reused names another process."""
    with open(f"/proc/{pid}/stat") as stat:
        started = int(stat.read().rsplit(") ", 1)[1].split()[19])
    return f"{pid} {started - _boottime_offset_ticks()}"


def agent_alive(path: pathlib.Path) -> bool:
    """Whether the agent named in `path` (an AGENT file) still runs; True when there is no such file."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return True
    try:
        pid, started = (int(v) for v in text.split())
        now_pid, now_started = (int(v) for v in process_identity(pid).split())
    except (OSError, ValueError):  # gone (no /proc entry), or not an identity
        return False
    return now_pid == pid and abs(now_started - started) <= 1  # the offset's rounding may cost one tick


@dataclasses.dataclass(frozen=True)
class TensorDecl:
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class WarmupTensor:
    """One input of a declared warm-up sample: its shape and a fill value, a [low, high) range or literal values
    (none of them: made-up values, as the default warm-up uses)."""

    name: str
    shape: tuple[int, ...]
    fill: float | None = None
    low: float | None = None
    high: float | None = None
    values: tuple[float, ...] | None = None


@dataclasses.dataclass(frozen=True)
class WarmupSample:
    """The inputs of one declared warm-up inference (inputs left out get made-up values)."""

    tensors: tuple[WarmupTensor, ...]


# The per-thread stack a GPU worker's CUDA context reserves, against the driver's 1 KiB: the context keeps that
# much local memory for every thread the GPU can run at once (about 264 MiB per KiB on an H200), and every driver
# checkpoint copies it. The driver grows it for any kernel that needs more (warm-up runs them all before a
# snapshot), so a small floor costs nothing but the copies it saves: 64 bytes made a PyTorch worker's checkpoint
# 248 MiB smaller and its restore 70 ms faster on the H200 (bench/driver_region.py).
DEFAULT_CUDA_STACK_BYTES = 64


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to know, written by the agent as JSON (the worker does not parse ModelSpecs)."""

    model_id: str
    framework: str
    path: str
    inputs: tuple[TensorDecl, ...]
    outputs: tuple[TensorDecl, ...]
    socket: str
    signal_dir: str
    device: str = "cpu"
    warmup_iterations: int = 3
    reset_rng_on_restore: bool = True
    intra_op_threads: int = 0
    max_batch_size: int = 256
    cuda_graph_batches: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()  # CPUs the launcher pinned the worker to (nsinit --cpus); () leaves it free
    restore_warmups: int = 0  # warmup iterations run again after each restore (warmupCacheRatio)
    precision: str = "fp32"  # fp16/bf16: torch models run in that dtype (hardware.precision)
    warmup: tuple[WarmupSample, ...] = ()  # declared warm-up samples (runtime.warmup); () runs made-up inputs
    warmup_file: str = ""  # an .npz of real inputs run after the declared samples (runtime.warmupFile)
    cuda_stack_bytes: int = 0  # per-thread stack the CUDA context reserves (CU_LIMIT_STACK_SIZE); 0: the driver's
    # Keep captured CUDA graphs in snapshots; False drops them before the driver's checkpoint and captures them
    # again after the restore (`backends.TorchBackend.park`, `sleep`): less to copy for a few ms of capture.
    graphs_in_images: bool = False
    # Before the driver's SUSPENDED checkpoint the worker copies its weights to pinned host memory itself
    # (`backends.TorchBackend.sleep`) instead of leaving them on the device for the driver to copy: on an H200,
    # 0.13 GiB of weights, the SUSPENDED wake 250 vs 290 ms p50 and the checkpoint 340 vs 426 ms
    # (`bench/wake_phases.py`, docs/measurements.md "SUSPENDED: the worker moves its own weights").
    suspend_copies_weights: bool = True
    # How weights in host memory reach the GPU on a wake (`backends.TorchBackend`). "staged": through small pinned
    # buffers from several threads (`worker.staging`: pread from a parked file, memcpy from the host copy), the
    # host copy unpinned before the driver's checkpoint (whose restore would otherwise pin it again). "pinned": the
    # host copy kept pinned across the driver's checkpoint, a parked file pinned in place chunk by chunk
    # (`worker.pinning`). "auto": parked files staged; a SUSPENDED host copy staged from `staging_min_mib` of
    # weights, pinned below (on an H200, SUSPENDED at 2 GiB 271 / 301 ms p50 / p99 staged against 314 / 373
    # pinned; run 4 of bench/results/tiers/wake-copy-h200.md). `volga bench tiers --gpu --wake-copy pinned,auto`
    # compares them in one run.
    wake_copy: str = "auto"
    staging_min_mib: int = 1024
    # The staged copy's threads (fewer where the worker may run on fewer CPUs), and each one's two buffers' size:
    # on an H200 12 threads of 4 MiB buffers reached 44-50 GB/s from memory and from a tmpfs file, 8 or 16 MiB
    # 24-38 (bench/stage_rate.py, docs/measurements.md "Staged copies").
    staging_threads: int = 12
    staging_chunk_mib: int = 4
    # How each staged piece's copy is queued: "driver" (the driver's calls straight through ctypes,
    # `staging.Driver`) or "torch" (its copy_ and events, several round trips through the GIL a piece).
    staging_engine: str = "driver"
    # Keep the staging buffers pinned from one staged copy to the next (pinned again by each driver restore:
    # a few ms for 96 MiB), freed before a CRIU dump; pinning them afresh costs about 1 ms per 4 MiB on the wake.
    staging_keep_buffers: bool = True
    # Map the whole weight arena (VMM) before the staged copies start, instead of chunk by chunk as they go.
    staging_premap: bool = False
    # Capture the released CUDA graphs while the staged copies run (the arena mapped first; graphs replay only
    # after the copies are done): on an H200 a SUSPENDED worker's wake took 52 instead of 57 ms at 2 GiB and 180
    # instead of 200 ms at 8 GiB (run 6 of bench/results/tiers/wake-copy-h200.md).
    staging_overlap_graphs: bool = True
    # How a parked weights file is readied at the freeze for its first staged read (`staging.ready_file`: "read",
    # "populate" or "none"): pages written through the park's mapping read at half the rate the first time.
    park_ready: str = "read"
    # The user and group the worker drops to once started (`serve.drop_privileges`); 0 and 0: it stays the agent's.
    uid: int = 0
    gid: int = 0
    # The folders (symlinks resolved) the model file must lie in, checked again on the file the worker opened,
    # since the agent's check (admission.check_source) came earlier; () allows any regular file.
    model_roots: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        raw = json.loads(text)
        raw["model_roots"] = tuple(raw.get("model_roots", ()))
        raw["cuda_graph_batches"] = tuple(raw.get("cuda_graph_batches", ()))
        raw["cpus"] = tuple(raw.get("cpus", ()))
        raw["inputs"] = tuple(TensorDecl(t["name"], t["dtype"], tuple(t["shape"])) for t in raw["inputs"])
        raw["outputs"] = tuple(TensorDecl(t["name"], t["dtype"], tuple(t["shape"])) for t in raw["outputs"])
        raw["warmup"] = tuple(WarmupSample(tuple(
            WarmupTensor(**{**t, "shape": tuple(t["shape"]),
                            "values": None if t.get("values") is None else tuple(t["values"])})
            for t in sample["tensors"])) for sample in raw.get("warmup", ()))
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def sample_inputs(decls: tuple[TensorDecl, ...], batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs of the declared shapes (-1 -> batch); integer inputs are small indices."""
    rng = np.random.default_rng(seed)
    out = {}
    for decl in decls:
        shape = tuple(batch if d == -1 else d for d in decl.shape)
        dtype = protocol.NP_DTYPES[decl.dtype]
        if dtype.kind in "iu":
            out[decl.name] = rng.integers(0, 100, size=shape).astype(dtype)
        elif dtype.kind == "b":
            out[decl.name] = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            out[decl.name] = rng.standard_normal(shape).astype(dtype)
    return out


def check_inputs(decls: tuple[TensorDecl, ...], inputs: dict[str, np.ndarray], max_batch: int) -> None:
    """Reject inputs that do not match the ModelSpec before they reach the framework."""
    want = {d.name for d in decls}
    if set(inputs) != want:
        missing, extra = sorted(want - set(inputs)), sorted(set(inputs) - want)
        raise protocol.WorkerError("INVALID_ARGUMENT", f"inputs missing {missing}, unexpected {extra}")
    for decl in decls:
        array = inputs[decl.name]
        dtype = protocol.DTYPE_NAMES.get(array.dtype)
        if dtype != decl.dtype:
            raise protocol.WorkerError("INVALID_ARGUMENT",
                                       f"input {decl.name!r}: dtype {dtype} given, {decl.dtype} expected")
        if len(array.shape) != len(decl.shape) or any(
                d != -1 and d != s for d, s in zip(decl.shape, array.shape, strict=True)):
            raise protocol.WorkerError("INVALID_ARGUMENT", f"input {decl.name!r}: shape {list(array.shape)} "
                                       f"given, [{', '.join(map(str, decl.shape))}] expected")
        if decl.shape and decl.shape[0] == -1 and array.shape[0] > max_batch:
            raise protocol.WorkerError("INVALID_ARGUMENT", f"input {decl.name!r}: batch {array.shape[0]} is "
                                       f"over maxBatchSize {max_batch}")


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


@dataclasses.dataclass(frozen=True)
class OutputSeen:
    """One declared output and the shapes the model answered with in the warm-up (one per sample that ran, in order)."""

    name: str
    declared: tuple[int, ...]
    seen: tuple[tuple[int, ...], ...]

    @property
    def contradicts(self) -> bool:
        """Whether an answer has another rank than the declaration, or another size where it fixes one."""
        return any(len(s) != len(self.declared)
                   or any(d != -1 and d != g for d, g in zip(self.declared, s, strict=True)) for s in self.seen)

    @property
    def answered(self) -> tuple[int, ...] | None:
        """The shape the answers take, as metadata should say it: the answered rank, -1 where the samples' answers
        differ in size (or have none) or the declaration says any size (at the same rank), and -1 for the batch
        (first) dimension where the declaration has one. None when the answers differ in rank (no shape says them)."""
        if not self.seen or len({len(s) for s in self.seen}) != 1:
            return None
        # A size that differs between answers, or 0 (no rows this time), says nothing of the size: any.
        dims = [sizes[0] if len(set(sizes)) == 1 and sizes[0] else -1 for sizes in zip(*self.seen, strict=True)]
        if len(dims) == len(self.declared):
            dims = [-1 if d == -1 else g for d, g in zip(self.declared, dims, strict=True)]
        elif dims and self.declared and self.declared[0] == -1:
            dims[0] = -1
        return tuple(dims)

    def describe(self) -> str:
        """'output 'y': declared [-1, 4], the model answered [1, 4, 1]' (each different answer once)."""
        answers = " and ".join(_shape_text(s) for s in dict.fromkeys(self.seen))
        return f"output {self.name!r}: declared {_shape_text(self.declared)}, the model answered {answers}"


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What the worker's warm-up found, for the agent (the worker's `warmup` op): why the made-up warm-up was skipped
    ("" when it ran, or when the spec's own samples did), and the shapes each declared output answered with."""

    skipped: str = ""
    outputs: tuple[OutputSeen, ...] = ()

    @property
    def mismatches(self) -> tuple[OutputSeen, ...]:
        """The outputs whose answers contradict their declaration."""
        return tuple(o for o in self.outputs if o.contradicts)

    @property
    def mismatch(self) -> str:
        """The contradictions, for people ("" when none): each output with its declared and answered shapes."""
        found = self.mismatches
        if not found:
            return ""
        return "the model's answers contradict its declared outputs: " + "; ".join(o.describe() for o in found)

    @property
    def answered(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(name, shape) of each output whose answers contradict the declaration, the shape as `OutputSeen.answered`
        says it (outputs whose answers differ in rank left out)."""
        return tuple((o.name, shape) for o in self.mismatches if (shape := o.answered) is not None)

    def to_wire(self) -> dict[str, object]:
        return {"skipped": self.skipped, "outputs": [
            {"name": o.name, "declared": list(o.declared), "seen": [list(s) for s in o.seen]} for o in self.outputs]}

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> WarmupReport:
        return cls(str(raw.get("skipped") or ""), tuple(
            OutputSeen(str(o["name"]), tuple(int(d) for d in o["declared"]),
                       tuple(tuple(int(d) for d in s) for s in o["seen"])) for o in raw.get("outputs") or ()))


def mapped_files(pid: int | str = "self") -> set[str]:
    """The regular files process `pid` maps, by the paths /proc shows."""
    files = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/") and not fields[5].rstrip().endswith("(deleted)"):
                files.add(fields[5].rstrip("\n"))
    return files
