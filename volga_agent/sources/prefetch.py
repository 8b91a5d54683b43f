"""Prefetch in cluster mode: a ModelSpec with a remote source placed on this node is fetched in the background as
soon as the agent sees it, before any request, so that the instance's cold start loads from the cache.

`local` answers at once, without the network: the spec naming the cached copy when the cache has it, else None
while a fetch runs (started here when none does). When a fetch ends, `on_done` asks for the ModelSpecs to be
applied again. A fetch that fails with a retryable error (an unreachable store, a full cache) is tried again with
exponential backoff; one that cannot succeed as things are (refused credentials, an untrusted certificate, a
missing object, a digest that does not match) is not tried again until the ModelSpec changes (its source, digest
or Secret name), the Secret it names changes (its resourceVersion, read every `secret_poll_sec`: one GET of the
Secret, the store is not asked), or the agent restarts. Either way the error is kept for the EMI's conditions
(`problem`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping

from volga_agent.sources import cache, errors
from volga_core import api

log = logging.getLogger(__name__)

BACKOFF_START_SEC = 2.0
BACKOFF_MAX_SEC = 300.0
SECRET_POLL_SEC = 15.0  # how often a failed fetch's Secret is read for a change ($VOLGA_SOURCE_SECRET_POLL_SEC)


def _said(source: str, exc: Exception) -> str:
    return str(exc) if str(exc).startswith(source) else f"{source}: {exc}"


@dataclasses.dataclass(frozen=True)
class Secret:
    """A Secret's keys and values, and its resourceVersion (what changes when they do)."""

    data: Mapping[str, str]
    version: str


# (the ModelSpec's namespace, the Secret's name) -> the Secret, or None when there is none of that name
SecretReader = Callable[[str, str], Secret | None]
Key = tuple[str, str, str, str, bool]  # namespace, source, digest, Secret name, whole (a model server's folder)


@dataclasses.dataclass
class _Job:
    thread: threading.Thread
    error: errors.SourceError | None = None
    attempts: int = 0  # fetches tried (each asks the store)
    settled: bool = False  # failed in a way that is not tried again until the ModelSpec or its Secret changes
    secret_version: str = ""  # the Secret's resourceVersion the last attempt used
    dropped: threading.Event = dataclasses.field(default_factory=threading.Event)


class Prefetcher:
    def __init__(self, model_cache: cache.Cache, read_secret: SecretReader, on_done: Callable[[], None]) -> None:
        self.cache = model_cache
        self.read_secret = read_secret
        self.on_done = on_done
        self.secret_poll_sec = float(os.environ.get("VOLGA_SOURCE_SECRET_POLL_SEC") or SECRET_POLL_SEC)
        self._jobs: dict[Key, _Job] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @staticmethod
    def key(namespace: str, spec: api.ModelSpecSpec) -> Key:
        return namespace, spec.source, spec.source_digest or "", spec.source_secret or "", \
            spec.framework is api.Framework.SERVER

    def local(self, namespace: str, spec: api.ModelSpecSpec) -> api.ModelSpecSpec | None:
        """`spec` naming its cached copy, or None while its bytes are not on this node (a fetch is started)."""
        if not spec.remote_source:
            return spec
        secret = f"{namespace}/{spec.source_secret}" if spec.source_secret else ""
        found = self.cache.lookup(spec.source, spec.source_digest or "", secret, spec.framework is api.Framework.SERVER)
        if found is not None:
            return spec.model_copy(update={"source": str(found.path), "source_digest": found.digest})
        key = self.key(namespace, spec)
        with self._lock:
            if key not in self._jobs:
                thread = threading.Thread(target=self._fetch, args=(key,), name=f"prefetch {spec.model_id}",
                                          daemon=True)
                self._jobs[key] = _Job(thread)
                thread.start()
        return None

    def keep(self, keys: Iterable[Key]) -> None:
        """Forget the fetches of sources no longer placed on this node (their retries and Secret reads stop)."""
        wanted = set(keys)
        with self._lock:
            for key in [k for k in self._jobs if k not in wanted]:
                self._jobs.pop(key).dropped.set()

    def problem(self, namespace: str, spec: api.ModelSpecSpec) -> errors.SourceError | None:
        """The last error of this spec's fetch, while it has not succeeded."""
        with self._lock:
            job = self._jobs.get(self.key(namespace, spec))
            return job.error if job is not None else None

    def attempts(self, namespace: str, spec: api.ModelSpecSpec) -> int:
        """How many times this spec's fetch has asked the store, while it has not succeeded."""
        with self._lock:
            job = self._jobs.get(self.key(namespace, spec))
            return job.attempts if job is not None else 0

    def fetching(self, source: str) -> cache.Fetching | None:
        return self.cache.fetching.get(source)

    def stop(self) -> None:
        self._stop.set()

    def _wait(self, job: _Job, seconds: float) -> bool:
        """Wait `seconds`; False when the fetch should end (the agent stops, the source is no longer placed)."""
        self._stop.wait(seconds)
        return not self._stop.is_set() and not job.dropped.is_set()

    def _fetch(self, key: Key) -> None:
        namespace, source, digest, secret, whole = key
        with self._lock:
            job = self._jobs[key]
        delay = BACKOFF_START_SEC
        where = f"{namespace}/{secret}" if secret else ""
        while not self._stop.is_set() and not job.dropped.is_set():
            try:
                credentials: Mapping[str, str] = {}
                if secret:
                    got = self.read_secret(namespace, secret)
                    version = got.version if got is not None else ""
                    if job.settled:
                        if version == job.secret_version:  # unchanged: the failure stands, the store is not asked
                            if not self._wait(job, self.secret_poll_sec):
                                return
                            continue
                        log.info("%s: Secret %s changed: fetching again", source, where)
                        job.settled = False
                    job.secret_version = version
                    if got is None:
                        raise errors.SourceDenied(f"{source}: the Secret {where!r} that spec.sourceSecret names does "
                                                  "not exist")
                    credentials = got.data
                job.attempts += 1
                self.cache.resolve(source, digest, credentials, secret=where, whole=whole)
            except errors.SourceError as exc:
                job.error = exc
                if not exc.retry:
                    log.warning("%s (not tried again until the ModelSpec%s changes)", _said(source, exc),
                                f" or its Secret {where!r}" if secret else "")
                    job.settled = True
                    delay = BACKOFF_START_SEC
                    self.on_done()
                    if not secret or not self._wait(job, self.secret_poll_sec):
                        return
                    continue
                log.warning("%s; trying again in %.0f s", _said(source, exc), delay)
                self.on_done()
                if not self._wait(job, delay):
                    return
                delay = min(delay * 2, BACKOFF_MAX_SEC)
                continue
            except Exception as exc:  # a broken Secret read, a full disk: said, then tried again
                if not job.settled:
                    job.error = errors.SourceUnavailable(f"{source}: {type(exc).__name__}: {exc}")
                    log.warning("%s; trying again in %.0f s", job.error, delay)
                if not self._wait(job, self.secret_poll_sec if job.settled else delay):
                    return
                if not job.settled:
                    delay = min(delay * 2, BACKOFF_MAX_SEC)
                continue
            with self._lock:
                if self._jobs.get(key) is job:
                    self._jobs.pop(key)
            log.info("%s: fetched after %d attempt(s)", source, job.attempts)
            self.on_done()
            return
