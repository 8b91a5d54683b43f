"""The agent's local tier policy: which instances to move one tier colder, and why.

Everything here is a pure function of values the caller passes in (instance views, settings, node usage and
`now`, a monotonic clock reading). Nothing reads a clock, touches a process or does I/O, so the agent loop can
call `plan_demotions` on every tick, `volga up` can reuse it without Kubernetes, and the tests can pin every
decision down. The one stateful piece is `CircuitBreaker`, which remembers snapshot failures between ticks.
The settings themselves, and how they are read, are `settings.Settings`; this module only takes them.

A plan is built in two passes:

1. Idle demotions. An instance idle for long enough moves one step down its ladder; the members of a chain
   (`InstanceView.chain`) count from the latest use of any of them, and stay while one of them runs a request.
   The thresholds are keyed by the tier being entered (WARM after `idle.hot_sec`, SUSPENDED after
   `idle.warm_sec`, FROZEN after `idle.suspended_sec`, all counted from `last_used`), so at any idle time an
   instance heads for the same tier whichever ladder it is on: a CPU instance skips WARM and SUSPENDED and
   freezes after `idle.suspended_sec`, not after `idle.hot_sec`. Nothing goes COLD for being idle; only the
   snapshot disk budget discards snapshots. WARM is the idle tier while GPU memory is plentiful: an idle WARM
   instance goes SUSPENDED only once the GPU memory in use (`gpu_in_use`) reaches `idle.keep_warm_below_gpu_pct`
   of the node's (`Usage.gpu_total_bytes`; unknown, 0: no such hold), since a storm of SUSPENDED wakes queues in
   the driver's one-at-a-time restore and a storm of WARM wakes does not (docs/measurements.md, wake storms).
2. Budget evictions. While the estimated usage exceeds a budget, victims taken in `eviction_order` move to
   the tier that frees the constrained resource: GPU memory -> one step down (HOT -> WARM frees the
   weights, WARM -> SUSPENDED frees the context), host memory -> FROZEN, snapshot disk -> COLD (only FROZEN
   instances: a live instance's snapshot is a refresh cache, not a tier). Budgets are handled in that
   order because freeing GPU memory fills host memory, and freezing fills the snapshot disk.

Every move honours the pool floor (`floor_tier`: never colder than it) and never touches a busy instance;
an instance gets at most one move per plan, and the caller re-plans on the next tick with measured usage.
The usage estimates (`usage_after`) are deliberately rough: they only decide when to stop evicting.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
from collections.abc import Callable, Iterable, Sequence

from volga_agent.node.settings import EVICTION_POLICIES, Settings
from volga_core import api

GPU_LADDER: tuple[api.Tier, ...] = (api.Tier.HOT, api.Tier.WARM, api.Tier.SUSPENDED, api.Tier.FROZEN,
                                    api.Tier.COLD)
CPU_LADDER: tuple[api.Tier, ...] = (api.Tier.HOT, api.Tier.FROZEN, api.Tier.COLD)
# Tiers from the fastest to wake (HOT) to the slowest (COLD).
RANK: dict[api.Tier, int] = {tier: rank for rank, tier in enumerate(GPU_LADDER)}


class Reason(enum.StrEnum):
    """Why a move was planned; stable strings for events, conditions and metric labels."""

    IDLE = "Idle"
    GPU_MEMORY_BUDGET = "GpuMemoryBudget"
    HOST_MEMORY_BUDGET = "HostMemoryBudget"
    SNAPSHOT_DISK_BUDGET = "SnapshotDiskBudget"


@dataclasses.dataclass(frozen=True)
class InstanceView:
    """What the policy needs to know about one instance; byte counts are what it holds in its current tier."""

    name: str
    model_id: str
    tier: api.Tier
    gpu: bool  # the node path allows WARM and SUSPENDED for it
    last_used: float  # monotonic seconds
    host_bytes: int = 0
    gpu_bytes: int = 0
    snapshot_bytes: int = 0
    floor_tier: api.Tier | None = None  # never move it colder than this
    busy: bool = False  # a request or a move is in flight
    chain: str = ""  # the head's model id when the model is in a chain: the chain idles as one


@dataclasses.dataclass(frozen=True)
class Usage:
    """Node totals the budgets are checked against."""

    host_bytes: int = 0
    gpu_bytes: int = 0
    snapshot_bytes: int = 0
    gpu_total_bytes: int = 0  # the node's GPU memory; 0: unknown (or no GPU)


# What a WARM instance's CUDA context holds on the GPU, for `gpu_in_use` (a PyTorch context with cuBLAS and the
# 64-byte stack floor holds 0.4-0.6 GiB on an H200, docs/measurements.md).
WARM_CONTEXT_BYTES = 512 << 20


def gpu_in_use(instances: Iterable[InstanceView], usage: Usage) -> int:
    """GPU memory in use by the estimate: HOT weights (`usage.gpu_bytes`) and a context per WARM instance."""
    return usage.gpu_bytes + WARM_CONTEXT_BYTES * sum(1 for view in instances if view.tier == api.Tier.WARM)


def keeps_warm(instances: Sequence[InstanceView], usage: Usage, settings: Settings) -> bool:
    """Whether idle WARM instances stay WARM: the node's GPU memory is known and less than
    `idle.keep_warm_below_gpu_pct` of it is in use."""
    pct = settings.idle.keep_warm_below_gpu_pct
    return pct > 0 and usage.gpu_total_bytes > 0 and gpu_in_use(instances, usage) < usage.gpu_total_bytes * pct / 100


@dataclasses.dataclass(frozen=True)
class Move:
    instance: str
    target: api.Tier
    reason: Reason


def ladder(gpu: bool) -> tuple[api.Tier, ...]:
    return GPU_LADDER if gpu else CPU_LADDER


def is_colder(tier: api.Tier, than: api.Tier) -> bool:
    return RANK[tier] > RANK[than]


def next_tier_down(tier: api.Tier, gpu: bool) -> api.Tier | None:
    """The next tier colder than `tier` on the instance's ladder; None for COLD.

    A tier that is not on the ladder (WARM on a CPU path) goes to the next one that is.
    """
    return next((candidate for candidate in ladder(gpu) if is_colder(candidate, tier)), None)


def floor_allows(view: InstanceView, target: api.Tier) -> bool:
    return view.floor_tier is None or not is_colder(target, view.floor_tier)


def idle_threshold(target: api.Tier, settings: Settings) -> float | None:
    """Seconds since last use after which an instance may enter `target`; None: never for idleness."""
    return {
        api.Tier.WARM: settings.idle.hot_sec,
        api.Tier.SUSPENDED: settings.idle.warm_sec,
        api.Tier.FROZEN: settings.idle.suspended_sec,
    }.get(target)


def usage_after(usage: Usage, view: InstanceView, target: api.Tier) -> Usage:
    """Estimated node usage once `view` has moved to `target`.

    WARM and SUSPENDED move GPU memory into host memory (pinned weights, or the driver's checkpoint); the CUDA
    context a WARM instance keeps is counted as freed, and the next tick's measurement corrects it. FROZEN
    frees the process and writes an image about the size of what it held, replacing an older snapshot.
    COLD frees everything.
    """
    host, gpu, disk = view.host_bytes, view.gpu_bytes, view.snapshot_bytes
    if not is_colder(target, view.tier):
        return usage
    if target in (api.Tier.WARM, api.Tier.SUSPENDED):
        delta = (gpu, -gpu, 0)
    elif target == api.Tier.FROZEN:
        delta = (-host, -gpu, max(disk, host + gpu) - disk)
    else:
        delta = (-host, -gpu, -disk)
    return Usage(host_bytes=max(0, usage.host_bytes + delta[0]),
                 gpu_bytes=max(0, usage.gpu_bytes + delta[1]),
                 snapshot_bytes=max(0, usage.snapshot_bytes + delta[2]), gpu_total_bytes=usage.gpu_total_bytes)


def eviction_order(instances: Iterable[InstanceView], policy: str, now: float) -> list[InstanceView]:
    """Victims first.

    "lru": least recently used first.
    "hybrid": by score = idle_seconds * (1 + snapshot_bytes / mean_snapshot_bytes), highest first, so that of
    two equally idle instances the one with the larger snapshot (the one that frees more) goes first, and a
    large instance can go before a slightly older small one. With no snapshot sizes known it is plain LRU.
    Ties go to the older, then to the name, so the order never depends on the input order.
    """
    views = list(instances)
    if policy == "lru":
        return sorted(views, key=lambda view: (view.last_used, view.name))
    if policy != "hybrid":
        raise ValueError(f"scheduler_eviction_policy: must be one of {', '.join(EVICTION_POLICIES)}, "
                         f"got {policy!r}")
    mean = sum(view.snapshot_bytes for view in views) / len(views) if views else 0.0

    def score(view: InstanceView) -> float:
        weight = 1.0 + view.snapshot_bytes / mean if mean > 0 else 1.0
        return max(0.0, now - view.last_used) * weight

    return sorted(views, key=lambda view: (-score(view), view.last_used, view.name))


def _gpu_target(view: InstanceView) -> api.Tier | None:
    if view.gpu_bytes > 0 and view.tier in (api.Tier.HOT, api.Tier.WARM):
        return next_tier_down(view.tier, view.gpu)
    return None


def _host_target(view: InstanceView) -> api.Tier | None:
    if view.host_bytes > 0 and is_colder(api.Tier.FROZEN, view.tier):
        return api.Tier.FROZEN
    return None


def _disk_target(view: InstanceView) -> api.Tier | None:
    if view.snapshot_bytes > 0 and view.tier == api.Tier.FROZEN:
        return api.Tier.COLD
    return None


def plan_demotions(instances: Sequence[InstanceView], settings: Settings, now: float, usage: Usage) -> list[Move]:
    """Idle demotions (by name), then budget evictions (GPU, host, snapshot disk; each in eviction order)."""
    duplicates = sorted(name for name, count in collections.Counter(v.name for v in instances).items() if count > 1)
    if duplicates:
        raise ValueError(f"instance names must be unique: {', '.join(duplicates)} given more than once")

    moves: list[Move] = []
    estimate = usage

    def plan(view: InstanceView, target: api.Tier, reason: Reason) -> None:
        nonlocal estimate
        moves.append(Move(view.name, target, reason))
        estimate = usage_after(estimate, view, target)

    # A chain is idle when all of it is: its members count from the latest use of any, and none moves while a
    # member is busy HOT (a request in flight).
    chain_used: dict[str, float] = {}
    for view in instances:
        if view.chain:
            chain_used[view.chain] = max(chain_used.get(view.chain, view.last_used), view.last_used)
    chain_busy = {view.chain for view in instances if view.chain and view.busy and view.tier == api.Tier.HOT}
    warm_held = keeps_warm(instances, usage, settings)
    for view in sorted(instances, key=lambda view: view.name):
        target = next_tier_down(view.tier, view.gpu)
        if view.busy or target is None or not floor_allows(view, target) or view.chain in chain_busy:
            continue
        if warm_held and view.tier == api.Tier.WARM and target == api.Tier.SUSPENDED:
            continue
        threshold = idle_threshold(target, settings)
        if threshold is not None and now - chain_used.get(view.chain, view.last_used) >= threshold:
            plan(view, target, Reason.IDLE)

    pressures: tuple[tuple[Reason, int, Callable[[Usage], int], Callable[[InstanceView], api.Tier | None]], ...] = (
        (Reason.GPU_MEMORY_BUDGET, settings.budgets.gpu_memory_bytes, lambda u: u.gpu_bytes, _gpu_target),
        (Reason.HOST_MEMORY_BUDGET, settings.budgets.host_memory_bytes, lambda u: u.host_bytes, _host_target),
        (Reason.SNAPSHOT_DISK_BUDGET, settings.budgets.snapshot_disk_bytes, lambda u: u.snapshot_bytes,
         _disk_target),
    )
    for reason, budget, measure, target_of in pressures:
        if budget <= 0:
            continue
        moved = {move.instance for move in moves}
        candidates = [view for view in instances if not view.busy and view.name not in moved]
        for view in eviction_order(candidates, settings.scheduler_eviction_policy, now):
            if measure(estimate) <= budget:
                break
            target = target_of(view)
            if target is not None and floor_allows(view, target):
                plan(view, target, reason)
    return moves


class BreakerState(enum.StrEnum):
    CLOSED = "Closed"
    OPEN = "Open"
    HALF_OPEN = "HalfOpen"


@dataclasses.dataclass
class _Trip:
    failures: int = 0
    open_until: float | None = None
    trial_since: float | None = None  # when the half-open attempt was let through


class CircuitBreaker:
    """Stops snapshot attempts for a key (an instance or a model) that keeps failing.

    Closed until `max_failures` consecutive failures; then open for `backoff_duration_sec`; then half-open:
    `is_open` lets exactly one attempt through (call it right before attempting). Its success closes the
    breaker, its failure opens it for another backoff. A trial that never reports is given up on after one
    backoff, so a lost result cannot hold the breaker open forever. Thread-safe.
    """

    def __init__(self, max_failures: int = 5, backoff_duration_sec: float = 600.0) -> None:
        if max_failures < 1:
            raise ValueError(f"max_failures: must be >= 1, got {max_failures}")
        if backoff_duration_sec < 0:
            raise ValueError(f"backoff_duration_sec: must be >= 0, got {backoff_duration_sec:g}")
        self.max_failures = max_failures
        self.backoff_duration_sec = backoff_duration_sec
        self._lock = threading.Lock()
        self._trips: dict[str, _Trip] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> CircuitBreaker:
        return cls(settings.breaker.max_failures, settings.breaker.backoff_duration_sec)

    def record_failure(self, key: str, now: float) -> None:
        with self._lock:
            trip = self._trips.setdefault(key, _Trip())
            trip.failures += 1
            trip.trial_since = None
            if trip.failures >= self.max_failures:
                trip.open_until = now + self.backoff_duration_sec

    def record_success(self, key: str) -> None:
        with self._lock:
            self._trips.pop(key, None)

    def state(self, key: str, now: float) -> BreakerState:
        """The breaker's state, without claiming the half-open attempt (for status and metrics)."""
        with self._lock:
            return self._state(self._trips.get(key), now)

    def is_open(self, key: str, now: float) -> bool:
        """True: do not attempt. In the half-open state the first caller gets False and is the one attempt."""
        with self._lock:
            trip = self._trips.get(key)
            state = self._state(trip, now)
            if state is not BreakerState.HALF_OPEN or trip is None:
                return state is BreakerState.OPEN
            if trip.trial_since is not None and now - trip.trial_since < self.backoff_duration_sec:
                return True
            trip.trial_since = now
            return False

    def open_keys(self, now: float) -> list[str]:
        """Keys whose breaker has tripped and not yet closed (open or half-open), sorted."""
        with self._lock:
            return sorted(key for key, trip in self._trips.items()
                          if self._state(trip, now) is not BreakerState.CLOSED)

    @staticmethod
    def _state(trip: _Trip | None, now: float) -> BreakerState:
        if trip is None or trip.open_until is None:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now < trip.open_until else BreakerState.HALF_OPEN

