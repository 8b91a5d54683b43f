"""Dynamic batching in the gateway, per model, as Triton's dynamic batcher does it.

A model whose ModelSpec enables `runtime.dynamicBatching` (and whose every tensor has the batch as its first
dimension) gets one `Batcher`. Its requests wait in a bounded queue; whenever the model is free (one batch in
flight per model: the router sends a model's requests to one instance), the batcher takes the oldest request
and the queued requests compatible with it (same device hint, same dtypes and non-batch dimensions), in
arrival order, up to the current cap in rows:

- at once when they fill the cap, or reach the largest preferred batch size that fits under it;
- otherwise when the oldest has waited `maxQueueDelayMicroseconds` (0: at once, with whatever is queued).

Of what it took, it sends the longest prefix whose rows make a preferred size, when one does, else all of it.
The inputs are concatenated along dimension 0, run as one call of `run` (the dataplane's path: router ->
links -> workers, retries of unrun requests included), and the outputs are split back by each request's
row count. A batch that fails fails every request in it with the same status.

A full queue answers RESOURCE_EXHAUSTED (HTTP 429). Each request keeps its own deadline: one that expires in
the queue leaves it (DEADLINE_EXCEEDED), one whose client goes away is dropped. The cap can be lowered (or
restored) at run time from any thread (`set_cap`). See `docs/architecture.md`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from volga_agent import metrics
from volga_agent.gateway import oip
from volga_core import api

Tensors = dict[str, np.ndarray]
# The dataplane's path to a worker: (inputs, device hint, deadline on time.monotonic()) -> outputs.
Run = Callable[[Tensors, str, float | None], Awaitable[Tensors]]


class Overloaded(oip.OipError):
    """RESOURCE_EXHAUSTED (HTTP 429): the model's queue is full, or the model is shed; retry later, after
    `retry_after_ms` when it is set."""

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__("RESOURCE_EXHAUSTED", 429, message)
        self.retry_after_ms = retry_after_ms


@dataclasses.dataclass(frozen=True)
class Policy:
    """A model's `runtime.dynamicBatching`, in the units the batcher uses."""

    max_batch: int  # runtime.maxBatchSize, in rows
    preferred: tuple[int, ...]  # ascending
    max_delay_s: float
    max_queue: int

    @classmethod
    def of(cls, spec: api.ModelSpecSpec) -> Policy:
        b = spec.runtime.dynamic_batching
        return cls(spec.runtime.max_batch_size, tuple(sorted(b.preferred_batch_sizes)),
                   b.max_queue_delay_microseconds / 1e6, b.max_queue_size)


@dataclasses.dataclass(eq=False)
class _Request:
    inputs: Tensors
    rows: int
    key: tuple[Any, ...]  # what must be equal to share a batch: device hint, dtypes and non-batch dimensions
    hint: str
    deadline: float | None
    arrived: float
    future: asyncio.Future[Tensors]
    sent: bool = False


def batch_key(inputs: Tensors, hint: str) -> tuple[Any, ...]:
    return (hint, *((name, a.dtype.str, a.shape[1:]) for name, a in sorted(inputs.items())))


