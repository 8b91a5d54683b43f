"""The agent's local tier policy: which instances to move one tier colder, and why.

Everything here is a pure function of values the caller passes in (instance views, settings, node usage and
`now`, a monotonic clock reading). Nothing reads a clock, touches a process or does I/O, so the agent loop can
call `plan_demotions` on every tick, `volga up` can reuse it without Kubernetes, and the tests can pin every
decision down. The one stateful piece is `CircuitBreaker`, which remembers snapshot failures between ticks.

A plan is built in two passes:

1. Idle demotions. An instance idle for long enough moves one step down its ladder; the members of a chain
   (`InstanceView.chain`) count from the latest use of any of them, and stay while one of them runs a request.
   The thresholds are keyed by the tier being entered (WARM after `hot_idle_sec`, SUSPENDED after `warm_idle_sec`,
   FROZEN after `suspended_idle_sec`, all counted from `last_used`), so at any idle time an instance heads for
   the same tier whichever ladder it is on: a CPU instance skips WARM and SUSPENDED and freezes after
   `suspended_idle_sec`, not after `hot_idle_sec`. Nothing goes COLD for being idle; only the snapshot disk
   budget discards snapshots.
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
import difflib
import enum
import grp
import pwd
import threading
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal

import pydantic
from pydantic import alias_generators

from volga_agent.worker import contract
from volga_core import api

EvictionPolicy = Literal["lru", "hybrid"]
EVICTION_POLICIES: tuple[str, ...] = typing.get_args(EvictionPolicy)

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


NonNegative = Annotated[float, pydantic.Field(ge=0)]
Bytes = Annotated[int, pydantic.Field(ge=0)]


class Settings(pydantic.BaseModel):
    """Node agent settings (see docs/architecture.md); budgets of 0 mean unlimited.

    camelCase keys (the chart's settings.yaml) and snake_case names are both accepted; types are strict (a
    string is not a number, a boolean not an integer), and `from_mapping` words every error as
    `settings.NAME: reason`.
    """

    model_config = pydantic.ConfigDict(alias_generator=alias_generators.to_camel, populate_by_name=True,
                                       extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    snapshot_interval_sec: Annotated[float, pydantic.Field(gt=0)] = 30.0
    warmup_cache_ratio: Annotated[float, pydantic.Field(ge=0, le=1)] = 0.0
    gateway_cache_ttl_sec: NonNegative = 60.0
    scheduler_eviction_policy: EvictionPolicy = "lru"
    reset_rng_on_restore: bool = True
    numa_affinity: bool = False
    max_failures: Annotated[int, pydantic.Field(ge=1)] = 5
    backoff_duration_sec: NonNegative = 600.0
    api_writes_per_sec: Annotated[float, pydantic.Field(gt=0)] = 200.0
    hot_idle_sec: NonNegative = 60.0
    warm_idle_sec: NonNegative = 300.0
    suspended_idle_sec: NonNegative = 900.0
    host_memory_budget_bytes: Bytes = 0
    gpu_memory_budget_bytes: Bytes = 0
    snapshot_disk_budget_bytes: Bytes = 0
    # Restore FROZEN images with CRIU lazy pages (userfaultfd): the process runs before its memory is read.
    # None (the default): lazily on GPU workers, whose images are large and whose first request touches little
    # of them (0.13 GiB MLP on an H200: 334 / 365 ms p50 / p99 against 492 / 545 eager); eagerly on the CPU,
    # where the first request touches most pages and lazy pages do not pay.
    lazy_restore: bool | None = None
    # Before a restored instance answers, it answers a fixed canary input, compared with the answer recorded
    # before its snapshot: an image damaged where that answer depends on it costs a cold start, not wrong answers.
    verify_restores: bool = True
    # The per-thread stack each GPU worker's CUDA context reserves (0: the driver's 1 KiB); see
    # worker/contract.py DEFAULT_CUDA_STACK_BYTES for why it is small.
    gpu_stack_bytes: Annotated[int, pydantic.Field(ge=0)] = contract.DEFAULT_CUDA_STACK_BYTES
    # Keep GPU workers' captured CUDA graphs in their snapshots (FROZEN images, SUSPENDED driver checkpoints). Off:
    # they are dropped before the checkpoint and captured again after the restore, which keeps their memory (graph
    # pools, cuBLAS workspaces) out of what the driver and CRIU copy.
    gpu_graphs_in_images: bool = False
    # Failed restores whose image and logs stay under the snapshot root's failed/ folder, newest first.
    keep_failed_restores: Annotated[int, pydantic.Field(ge=0)] = 3
    # The node autonomy loop (volga_agent/autonomy): a sample every autonomy_sample_ms, a decision per window of
    # autonomy_window_samples samples; a state changes after autonomy_hysteresis_windows windows agree.
    autonomy_sample_ms: Annotated[float, pydantic.Field(gt=0, le=10_000)] = 10.0
    autonomy_window_samples: Annotated[int, pydantic.Field(ge=1, le=1000)] = 10
    autonomy_hysteresis_windows: Annotated[int, pydantic.Field(ge=1, le=100)] = 3
    # Memory watermarks, in percent of the node's GPU memory (host memory on a CPU node): below preload the loop
    # may wake models ahead of their requests; from optimize on it trims batch caps and demotes idle models;
    # from emergency on it sheds the most tolerant models.
    autonomy_preload_below_pct: Annotated[float, pydantic.Field(ge=0, le=100)] = 40.0
    autonomy_optimize_above_pct: Annotated[float, pydantic.Field(ge=0, le=100)] = 70.0
    autonomy_emergency_above_pct: Annotated[float, pydantic.Field(ge=0, le=100)] = 85.0
    # A model not awake is preloaded when its arrival rate (requests/s over a window) is at least this and both
    # its slope and its acceleration over the last three windows are positive.
    autonomy_preload_min_rate: NonNegative = 1.0
    # Windows without arrivals after which an awake model counts as idle (OPTIMIZE may demote it).
    autonomy_idle_windows: Annotated[int, pydantic.Field(ge=1)] = 3
    # What shed requests are told to wait before retrying.
    autonomy_shed_retry_after_ms: Annotated[int, pydantic.Field(ge=0)] = 1000
    # Log each decision's full context (inputs, path, actions), at most every 100 ms.
    autonomy_debug: bool = False
    # Run the autonomy loop on this node (`volga up --autonomy`; the daemons' settings file).
    autonomy_enabled: bool = False
    # Windows that must agree before entering EMERGENCY, and before leaving it (unshedding); 0: as
    # autonomy_hysteresis_windows. A short way in and a long way out keep a shed through a burst.
    autonomy_emergency_windows: Annotated[int, pydantic.Field(ge=0, le=1000)] = 0
    autonomy_calm_windows: Annotated[int, pydantic.Field(ge=0, le=10_000)] = 0
    # A violation turns into an EMERGENCY once it has lasted this share of the model's recoveryDeadlineMs
    # (below 100: early enough that shedding can end it within the deadline).
    autonomy_deadline_share_pct: Annotated[float, pydantic.Field(gt=0, le=100)] = 100.0
    # How often a sidecar gateway sends its per-model load to the agent and takes the loop's directives back.
    autonomy_exchange_ms: Annotated[float, pydantic.Field(ge=5, le=1000)] = 50.0
    # A violation makes the workers of co-runners at least autonomy_yield_tolerance_ratio times as tolerant as the
    # violating model yield the CPU: their threads (and their session's scheduling group) run at nice
    # autonomy_yield_nice until the state is PRELOAD or ACCEPT again and autonomy_yield_calm_windows windows have
    # passed without a violation. 0 leaves priorities alone: giving a priority back needs CAP_SYS_NICE, which a
    # node agent has and an unprivileged `volga up` does not.
    autonomy_yield_nice: Annotated[int, pydantic.Field(ge=0, le=19)] = 0
    autonomy_yield_tolerance_ratio: Annotated[float, pydantic.Field(ge=1)] = 2.0
    autonomy_yield_calm_windows: Annotated[int, pydantic.Field(ge=1, le=10_000)] = 10
    # Yielding threads also run under SCHED_IDLE, so that a waking thread of any other worker (or the gateway)
    # preempts them at once instead of after their time slice.
    autonomy_yield_sched_idle: bool = True
    # The same violation also throttles those co-runners' HOT workers (volga_agent/host/throttle.py): the agent stops
    # each (SIGSTOP, every thread) for autonomy_throttle_share of every autonomy_throttle_period_ms and lets it run
    # the rest, entered and left as the yield is. A co-runner's share is at most what its own tolerance t allows,
    # t / (100 + t) (0.75 at 300 %). 0 leaves the co-runners running.
    autonomy_throttle_share: Annotated[float, pydantic.Field(ge=0, lt=1)] = 0.0
    autonomy_throttle_period_ms: Annotated[float, pydantic.Field(ge=2, le=1000)] = 20.0
    # Guarded: the throttle stops those co-runners only while a request of a model they give way to is at its
    # worker (and still at most their share of the time), so they lose about that model's busy time instead of
    # the whole share. It needs the gateway in the agent's process (`volga up --autonomy`); an agent whose gateway
    # is a sidecar throttles by the plain duty cycle.
    autonomy_throttle_guard: bool = False
    # Folders ModelSpec sources must resolve inside (symlinks followed); empty: anywhere. `volga up` and
    # `volga-agent --kube` fill it in (docs/security.md).
    model_roots: Annotated[tuple[str, ...], pydantic.Strict(False)] = ()
    # Load models that run code when loaded (framework pytorch: a .py file, or a pickled module).
    allow_model_code: bool = False
    # Instances this node runs at most; 0: one per 256 MiB of the machine's memory (the node daemons).
    max_instances: Annotated[int, pydantic.Field(ge=0)] = 0
    # With host_memory_budget_bytes 0, the node daemons budget this share of the machine's memory; 0: no budget.
    host_memory_fraction: Annotated[float, pydantic.Field(ge=0, le=1)] = 0.8
    # Every CRIU call (dump, restore, lazy-pages start, check) is killed with its whole process tree after
    # criu_timeout_floor_sec plus criu_timeout_sec_per_gib per GiB it moves; a restore killed so is a failed one.
    criu_timeout_floor_sec: Annotated[float, pydantic.Field(gt=0)] = 10.0
    criu_timeout_sec_per_gib: NonNegative = 10.0
    # A dump records a CRC-32 of each pages file and a restore checks them first: damage the canary input does not
    # read (and a truncated file) fails the restore at once instead of answering wrongly (or hanging criu).
    verify_image_checksums: bool = True
    # A folder every node mounts (the chart's persistentVolumeClaim mode): a node restores a compatible image
    # another published there instead of cold-starting, and publishes its own first freeze (snapshot/shared.py).
    # "" keeps snapshots node-local.
    shared_snapshots: str = ""
    # Bytes the shared images may take (the least recently used go first); 0: no budget.
    shared_snapshot_budget_bytes: Bytes = 0
    # How long a shared image of a version no ModelSpec has any more stays before it is removed.
    shared_snapshot_grace_sec: NonNegative = 600.0
    # Neighbours (volga_agent/neighbours.py): trade this node's water level with two other nodes' agents every
    # neighbours_period_ms, so the gateway of an overloaded node passes requests on instead of refusing them. Off by
    # default: it needs the autonomy loop and an Agent API other nodes can reach (tokens), both off by default.
    neighbours_enabled: bool = False
    neighbours_period_ms: Annotated[float, pydantic.Field(ge=20, le=500)] = 200.0
    # With the autonomy loop on, in cluster mode: how often the agent refreshes its node's `volga.dev/autonomy`
    # annotation (state, since, memory), besides writing it at once when the state changes. The operator reads
    # a heartbeat older than three of these as no news (docs/architecture.md, "The cluster tier").
    autonomy_heartbeat_sec: Annotated[float, pydantic.Field(ge=0.5, le=3600)] = 5.0
    # The user workers drop to once started, where their tiers allow it (docs/security.md): a user name, UID or
    # UID:GID; "root" keeps them root.
    worker_user: str = "nobody"
    # Workers that CRIU may snapshot drop to worker_user too (it needs CAP_SYS_RESOURCE in the agent, and no PID
    # namespace per worker). Off: such a dump and restore has not run on a real node yet (docs/security.md).
    unprivileged_snapshots: bool = False

    @pydantic.field_validator("worker_user")
    @classmethod
    def _known_user(cls, value: str) -> str:
        worker_ids(value)
        return value

    def worker_ids(self) -> tuple[int, int]:
        return worker_ids(self.worker_user)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _once(cls, data: Any) -> Any:
        """A setting given both by its name and by its camelCase alias is refused, not silently resolved."""
        if isinstance(data, Mapping):
            for name, field in cls.model_fields.items():
                if name in data and field.alias in data and field.alias != name:
                    raise ValueError(f"settings.{name}: given twice (as {name!r} and {field.alias!r})")
        return data

    @pydantic.model_validator(mode="after")
    def _thresholds_in_order(self) -> Settings:
        # Thresholds count from the same last_used, so a colder tier must not come sooner than a hotter one.
        if self.warm_idle_sec < self.hot_idle_sec:
            raise ValueError(f"settings.warm_idle_sec: must be >= hot_idle_sec ({self.hot_idle_sec:g}), "
                             f"got {self.warm_idle_sec:g}")
        if self.suspended_idle_sec < self.warm_idle_sec:
            raise ValueError(f"settings.suspended_idle_sec: must be >= warm_idle_sec ({self.warm_idle_sec:g}), "
                             f"got {self.suspended_idle_sec:g}")
        return self

    @pydantic.model_validator(mode="after")
    def _watermarks_in_order(self) -> Settings:
        if self.autonomy_optimize_above_pct < self.autonomy_preload_below_pct:
            raise ValueError(f"settings.autonomy_optimize_above_pct: must be >= autonomy_preload_below_pct "
                             f"({self.autonomy_preload_below_pct:g}), got {self.autonomy_optimize_above_pct:g}")
        if self.autonomy_emergency_above_pct < self.autonomy_optimize_above_pct:
            raise ValueError(f"settings.autonomy_emergency_above_pct: must be >= autonomy_optimize_above_pct "
                             f"({self.autonomy_optimize_above_pct:g}), got {self.autonomy_emergency_above_pct:g}")
        return self

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> Settings:
        """Build from a config mapping with snake_case or camelCase keys; ValueError names each bad setting."""
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as exc:
            raise ValueError("; ".join(_explain(cls, error) for error in exc.errors())) from None

    def lazy_restore_on(self, device: str) -> bool:
        """Whether FROZEN images of instances on `device` ("cpu", "cuda:N") are restored with lazy pages."""
        return device != "cpu" if self.lazy_restore is None else self.lazy_restore


_KINDS = {"int_type": "an integer", "float_type": "a finite number", "finite_number": "a finite number",
          "bool_type": "a boolean", "string_type": "a string"}
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than_equal": ("le", "<=")}


def _explain(model: type[pydantic.BaseModel], error: Any) -> str:
    """One pydantic error as `settings.NAME: reason`, NAME being the setting's snake_case name."""
    kind, loc, value = error["type"], error["loc"], error.get("input")
    if not loc:  # a model validator's message names its setting already
        return str(error["ctx"]["error"]) if kind == "value_error" else f"settings: {error['msg']}"
    names = {field.alias or name: name for name, field in model.model_fields.items()}
    key = ".".join(str(part) for part in loc)
    name = names.get(key, key)
    if kind == "extra_forbidden":
        hint = difflib.get_close_matches(key, [*names, *names.values()], n=1)
        return f"settings.{key}: unknown setting" + (f" (did you mean {hint[0]!r}?)" if hint else "")
    if kind in _KINDS:
        return f"settings.{name}: must be {_KINDS[kind]}, got {value!r}"
    if kind in _BOUNDS:
        bound, sign = _BOUNDS[kind]
        return f"settings.{name}: must be {sign} {error['ctx'][bound]:g}, got {value:g}"
    if kind == "literal_error":
        return f"settings.{name}: must be one of {', '.join(EVICTION_POLICIES)}, got {value!r}"
    return f"settings.{name}: {error['msg']}"


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
        api.Tier.WARM: settings.hot_idle_sec,
        api.Tier.SUSPENDED: settings.warm_idle_sec,
        api.Tier.FROZEN: settings.suspended_idle_sec,
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
                 snapshot_bytes=max(0, usage.snapshot_bytes + delta[2]))


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
    for view in sorted(instances, key=lambda view: view.name):
        target = next_tier_down(view.tier, view.gpu)
        if view.busy or target is None or not floor_allows(view, target) or view.chain in chain_busy:
            continue
        threshold = idle_threshold(target, settings)
        if threshold is not None and now - chain_used.get(view.chain, view.last_used) >= threshold:
            plan(view, target, Reason.IDLE)

    pressures: tuple[tuple[Reason, int, Callable[[Usage], int], Callable[[InstanceView], api.Tier | None]], ...] = (
        (Reason.GPU_MEMORY_BUDGET, settings.gpu_memory_budget_bytes, lambda u: u.gpu_bytes, _gpu_target),
        (Reason.HOST_MEMORY_BUDGET, settings.host_memory_budget_bytes, lambda u: u.host_bytes, _host_target),
        (Reason.SNAPSHOT_DISK_BUDGET, settings.snapshot_disk_budget_bytes, lambda u: u.snapshot_bytes,
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
        return cls(settings.max_failures, settings.backoff_duration_sec)

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


def worker_ids(user: str) -> tuple[int, int]:
    """The (uid, gid) of settings.worker_user: a name, UID or UID:GID; "root" is (0, 0). ValueError names it."""
    name, _, group = user.strip().partition(":")
    try:
        if name.isdigit():
            uid = int(name)
            try:
                gid = pwd.getpwuid(uid).pw_gid
            except KeyError:
                gid = uid
        else:
            entry = pwd.getpwnam(name)
            uid, gid = entry.pw_uid, entry.pw_gid
        if group:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        if user == "nobody":
            return contract.NOBODY
        raise ValueError(f"settings.worker_user: no such user or group here: {user!r} "
                         "(a name, UID or UID:GID; root keeps workers root)") from None
    return uid, gid
