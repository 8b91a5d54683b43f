"""The node agent's settings: one frozen pydantic model in groups, and how it is read from a mapping.

They have a module of their own because reading them is configuration, not tier policy: the autonomy loop, the
neighbour exchange, CRIU, the shared snapshot folder, the workers and `volga up` read them as much as `policy`
does, and turning a file into settings (names, camelCase aliases, strict types, errors worded
`settings.NAME: reason`) is no decision. `policy` keeps its pure functions and takes a `Settings` argument.

Families of settings are small nested models, as kopf's `OperatorSettings` groups its own: `settings.autonomy`,
`settings.neighbours`, `settings.idle`, `settings.budgets`, `settings.breaker`, `settings.criu` and
`settings.shared`; settings of no family stay at the top. A grouped setting has two names: its nested one
(`autonomy.hysteresis_windows`, what the code reads) and its flat one (`autonomy_hysteresis_windows`): the name
the chart's values (`agent.settings`) and ConfigMap, `volga-agent --settings`, and `volga up`'s settings file and
`--set` have always used. A group's flat names are its prefix and the nested name, but where the group says
otherwise (`Group.FLAT`: `hot_idle_sec` is `idle.hot_sec`, `shared_snapshots` is `shared.folder`).

A mapping may give a setting flat or in its group mapping (`{"autonomy_enabled": true, "autonomy": {"debug":
true}}`), in snake_case or camelCase, but once; unknown names are refused, at the top and in a group, with the name
and the closest known one. Errors name a setting as it was given: flat when given flat, `group.name` when given
in its group. Defaults and bounds are those the flat model had.
"""

from __future__ import annotations

import difflib
import functools
import grp
import pwd
import typing
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import pydantic
import pydantic_core
from pydantic import alias_generators

from volga_agent.worker import contract

EvictionPolicy = Literal["lru", "hybrid"]
EVICTION_POLICIES: tuple[str, ...] = typing.get_args(EvictionPolicy)

NonNegative = Annotated[float, pydantic.Field(ge=0)]
Bytes = Annotated[int, pydantic.Field(ge=0)]

# camelCase keys (the chart's settings.yaml) and snake_case names are both accepted; types are strict (a string is
# not a number, a boolean not an integer); unknown names are refused.
_CONFIG = pydantic.ConfigDict(alias_generator=alias_generators.to_camel, populate_by_name=True, extra="forbid",
                              frozen=True, strict=True, allow_inf_nan=False)


class Group(pydantic.BaseModel):
    """A family of settings, `Settings.<group>.<name>`; its flat name is PREFIX + name unless FLAT names it."""

    model_config = _CONFIG

    PREFIX: ClassVar[str] = ""
    FLAT: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def flat_name(cls, name: str) -> str:
        return cls.FLAT.get(name, cls.PREFIX + name)


def _at_least(group: Group, name: str, other: str) -> None:
    """Refuses group.name < group.other; `Settings.from_mapping` names both settings as they were given."""
    value, bound = getattr(group, name), getattr(group, other)
    if value < bound:
        raise pydantic_core.PydanticCustomError(
            "settings_order", "{name}: must be >= {other} ({bound}), got {value}",
            {"name": name, "other": other, "bound": f"{bound:g}", "value": f"{value:g}"})


