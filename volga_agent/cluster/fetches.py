"""Cluster mode's remote sources: the ModelSpecs with an s3://, https:// or oci:// source that have EMIs on this
node are fetched into the node's model cache before their instances are created (`sources.prefetch`), with the
credentials of the Secret each names (read from the API server, never logged or written to a status).

While a fetch runs, the EMI is reported COLD with Ready=False, reason Fetching, and its status.source says how
many bytes have landed and at what rate; an instance of an earlier version of the ModelSpec keeps serving until
the new bytes are on the node. A fetch that fails is reported with its reason (SourceUnavailable, SourceDenied
naming the Secret, SourceCertificateUntrusted, SourceNotFound, SourceDigestMismatch, CacheFull).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from volga_agent.node import signature
from volga_agent.sources import cache, errors, prefetch
from volga_core import api, planner

log = logging.getLogger(__name__)


# The failures a fetch is tried again after (requests wait on): an unreachable store, a full cache.
RETRIED = frozenset({errors.SourceUnavailable.reason, errors.CacheFull.reason})


@dataclasses.dataclass(frozen=True)
class Pending:
    """A placed ModelSpec whose bytes are not on the node yet: fetching, or failed with `reason`/`message`."""

    spec: api.ModelSpecSpec
    reason: str
    message: str
    source: api.SourceStatus


class Fetches:
    def __init__(self, core: Any, on_done: Callable[[], None], root: str | None = None, metrics: Any = None) -> None:
        self.core = core
        self.metrics = metrics
        self.on_done = on_done
        self.root = root
        self._prefetcher: prefetch.Prefetcher | None = None
        self._filled: dict[tuple[str, str], api.ModelSpecSpec] = {}  # (owner, local source) -> signature read
        self._lock = threading.Lock()
        self.pending: dict[str, Pending] = {}  # owner -> what keeps its instances from being created
        self.loaded: dict[str, api.SourceStatus] = {}  # owner -> where its bytes came from
        self._waits: dict[str, threading.Event] = {}  # model id -> set once its instances exist (`applied`)

    def _cache(self) -> prefetch.Prefetcher:
        with self._lock:
            if self._prefetcher is None:  # made at the first remote source: nodes without one keep no cache
                model_cache = cache.Cache(self.root or cache.default_root(), cache.default_budget(),
                                          metrics=self.metrics)
                self._prefetcher = prefetch.Prefetcher(model_cache, self._read_secret, self.on_done)
            return self._prefetcher

    @property
    def model_cache(self) -> cache.Cache | None:
        """The node's model cache, once a remote source has been placed here."""
        return self._prefetcher.cache if self._prefetcher is not None else None

    def _read_secret(self, namespace: str, name: str) -> prefetch.Secret | None:
        from kubernetes.client import ApiException

        try:
            secret = self.core.read_namespaced_secret(name, namespace, _request_timeout=10)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return prefetch.Secret({k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()},
                               str(secret.metadata.resource_version or ""))

    def localise(self, specs: Mapping[str, api.ModelSpecSpec], desired: Sequence[planner.Desired],
                 current: Callable[[str], api.ModelSpecSpec | None]) -> tuple[dict[str, api.ModelSpecSpec],
                                                                                  list[planner.Desired]]:
        """`specs` with the remote sources of the placed ones replaced by their cached copies (signatures read),
        and `desired` without the instances that wait for bytes (unless an instance of an earlier version runs:
        `current(name)` gives its spec, kept until the new bytes are here)."""
        out = dict(specs)
        pending: dict[str, Pending] = {}
        loaded: dict[str, api.SourceStatus] = {}
        for owner in sorted({d.model_spec for d in desired if specs[d.model_spec].remote_source}):
            spec = specs[owner]
            namespace = owner.split("/", 1)[0]
            fetcher = self._cache()
            local = fetcher.local(namespace, spec)
            if local is not None:
                try:
                    out[owner] = self._fill(owner, local)
                    loaded[owner] = api.SourceStatus(uri=spec.source, digest=local.source_digest or "",
                                                     bytes=cache.size_of(local.source_path))
                    continue
                except (api.SpecError, OSError) as exc:
                    problem = exc.problems[0][1] if isinstance(exc, api.SpecError) else str(exc)
                    pending[owner] = Pending(spec, "SignatureUnreadable", problem, api.SourceStatus(uri=spec.source))
                    continue
            error = fetcher.problem(namespace, spec)
            going = fetcher.fetching(spec.source)
            status = api.SourceStatus(uri=spec.source, fetching=going is not None,
                                      bytes=going.progress.done if going else 0,
                                      total_bytes=going.progress.total if going else 0,
                                      rate_bytes_per_sec=round(going.progress.rate, 1) if going else 0.0)
            if error is not None and going is None:
                pending[owner] = Pending(spec, error.reason, str(error), status)
            else:
                pending[owner] = Pending(spec, "Fetching", f"fetching {spec.source}: {status.bytes} of "
                                         f"{status.total_bytes} bytes at {status.rate_bytes_per_sec / 1e6:.1f} MB/s",
                                         status)
        if self._prefetcher is not None:  # the fetches of ModelSpecs no longer placed here end
            self._prefetcher.keep(prefetch.Prefetcher.key(o.split("/", 1)[0], specs[o])
                                  for o in {d.model_spec for d in desired} if specs[o].remote_source)
        kept = []
        for d in desired:
            if d.model_spec not in pending:
                kept.append(d)
            elif (running := current(d.name)) is not None:
                kept.append(d)
                out[d.model_spec] = running
        if self._prefetcher is not None:  # the bytes of the placed models stay until they are no longer placed
            for owner in self.loaded.keys() - loaded.keys():
                self._prefetcher.cache.release(owner)
            for owner, status in loaded.items():
                self._prefetcher.cache.hold(owner, status.digest)
        with self._lock:
            self.pending, self.loaded = pending, loaded
            for p in pending.values():
                if p.reason == "Fetching" or p.reason in RETRIED:
                    self._waits.setdefault(p.spec.model_id, threading.Event())
        return out, kept

    def awaiting(self, model_id: str) -> threading.Event | None:
        """The Event a request for `model_id` waits on while its source is being fetched (`pool.awaiting`)."""
        with self._lock:
            return self._waits.get(model_id)

    def applied(self) -> None:
        """The pool has applied what `localise` gave: wake the requests of models whose bytes are here now (or
        whose fetch failed for good: they get the error at once)."""
        with self._lock:
            waiting = {p.spec.model_id for p in self.pending.values() if p.reason == "Fetching" or p.reason in RETRIED}
            for model_id in [m for m in self._waits if m not in waiting]:
                self._waits.pop(model_id).set()

    def _fill(self, owner: str, local: api.ModelSpecSpec) -> api.ModelSpecSpec:
        key = (owner, f"{local.source}\n{local.model_dump_json()}")
        filled = self._filled.get(key)
        if filled is None:
            filled = self._filled[key] = signature.fill(local)
        return filled

    def stop(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.stop()