class Batcher:
    def __init__(self, model: str, policy: Policy, run: Run, gateway_metrics: metrics.GatewayMetrics,
                 cap: int | None = None) -> None:
        self.model = model
        self.policy = policy
        self._run = run
        self._metrics = gateway_metrics
        self._cap = cap
        self._queue: list[_Request] = []
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._free = asyncio.Event()  # no batch in flight
        self._free.set()
        self._dispatcher: asyncio.Task[None] | None = None
        self._sending: set[asyncio.Task[None]] = set()

    @property
    def cap(self) -> int:
        """The most rows a batch takes now: the cap set at run time, else runtime.maxBatchSize."""
        return self.policy.max_batch if self._cap is None else min(self._cap, self.policy.max_batch)

    def set_cap(self, cap: int | None) -> None:
        """Lower the cap (None: back to the spec's); from any thread. Batches already sent keep their size."""
        self._cap = cap
        self._poke()

    def set_policy(self, policy: Policy) -> None:
        """The ModelSpec changed; from the loop's thread."""
        self.policy = policy
        self._wake.set()

    def depth(self) -> int:
        """Requests waiting in the queue (some may have left since: they are dropped when the batcher looks)."""
        return len(self._queue)

    def _poke(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits any more
            self._loop.call_soon_threadsafe(self._wake.set)

    async def submit(self, inputs: Tensors, hint: str, deadline: float | None) -> Tensors:
        """Queue a request (inputs already checked against the model) and wait for its rows of a batch."""
        if len(self._queue) >= self.policy.max_queue:
            self._queue = [r for r in self._queue if not r.future.done()]
            if len(self._queue) >= self.policy.max_queue:
                raise Overloaded(f"model {self.model!r}: its batch queue is full ({self.policy.max_queue} requests "
                                 "waiting, runtime.dynamicBatching.maxQueueSize); retry later")
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = self._loop.create_task(self._dispatch(), name=f"batcher {self.model}")
        first = next(iter(inputs.values()))
        request = _Request(inputs, int(first.shape[0]), batch_key(inputs, hint), hint, deadline, time.monotonic(),
                           self._loop.create_future())
        self._queue.append(request)
        self._wake.set()
        try:
            if deadline is None:
                return await request.future
            return await asyncio.wait_for(request.future, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            if not request.future.cancelled():
                raise
            where = "inference" if request.sent else "waiting in the batch queue"
            raise oip.error("DEADLINE_EXCEEDED", f"deadline (x-timeout-ms) expired while {where}") from None

    async def _dispatch(self) -> None:
        while True:
            await self._free.wait()
            batch = await self._next()
            self._free.clear()
            task = self._loop.create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _next(self) -> list[_Request]:
        while True:
            while self._queue and self._queue[0].future.done():
                self._queue.pop(0)  # its deadline passed, or its client went away
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = time.monotonic()
            due = self._queue[0].arrived + self.policy.max_delay_s
            batch = self._take(expired=now >= due)
            if batch:
                taken = set(batch)
                self._queue = [r for r in self._queue if r not in taken and not r.future.done()]
                return batch
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), due - now)

    def _take(self, expired: bool) -> list[_Request]:
        """The batch to send now, or [] to wait for more (see the module's docstring)."""
        cap, key = self.cap, self._queue[0].key
        preferred = [p for p in self.policy.preferred if p <= cap]
        taken: list[_Request] = []
        total, full = 0, False
        for r in self._queue:
            if r.future.done() or r.key != key:
                continue
            if taken and total + r.rows > cap:
                full = True
                break
            taken.append(r)
            total += r.rows
            if total >= cap:
                break
        full = full or total >= cap
        if not (full or expired or total >= (preferred[-1] if preferred else cap)):
            return []
        rows = 0
        sums = [rows := rows + r.rows for r in taken]
        for i in range(len(taken) - 1, -1, -1):
            if sums[i] in preferred:
                return taken[:i + 1]
        return taken

    async def _send(self, batch: list[_Request]) -> None:
        try:
            try:
                outputs = await self._run_batch(batch)
            except Exception as exc:
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(_same(exc))
                return
            for r, part in zip(batch, outputs, strict=True):
                if not r.future.done():
                    r.future.set_result(part)
        except BaseException:  # cancelled: the gateway stops
            for r in batch:
                r.future.cancel()
            raise
        finally:
            self._free.set()

    async def _run_batch(self, batch: list[_Request]) -> list[Tensors]:
        now = time.monotonic()
        for r in batch:
            r.sent = True
            self._metrics.queue_delay.labels(self.model).observe((now - r.arrived) * 1e3)
        rows = sum(r.rows for r in batch)
        self._metrics.batch_size.labels(self.model).observe(rows)
        self._metrics.batch_requests.labels(self.model).observe(len(batch))
        if len(batch) == 1:
            return [await self._run(batch[0].inputs, batch[0].hint, batch[0].deadline)]
        inputs = {name: np.concatenate([r.inputs[name] for r in batch]) for name in batch[0].inputs}
        deadlines = [r.deadline for r in batch]
        deadline = None if None in deadlines else max(d for d in deadlines if d is not None)
        return _split(self.model, await self._run(inputs, batch[0].hint, deadline), batch, rows)

    async def close(self) -> None:
        """Stop; requests still queued fail with UNAVAILABLE."""
        tasks = [t for t in (self._dispatcher, *self._sending) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in self._queue:
            if not r.future.done():
                r.future.set_exception(oip.error("UNAVAILABLE", "the gateway is shutting down"))
        self._queue.clear()


def _split(model: str, outputs: Tensors, batch: list[_Request], rows: int) -> list[Tensors]:
    """Each request's rows of the batch's outputs, in the batch's order."""
    for name, value in outputs.items():
        if value.ndim == 0 or value.shape[0] != rows:
            raise oip.error("INTERNAL", f"model {model!r}: output {name!r} has shape {list(value.shape)} for a batch "
                            f"of {rows} rows; dynamic batching needs outputs whose first dimension is the batch")
    parts, start = [], 0
    for r in batch:
        parts.append({name: value[start:start + r.rows] for name, value in outputs.items()})
        start += r.rows
    return parts


def _same(exc: Exception) -> Exception:
    """The failure of a batch, once for each of its requests (an exception object is raised in one place)."""
    if isinstance(exc, Overloaded):
        return Overloaded(exc.message, exc.retry_after_ms)
    if isinstance(exc, oip.OipError):
        return oip.OipError(exc.code, exc.http_status, exc.message)
    return exc