class IdleSettings(Group):
    """Idle demotions (`policy.plan_demotions`): seconds since the last use after which an instance enters the
    next tier, keyed by the tier it leaves on the GPU ladder: WARM after hot_sec, SUSPENDED after warm_sec, FROZEN
    after suspended_sec (a CPU instance freezes after suspended_sec too). Flat: hot_idle_sec, warm_idle_sec,
    suspended_idle_sec."""

    FLAT: ClassVar[Mapping[str, str]] = {"hot_sec": "hot_idle_sec", "warm_sec": "warm_idle_sec",
                                         "suspended_sec": "suspended_idle_sec",
                                         "keep_warm_below_gpu_pct": "keep_warm_below_gpu_pct"}

    hot_sec: NonNegative = 60.0
    warm_sec: NonNegative = 300.0
    suspended_sec: NonNegative = 900.0
    # An idle WARM instance stays WARM past warm_sec while the node's GPU memory in use (HOT weights and WARM
    # contexts, `policy.gpu_in_use`) is below this percent of its GPU memory: a WARM wake is a copy of the weights,
    # a SUSPENDED one a driver restore, and the driver restores one context at a time (docs/measurements.md, wake
    # storms). 0: WARM instances go SUSPENDED after warm_sec whatever the headroom.
    keep_warm_below_gpu_pct: Annotated[float, pydantic.Field(ge=0, le=100)] = 50.0

    @pydantic.model_validator(mode="after")
    def _in_order(self) -> IdleSettings:
        # Thresholds count from the same last_used, so a colder tier must not come sooner than a hotter one.
        _at_least(self, "warm_sec", "hot_sec")
        _at_least(self, "suspended_sec", "warm_sec")
        return self


class BudgetSettings(Group):
    """What the node may use before `policy.plan_demotions` evicts; 0 means unlimited. Flat:
    host_memory_budget_bytes, gpu_memory_budget_bytes, snapshot_disk_budget_bytes, host_memory_fraction."""

    FLAT: ClassVar[Mapping[str, str]] = {"host_memory_bytes": "host_memory_budget_bytes",
                                         "gpu_memory_bytes": "gpu_memory_budget_bytes",
                                         "snapshot_disk_bytes": "snapshot_disk_budget_bytes"}

    host_memory_bytes: Bytes = 0
    gpu_memory_bytes: Bytes = 0
    snapshot_disk_bytes: Bytes = 0
    # With host_memory_bytes 0, the node daemons budget this share of the machine's memory; 0: no budget.
    host_memory_fraction: Annotated[float, pydantic.Field(ge=0, le=1)] = 0.8


class BreakerSettings(Group):
    """The snapshot circuit breaker (`policy.CircuitBreaker`): open after max_failures consecutive failures, for
    backoff_duration_sec. Flat names are the same."""

    max_failures: Annotated[int, pydantic.Field(ge=1)] = 5
    backoff_duration_sec: NonNegative = 600.0


class CriuSettings(Group):
    """Every CRIU call (dump, restore, lazy-pages start, check) is killed with its whole process tree after
    timeout_floor_sec plus timeout_sec_per_gib per GiB it moves; a restore killed so is a failed one. A lazy
    restore's pages are served by lazy_pages_server: "volga" (the agent's own, `snapshot.lazypages`, with
    lazy_pages_threads filling in the background, 0: one per 256 MiB of lazy pages, at most 4) or "criu" (a `criu
    lazy-pages` daemon). lazy_pages_fill: "after-wake" (for a wake, the agent's server brings first the pages the
    instance's last wake faulted on, the rest once the wake has answered), "record-first" (first the pages the
    last wake faulted on during the driver's restore, the rest at once beside them), "at-once" (every page from the
    start, in address order), or "auto" (after the wake on the CPU, record first for GPU processes). Flat:
    criu_timeout_floor_sec, criu_timeout_sec_per_gib, criu_lazy_pages_server, criu_lazy_pages_threads,
    criu_lazy_pages_fill."""

    PREFIX: ClassVar[str] = "criu_"

    timeout_floor_sec: Annotated[float, pydantic.Field(gt=0)] = 10.0
    timeout_sec_per_gib: NonNegative = 10.0
    lazy_pages_server: Literal["volga", "criu"] = "volga"
    lazy_pages_threads: Annotated[int, pydantic.Field(ge=0, le=64)] = 0
    lazy_pages_fill: Literal["auto", "after-wake", "record-first", "at-once"] = "auto"


