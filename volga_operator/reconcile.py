"""What the operator should write, computed from what it has seen: pure functions over a snapshot.

The reconcile loop (`loop.py`) only records what the watches deliver into a `State` and wakes itself;
it calls `compute` for the ModelSpecs that changed and applies the returned `Action`s through the rate
limiter. Keeping the decisions here, free of I/O, is what lets the unit tests cover them and what makes
the operator level-triggered: the same state always yields the same actions, and a periodic full pass
repairs anything a missed event left behind.

A ModelSpec gets no finalizer (that was a write per ModelSpec): its EMIs carry a controller ownerReference to it,
so Kubernetes' garbage collector deletes them with it, and the operator deletes every EMI whose ModelSpec it no
longer holds, when the watch says it is gone or, had the operator been away, at its first pass. An EMI whose
ownerReference names an earlier ModelSpec of the same name is deleted, not adopted, and made again for the new one.

The cluster tier (docs/architecture.md, "The cluster tier") is here too: the agents' published autonomy states
(`Heard`), the cluster's memory watermarks (`watermarks`), the chain registry in each head's `status.chain`, and
the one move the operator makes on its own, a chain off a node that has stayed in EMERGENCY (`TierSettings`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from volga_core import api, nodes, planner
from volga_core.api import conditions, labels

Key = tuple[str, str]  # (namespace, name)

EMERGENCY = "EMERGENCY"
REASON_CHAIN_MIGRATED = "ChainMigrated"
STALE_HEARTBEATS = 3.0  # a heartbeat older than this many of its periods: the agent is gone, its state unknown


@dataclasses.dataclass(frozen=True)
class TierSettings:
    """The cluster tier's two settings: a chain leaves a node whose fresh heartbeat has said EMERGENCY for
    `migrate_after_sec`, and no chain moves again within `min_interval_sec` of its last move (no flapping)."""

    migrate_after_sec: float = 30.0
    min_interval_sec: float = 300.0


@dataclasses.dataclass(frozen=True)
class Heard:
    """A node's published autonomy state and when the operator received its latest heartbeat (the operator's
    clock, unix seconds): freshness and time in state are measured with each side's own clock, so skewed node
    clocks do not matter."""

    autonomy: nodes.NodeAutonomy
    received: float

    def fresh(self, now: float) -> bool:
        return now - self.received <= STALE_HEARTBEATS * max(self.autonomy.period_sec, 0.5)

    def in_state_for(self, now: float) -> float:
        """Seconds the node has been in its state: as long as the agent said at its heartbeat, plus since then."""
        return max(0.0, self.autonomy.heartbeat - self.autonomy.since) + max(0.0, now - self.received)


def hear(previous: Heard | None, autonomy: nodes.NodeAutonomy | None, now: float) -> Heard | None:
    """The record of a node annotation just seen: a new heartbeat counts from now; the first one seen (at start)
    from when the agent wrote it, as far as the two clocks agree; the same heartbeat again (a relist) changes
    nothing."""
    if autonomy is None:
        return None
    if previous is not None and previous.autonomy.heartbeat == autonomy.heartbeat:
        return Heard(autonomy, previous.received)
    return Heard(autonomy, now if previous is not None else min(now, autonomy.heartbeat))


# The EMI status fields the operator reads (tier counts, readiness, the planner's recency and snapshot size): a
# record keeps only these, so what the operator holds per EMI stays small whatever the agents report.
EMI_STATUS_FIELDS = ("tier", "conditions", "lastUsed", "snapshotBytes")
# ... and, where an agent reports one, the shared snapshot the instance restored from or published.
EMI_SHARED_FIELDS = ("sharedSnapshot",)


def resource_version(meta: Mapping[str, Any]) -> int:
    """metadata.resourceVersion as a number (etcd's revision), 0 when absent or not a number."""
    try:
        return int(meta.get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


@dataclasses.dataclass(frozen=True)
class SpecRecord:
    namespace: str
    name: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    status: Mapping[str, Any]
    finalizers: tuple[str, ...] = ()
    deleting: bool = False
    resource_version: int = 0

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> SpecRecord:
        meta: Mapping[str, Any] = body.get("metadata") or {}
        return cls(meta.get("namespace", "default"), meta["name"], meta.get("uid", ""), int(meta.get("generation", 1)),
                   body.get("spec") or {}, body.get("status") or {}, tuple(meta.get("finalizers") or ()),
                   bool(meta.get("deletionTimestamp")), resource_version(meta))


@dataclasses.dataclass(frozen=True)
class EmiRecord:
    namespace: str
    name: str
    spec: Mapping[str, Any]
    status: Mapping[str, Any]
    resource_version: int = 0
    owner_uid: str = ""  # the uid in its controller ownerReference ("" where not known)

    @property
    def owner(self) -> str:
        return str(self.spec.get("modelSpec", ""))

    @property
    def node(self) -> str:
        return str(self.spec.get("node", ""))

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> EmiRecord:
        meta: Mapping[str, Any] = body.get("metadata") or {}
        status: Mapping[str, Any] = body.get("status") or {}
        kept = {k: status[k] for k in (*EMI_STATUS_FIELDS, *EMI_SHARED_FIELDS) if k in status}
        return cls(meta.get("namespace", "default"), meta["name"], body.get("spec") or {}, kept, resource_version(meta),
                   owner_uid(meta))


def owner_uid(meta: Mapping[str, Any]) -> str:
    """The uid of the ModelSpec an EMI's controller ownerReference names ("" when it has none)."""
    return next((str(ref.get("uid", "")) for ref in meta.get("ownerReferences") or ()
                 if ref.get("kind") == "ModelSpec" and ref.get("controller")), "")


class EmiIndex(collections.UserDict[Key, EmiRecord]):
    """The EMIs by (namespace, name), also indexed by owning ModelSpec, so a pass over a few ModelSpecs does not
    walk every EMI. Every mutation goes through __setitem__/__delitem__ (UserDict routes pop, update, ... there)."""

    def __init__(self) -> None:
        self._by_owner: dict[Key, dict[str, EmiRecord]] = {}
        self.per_node: collections.Counter[str] = collections.Counter()  # EMIs by node: the planner's load
        super().__init__()

    def __setitem__(self, key: Key, record: EmiRecord) -> None:
        if key in self.data:
            self._unindex(self.data[key])
        self.data[key] = record
        self._by_owner.setdefault((record.namespace, record.owner), {})[record.name] = record
        self.per_node[record.node] += 1

    def __delitem__(self, key: Key) -> None:
        self._unindex(self.data.pop(key))

    def _unindex(self, record: EmiRecord) -> None:
        self.per_node[record.node] -= 1
        if self.per_node[record.node] <= 0:
            del self.per_node[record.node]
        owner = (record.namespace, record.owner)
        mine = self._by_owner.get(owner, {})
        mine.pop(record.name, None)
        if not mine:
            self._by_owner.pop(owner, None)

    def owned(self, key: Key) -> list[EmiRecord]:
        """The EMIs of one ModelSpec, by name."""
        return sorted(self._by_owner.get(key, {}).values(), key=lambda e: e.name)

    def owners(self) -> list[Key]:
        return list(self._by_owner)


class SpecIndex(collections.UserDict[Key, SpecRecord]):
    """The ModelSpecs by (namespace, name), counting per namespace those that name a chain or an ensemble: where a
    namespace has none, a pass skips the chain checks, which read every ModelSpec of the namespace."""

    def __init__(self) -> None:
        self.chained: collections.Counter[str] = collections.Counter()
        super().__init__()

    def __setitem__(self, key: Key, record: SpecRecord) -> None:
        if key in self.data:
            self._uncount(self.data[key])
        self.data[key] = record
        if _chained(record):
            self.chained[record.namespace] += 1

    def __delitem__(self, key: Key) -> None:
        self._uncount(self.data.pop(key))

    def _uncount(self, record: SpecRecord) -> None:
        if _chained(record):
            self.chained[record.namespace] -= 1
            if self.chained[record.namespace] <= 0:
                del self.chained[record.namespace]


def _chained(record: SpecRecord) -> bool:
    return bool(record.spec.get("chain") or record.spec.get("ensemble"))


@dataclasses.dataclass
class State:
    specs: SpecIndex = dataclasses.field(default_factory=SpecIndex)
    emis: EmiIndex = dataclasses.field(default_factory=EmiIndex)
    nodes: dict[str, nodes.NodeProfile] = dataclasses.field(default_factory=dict)
    autonomy: dict[str, Heard] = dataclasses.field(default_factory=dict)  # nodes whose agents publish one
    tier: TierSettings = dataclasses.field(default_factory=TierSettings)

    def emis_by_owner(self) -> collections.defaultdict[Key, list[EmiRecord]]:
        """Each ModelSpec's EMIs, by name."""
        owned: collections.defaultdict[Key, list[EmiRecord]] = collections.defaultdict(list)
        for key in self.emis.owners():
            owned[key] = self.emis.owned(key)
        return owned


@dataclasses.dataclass(frozen=True)
class Action:
    """One API write. `verb`: create_emi | patch_emi | delete_emi | patch_spec_status | patch_spec_meta |
    create_event (on the ModelSpec `name`) | apply_configmap."""

    verb: str
    namespace: str
    name: str
    body: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def node_profile(name: str, annotations: Mapping[str, str] | None,
                 node_conditions: Iterable[Mapping[str, Any]] | None) -> nodes.NodeProfile | None:
    """A node hosts Volga instances only once its agent has published a hardware profile."""
    if not annotations or labels.PROFILE_KEY not in annotations:
        return None
    ready = True
    for condition in node_conditions or ():
        if condition.get("type") == "Ready":
            ready = condition.get("status") == "True"
    return nodes.NodeProfile.from_annotations(name, annotations, ready)


def emi_ready(emi: EmiRecord) -> bool:
    return conditions.is_true(emi.status.get("conditions", ()))


def observed(state: State, now: str) -> list[planner.Observed]:
    """The EMIs as the planner sees them; the age of their last use comes from the agents' status.lastUsed."""
    out = []
    clock = conditions.unix(now)
    for emi in state.emis.values():
        used = conditions.unix(emi.status.get("lastUsed") or "")
        age = None if used is None or clock is None else max(0.0, clock - used)
        out.append(planner.Observed(f"{emi.namespace}/{emi.name}", f"{emi.namespace}/{emi.owner}",
                                    str(emi.spec.get("node", "")), last_used_age_s=age,
                                    snapshot_bytes=int(emi.status.get("snapshotBytes", 0) or 0)))
    return out


def emi_body(record: SpecRecord, desired: planner.Desired) -> dict[str, Any]:
    name = desired.name.split("/", 1)[1]
    return {
        "apiVersion": api.API_VERSION, "kind": "ExecutableModelInstance",
        "metadata": {"name": name, "namespace": record.namespace,
                     "labels": {labels.LABEL_SPEC: record.name, labels.LABEL_NODE: desired.node},
                     "ownerReferences": [{"apiVersion": api.API_VERSION, "kind": "ModelSpec", "name": record.name,
                                          "uid": record.uid, "controller": True, "blockOwnerDeletion": False}]},
        "spec": dataclasses.replace(desired, model_spec=record.name).emi_spec().to_wire(),
    }


def emergencies(state: State, now: float) -> dict[str, Heard]:
    """The nodes whose fresh heartbeat says EMERGENCY (a stale one says nothing: that agent may be gone, and a lost
    node is the Ready condition's business)."""
    return {node: h for node, h in state.autonomy.items()
            if h.autonomy.state == EMERGENCY and h.fresh(now) and node in state.nodes}


def due_nodes(state: State, now: float, urgent: Mapping[str, Heard] | None = None) -> dict[str, Heard]:
    """The nodes in EMERGENCY (`urgent`, worked out here when not given) for at least `migrate_after_sec`: their
    chains are to move."""
    return {node: h for node, h in (emergencies(state, now) if urgent is None else urgent).items()
            if h.in_state_for(now) >= state.tier.migrate_after_sec}


def chains_on(state: State, nodes: Iterable[str]) -> set[Key]:
    """The ModelSpecs in a chain (a head, or a model a head lists) with an EMI on one of these nodes."""
    wanted = set(nodes)
    owners = {(e.namespace, e.owner) for e in state.emis.values() if e.node in wanted}
    listed = {(ns, str(m)) for (ns, _), r in state.specs.items() for m in (r.spec.get("chain") or ())}
    return {k for k in owners if (r := state.specs.get(k)) is not None
            and (r.spec.get("chain") or (k[0], str(r.spec.get("modelId", ""))) in listed)}


def watermarks(state: State, now: float) -> nodes.ClusterWatermarks:
    """The memory level of the nodes with a fresh heartbeat, for the agents."""
    fresh = [h.autonomy for h in state.autonomy.values() if h.fresh(now)]
    if not fresh:
        return nodes.ClusterWatermarks()
    levels = [a.memory_pct for a in fresh]
    return nodes.ClusterWatermarks(round(sum(levels) / len(levels), 1), round(max(levels), 1), len(fresh),
                                     sum(a.state == EMERGENCY for a in fresh))


@dataclasses.dataclass(frozen=True)
class Move:
    """A chain to take off the nodes `away` (in EMERGENCY for too long), and why."""

    head: str  # namespace/name
    members: tuple[str, ...]
    away: frozenset[str]
    reason: str


def _moves(state: State, groups: Mapping[str, tuple[str, ...]], now: float, urgent: Mapping[str, Heard]
           ) -> list[Move]:
    """The chains of `groups` with instances on a node due for a move, and not moved within min_interval_sec."""
    due = due_nodes(state, now, urgent)
    if not due:
        return []
    moves = []
    for head in sorted({members[0] for members in groups.values()}):
        members = groups[head]
        away = frozenset(e.node for m in members for e in state.emis.owned(_key(m)) if e.node in due)
        if not away:
            continue
        record = state.specs.get(_key(head))
        last = ((record.status.get("chain") or {}).get("lastMigration") or {}) if record is not None else {}
        moved_at = conditions.unix(str(last.get("time", "")))
        if moved_at is not None and now - moved_at < state.tier.min_interval_sec:
            continue
        reason = "; ".join(f"node {n} in EMERGENCY for {due[n].in_state_for(now):.0f} s (memory "
                           f"{due[n].autonomy.memory_pct:.0f} %, moves after {state.tier.migrate_after_sec:g} s)"
                           for n in sorted(away))
        moves.append(Move(head, members, away, reason))
    return moves


def _key(plan_key: str) -> Key:
    ns, _, name = plan_key.partition("/")
    return ns, name


def compute(state: State, keys: Iterable[Key], now: str | None = None, settle: bool = False) -> list[Action]:
    """The writes that bring the given ModelSpecs (and their EMIs) to where they should be.

    With `settle`, a ModelSpec's status is the one its EMIs will give once the returned EMI writes land, so a
    new ModelSpec gets one status write instead of one now and another when its EMIs' watch events arrive."""
    now = now or conditions.timestamp()
    actions: list[Action] = []
    valid: dict[str, api.ModelSpecSpec] = {}
    invalid: dict[Key, str] = {}
    keys = set(keys)
    if any(ns in state.specs.chained for ns, _ in keys):
        keys = api.chain_peers(keys, {k: record.spec for k, record in state.specs.items()})
    for key in sorted(keys):
        record = state.specs.get(key)
        if record is None:
            # The ModelSpec is gone (deleted while we were not looking): its EMIs are orphans.
            actions += [Action("delete_emi", e.namespace, e.name) for e in state.emis.owned(key)]
            continue
        if record.deleting:
            actions += _finalize(record, state.emis.owned(key))
            continue
        spec, problem = api.validate_spec(record.spec)
        if spec is None:
            invalid[key] = problem
        else:
            valid[f"{record.namespace}/{record.name}"] = spec
    chained = {plan_key for plan_key in valid if plan_key.partition("/")[0] in state.specs.chained}
    everything = {f"{ns}/{name}": record.spec for (ns, name), record in state.specs.items()} if chained else {}
    for plan_key, problem in api.chain_invalid({k: valid[k] for k in chained}, everything).items():
        del valid[plan_key]
        invalid[(plan_key.partition("/")[0], plan_key.partition("/")[2])] = problem
    clock = conditions.unix(now) or 0.0
    urgent = emergencies(state, clock)
    groups = planner.chains(valid)
    avoid = frozenset(urgent)
    moved, move_desired = move_chains(state, valid, now, _moves(state, groups, clock, urgent), avoid)
    moving = {m for done in moved.values() for m in done.move.members}
    result = place(state, {k: spec for k, spec in valid.items() if k not in moving}, now, avoid)
    result = planner.Plan((*move_desired, *result.desired), result.unplaced)
    by_spec: dict[str, list[planner.Desired]] = {}
    for d in result.desired:
        by_spec.setdefault(d.model_spec, []).append(d)
    afters: dict[str, list[EmiRecord]] = {}
    for plan_key in sorted(valid):
        record = state.specs[_key(plan_key)]
        emi_actions, afters[plan_key] = _converge_emis(record, state.emis.owned(_key(plan_key)),
                                                       by_spec.get(plan_key, []), state.nodes)
        actions += emi_actions
    for plan_key in sorted(valid):
        record = state.specs[_key(plan_key)]
        chain = None
        if plan_key in groups and groups[plan_key][0] == plan_key:
            seen = afters if settle else {m: state.emis.owned(_key(m)) for m in groups[plan_key]}
            chain = _chain_status(record, groups[plan_key], seen, moved.get(plan_key), now)
            if plan_key in moved:
                actions.append(_migration_event(record, moved[plan_key], now))
        actions += _status(record, afters[plan_key] if settle else state.emis.owned(_key(plan_key)),
                           valid[plan_key], result.unplaced.get(plan_key), now, chain)
    for (ns, name), problem in sorted(invalid.items()):
        record = state.specs[(ns, name)]
        actions += [Action("delete_emi", e.namespace, e.name) for e in state.emis.owned((ns, name))]
        actions += _invalid_status(record, problem, now)
    return actions


@dataclasses.dataclass(frozen=True)
class Moved:
    """A chain move the plan makes: from which nodes to which."""

    move: Move
    to: tuple[str, ...]


def move_chains(state: State, specs: Mapping[str, api.ModelSpecSpec], now: str, moves: Iterable[Move],
                avoid: frozenset[str]) -> tuple[dict[str, Moved], list[planner.Desired]]:
    """The chains of `moves` planned again without the nodes they leave: a chain moves only where each of its
    instances that leaves finds a node not in EMERGENCY (`avoid`; else it stays). The moves made, by head, and the
    plan of their members."""
    moved: dict[str, Moved] = {}
    move_desired: list[planner.Desired] = []
    for move in moves:
        mine = {m: specs[m] for m in move.members}
        observed, leaving = [], set()
        own, base_load = _observed_for(state, mine, now)
        for o in own:
            if o.node in move.away:
                leaving.add(o.name)
            else:
                observed.append(o)
        nodes = [n for n in state.nodes.values() if n.name not in move.away]
        trial = planner.plan(mine, nodes, observed, shared_images(state, mine), avoid, base_load)
        to = [d.node for d in trial.desired if d.name in leaving]
        if trial.unplaced or not to or any(node in avoid for node in to):
            continue  # no node out of EMERGENCY takes the chain: it stays
        moved[move.head] = Moved(move, tuple(sorted(set(to))))
        move_desired += trial.desired
    return moved, move_desired


def place(state: State, planning: Mapping[str, api.ModelSpecSpec], now: str,
          avoid: frozenset[str] | None = None) -> planner.Plan:
    """`planner.plan` for these ModelSpecs against every node, with a shortcut that gives the same answer: a spec
    whose EMIs all stay where they are is planned against its own EMIs' nodes only (a handful, not every node).
    Only specs that need a new placement pay for scoring the whole cluster; nodes in EMERGENCY take their new
    instances only when no other node can (`avoid`, worked out here when not given)."""
    kept_plans: dict[str, list[planner.Desired]] = {}
    rest: dict[str, api.ModelSpecSpec] = {}
    for plan_key, spec in planning.items():
        kept = _kept(state, plan_key, spec)
        if kept is None:
            rest[plan_key] = spec
        else:
            kept_plans[plan_key] = kept
    # A chain is placed as one: when one member needs a new placement, the planner sees every member.
    groups = planner.chains(planning)
    for plan_key in {mate for key in list(rest) for mate in groups.get(key, ())} - rest.keys():
        del kept_plans[plan_key]
        rest[plan_key] = planning[plan_key]
    desired = [d for plans in kept_plans.values() for d in plans]
    if not rest:
        return planner.Plan(tuple(desired), {})
    if avoid is None:
        avoid = frozenset(emergencies(state, conditions.unix(now) or 0.0))
    own, base_load = _observed_for(state, rest, now)
    result = planner.plan(rest, state.nodes.values(), own, shared_images(state, rest), avoid, base_load)
    return planner.Plan((*desired, *result.desired), result.unplaced)


def _chain_status(record: SpecRecord, members: tuple[str, ...], emis: Mapping[str, list[EmiRecord]],
                  moved: Moved | None, now: str) -> dict[str, Any]:
    """The head's `status.chain`: its members, the node of its K-th instances by K, and its moves."""
    at: dict[int, list[str]] = {}
    for member in members:
        name = _key(member)[1]
        for emi in emis.get(member, ()):
            index = emi.name.removeprefix(f"{name}-")
            if index.isdigit():
                at.setdefault(int(index), []).append(emi.node)
    nodes = [max(sorted(set(at[k])), key=at[k].count) if k in at else "" for k in range(max(at, default=-1) + 1)]
    previous = record.status.get("chain") or {}
    chain: dict[str, Any] = {"members": [_key(m)[1] for m in members], "node": nodes[0] if nodes else "",
                             "nodes": nodes, "migrations": int(previous.get("migrations", 0) or 0)}
    if moved is not None:
        chain["migrations"] += 1
        chain["lastMigration"] = {"fromNode": ",".join(sorted(moved.move.away)), "toNode": ",".join(moved.to),
                                  "time": now, "reason": moved.move.reason}
    elif previous.get("lastMigration"):
        chain["lastMigration"] = previous["lastMigration"]
    return chain


def _migration_event(record: SpecRecord, moved: Moved, now: str) -> Action:
    """An Event on the head ModelSpec: `kubectl describe ms` and `kubectl get events` show the move and why."""
    message = (f"chain {', '.join(_key(m)[1] for m in moved.move.members)} moved from "
               f"{', '.join(sorted(moved.move.away))} to {', '.join(moved.to)}: {moved.move.reason}")
    return Action("create_event", record.namespace, record.name, {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{record.name}.", "namespace": record.namespace},
        "involvedObject": {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "name": record.name,
                           "namespace": record.namespace, "uid": record.uid},
        "related": {"apiVersion": "v1", "kind": "Node", "name": sorted(moved.move.away)[0]},
        "reason": REASON_CHAIN_MIGRATED, "message": message[:1024], "type": "Normal",
        "source": {"component": "volga-operator"}, "reportingComponent": "volga-operator",
        "firstTimestamp": now, "lastTimestamp": now, "count": 1})


def _kept(state: State, plan_key: str, spec: api.ModelSpecSpec) -> list[planner.Desired] | None:
    """The plan of one spec when every instance it wants already exists on an eligible node, else None."""
    ns, name = plan_key.split("/", 1)
    mine = state.emis.owned((ns, name))
    nodes = {state.nodes[e.node] for e in mine if e.node in state.nodes}
    if not nodes:
        return None
    where = {f"{ns}/{e.name}": e.node for e in mine}
    result = planner.plan({plan_key: spec}, nodes, [planner.Observed(n, plan_key, node) for n, node in where.items()])
    if result.unplaced or any(where.get(d.name) != d.node for d in result.desired):
        return None
    return list(result.desired)


def _observed_for(state: State, planned: Mapping[str, api.ModelSpecSpec], now: str
                  ) -> tuple[list[planner.Observed], dict[str, int]]:
    """The planned specs' own EMIs as the planner sees them (ages and snapshot sizes score their nodes), and every
    other EMI as a count per node (it only counts into its node's load)."""
    clock = conditions.unix(now)
    out = []
    base_load = dict(state.emis.per_node)
    for plan_key in planned:
        for emi in state.emis.owned(_key(plan_key)):
            base_load[emi.node] -= 1
            used = conditions.unix(emi.status.get("lastUsed") or "")
            age = None if used is None or clock is None else max(0.0, clock - used)
            out.append(planner.Observed(f"{emi.namespace}/{emi.name}", plan_key, emi.node, last_used_age_s=age,
                                        snapshot_bytes=int(emi.status.get("snapshotBytes", 0) or 0)))
    return out, base_load


def _finalize(record: SpecRecord, emis: list[EmiRecord]) -> list[Action]:
    """A ModelSpec being deleted: its EMIs go, then the finalizer earlier versions of the operator added (a new
    ModelSpec gets none, see the module's docstring)."""
    if emis:
        return [Action("delete_emi", e.namespace, e.name) for e in emis]
    if labels.FINALIZER in record.finalizers:
        kept = [f for f in record.finalizers if f != labels.FINALIZER]
        return [Action("patch_spec_meta", record.namespace, record.name, {"metadata": {"finalizers": kept}})]
    return []


def _converge_emis(record: SpecRecord, emis: list[EmiRecord], desired: list[planner.Desired],
                   nodes: Mapping[str, nodes.NodeProfile]) -> tuple[list[Action], list[EmiRecord]]:
    """The EMI writes for one spec, and its EMIs as they will be once those writes land."""
    actions = []
    after = []
    existing = {e.name: e for e in emis}
    for d in desired:
        body = emi_body(record, d)
        name = body["metadata"]["name"]
        current = existing.get(name)
        if current is not None and current.owner_uid and record.uid and current.owner_uid != record.uid:
            continue  # a ModelSpec of the same name deleted before: its EMI goes (below), a new one comes after
        existing.pop(name, None)
        if current is None:
            actions.append(Action("create_emi", record.namespace, name, body))
            after.append(EmiRecord(record.namespace, name, body["spec"], {}, owner_uid=record.uid))
            continue
        spec = _keep_gpu(current.spec, body["spec"], nodes.get(current.node))
        if dict(current.spec) != spec:
            actions.append(Action("patch_emi", record.namespace, name,
                                  {"metadata": {"labels": body["metadata"]["labels"]}, "spec": spec}))
            after.append(dataclasses.replace(current, spec=spec))
        else:
            after.append(current)
    actions += [Action("delete_emi", e.namespace, e.name) for e in existing.values()]
    return actions, after


def _keep_gpu(current: Mapping[str, Any], wanted: dict[str, Any], node: nodes.NodeProfile | None) -> dict[str, Any]:
    """An instance that stays on its node keeps its GPU: the planner derives a GPU index from the load it sees
    while planning, which differs between a pass over a few specs and a pass over all, and moving a running
    instance to another GPU for that would be churn (a write and a restart) for nothing."""
    gpu = current.get("gpu")
    if (node is None or current.get("node") != wanted.get("node") or "gpu" not in wanted
            or not isinstance(gpu, Mapping) or not 0 <= int(gpu.get("index", -1)) < node.gpu_count):
        return wanted
    return {**wanted, "gpu": dict(gpu)}


def shared_snapshots(emis: Iterable[EmiRecord]) -> list[dict[str, Any]]:
    """The shared images a ModelSpec's EMIs report (restored from or published), once each, by key."""
    refs: dict[str, dict[str, Any]] = {}
    for emi in emis:
        ref = emi.status.get("sharedSnapshot")
        if isinstance(ref, dict) and ref.get("key"):
            refs.setdefault(str(ref["key"]), {k: v for k, v in ref.items() if k != "role"})
    return [refs[key] for key in sorted(refs)][:64]


def shared_images(state: State, specs: Iterable[str]) -> dict[str, list[planner.SharedImage]]:
    """Per ModelSpec (namespace/name), the GPU product and driver of the shared images its EMIs report."""
    out: dict[str, list[planner.SharedImage]] = {}
    for plan_key in specs:
        ns, name = plan_key.split("/", 1)
        refs = shared_snapshots(state.emis.owned((ns, name)))
        if refs:
            out[plan_key] = [planner.SharedImage(str(r.get("gpuProduct", "")), str(r.get("gpuDriver", "")))
                             for r in refs]
    return out


def tier_counts(emis: Iterable[EmiRecord]) -> dict[str, int]:
    counts = {t.value: 0 for t in api.Tier}
    for emi in emis:
        tier = emi.status.get("tier")
        if tier in counts:
            counts[tier] += 1
    return counts


def _status(record: SpecRecord, emis: list[EmiRecord], spec: api.ModelSpecSpec, unplaced: str | None,
            now: str, chain: Mapping[str, Any] | None = None) -> list[Action]:
    previous = record.status.get("conditions", ())
    ready = [e for e in emis if emi_ready(e)]
    if unplaced:
        ready_cond = conditions.condition("Ready", False, "Unschedulable", unplaced, previous, now)
    elif ready:
        ready_cond = conditions.condition("Ready", True, "InstanceReady",
                                          f"{len(ready)} of {len(emis)} instance(s) ready", previous, now)
    else:
        ready_cond = conditions.condition("Ready", False, "Pending", f"0 of {len(emis)} instance(s) ready",
                                          previous, now)
    status = {
        "observedGeneration": record.generation,
        "inputHash": spec.input_hash(),
        "instances": len(emis),
        "tiers": tier_counts(emis),
        **({"sharedSnapshots": refs} if (refs := shared_snapshots(emis)) else {}),
        **({"chain": chain} if chain is not None else {}),
        "conditions": [
            ready_cond,
            conditions.condition("Valid", True, "Valid", "", previous, now),
            conditions.condition("Placed", not unplaced, "Unschedulable" if unplaced else "Placed", unplaced or "",
                                 previous, now),
        ],
    }
    return [] if _same(record.status, status) else [Action("patch_spec_status", record.namespace, record.name,
                                                           {"status": status})]


def _invalid_status(record: SpecRecord, problem: str, now: str) -> list[Action]:
    previous = record.status.get("conditions", ())
    status = {
        "observedGeneration": record.generation, "instances": 0, "tiers": tier_counts(()),
        "conditions": [conditions.condition("Ready", False, "InvalidSpec", problem, previous, now),
                       conditions.condition("Valid", False, "InvalidSpec", problem, previous, now)],
    }
    return [] if _same(record.status, status) else [Action("patch_spec_status", record.namespace, record.name,
                                                           {"status": status})]


def _same(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    return all(old.get(k) == v for k, v in new.items())
