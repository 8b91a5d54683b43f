"""The node's model cache: one verified copy of each model's bytes, named by their content digest.

Layout under the cache root:

    sha256/<hex>/            one entry per content digest: the model file (or folder), with its own name
    partial/<key>/           fetches under way: each object's .part file and its resume state
    tmp/                     entries being assembled; renamed into sha256/ once verified, emptied at start
    ca/<hex>.pem             CA bundles a Secret gave as PEM text (SOURCE_CA_BUNDLE), by their digest
    index.json               the entries (size, last use, model file) and, per source URI (and the credentials
                             that read it), the version and digest it last resolved to: survives an agent restart
    .users, .index.lock      locks: several processes may share a cache (each holds .users shared; the index is
                             merged under .index.lock); only a process alone with it evicts or clears tmp/

The content digest of a file is the sha256 of its bytes; of a folder, the sha256 of the lines
`<file sha256 hex>  <relative path>\n` sorted by path (what `sha256sum` prints, so
`cd model && find . -type f -printf '%P\n' | LC_ALL=C sort | xargs sha256sum | sha256sum` computes it). A ModelSpec
with `sourceDigest` gets exactly those bytes or an error; without it, a source whose version changed (a new ETag,
a new manifest) resolves to a new digest: a new model version, never mixed with the old one's.

The cache is bounded by a disk budget: a fetch first evicts the least recently used entries that no instance
holds, and is refused (CacheFull) when even that would not make room. Other models keep serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import os
import pathlib
import shutil
import tarfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from volga_agent.sources import download, errors, stores, uri
from volga_core import api

log = logging.getLogger(__name__)

MODEL_SUFFIXES = (".onnx", ".pt", ".pth", ".ts", ".torchscript", ".jit")
_ORIGINS: dict[str, str] = {}  # a cached model file's path -> the source URI this process last resolved to it


def origin(path: str) -> str:
    """The source URI a model file of this process's model cache was resolved from ('' for any other path)."""
    return _ORIGINS.get(path, "")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A source resolved to local bytes. path: the model file to load (a model server's: the folder it fetched);
    digest: the content digest; hit: served from the cache without a download; source: the URI the bytes came
    from."""

    source: str
    path: pathlib.Path
    digest: str
    size: int
    hit: bool
    seconds: float = 0.0


@dataclasses.dataclass
class Fetching:
    """A fetch under way, for the EMI status: the source, bytes landed of the total, the current rate."""

    source: str
    progress: download.Progress


def tree_digest(files: Mapping[str, str]) -> str:
    """The content digest of a folder: {relative path: sha256 hex} -> 'sha256:...'."""
    lines = "".join(f"{files[path]}  {path}\n" for path in sorted(files))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(download.HASH_BYTES):
            digest.update(block)
    return digest.hexdigest()


def size_of(path: pathlib.Path) -> int:
    """A file's bytes, or a folder's (a model server's fetched files): the sum of its files'."""
    if not path.is_dir():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def model_file(folder: pathlib.Path, files: list[str]) -> str:
    """The file to load in a folder source: its only file, or its only model file (by suffix) at the top."""
    if len(files) == 1:
        return files[0]
    models = [f for f in files if "/" not in f and f.endswith(MODEL_SUFFIXES)]
    if len(models) != 1:
        raise errors.SourceNotFound(
            f"the folder has {len(models) or 'no'} model files at its top ({', '.join(models) or ', '.join(files)}); "
            f"a folder source holds one ({', '.join(MODEL_SUFFIXES)}) beside its data files")
    return models[0]


class Cache:
    """Thread-safe. `budget_bytes`: the most the entries may take (0: no bound but the disk's free space)."""

    def __init__(self, root: str | pathlib.Path, budget_bytes: int = 0, connections: int = 10,
                 chunk_bytes: int = download.CHUNK_BYTES, metrics: Any = None,
                 open_store: Callable[..., stores.Store] = stores.open_store) -> None:
        self.root = pathlib.Path(root)
        self.budget = budget_bytes
        self.connections = connections
        self.chunk_bytes = chunk_bytes
        self.metrics = metrics
        self._open_store = open_store
        self._lock = threading.RLock()
        self._holds: dict[str, str] = {}  # holder -> digest
        self._inflight: dict[str, threading.Lock] = {}  # source URI -> its fetch's lock
        self.fetching: dict[str, Fetching] = {}
        self.evictions = 0
        self._dropped: set[str] = set()  # digests this process evicted
        for sub in ("sha256", "partial", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # Every process using the cache holds a shared lock on `.users` for as long as it does: one that gets it
        # exclusively is alone, and only then removes what others could be using (their assemblies in tmp/,
        # entries the index does not list yet, evictions).
        self._users = os.open(self.root / ".users", os.O_RDWR | os.O_CREAT, 0o644)
        self._release = weakref.finalize(self, os.close, self._users)
        alone = self._alone()
        if alone:
            shutil.rmtree(self.root / "tmp", ignore_errors=True)
            (self.root / "tmp").mkdir()
        self._index = self._load(remove_strays=alone)
        self._share()
        self._gauge()

    # -- state ----------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop using the cache: its lock goes (as when the Cache is collected, or the process exits)."""
        self._release()

    def _alone(self) -> bool:
        try:
            fcntl.flock(self._users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _share(self) -> None:
        fcntl.flock(self._users, fcntl.LOCK_SH)

    def _read(self) -> dict[str, Any]:
        try:
            index: dict[str, Any] = json.loads((self.root / "index.json").read_text())
        except (OSError, ValueError):
            index = {}
        return index

    def _load(self, remove_strays: bool) -> dict[str, Any]:
        index = self._read()
        entries = {d: e for d, e in index.get("entries", {}).items() if self._entry(d).is_dir()}
        if remove_strays:
            for stray in (self.root / "sha256").iterdir():  # an entry the index lost: its bytes are not vouched for
                if f"sha256:{stray.name}" not in entries:
                    shutil.rmtree(stray, ignore_errors=True)
        sources = {u: s for u, s in index.get("sources", {}).items() if s.get("digest") in entries}
        return {"entries": entries, "sources": sources}

    def _merge(self, disk: Mapping[str, Any]) -> None:
        """Take in what other processes using the cache wrote to the index."""
        entries = {**disk.get("entries", {}), **self._index["entries"]}
        for digest in self._dropped:
            entries.pop(digest, None)
        entries = {d: e for d, e in entries.items() if self._entry(d).is_dir()}
        sources = {k: v for k, v in {**disk.get("sources", {}), **self._index["sources"]}.items()
                   if v.get("digest") in entries}
        self._index = {"entries": entries, "sources": sources}

    def _refresh(self) -> None:
        with (self.root / ".index.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            self._merge(self._read())

    def _save(self) -> None:
        """Write the index, merged with what other processes using the cache wrote meanwhile."""
        with (self.root / ".index.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._merge(self._read())
            tmp = self.root / f"index.json.{uuid.uuid4().hex}"
            tmp.write_text(json.dumps(self._index, indent=1, sort_keys=True))
            os.replace(tmp, self.root / "index.json")

    def _entry(self, digest: str) -> pathlib.Path:
        return self.root / "sha256" / digest.removeprefix("sha256:")

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.cache_bytes.set(self.used())

    def used(self) -> int:
        with self._lock:
            return sum(int(e["size"]) for e in self._index["entries"].values())

    def entries(self) -> dict[str, dict[str, Any]]:
        """digest -> {size, last_used, model, sources}, a copy."""
        with self._lock:
            self._refresh()
            copy: dict[str, dict[str, Any]] = json.loads(json.dumps(self._index["entries"]))
            return copy

    def hold(self, holder: str, digest: str) -> None:
        """`holder` (an instance) uses `digest`: it is not evicted until released."""
        with self._lock:
            self._holds[holder] = digest

    def release(self, holder: str) -> None:
        with self._lock:
            self._holds.pop(holder, None)

    def held(self) -> set[str]:
        with self._lock:
            return set(self._holds.values())

    # -- resolving ------------------------------------------------------------------------------------------------

    @staticmethod
    def _memo(source: str, secret: str) -> str:
        # Who fetched a source is part of the memo: a copy is handed out without asking the store only to the
        # credentials that fetched it; others first show the store lets them read it (`resolve`).
        return f"{secret}|{source}"

    def lookup(self, source: str, digest: str = "", secret: str = "", whole: bool = False) -> Resolved | None:
        """The cached copy of `source` without asking the store, as these credentials (`secret`: the name of
        their Secret) last resolved it; with `digest`, only when it has that digest; with `whole`, the folder of
        its files (a model server's) rather than its model file. None when there is none."""
        with self._lock:
            memo = self._index["sources"].get(self._memo(source, secret), {})
            if not memo:  # another process using the cache may have fetched it
                self._refresh()
                memo = self._index["sources"].get(self._memo(source, secret), {})
            if not memo or (digest and memo.get("digest") != digest):
                return None
            return self._resolved(source, memo["digest"], whole)

    def _resolved(self, source: str, digest: str, whole: bool = False) -> Resolved | None:
        entry = self._index["entries"].get(digest)
        if entry is None or not (whole or entry["model"]):  # fetched for a server: no model file chosen in it
            return None
        entry["last_used"] = time.time()
        path = self._entry(digest) / ("" if whole else entry["model"])
        _ORIGINS[str(path)] = source
        return Resolved(source, path, digest, int(entry["size"]), True)

    def resolve(self, source: str, digest: str = "", credentials: Mapping[str, str] | None = None,
                secret: str = "", whole: bool = False) -> Resolved:
        """The local model file for `source` (with `whole`, the folder of its files: a model server's), fetched and
        verified when the cache lacks it. A file:// source or node path comes back as it is. SourceError when the
        bytes cannot be had or are not the ones promised."""
        src = uri.parse(source)
        if not src.remote:
            return Resolved(source, pathlib.Path(src.path), digest, 0, True)
        started = time.monotonic()
        if digest and (found := self.lookup(source, digest, secret, whole)) is not None:
            return self._hit(found)
        with self._lock:
            lock = self._inflight.setdefault(source, threading.Lock())
        with lock:  # one fetch per source: a second caller waits, then finds the entry
            if digest and (found := self.lookup(source, digest, secret, whole)) is not None:
                return self._hit(found)
            store = self._open_store(src, self._ca_file(credentials or {}), secret, self.connections)
            listing = store.describe(src)  # the store says these credentials may read it, and its version
            with self._lock:
                self._refresh()
                for memo in list(self._index["sources"].values()):
                    if memo.get("uri") == source and memo.get("version") == listing.version and \
                            (not digest or memo["digest"] == digest) and \
                            (found := self._resolved(source, memo["digest"], whole)) is not None:
                        self._index["sources"][self._memo(source, secret)] = dict(memo)
                        return self._hit(found)
            resolved = self._fetch(src, store, listing, digest, secret, whole)
        return dataclasses.replace(resolved, seconds=time.monotonic() - started)

    def _ca_file(self, credentials: Mapping[str, str]) -> Mapping[str, str]:
        """`credentials` with a CA bundle given as PEM text (a Secret's key) written to a file the stores read."""
        pem = credentials.get(stores.CA_BUNDLE, "")
        if not pem.lstrip().startswith("-----BEGIN"):
            return credentials  # none, or a file's path (volga up's environment)
        path = self.root / "ca" / f"{hashlib.sha256(pem.encode()).hexdigest()[:32]}.pem"
        if not path.is_file():
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
            tmp.write_text(pem)
            os.replace(tmp, path)
        return {**credentials, stores.CA_BUNDLE: str(path)}

    def _hit(self, found: Resolved) -> Resolved:
        if self.metrics is not None:
            self.metrics.cache_hits.inc()
        with self._lock:
            self._save()
        return found

    def _fetch(self, src: uri.Source, store: stores.Store, listing: stores.Listing, pinned: str,
               secret: str, whole: bool = False) -> Resolved:
        need = listing.size * (2 if any(o.unpack for o in listing.objects) else 1)
        self._make_room(need, src.uri)
        key = hashlib.sha256(src.uri.encode()).hexdigest()[:32]
        partial = self.root / "partial" / key
        partial.mkdir(parents=True, exist_ok=True)
        progress = download.Progress(listing.size)
        self.fetching[src.uri] = Fetching(src.uri, progress)
        started = time.monotonic()
        assembly = pathlib.Path(self.root / "tmp" / uuid.uuid4().hex)
        try:
            hashes: dict[str, str] = {}
            for n, obj in enumerate(listing.objects):
                part = partial / f"{n}.part"
                got = download.fetch(functools.partial(store.read, obj), obj.size, part, obj.version,
                                     self.connections, self.chunk_bytes, progress)
                if obj.digest and f"sha256:{got}" != obj.digest:
                    self._drop(part)
                    raise errors.SourceMismatch(f"{src}: {obj.relpath}: the bytes fetched have digest sha256:{got}, "
                                                f"the store promised {obj.digest}")
                target = assembly / obj.relpath
                if obj.unpack:
                    hashes.update(_unpack(part, assembly, src.uri))
                    self._drop(part)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(part, target)
                    part.with_name(part.name + ".json").unlink(missing_ok=True)
                    hashes[obj.relpath] = got
            digest = tree_digest(hashes) if listing.folder else "sha256:" + hashes[listing.objects[0].relpath]
            if pinned and digest != pinned:
                raise errors.SourceMismatch(f"{src}: the bytes fetched have digest {digest}, spec.sourceDigest is "
                                            f"{pinned}: refused")
            model = "" if whole else model_file(assembly, sorted(hashes))
            size = sum((assembly / p).stat().st_size for p in hashes)
            with self._lock:
                entry = self._entry(digest)
                if not entry.is_dir():
                    os.rename(assembly, entry)
                record = self._index["entries"].setdefault(digest, {"size": size, "model": model, "sources": []})
                record["model"] = record["model"] or model
                record["last_used"] = time.time()
                if src.uri not in record["sources"]:
                    record["sources"].append(src.uri)
                self._index["sources"][self._memo(src.uri, secret)] = {"uri": src.uri, "version": listing.version,
                                                                       "digest": digest}
                self._save()
                self._gauge()
            seconds = time.monotonic() - started
            if self.metrics is not None:
                self.metrics.fetched_bytes.labels(src.scheme).inc(listing.size)
                self.metrics.fetch_latency.labels(src.scheme).observe(seconds * 1000)
            log.info("%s: fetched %d bytes in %.1f s, digest %s", src.uri, listing.size, seconds, digest)
            _ORIGINS[str(entry / model)] = src.uri
            return Resolved(src.uri, entry / model, digest, size, False, seconds)  # `whole`: the entry itself
        except errors.CacheFull as exc:
            shutil.rmtree(partial, ignore_errors=True)  # a full disk: what landed gives its space back
            if str(exc).startswith(src.uri):
                raise
            raise errors.CacheFull(f"{src}: {exc}") from None
        finally:
            self.fetching.pop(src.uri, None)
            shutil.rmtree(assembly, ignore_errors=True)
            with contextlib.suppress(OSError):
                partial.rmdir()  # left when a fetch is cut short: its parts resume the next one

    @staticmethod
    def _drop(part: pathlib.Path) -> None:
        part.unlink(missing_ok=True)
        part.with_name(part.name + ".json").unlink(missing_ok=True)

    def _make_room(self, need: int, source: str) -> None:
        """Evict least recently used entries no instance holds until `need` more bytes fit the budget and the
        disk; CacheFull when they cannot."""
        with self._lock:
            held = set(self._holds.values())
            free = shutil.disk_usage(self.root).free

            def over() -> bool:
                return bool(self.budget and self.used() + need > self.budget) or need > free

            if not over():
                return
            # Another process's instances may use any entry: evict only while no other process uses the cache.
            alone = self._alone()
            victims = sorted((e["last_used"], d) for d, e in self._index["entries"].items()
                             if d not in held) if alone else []
            evictable = sum(int(self._index["entries"][d]["size"]) for _, d in victims)
            if (self.budget and self.used() - evictable + need > self.budget) or need > free + evictable:
                victims = []  # even evicting them all would not make room: nothing is evicted in vain
            while over() and victims:
                _, digest = victims.pop(0)
                size = int(self._index["entries"].pop(digest)["size"])
                self._dropped.add(digest)
                self._index["sources"] = {u: s for u, s in self._index["sources"].items() if s["digest"] != digest}
                shutil.rmtree(self._entry(digest), ignore_errors=True)
                free += size
                self.evictions += 1
                if self.metrics is not None:
                    self.metrics.cache_evictions.inc()
                log.info("model cache: evicted %s (%d bytes) to make room for %s", digest, size, source)
            self._save()
            self._share()  # the shared lock again (a failed upgrade gave it up too)
            self._gauge()
            if over():
                shared = "" if alone else "; another process uses the cache, so nothing was evicted"
                budget = f"a budget of {self.budget} bytes" if self.budget else "no budget"
                raise errors.CacheFull(
                    f"{source}: {need} bytes do not fit the model cache{shared} ({self.used()} bytes cached, "
                    f"{budget}, {free} bytes free on disk; models in use are never evicted)")


def _unpack(archive: pathlib.Path, into: pathlib.Path, source: str) -> dict[str, str]:
    """Unpack a gzipped tar (a folder as ORAS pushes it) into `into`, its top folder stripped: regular files and
    folders only, none outside. {relative path: sha256 hex}."""
    hashes: dict[str, str] = {}
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:*") as tar:
        members = tar.getmembers()
        tops = {m.name.split("/", 1)[0] for m in members}
        strip = len(tops) == 1 and any("/" in m.name for m in members)
        for member in members:
            name = member.name.split("/", 1)[1] if strip and "/" in member.name else member.name
            if member.isdir() or (strip and "/" not in member.name):
                continue
            if not member.isfile() or name.startswith("/") or ".." in name.split("/"):
                raise errors.SourceMismatch(f"{source}: the archive holds {member.name!r}, which is not a plain "
                                            "file inside the folder")
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            reader = tar.extractfile(member)
            assert reader is not None
            digest = hashlib.sha256()
            with reader, target.open("wb") as out:
                while block := reader.read(download.HASH_BYTES):
                    digest.update(block)
                    out.write(block)
            hashes[name] = digest.hexdigest()
    if not hashes:
        raise errors.SourceNotFound(f"{source}: the archive holds no files")
    return hashes


def default_root() -> pathlib.Path:
    """The node's model cache: $VOLGA_MODEL_CACHE, else ~/.cache/volga/model-cache."""
    return pathlib.Path(os.environ.get("VOLGA_MODEL_CACHE") or pathlib.Path.home() / ".cache/volga/model-cache")


def default_budget() -> int:
    """The cache's disk budget in bytes: $VOLGA_MODEL_CACHE_BYTES, else 0 (bounded by the free disk only)."""
    return int(os.environ.get("VOLGA_MODEL_CACHE_BYTES") or 0)


@functools.cache
def for_process(root: pathlib.Path, budget: int) -> Cache:
    """The one Cache of this process on `root` (it holds the cache's shared lock as long as the process runs)."""
    return Cache(root, budget)


def localise(cache: Cache, spec: api.ModelSpecSpec, credentials: Mapping[str, str],
             secret: str = "", holder: str = "") -> tuple[api.ModelSpecSpec, Resolved]:
    """`spec` with its remote source replaced by the cached, verified local copy (and the digest it has pinned),
    held for `holder` when given; a local source comes back unchanged. SourceError when the bytes cannot be
    had."""
    if not spec.remote_source:
        if spec.source_digest:
            verify_local(spec.source_path, spec.source_digest)
        return spec, Resolved(spec.source, spec.source_path, spec.source_digest or "", 0, True)
    resolved = cache.resolve(spec.source, spec.source_digest or "", credentials, secret or spec.source_secret or "",
                             whole=spec.framework is api.Framework.SERVER)
    if holder:
        cache.hold(holder, resolved.digest)
    return spec.model_copy(update={"source": str(resolved.path), "source_digest": resolved.digest}), resolved


_VERIFIED: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}  # (path, its files' stamps) -> digest


def verify_local(path: pathlib.Path, digest: str) -> None:
    """A node file (or folder: a model server's) pinned by spec.sourceDigest: SourceMismatch unless it has that
    digest (hashed once per version of its files)."""
    try:
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file())
            stamps = tuple((f.relative_to(path).as_posix(), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
        else:
            st = path.stat()
            stamps = (("", st.st_mtime_ns, st.st_size),)
        key = (str(path), stamps)
        if key not in _VERIFIED:
            _VERIFIED[key] = tree_digest({name: file_sha256(path / name) for name, _, _ in stamps}) \
                if path.is_dir() else "sha256:" + file_sha256(path)
    except OSError as exc:
        raise errors.SourceNotFound(f"{path}: {exc.strerror}") from None
    if _VERIFIED[key] != digest:
        raise errors.SourceMismatch(f"{path} has digest {_VERIFIED[key]}, spec.sourceDigest is {digest}: refused")
