"""Shared snapshot storage: CRIU images one node writes and every compatible node may restore.

Without it each node cold-starts every model itself and freezes its own copy. With a shared root (a folder on a
volume every node mounts: the chart's persistentVolumeClaim mode), the first node to freeze a model publishes
its image there under a compatibility `Key`, and a node whose instance is COLD restores a published image whose
key equals its own instead of cold-starting (`instance`).

- The key names everything a restore depends on: the model (id, version, input hash), the framework and its
  runtime version, Python, CRIU, the GPU product and driver, the CPU flags numpy and onnxruntime dispatch on,
  and the kernel's major version. An image is found by the key's digest, so an incompatible one is never seen.
- A restored process finds its files at the paths it had: every node runs its agent with the same work root
  path (the pod's own mounts), and the worker's log, which CRIU reopens at its dumped size, travels with the
  image. The instance's work folder (and its parked weights' folder) is part of the key: an image is restored
  only by an instance whose paths are the ones the image holds. Those folders are named by the model and a
  per-node slot, not by the EMI (`pool.work_folder`), so any replica in the same slot on any node restores it.
- A GPU worker frozen from HOT parks its weights in a file under the snapshot root, which its image maps by
  path (CRIU records shared file mappings by reference). Such an image is published with that file (`Parked`:
  where the image maps it, its size and checksums), and a fetch puts it back at exactly that path (hard-linked
  where the filesystems allow), checked against its checksums before the restore.
- Publishing is atomic: the image is written into a temporary folder on the shared filesystem and renamed onto
  its digest; a rename onto an existing image fails, so when two nodes publish at once one wins and the other
  discards its copy. A reader never sees half an image (it looks only at digest folders with a manifest).
- The manifest holds the CRC-32 of each pages file and the canary answer recorded before the dump: a restore
  checks both, like a local one, and an image that fails is removed from the store.
- `collect` removes images of versions no ModelSpec has any more (after a grace period) and keeps the store
  within its byte budget, the least recently used first (parked weights count into an image's bytes).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import pathlib
import platform
import shutil
import time
import uuid
import zlib
from collections.abc import Iterable

import pydantic

from volga_agent.host import process
from volga_agent.snapshot import criu
from volga_core import api
from volga_core.api import conditions

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOG = "worker.log"
USED = "last-used"
PARKED = "parked-weights"  # a published image's copy of the weights it maps from outside itself
TMP_PREFIX = ".tmp-"
# What a restore writes into an image folder, and the owner marker of a local one: never published.
LOCAL_FILES = frozenset({"restore.log", "restore.pid", "lazy-pages.log", "lazy-pages.socket", process.OWNER_FILE})
# The /proc/cpuinfo flags numpy's and onnxruntime's kernels dispatch on: a process started where they exist
# may run instructions that fault where they do not.
CPU_FLAGS = ("sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
             "avx512cd", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16",
             "amx_int8", "asimd", "sve", "sve2")
# The Python distributions each framework's worker may run on (onnxruntime-gpu installs the same module as
# onnxruntime; the GPU agent image has only the former).
RUNTIMES = {"onnx": ("onnxruntime", "onnxruntime-gpu"), "torchscript": ("torch",), "pytorch": ("torch",)}
# A temporary folder older than this was left by a publisher that died.
STALE_TMP_SEC = 3600.0


class SharedImageError(RuntimeError):
    """A shared image could not be read or failed verification."""


@dataclasses.dataclass(frozen=True)
class Key:
    """What an image needs of the node that restores it; equal keys mean a compatible image."""

    model_id: str
    version: str
    input_hash: str
    framework: str
    runtime: str  # the framework's runtime distribution and version, e.g. onnxruntime 1.20.1
    python: str
    criu: str
    gpu_product: str  # "" on CPU
    gpu_driver: str
    cpu_flags: str
    kernel_major: str
    workdir: str = ""  # the instance's work folder: the restored worker's socket, log and signals are there
    parked_dir: str = ""  # where its GPU weights are parked while FROZEN ("" when they never are)
    # The content digest of the model's bytes (a remote source's, spec.sourceDigest): another node restores the
    # image only against the same bytes. "" where unknown; then left out of the digest (keys as they were).
    model_digest: str = ""

    @property
    def digest(self) -> str:
        fields = dataclasses.asdict(self)
        if not fields["model_digest"]:
            del fields["model_digest"]
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    """The parts of a key that belong to the node rather than the model."""

    criu: str
    gpu_product: str = ""
    gpu_driver: str = ""
    cpu_flags: str = dataclasses.field(default_factory=lambda: cpu_flags())
    kernel_major: str = dataclasses.field(default_factory=lambda: platform.release().split(".")[0])

    def key(self, model_id: str, version: str, input_hash: str, framework: str, gpu: bool, workdir: str = "",
            parked_dir: str = "", model_digest: str = "") -> Key:
        return Key(model_id, version, input_hash, framework, runtime_version(framework),
                   platform.python_version(), self.criu, self.gpu_product if gpu else "",
                   self.gpu_driver if gpu else "", self.cpu_flags, self.kernel_major, workdir, parked_dir,
                   model_digest)


def cpu_flags(cpuinfo: str | None = None) -> str:
    """The dispatch-relevant flags of this CPU, sorted, comma-separated."""
    if cpuinfo is None:
        try:
            cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    present: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            present.update(value.split())
            break
    return ",".join(flag for flag in CPU_FLAGS if flag in present)


@functools.cache
def runtime_version(framework: str) -> str:
    dists = RUNTIMES.get(framework, (framework,))
    for dist in dists:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{dists[0]} (not installed)"


def file_checksums(path: pathlib.Path) -> tuple[int, ...]:
    """A CRC-32 of each criu.CHECKSUM_CHUNK bytes of one file, like an image's pages files (a few threads: zlib
    releases the GIL)."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return ()
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as data, memoryview(data) as view, \
                concurrent.futures.ThreadPoolExecutor(criu.CHECKSUM_THREADS) as pool:
            return tuple(pool.map(lambda at: zlib.crc32(view[at:at + criu.CHECKSUM_CHUNK]),
                                  range(0, size, criu.CHECKSUM_CHUNK)))