class SharedSnapshotSettings(Group):
    """Snapshots shared between nodes (snapshot/shared.py). Flat: shared_snapshots, shared_snapshot_budget_bytes,
    shared_snapshot_grace_sec."""

    FLAT: ClassVar[Mapping[str, str]] = {"folder": "shared_snapshots", "budget_bytes": "shared_snapshot_budget_bytes",
                                         "grace_sec": "shared_snapshot_grace_sec",
                                         "node_local": "shared_snapshots_node_local"}

    # A folder every node mounts (the chart's persistentVolumeClaim mode): a node restores a compatible image
    # another published there instead of cold-starting, and publishes its own first freeze. "" keeps snapshots
    # node-local.
    folder: str = ""
    # Bytes the shared images may take (the least recently used go first); 0: no budget.
    budget_bytes: Bytes = 0
    # How long a shared image of a version no ModelSpec has any more stays before it is removed.
    grace_sec: NonNegative = 600.0
    # The folder is this node's own disk (the chart's hostPath mode): its images carry the node's instances across
    # agent restarts and upgrades (a compatible image is restored instead of a cold start), and an agent that stops
    # because it was uninstalled (its DaemonSet gone) removes them.
    node_local: bool = False


class NeighbourSettings(Group):
    """Neighbours (volga_agent/neighbours.py): trade this node's water level with two other nodes' agents every
    period_ms, so the gateway of an overloaded node passes requests on instead of refusing them. Off by default:
    it needs the autonomy loop and an Agent API other nodes can reach (tokens), both off by default. Flat:
    neighbours_enabled, neighbours_period_ms."""

    PREFIX: ClassVar[str] = "neighbours_"

    enabled: bool = False
    period_ms: Annotated[float, pydantic.Field(ge=20, le=500)] = 200.0


class AutonomySettings(Group):
    """The node autonomy loop (volga_agent/autonomy): a sample every sample_ms, a decision per window of
    window_samples samples; a state changes after hysteresis_windows windows agree. Flat: autonomy_ + the name."""

    PREFIX: ClassVar[str] = "autonomy_"

    sample_ms: Annotated[float, pydantic.Field(gt=0, le=10_000)] = 10.0
    window_samples: Annotated[int, pydantic.Field(ge=1, le=1000)] = 10
    hysteresis_windows: Annotated[int, pydantic.Field(ge=1, le=100)] = 3
    # Memory watermarks, in percent of the node's GPU memory (host memory on a CPU node): below preload the loop
    # may wake models ahead of their requests; from optimize on it trims batch caps and demotes idle models;
    # from emergency on it sheds the most tolerant models.
    preload_below_pct: Annotated[float, pydantic.Field(ge=0, le=100)] = 40.0
    optimize_above_pct: Annotated[float, pydantic.Field(ge=0, le=100)] = 70.0
    emergency_above_pct: Annotated[float, pydantic.Field(ge=0, le=100)] = 85.0
    # A model not awake is preloaded when its arrival rate (requests/s over a window) is at least this and both
    # its slope and its acceleration over the last three windows are positive.
    preload_min_rate: NonNegative = 1.0
    # Windows without arrivals after which an awake model counts as idle (OPTIMIZE may demote it).
    idle_windows: Annotated[int, pydantic.Field(ge=1)] = 3
    # What shed requests are told to wait before retrying.
    shed_retry_after_ms: Annotated[int, pydantic.Field(ge=0)] = 1000
    # Log each decision's full context (inputs, path, actions), at most every 100 ms.
    debug: bool = False
    # Run the autonomy loop on this node (`volga up --autonomy`; the daemons' settings file).
    enabled: bool = False
    # Windows that must agree before entering EMERGENCY, and before leaving it (unshedding); 0: as
    # hysteresis_windows. A short way in and a long way out keep a shed through a burst.
    emergency_windows: Annotated[int, pydantic.Field(ge=0, le=1000)] = 0
    calm_windows: Annotated[int, pydantic.Field(ge=0, le=10_000)] = 0
    # A violation turns into an EMERGENCY once it has lasted this share of the model's recoveryDeadlineMs
    # (below 100: early enough that shedding can end it within the deadline).
    deadline_share_pct: Annotated[float, pydantic.Field(gt=0, le=100)] = 100.0
    # How often a sidecar gateway sends its per-model load to the agent and takes the loop's directives back.
    exchange_ms: Annotated[float, pydantic.Field(ge=5, le=1000)] = 50.0
    # A violation makes the workers of co-runners at least yield_tolerance_ratio times as tolerant as the
    # violating model yield the CPU: their threads (and their session's scheduling group) run at nice yield_nice
    # until the state is PRELOAD or ACCEPT again and yield_calm_windows windows have passed without a violation.
    # 0 leaves priorities alone: giving a priority back needs CAP_SYS_NICE, which a node agent has and an
    # unprivileged `volga up` does not.
    yield_nice: Annotated[int, pydantic.Field(ge=0, le=19)] = 0
    yield_tolerance_ratio: Annotated[float, pydantic.Field(ge=1)] = 2.0
    yield_calm_windows: Annotated[int, pydantic.Field(ge=1, le=10_000)] = 10
    # Yielding threads also run under SCHED_IDLE, so that a waking thread of any other worker (or the gateway)
    # preempts them at once instead of after their time slice.
    yield_sched_idle: bool = True
    # The same violation also throttles those co-runners' HOT workers (volga_agent/host/throttle.py): the agent
    # stops each (SIGSTOP, every thread) for throttle_share of every throttle_period_ms and lets it run the rest,
    # entered and left as the yield is. A co-runner's share is at most what its own tolerance t allows,
    # t / (100 + t) (0.75 at 300 %). 0 leaves the co-runners running.
    throttle_share: Annotated[float, pydantic.Field(ge=0, lt=1)] = 0.0
    throttle_period_ms: Annotated[float, pydantic.Field(ge=2, le=1000)] = 20.0
    # Guarded: the throttle stops those co-runners only while a request of a model they give way to is at its
    # worker (and still at most their share of the time), so they lose about that model's busy time instead of
    # the whole share. It needs the gateway in the agent's process (`volga up --autonomy`); an agent whose gateway
    # is a sidecar throttles by the plain duty cycle.
    throttle_guard: bool = False
    # In cluster mode: how often the agent refreshes its node's `volga.dev/autonomy` annotation (state, since,
    # memory), besides writing it at once when the state changes. The operator reads a heartbeat older than three
    # of these as no news (docs/architecture.md, "The cluster tier").
    heartbeat_sec: Annotated[float, pydantic.Field(ge=0.5, le=3600)] = 5.0

    @pydantic.model_validator(mode="after")
    def _watermarks_in_order(self) -> AutonomySettings:
        _at_least(self, "optimize_above_pct", "preload_below_pct")
        _at_least(self, "emergency_above_pct", "optimize_above_pct")
        return self


