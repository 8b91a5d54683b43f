"""A token bucket for Kubernetes API writes, with exponential backoff on errors.

Thousands of ModelSpecs applied at once, or hundreds of agents reporting after a restart, would otherwise
hit etcd with a write storm (docs/architecture.md). Every write of the operator and of an agent waits for
a token: at most `rate` writes per second on average, `burst` at once. A write that fails with 429, 409 or
5xx is retried after a growing, jittered delay; other errors go to the caller.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import tenacity

T = TypeVar("T")
RETRYABLE = frozenset({409, 429, 500, 502, 503, 504})


class TokenBucket:
    """Thread-safe; `acquire` blocks, `acquire_async` awaits."""

    def __init__(self, rate: float, burst: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate = rate
        self.burst = burst if burst is not None else max(1, int(rate / 10))
        self.clock = clock
        self._tokens = float(self.burst)
        self._stamp = clock()
        self._lock = threading.Lock()

    @classmethod
    def within(cls, limit_per_sec: float, burst_share: float = 0.1) -> TokenBucket:
        """A bucket whose burst plus steady rate stays within the limit in any one-second window; the burst is
        `burst_share` of the limit (at least one write)."""
        burst = max(1, int(limit_per_sec * burst_share))
        return cls(limit_per_sec - burst, burst)

    def _reserve(self) -> float:
        """Take a token (possibly borrowing from the future); return how long to wait for it."""
        with self._lock:
            now = self.clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= 1
            return max(0.0, -self._tokens / self.rate)

    def acquire(self) -> None:
        wait = self._reserve()
        if wait > 0:
            time.sleep(wait)

    async def acquire_async(self) -> None:
        wait = self._reserve()
        if wait > 0:
            await asyncio.sleep(wait)


class CompletionWindow:
    """At most `limit` writes complete in any `window` seconds however their latencies bunch them (the API server
    counts a write when it completes, and a stalled server answers a backlog at once): a write holds one of
    `limit` slots from its start until `window` after it completes. Thread-safe. Waiting writers queue in order and
    only the first of them watches the clock, so a slot coming free wakes one thread, not every writer."""

    def __init__(self, limit: int, window: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit, self.window, self.clock = limit, window, clock
        self._in_flight = 0
        self._completed: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # what the first writer in line waits on
        self._line: collections.deque[threading.Condition] = collections.deque()

    def _take(self) -> bool:
        now = self.clock()
        while self._completed and self._completed[0] <= now - self.window:
            self._completed.popleft()
        if self._in_flight + len(self._completed) < self.limit:
            self._in_flight += 1
            return True
        return False

    def acquire(self) -> None:
        with self._lock:
            if not self._line and self._take():
                return
            turn = threading.Condition(self._lock)
            self._line.append(turn)
            while self._line[0] is not turn:
                turn.wait()
            while not self._take():
                self._changed.wait(self._completed[0] + self.window - self.clock() if self._completed else None)
            self._line.popleft()
            if self._line:
                self._line[0].notify()

    def release(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._completed.append(self.clock())
            self._changed.notify()


def status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _retrying(attempts: int, base_delay: float, max_delay: float) -> dict[str, Any]:
    """Retry the RETRYABLE statuses up to `attempts` calls in all, waiting min(max_delay, base_delay * 2**n)
    after the n-th failure (n from 0), jittered to between half and all of it; the last failure is raised."""
    half = tenacity.wait_exponential(multiplier=base_delay / 2, max=max_delay / 2)
    jitter = tenacity.wait_random_exponential(multiplier=base_delay / 2, max=max_delay / 2)
    return {"retry": tenacity.retry_if_exception(lambda exc: status_of(exc) in RETRYABLE),
            "stop": tenacity.stop_after_attempt(attempts), "wait": half + jitter, "reraise": True}


async def write(bucket: TokenBucket, call: Callable[[], Awaitable[T]], attempts: int = 6,
                base_delay: float = 0.2, max_delay: float = 10.0) -> T:
    """Run one API write under the bucket, retrying retryable failures with jittered exponential backoff."""

    async def once() -> T:
        await bucket.acquire_async()
        return await call()

    return await tenacity.AsyncRetrying(**_retrying(attempts, base_delay, max_delay))(once)


def write_sync(bucket: TokenBucket, call: Callable[[], T], attempts: int = 6, base_delay: float = 0.2,
               max_delay: float = 10.0) -> T:
    """`write` for threads (the agent's status reporter)."""

    def once() -> T:
        bucket.acquire()
        return call()

    return tenacity.Retrying(**_retrying(attempts, base_delay, max_delay))(once)