class Parked(pydantic.BaseModel):
    """Weights an image maps from a file outside itself (a GPU worker frozen from HOT parks them there)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    path: str  # the absolute path the image maps: a restore needs the file there
    size_bytes: int
    checksums: list[int]  # a CRC-32 per criu.CHECKSUM_CHUNK bytes


class Manifest(pydantic.BaseModel):
    """What a published image carries beside CRIU's files."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    key: dict[str, str]
    digest: str
    node: str
    snapshot_id: str
    size_bytes: int
    dump_seconds: float
    published_unix: float
    canary: str  # the digest of the model's answer to the canary input, recorded before the dump
    generation: int  # the worker state the canary answer belongs to
    checksums: list[tuple[str, list[int]]]  # criu.Checksums: a CRC-32 per chunk of each pages file
    parked: Parked | None = None  # the parked weights the image maps, published beside it


@dataclasses.dataclass(frozen=True)
class Entry:
    """A complete image in the store."""

    path: pathlib.Path
    manifest: Manifest

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def model_id(self) -> str:
        return self.manifest.key.get("model_id", "")

    @property
    def version(self) -> str:
        return self.manifest.key.get("version", "")

    @property
    def size_bytes(self) -> int:
        """What the image takes in the store, its parked weights included."""
        parked = self.manifest.parked
        return self.manifest.size_bytes + (parked.size_bytes if parked is not None else 0)

    def ref(self, role: str | None = None) -> api.SharedSnapshotRef:
        """The image as EMI and ModelSpec statuses list it."""
        return api.SharedSnapshotRef(key=self.digest, node=self.manifest.node, size_bytes=self.size_bytes,
                                     published_at=conditions.timestamp(self.manifest.published_unix),
                                     gpu_product=self.manifest.key.get("gpu_product", ""),
                                     gpu_driver=self.manifest.key.get("gpu_driver", ""), role=role)

    def last_used(self) -> float:
        try:
            return (self.path / USED).stat().st_mtime
        except OSError:
            return self.manifest.published_unix