class Settings(pydantic.BaseModel):
    """Node agent settings (see docs/architecture.md): the top-level ones, then the groups.

    Build them from a config mapping with `from_mapping` (flat or nested names, snake_case or camelCase), which
    words every error as `settings.NAME: reason`; keyword construction takes the same names.
    """

    model_config = _CONFIG

    snapshot_interval_sec: Annotated[float, pydantic.Field(gt=0)] = 30.0
    warmup_cache_ratio: Annotated[float, pydantic.Field(ge=0, le=1)] = 0.0
    gateway_cache_ttl_sec: NonNegative = 60.0
    scheduler_eviction_policy: EvictionPolicy = "lru"
    reset_rng_on_restore: bool = True
    numa_affinity: bool = False
    api_writes_per_sec: Annotated[float, pydantic.Field(gt=0)] = 200.0
    # Restore FROZEN images with CRIU lazy pages (userfaultfd): the process runs before its memory is read. None
    # (the default): lazily. A wake touches little of an image (0.13 GiB MLP on an H200: 334 / 365 ms p50 / p99
    # against 492 / 545 eager); on the CPU lazy pages pay with the last wake's pages brought first and the rest
    # after the wake (criu.lazy_pages_fill; the default model: 31 ms against 53 eager, docs/snapshots.md). A model
    # server's: None lets the server decide by its image (`node.server.LAZY_MIN_BYTES`, its CUDA processes' parked
    # copies); True or False, lazily or eagerly always.
    lazy_restore: bool | None = None
    # Before a restored instance answers, it answers a fixed canary input, compared with the answer recorded
    # before its snapshot: an image damaged where that answer depends on it costs a cold start, not wrong answers.
    verify_restores: bool = True
    # The per-thread stack each GPU worker's CUDA context reserves (0: the driver's 1 KiB), and what the contexts of a
    # server's processes run through worker/handshake.py are lowered to before each driver checkpoint (0: left as they
    # are); see worker/contract.py DEFAULT_CUDA_STACK_BYTES for why it is small.
    gpu_stack_bytes: Annotated[int, pydantic.Field(ge=0)] = contract.DEFAULT_CUDA_STACK_BYTES
    # Keep GPU workers' captured CUDA graphs in their snapshots (FROZEN images, SUSPENDED driver checkpoints). Off:
    # they are dropped before the checkpoint and captured again after the restore, which keeps their memory (graph
    # pools, cuBLAS workspaces) out of what the driver and CRIU copy.
    gpu_graphs_in_images: bool = False
    # Park FROZEN GPU instances' weights and driver copies on a tmpfs of huge pages mounted at <snapshot root>/.parked
    # where the snapshot root is on tmpfs and the agent may mount (host/tmpfs.py); off: on the snapshot root's pages.
    parked_huge_pages: bool = True
    # Driver restores (SUSPENDED and GPU FROZEN wakes) let into the CUDA driver at a time, in the order they were
    # asked for; 0: all at once. The driver restores one context at a time device-wide, so with 1 the first wake of
    # a storm comes back after one restore and the last after all of them one after another (docs/measurements.md).
    gpu_restores_at_once: Annotated[int, pydantic.Field(ge=0)] = 0
    # A driver restore asked for while none is under way goes in alone; those asked for meanwhile go in together
    # after it (with gpu_restores_at_once as their bound): a storm's first wake is one restore's time (16 SUSPENDED
    # models on an H200: first answer 272 ms p50 instead of 874, all answered 2714 ms instead of 2583).
    gpu_restore_lead: bool = True
    # Failed restores whose image and logs stay under the snapshot root's failed/ folder, newest first.
    keep_failed_restores: Annotated[int, pydantic.Field(ge=0)] = 3
    # Folders ModelSpec sources must resolve inside (symlinks followed); empty: anywhere. `volga up` and
    # `volga-agent --kube` fill it in (docs/security.md).
    model_roots: Annotated[tuple[str, ...], pydantic.Strict(False)] = ()
    # Load models that run code when loaded (framework pytorch: a .py file, or a pickled module).
    allow_model_code: bool = False
    # Instances this node runs at most; 0: one per 256 MiB of the machine's memory (the node daemons).
    max_instances: Annotated[int, pydantic.Field(ge=0)] = 0
    # A dump records a CRC-32 of each pages file and a restore checks them first: damage the canary input does not
    # read (and a truncated file) fails the restore at once instead of answering wrongly (or hanging criu).
    verify_image_checksums: bool = True
    # The user workers drop to once started, where their tiers allow it (docs/security.md): a user name, UID or
    # UID:GID; "root" keeps them root.
    worker_user: str = "nobody"
    # Workers that CRIU may snapshot drop to worker_user too (it needs CAP_SYS_RESOURCE in the agent, and no PID
    # namespace per worker). Off: such a dump and restore has not run on a real node yet (docs/security.md).
    unprivileged_snapshots: bool = False

    idle: IdleSettings = pydantic.Field(default_factory=IdleSettings)
    budgets: BudgetSettings = pydantic.Field(default_factory=BudgetSettings)
    breaker: BreakerSettings = pydantic.Field(default_factory=BreakerSettings)
    criu: CriuSettings = pydantic.Field(default_factory=CriuSettings)
    shared: SharedSnapshotSettings = pydantic.Field(default_factory=SharedSnapshotSettings)
    neighbours: NeighbourSettings = pydantic.Field(default_factory=NeighbourSettings)
    autonomy: AutonomySettings = pydantic.Field(default_factory=AutonomySettings)

    @pydantic.field_validator("worker_user")
    @classmethod
    def _known_user(cls, value: str) -> str:
        worker_ids(value)
        return value

    def worker_ids(self) -> tuple[int, int]:
        return worker_ids(self.worker_user)

    @property
    def lazy_restores(self) -> bool:
        """Whether FROZEN images of workers are restored with lazy pages."""
        return self.lazy_restore is not False

    @pydantic.model_validator(mode="before")
    @classmethod
    def _flat_names(cls, data: Any) -> Any:
        """Flat names of grouped settings go into their groups (see `nested`)."""
        return cls.nested(data) if isinstance(data, Mapping) else data

    @classmethod
    def nested(cls, data: Mapping[Any, object]) -> dict[Any, object]:
        """`data` in the nested snake_case form: a flat grouped setting (`autonomy_enabled`, `autonomyEnabled`) moved
        into its group (`autonomy: {enabled: ...}`), camelCase keys snake_cased. ValueError for a setting given twice
        (by two spellings, or flat and in its group); unknown keys are kept as they are, for validation to refuse by
        name."""
        out: dict[Any, object] = {}
        given: dict[tuple[str, ...], str] = {}
        not_mappings: dict[str, object] = {}

        def put(path: tuple[str, ...], key: str, value: object) -> None:
            if path in given:
                raise ValueError(f"settings.{_name(path, given[path])}: given twice (as {given[path]!r} and {key!r})")
            given[path] = key
            if len(path) == 1:
                out[path[0]] = value
            else:
                group = out.setdefault(path[0], {})
                assert isinstance(group, dict)
                group[path[1]] = value

        for key, value in data.items():
            group_name = _group_keys().get(key) if isinstance(key, str) else None
            if group_name is not None:
                if isinstance(value, Group):
                    value = {name: getattr(value, name) for name in value.model_fields_set}
                if not isinstance(value, Mapping):
                    not_mappings[group_name] = value  # refused by validation: a group is a mapping
                    continue
                inner = _inner_keys(group_name)
                for inner_key, inner_value in value.items():
                    if inner_key in inner:
                        put((group_name, inner[inner_key]), f"{key}.{inner_key}", inner_value)
                    else:
                        group = out.setdefault(group_name, {})
                        assert isinstance(group, dict)
                        group[inner_key] = inner_value
            elif isinstance(key, str) and key in _paths():
                put(_paths()[key], key, value)
            else:
                out[key] = value
        return {**out, **not_mappings}

    @classmethod
    def overlay(cls, base: Mapping[Any, object], top: Mapping[Any, object]) -> dict[Any, object]:
        """`base` with `top` over it: a setting `top` gives replaces the same setting in `base` however `base` spells
        it (snake_case or camelCase, flat or in its group); everything else is kept as given."""
        replaced = set(_spellings(top))
        out: dict[Any, object] = {}
        for key, value in base.items():
            group_name = _group_keys().get(key) if isinstance(key, str) else None
            if group_name is not None and isinstance(value, Mapping):
                inner = _inner_keys(group_name)
                out[key] = {k: v for k, v in value.items() if (group_name, inner.get(k, "")) not in replaced}
            elif not (isinstance(key, str) and _paths().get(key) in replaced):
                out[key] = value
        for key, value in top.items():
            below = out.get(key)
            if isinstance(below, Mapping) and isinstance(value, Mapping):
                out[key] = {**below, **value}
            else:
                out[key] = value
        return out

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> Settings:
        """Build from a config mapping (flat or nested names, snake_case or camelCase); ValueError names each bad
        setting as it was given."""
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as exc:
            raise ValueError("; ".join(_explain(error, data) for error in exc.errors())) from None


