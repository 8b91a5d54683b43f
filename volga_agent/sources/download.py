"""One object fetched into a file in byte ranges over several connections, resumably, hashed as it lands.

The object is cut into chunks; `connections` threads each take the next chunk, GET its range and write it at its
offset. What is done is written beside the partial file after every chunk, so a fetch cut short (an agent
restart, a dropped connection) starts again where it stopped, as long as the object's version and size are
the same. The calling thread hashes the file in order, chunk by chunk as they complete, so verification
costs no extra pass. A range that arrives short is fetched again (a few times), never accepted.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterator

from volga_agent.sources import errors

CHUNK_BYTES = 16 << 20
HASH_BYTES = 8 << 20
CHUNK_TRIES = 3
# How far the fetch may run ahead of the hash: a chunk is started only while fewer than `connections` + this many
# chunks lie between it and the first chunk not hashed yet. Unbounded, the connections took the CPU the hash needed
# (2 vCPUs shared with the store): bytes landed at 1 GB/s, then 0.3-0.6 s of hashing was left at the end.
AHEAD_CHUNKS = 2

# A range's bytes as they arrive; a memoryview piece may be reused once the next is asked for
Reader = Callable[[int, int], Iterator[bytes | memoryview]]


@dataclasses.dataclass
class Progress:
    """A fetch as it goes: bytes landed of the total, and the rate over the last seconds (bytes/s)."""

    total: int
    done: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)
    _marks: collections.deque[tuple[float, int]] = dataclasses.field(default_factory=collections.deque)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            self._marks.append((now, self.done))
            while len(self._marks) > 2 and now - self._marks[0][0] > 5.0:
                self._marks.popleft()

    @property
    def rate(self) -> float:
        with self._lock:
            if len(self._marks) < 2:
                return 0.0
            (t0, b0), (t1, b1) = self._marks[0], self._marks[-1]
            return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def fetch(read: Reader, size: int, part: pathlib.Path, version: str, connections: int = 8,
          chunk_bytes: int = CHUNK_BYTES, progress: Progress | None = None) -> str:
    """Fetch `size` bytes through `read(start, end)` into `part`; the sha256 (hex) of what landed. Resumes from
    `part` and its state file when they are of the same `version`. SourceError when a range cannot be had."""
    if size == 0:  # nothing to ask for (a range of an empty object is not satisfiable)
        part.write_bytes(b"")
        return hashlib.sha256(b"").hexdigest()
    state_file = part.with_name(part.name + ".json")
    chunks = [(start, min(start + chunk_bytes, size)) for start in range(0, size, chunk_bytes)]
    done: set[int] = set()
    try:
        state = json.loads(state_file.read_text())
        if (state["version"], state["size"], state["chunk"]) == (version, size, chunk_bytes) and \
                part.stat().st_size == size:
            done = {int(i) for i in state["done"]}
    except (OSError, ValueError, KeyError):
        pass
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not done:
            os.ftruncate(fd, 0)
        os.ftruncate(fd, size)
        try:  # the disk space, reserved before the first byte (a disk that fills meanwhile fails here, not midway)
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                os.ftruncate(fd, 0)
                raise errors.CacheFull(f"no space left on the cache's disk for the {size} bytes to fetch "
                                       f"({_free(part)} bytes free)") from None
            # A file system without fallocate (EOPNOTSUPP, EINVAL): the bytes are written without the reservation.
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        if progress is not None:
            progress.add(sum(chunks[i][1] - chunks[i][0] for i in done))
        try:
            return _run(read, fd, chunks, done, state_file, version, size, chunk_bytes, connections, progress)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise errors.CacheFull(f"the cache's disk filled during the fetch ({_free(part)} bytes free)") from None
    finally:
        os.close(fd)


def _free(path: pathlib.Path) -> int:
    st = os.statvfs(path.parent)
    return st.f_bavail * st.f_frsize


def _run(read: Reader, fd: int, chunks: list[tuple[int, int]], done: set[int], state_file: pathlib.Path,
         version: str, size: int, chunk_bytes: int, connections: int, progress: Progress | None) -> str:
    cond = threading.Condition()
    todo = collections.deque(i for i in range(len(chunks)) if i not in done)
    failure: list[BaseException] = []
    hashed = [0]  # the first chunk not hashed yet
    window = connections + AHEAD_CHUNKS

    def save() -> None:
        tmp = state_file.with_name(state_file.name + ".tmp")
        tmp.write_text(json.dumps({"version": version, "size": size, "chunk": chunk_bytes, "done": sorted(done)}))
        tmp.replace(state_file)

    def one(index: int) -> None:
        start, end = chunks[index]
        for attempt in range(CHUNK_TRIES):
            at = start
            try:
                for piece in read(start, end):
                    if at + len(piece) > end:
                        raise errors.SourceMismatch(f"the store sent more than the {end - start} bytes asked for")
                    os.pwrite(fd, piece, at)
                    at += len(piece)
                    if progress is not None:
                        progress.add(len(piece))
            except errors.SourceUnavailable:
                if attempt == CHUNK_TRIES - 1:
                    raise
            if progress is not None and at != end:
                progress.add(start - at)  # what this try landed is fetched again
            if at == end:
                return
            if attempt == CHUNK_TRIES - 1:
                raise errors.SourceUnavailable(f"the connection closed after {at - start} of {end - start} bytes "
                                               f"of range {start}-{end - 1}, {CHUNK_TRIES} times")

    def worker() -> None:
        while True:
            with cond:
                while todo and not failure and todo[0] >= hashed[0] + window:
                    cond.wait()  # the hash is behind: leave it the CPU
                if failure or not todo:
                    return
                index = todo.popleft()
            try:
                one(index)
            except BaseException as exc:
                with cond:
                    failure.append(exc)
                    cond.notify_all()
                return
            with cond:
                done.add(index)
                try:
                    save()
                except OSError as exc:  # a full disk, say: the fetch fails with it (never a worker lost silently)
                    failure.append(exc)
                    return
                finally:
                    cond.notify_all()

    threads = [threading.Thread(target=worker, name=f"fetch-{n}", daemon=True)
               for n in range(max(1, min(connections, len(todo))))]
    for thread in threads:
        thread.start()
    digest = hashlib.sha256()
    try:
        for index, (start, end) in enumerate(chunks):
            with cond:
                while index not in done and not failure:
                    cond.wait()
                if failure:
                    raise failure[0]
            at = start
            while at < end:
                piece = os.pread(fd, min(HASH_BYTES, end - at), at)
                if not piece:
                    raise errors.SourceMismatch(f"the partial file ends at {at} of {size} bytes")
                digest.update(piece)
                at += len(piece)
            with cond:
                hashed[0] = index + 1
                cond.notify_all()
    finally:
        with cond:
            if not failure and len(done) < len(chunks):
                failure.append(RuntimeError("stopped"))
            todo.clear()
            cond.notify_all()
        for thread in threads:
            thread.join()
    return digest.hexdigest()