def _link_or_copy(source: pathlib.Path, target: pathlib.Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


class Store:
    """The images under one shared root, one folder per key digest."""

    def __init__(self, root: str | pathlib.Path) -> None:
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._orphaned: dict[str, float] = {}  # digest -> when this node first saw its version gone

    def find(self, key: Key) -> Entry | None:
        return self.entry(key.digest)

    def entry(self, digest: str) -> Entry | None:
        path = self.root / digest
        try:
            manifest = Manifest.model_validate_json((path / MANIFEST).read_text())
        except (OSError, pydantic.ValidationError):
            return None
        return Entry(path, manifest)

    def entries(self) -> list[Entry]:
        found = []
        for path in sorted(self.root.iterdir()) if self.root.is_dir() else ():
            if not path.name.startswith(TMP_PREFIX):
                entry = self.entry(path.name)
                if entry is not None:
                    found.append(entry)
        return found

    def publish(self, image: criu.Image, key: Key, node: str, canary: str, generation: int,
                logfile: pathlib.Path, parked: pathlib.Path | None = None) -> Entry | None:
        """Publish a local image under `key`, with the parked weights it maps (`parked`) when it has any; None
        when an image of that key exists already (ours is discarded). The image's checksums must have been
        recorded (CriuEngine(checksums=True))."""
        if image.checksums is None:
            raise SharedImageError(f"{image.path}: no checksums recorded; shared images need them")
        sums = image.checksums.result()
        final = self.root / key.digest
        if (final / MANIFEST).exists():
            return None
        tmp = self.root / f"{TMP_PREFIX}{node}-{uuid.uuid4().hex[:12]}"
        try:
            tmp.mkdir()
            for source in image.path.iterdir():
                if source.name not in LOCAL_FILES and source.is_file() and not source.is_symlink():
                    shutil.copy2(source, tmp / source.name)
            shutil.copy2(logfile, tmp / LOG)
            weights = None
            if parked is not None:
                shutil.copy2(parked, tmp / PARKED)
                weights = Parked(path=str(parked.resolve()), size_bytes=(tmp / PARKED).stat().st_size,
                                 checksums=list(file_checksums(parked)))
            manifest = Manifest(key={k: str(v) for k, v in dataclasses.asdict(key).items()}, digest=key.digest,
                                node=node, snapshot_id=image.snapshot_id, size_bytes=image.size_bytes,
                                dump_seconds=image.dump_seconds, published_unix=time.time(), canary=canary,
                                generation=generation, checksums=[(name, list(crcs)) for name, crcs in sums],
                                parked=weights)
            with open(tmp / MANIFEST, "w") as out:
                out.write(manifest.model_dump_json())
                out.flush()
                os.fsync(out.fileno())
            (tmp / USED).touch()
            os.rename(tmp, final)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                return None  # another node published this key first
            raise
        log.info("published %s (%s) as shared image %s", image.path, key.model_id, key.digest)
        return Entry(final, manifest)

    def fetch(self, entry: Entry, folder: pathlib.Path, parked_dir: pathlib.Path | None = None) -> criu.Image:
        """A local, restorable copy of a shared image (hard links where the filesystem allows) in `folder`,
        whose restore checks the pages files against the checksums taken at the dump. An image that maps parked
        weights gets them back at the path it maps, which must be in `parked_dir` (the restoring instance's
        folder for them), checked against their checksums first."""
        try:
            folder.mkdir(parents=True)
            process.claim(folder)
            for source in entry.path.iterdir():
                if source.name not in (MANIFEST, USED, LOG, PARKED) and source.is_file() and not source.is_symlink():
                    _link_or_copy(source, folder / source.name)
        except OSError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise SharedImageError(f"shared image {entry.digest}: cannot copy it to {folder}: {exc}") from exc
        try:
            self._place_parked(entry, parked_dir)
        except SharedImageError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        with contextlib.suppress(OSError):
            os.utime(entry.path / USED)
        sums = concurrent.futures.Future[criu.Checksums]()
        sums.set_result(tuple((name, tuple(crcs)) for name, crcs in entry.manifest.checksums))
        return criu.Image(folder, entry.manifest.snapshot_id, entry.manifest.size_bytes,
                          entry.manifest.dump_seconds, sums)

    def _place_parked(self, entry: Entry, parked_dir: pathlib.Path | None) -> None:
        """Put the image's parked weights at the path it maps (replacing whatever is there, atomically)."""
        parked = entry.manifest.parked
        if parked is None:
            return
        target = pathlib.Path(parked.path)
        # The path comes from the store: only a plain file name inside the instance's own parked folder is taken.
        if (parked_dir is None or not target.is_absolute() or target.parent != parked_dir.resolve()
                or target.name.startswith(".")):
            raise SharedImageError(f"shared image {entry.digest}: it maps parked weights at {target}, outside this "
                                   f"instance's folder for them ({parked_dir})")
        partial = target.with_name(f".fetch-{uuid.uuid4().hex[:12]}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(entry.path / PARKED, partial)
            if partial.stat().st_size != parked.size_bytes or file_checksums(partial) != tuple(parked.checksums):
                raise SharedImageError(f"shared image {entry.digest}: its parked weights do not match the "
                                       "checksums taken when it was published: the image is damaged")
            os.replace(partial, target)
        except OSError as exc:
            raise SharedImageError(f"shared image {entry.digest}: cannot place its parked weights at {target}: "
                                   f"{exc}") from exc
        finally:
            partial.unlink(missing_ok=True)

    def place_log(self, entry: Entry, logfile: pathlib.Path) -> None:
        """Put the publisher's worker log where the restored worker's open log file is (CRIU reopens it and
        expects the size and the mode it had at the dump: the mode too is copied, as the restoring agent's umask
        may differ from the publisher's worker's)."""
        shutil.copyfile(entry.path / LOG, logfile)
        shutil.copymode(entry.path / LOG, logfile)

    def discard(self, digest: str) -> None:
        """Remove an image (atomically for readers: it is renamed away first)."""
        path = self.root / digest
        doomed = self.root / f"{TMP_PREFIX}gone-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, doomed)
        except OSError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def collect(self, live: Iterable[tuple[str, str]], served: Iterable[str], grace_sec: float,
                budget_bytes: int, now: float | None = None) -> list[str]:
        """Remove images of a served model whose version no live (model id, version) has, once they have been
        orphaned for `grace_sec`; then the least recently used until the store fits `budget_bytes` (0: no
        budget); and temporary folders publishers left. Returns the digests removed."""
        now = time.time() if now is None else now
        live_set, served_set = set(live), set(served)
        removed = []
        entries = self.entries()
        for entry in entries:
            if entry.model_id in served_set and (entry.model_id, entry.version) not in live_set:
                since = self._orphaned.setdefault(entry.digest, now)
                if now - since >= grace_sec:
                    removed.append(entry.digest)
            else:
                self._orphaned.pop(entry.digest, None)
        if budget_bytes > 0:
            kept = sorted((e for e in entries if e.digest not in removed), key=Entry.last_used)
            total = sum(e.size_bytes for e in kept)
            for entry in kept:
                if total <= budget_bytes:
                    break
                removed.append(entry.digest)
                total -= entry.size_bytes
        for digest in removed:
            self.discard(digest)
            self._orphaned.pop(digest, None)
            log.info("removed shared image %s", digest)
        for path in self.root.iterdir():
            with contextlib.suppress(OSError):
                if path.name.startswith(TMP_PREFIX) and now - path.stat().st_mtime > STALE_TMP_SEC:
                    shutil.rmtree(path, ignore_errors=True)
        return removed


@dataclasses.dataclass(frozen=True)
class Context:
    """What an instance needs to use the store: the store, this node's name and facts."""

    store: Store
    node: str
    facts: NodeFacts