def _group_class(name: str) -> type[Group] | None:
    annotation = Settings.model_fields[name].annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, Group) else None


@functools.cache
def _groups() -> dict[str, type[Group]]:
    """The groups by field name."""
    return {name: group for name in Settings.model_fields if (group := _group_class(name)) is not None}


@functools.cache
def _group_keys() -> dict[str, str]:
    """The keys a group mapping may be given by (its name, its camelCase alias) -> the group's name."""
    keys: dict[str, str] = {}
    for name in _groups():
        keys[name] = keys[str(Settings.model_fields[name].alias or name)] = name
    return keys


@functools.cache
def _inner_keys(group_name: str) -> dict[str, str]:
    """The keys a setting may be given by inside its group's mapping (snake_case, camelCase) -> its name."""
    keys: dict[str, str] = {}
    for name, field in _groups()[group_name].model_fields.items():
        keys[name] = keys[str(field.alias or name)] = name
    return keys


@functools.cache
def _paths() -> dict[str, tuple[str, ...]]:
    """The top-level keys a setting may be given by (snake_case, camelCase; flat for a grouped one) -> its path:
    ("max_instances",) at the top, ("autonomy", "enabled") in a group."""
    paths: dict[str, tuple[str, ...]] = {}
    for name, field in Settings.model_fields.items():
        group = _groups().get(name)
        if group is None:
            paths[name] = paths[str(field.alias or name)] = (name,)
            continue
        for inner in group.model_fields:
            flat = group.flat_name(inner)
            paths[flat] = paths[alias_generators.to_camel(flat)] = (name, inner)
    return paths


