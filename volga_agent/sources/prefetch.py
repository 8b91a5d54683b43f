"""Prefetch in cluster mode: a ModelSpec with a remote source placed on this node is fetched in the background as
soon as the agent sees it, before any request, so that the instance's cold start loads from the cache.

`local` answers at once, without the network: the spec naming the cached copy when the cache has it, else None
while a fetch runs (started here when none does). When a fetch ends, `on_done` asks for the ModelSpecs to be
applied again. A fetch that fails with a retryable error (an unreachable store, a full cache) is tried again with
exponential backoff; one that cannot succeed as things are (refused credentials, a missing object, a digest that
does not match) is not retried until the ModelSpec changes (its source, digest or Secret name) or the agent
restarts. Either way the error is kept for the
EMI's conditions (`problem`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping

from volga_agent.sources import cache, errors
from volga_core import api

log = logging.getLogger(__name__)

BACKOFF_START_SEC = 2.0
BACKOFF_MAX_SEC = 300.0

# (the ModelSpec's namespace, the Secret's name) -> the Secret's keys and values ({} when there is no Secret)
SecretReader = Callable[[str, str], Mapping[str, str]]


@dataclasses.dataclass
class _Job:
    thread: threading.Thread
    error: errors.SourceError | None = None
    attempts: int = 0


class Prefetcher:
    def __init__(self, model_cache: cache.Cache, read_secret: SecretReader, on_done: Callable[[], None]) -> None:
        self.cache = model_cache
        self.read_secret = read_secret
        self.on_done = on_done
        self._jobs: dict[tuple[str, str, str, str], _Job] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @staticmethod
    def _key(namespace: str, spec: api.ModelSpecSpec) -> tuple[str, str, str, str]:
        return namespace, spec.source, spec.source_digest or "", spec.source_secret or ""

    def local(self, namespace: str, spec: api.ModelSpecSpec) -> api.ModelSpecSpec | None:
        """`spec` naming its cached copy, or None while its bytes are not on this node (a fetch is started)."""
        if not spec.remote_source:
            return spec
        secret = f"{namespace}/{spec.source_secret}" if spec.source_secret else ""
        found = self.cache.lookup(spec.source, spec.source_digest or "", secret)
        if found is not None:
            return spec.model_copy(update={"source": str(found.path), "source_digest": found.digest})
        key = self._key(namespace, spec)
        with self._lock:
            if key not in self._jobs:
                thread = threading.Thread(target=self._fetch, args=(key, spec), name=f"prefetch {spec.model_id}",
                                          daemon=True)
                self._jobs[key] = _Job(thread)
                thread.start()
        return None

    def problem(self, namespace: str, spec: api.ModelSpecSpec) -> errors.SourceError | None:
        """The last error of this spec's fetch, while it has not succeeded."""
        with self._lock:
            job = self._jobs.get(self._key(namespace, spec))
            return job.error if job is not None else None

    def fetching(self, source: str) -> cache.Fetching | None:
        return self.cache.fetching.get(source)

    def stop(self) -> None:
        self._stop.set()

    def _fetch(self, key: tuple[str, str, str, str], spec: api.ModelSpecSpec) -> None:
        namespace, source, digest, secret = key
        delay = BACKOFF_START_SEC
        while not self._stop.is_set():
            job = self._jobs[key]
            job.attempts += 1
            try:
                credentials = self.read_secret(namespace, secret) if secret else {}
                self.cache.resolve(source, digest, credentials, secret=f"{namespace}/{secret}" if secret else "")
            except errors.SourceError as exc:
                job.error = exc
                if not exc.retry:
                    log.warning("%s: %s (not retried until the ModelSpec changes)", source, exc)
                    self.on_done()
                    return
                log.warning("%s: %s; trying again in %.0f s", source, exc, delay)
                self.on_done()
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX_SEC)
                continue
            except Exception as exc:  # a broken Secret read, a full disk: said, then tried again
                job.error = errors.SourceUnavailable(f"{source}: {type(exc).__name__}: {exc}")
                log.warning("%s: %s; trying again in %.0f s", source, job.error, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX_SEC)
                continue
            with self._lock:
                self._jobs.pop(key, None)
            log.info("%s: fetched after %d attempt(s)", source, job.attempts)
            self.on_done()
            return