def _spellings(data: Mapping[Any, object]) -> dict[tuple[str, ...], str]:
    """The known settings `data` gives, by path, each with the key it is given by (`autonomy.enabled` in a group)."""
    found: dict[tuple[str, ...], str] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            continue
        group_name = _group_keys().get(key)
        if group_name is not None and isinstance(value, Mapping):
            inner = _inner_keys(group_name)
            found.update({(group_name, inner[k]): f"{key}.{k}" for k in value if k in inner})
        elif key in _paths():
            found[_paths()[key]] = key
    return found


def _name(path: tuple[str, ...], given_as: str) -> str:
    """A setting's snake_case name as it was given: flat, or `group.name` when given in its group mapping."""
    if len(path) == 1:
        return path[0]
    return ".".join(path) if "." in given_as else _groups()[path[0]].flat_name(path[1])


_KINDS = {"int_type": "an integer", "float_type": "a finite number", "finite_number": "a finite number",
          "bool_type": "a boolean", "string_type": "a string", "model_type": "a mapping"}
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than_equal": ("le", "<=")}


def _explain(error: Any, data: Mapping[Any, object]) -> str:
    """One pydantic error as `settings.NAME: reason`, NAME being the setting's snake_case name as `data` gives it
    (flat, or `group.name`)."""
    kind, loc, value = error["type"], error["loc"], error.get("input")
    if not loc:  # a model validator's message names its setting already
        return str(error["ctx"]["error"]) if kind == "value_error" else f"settings: {error['msg']}"
    spelled = _spellings(data)
    group_name = loc[0] if loc[0] in _groups() else None
    if kind == "settings_order" and group_name is not None:
        ctx = error["ctx"]
        path = (group_name, ctx["name"])
        given_as = spelled.get(path, "")
        return (f"settings.{_name(path, given_as)}: must be >= {_name((group_name, ctx['other']), given_as)} "
                f"({ctx['bound']}), got {ctx['value']}")
    if kind == "extra_forbidden":
        key = str(loc[-1])
        if group_name is not None and len(loc) == 2:
            known = list(_inner_keys(group_name))
            key = f"{group_name}.{key}"
            hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
        else:
            key = ".".join(str(part) for part in loc)
            hint = difflib.get_close_matches(key, [*_paths(), *_group_keys()], n=1)
        return f"settings.{key}: unknown setting" + (f" (did you mean {hint[0]!r}?)" if hint else "")
    if group_name is not None and len(loc) >= 2:
        path = (group_name, str(loc[1]))
        name = ".".join([_name(path, spelled.get(path, "")), *(str(part) for part in loc[2:])])
    else:
        name = ".".join(str(part) for part in loc)
    if kind in _KINDS:
        return f"settings.{name}: must be {_KINDS[kind]}, got {value!r}"
    if kind in _BOUNDS:
        bound, sign = _BOUNDS[kind]
        return f"settings.{name}: must be {sign} {error['ctx'][bound]:g}, got {value:g}"
    if kind == "literal_error":
        return f"settings.{name}: must be one of {', '.join(EVICTION_POLICIES)}, got {value!r}"
    return f"settings.{name}: {error['msg']}"


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
