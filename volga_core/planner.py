"""The pool planner: ModelSpecs + node profiles -> the desired instances (EMIs), as a pure function.

The operator calls it every few seconds with what the API server holds; `volga up` calls it with a local
store and one node. Nothing here reads a clock, a cluster or a file, so the planner is what the unit tests
exercise.

For each ModelSpec:

1. Filter nodes by the hardware profile: a GPU model needs a node with GPUs, of the named product if the spec
   names one, with at least `minMemoryGiB` per GPU; with `numaAffinity`, the node must report NUMA nodes.
2. Score the eligible nodes (docs/architecture.md): hardware profile match 100, recency 30 (the node served
   this model lately), smaller snapshot 10 (the node holds a smaller image of it), lower load 5.
3. Meet the pool floors per tier (hot, warm, suspended, frozen), one EMI per floor slot; a spec whose floors
   are all zero still gets one EMI, kept COLD, so there is somewhere to wake it. Existing EMIs on nodes
   that are still eligible keep their node (no churn); new ones go to the best-scoring node, whose load
   then counts the new EMI, which spreads a model's instances. On a node without GPUs, WARM and
   SUSPENDED targets become FROZEN (the tiers a CPU node has).
4. A chain (a head ModelSpec's `chain`, with the members among the specs planned together) is placed as one:
   its K-th instances (one per member, `name-K`) go to one node that every member is eligible on, chosen by the
   sum of the members' scores (or the node most of them already use), and share one GPU when the GPU members'
   `minMemoryGiB` together fit in it; with no node eligible for every member, no member is placed.
5. Nodes in `avoid` (the operator passes those whose agents report EMERGENCY) take a new instance only when no
   other eligible node can; instances already on them stay (moving them is the operator's decision, not churn).

A new instance is not scored against every node: nodes alike in all but name and load score alike but for their
load, so `NodeIndex` keeps each such group in a heap by load and a placement scores each group's least loaded node
and the spec's own nodes (a handful at 1000 nodes, not 1000); `plan(exhaustive=True)` scores them all, for the tests.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Mapping, Sequence

from volga_core import api, nodes

Tier = api.Tier
TIER_ORDER = (Tier.HOT, Tier.WARM, Tier.SUSPENDED, Tier.FROZEN)

SCORE_PROFILE, SCORE_RECENCY, SCORE_SNAPSHOT, SCORE_LOAD = 100, 30, 10, 5
SCORE_SHARED_IMAGE = 3  # the node can restore a published shared snapshot instead of cold-starting
RECENT_SECONDS = 600.0


@dataclasses.dataclass(frozen=True)
class Observed:
    """What is known of an existing EMI: where it is and what it recently did."""

    name: str
    model_spec: str
    node: str
    last_used_age_s: float | None = None  # seconds since its last request, None if never used
    snapshot_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class SharedImage:
    """A published shared snapshot of a ModelSpec: the GPU product and driver it needs ("" for a CPU image)."""

    gpu_product: str = ""
    gpu_driver: str = ""


def restorable(node: nodes.NodeProfile, images: Sequence[SharedImage]) -> bool:
    """Whether the node can restore one of the images (a CPU image anywhere; a GPU one with its product and,
    where both are known, its driver)."""
    return any(not i.gpu_product or (i.gpu_product.lower() == node.gpu_product.lower() and (
        not i.gpu_driver or not node.gpu_driver or i.gpu_driver == node.gpu_driver)) for i in images)


@dataclasses.dataclass(frozen=True)
class Desired:
    name: str
    model_spec: str
    model_id: str
    node: str
    target_tier: Tier
    gpu_index: int | None = None

    def emi_spec(self) -> api.EmiSpec:
        gpu = api.GpuRef(index=self.gpu_index) if self.gpu_index is not None else None
        return api.EmiSpec(model_spec=self.model_spec, model_id=self.model_id, node=self.node, gpu=gpu,
                           target_tier=self.target_tier)


@dataclasses.dataclass(frozen=True)
class Plan:
    desired: tuple[Desired, ...]
    unplaced: Mapping[str, str]  # ModelSpec name -> why it could not be placed (for its conditions)


def eligible(spec: api.ModelSpecSpec, node: nodes.NodeProfile) -> str | None:
    """None when the node can host the model, else the reason it cannot."""
    hw = spec.hardware
    if not node.ready:
        return "node is not ready"
    if not hw.gpu:
        return None
    if node.gpu_count < 1:
        return "no GPU"
    if hw.gpu_product and hw.gpu_product.lower() not in node.gpu_product.lower():
        return f"GPU is {node.gpu_product or 'unknown'}, not {hw.gpu_product}"
    if hw.min_memory_gi_b and node.gpu_memory_bytes < hw.min_memory_gi_b * 2**30:
        return f"GPU memory {node.gpu_memory_bytes / 2**30:.0f} GiB < {hw.min_memory_gi_b:g} GiB"
    if hw.numa_affinity and not node.numa_nodes:
        return "no NUMA information (numaAffinity is set)"
    return None


def score(spec: api.ModelSpecSpec, node: nodes.NodeProfile, load: int, max_load: int, mine: Sequence[Observed],
          smallest_snapshot: int, can_restore: bool = False) -> float:
    """Placement score of one node for one ModelSpec; `mine` are that spec's existing EMIs on the node."""
    hw = spec.hardware
    total = 0.0
    if hw.gpu:
        if not hw.gpu_product or node.gpu_product.lower() == hw.gpu_product.lower():
            total += SCORE_PROFILE  # the exact product asked for, or any GPU when none is named
    elif node.gpu_count == 0:
        total += SCORE_PROFILE  # a CPU model on a CPU node leaves the GPUs to models that need them
    ages = [o.last_used_age_s for o in mine if o.last_used_age_s is not None]
    if ages and min(ages) < RECENT_SECONDS:
        total += SCORE_RECENCY * (1 - min(ages) / RECENT_SECONDS)
    sizes = [o.snapshot_bytes for o in mine if o.snapshot_bytes > 0]
    if sizes and smallest_snapshot > 0:
        total += SCORE_SNAPSHOT * smallest_snapshot / min(sizes)
    total += SCORE_LOAD * (1 - load / max_load) if max_load > 0 else SCORE_LOAD
    return total + (SCORE_SHARED_IMAGE if can_restore else 0)


def _slots(pool: api.Pool) -> list[Tier]:
    slots = [tier for tier in TIER_ORDER for _ in range(pool.floor(tier))]
    return slots or [Tier.COLD]


def _tier_on(node: nodes.NodeProfile, tier: Tier) -> Tier:
    return Tier.FROZEN if node.gpu_count == 0 and tier in (Tier.WARM, Tier.SUSPENDED) else tier


def chains(specs: Mapping[str, api.ModelSpecSpec]) -> dict[str, tuple[str, ...]]:
    """Spec name -> the spec names of its chain, head first, for each ModelSpec in a chain among `specs`; members
    not among them are left out, and a model two chains list stays in the first one (by head name)."""
    by_id = {spec.model_id: name for name, spec in specs.items()}
    groups: dict[str, tuple[str, ...]] = {}
    for name in sorted(specs):
        if not specs[name].chain or name in groups:
            continue
        members = tuple(dict.fromkeys(m for m in (name, *(by_id.get(i, "") for i in specs[name].chain))
                                      if m and m not in groups))
        if len(members) > 1:
            groups.update({m: members for m in members})
    return groups


class NodeIndex:
    """The nodes of one planning pass, grouped by everything but their name and load (nodes of one group are
    equally eligible and score alike but for their load), each group a heap by (load, name) kept as instances are
    placed. The best node of a group for a new instance is its least loaded, so a placement scores one node per
    group instead of every node; `load` is shared with the caller, and every change to it goes through `add`."""

    def __init__(self, profiles: Sequence[nodes.NodeProfile], load: dict[str, int], avoid: frozenset[str]) -> None:
        self.load = load
        self.max_load = max(load.values(), default=0)
        self.groups: dict[tuple[object, ...], list[tuple[int, str]]] = {}
        self.members: dict[tuple[object, ...], list[nodes.NodeProfile]] = {}
        self.by_name = {n.name: n for n in profiles}
        self.group_of: dict[str, tuple[object, ...]] = {}
        for node in profiles:
            group = (node.gpu_count, node.gpu_product, node.gpu_memory_bytes, bool(node.numa_nodes), node.ready,
                     node.gpu_driver, node.name in avoid)
            self.group_of[node.name] = group
            self.members.setdefault(group, []).append(node)
            self.groups.setdefault(group, []).append((load[node.name], node.name))
        for heap in self.groups.values():
            heapq.heapify(heap)

    def add(self, node: str) -> None:
        """One more instance on the node."""
        self.load[node] += 1
        self.max_load = max(self.max_load, self.load[node])
        heapq.heappush(self.groups[self.group_of[node]], (self.load[node], node))

    def least_loaded(self, group: tuple[object, ...]) -> nodes.NodeProfile | None:
        """The group's node with the fewest instances (then by name). A spec's own instances only add to a node's
        score, so where one of its nodes is the group's least loaded, that node is still the group's best."""
        heap = self.groups[group]
        while heap and heap[0][0] != self.load[heap[0][1]]:
            heapq.heappop(heap)  # an entry from before the node's last placement
        return self.by_name[heap[0][1]] if heap else None


def plan(specs: Mapping[str, api.ModelSpecSpec], nodes: Iterable[nodes.NodeProfile],
         observed: Sequence[Observed] = (), shared: Mapping[str, Sequence[SharedImage]] | None = None,
         avoid: frozenset[str] = frozenset(), base_load: Mapping[str, int] | None = None,
         exhaustive: bool = False) -> Plan:
    """Desired EMIs for the given ModelSpecs (keyed by name), deterministic for equal inputs; a new instance goes
    to a node of `avoid` only when no other eligible node can take it.

    `observed` may hold EMIs of other ModelSpecs too: they count into node load, so planning a few specs at a
    time (the operator plans the ones that changed) spreads as well as planning all at once. `base_load` adds
    instances per node that `observed` leaves out (the operator's count of every other EMI). `exhaustive`
    scores every eligible node for every new instance: the same choices as the index (`NodeIndex`) makes,
    at the cost of every node per placement (what the index is checked against).
    """
    node_list = sorted(nodes, key=lambda n: n.name)
    load = {n.name: (base_load or {}).get(n.name, 0) for n in node_list}
    by_spec_node: dict[tuple[str, str], list[Observed]] = {}
    by_spec: dict[str, list[Observed]] = {}
    for o in observed:
        by_spec_node.setdefault((o.model_spec, o.node), []).append(o)
        if o.model_spec in specs:
            by_spec.setdefault(o.model_spec, []).append(o)
        elif o.node in load:
            load[o.node] += 1
    index = NodeIndex(node_list, load, avoid)
    desired: list[Desired] = []
    unplaced: dict[str, str] = {}
    groups = chains(specs)
    for spec_name in sorted(specs):
        spec = specs[spec_name]
        if spec_name in groups:
            if spec_name == min(groups[spec_name]):
                _place_chain(groups[spec_name], specs, node_list, index, by_spec_node, desired, unplaced, avoid)
            continue
        reasons = {group: eligible(spec, members[0]) for group, members in index.members.items()}
        if all(reason is not None for reason in reasons.values()):
            counts: dict[str, int] = {}
            for group, reason in reasons.items():
                counts[reason or ""] = counts.get(reason or "", 0) + len(index.members[group])
            why = "; ".join(f"{n} node(s): {r}" for r, n in sorted(counts.items())) or "no nodes"
            unplaced[spec_name] = f"no eligible node ({why})"
            continue
        open_groups = [group for group, reason in reasons.items() if reason is None]
        mine = sorted((o for o in by_spec.get(spec_name, ()) if o.node in index.by_name
                       and reasons[index.group_of[o.node]] is None), key=lambda o: o.node)
        kept = {o.name: o.node for o in mine}
        own_nodes = sorted({o.node for o in mine})
        sizes = [o.snapshot_bytes for o in mine if o.snapshot_bytes > 0]
        smallest = min(sizes) if sizes else 0
        images = (shared or {}).get(spec_name, ())
        for slot, tier in enumerate(_slots(spec.pool)):
            name = f"{spec_name}-{slot}"
            if name in kept:
                node = index.by_name[kept[name]]
            else:
                if exhaustive:
                    contenders = [n for g in open_groups for n in index.members[g]]
                else:
                    contenders = [index.by_name[n] for n in own_nodes]
                    contenders += [n for g in open_groups if (n := index.least_loaded(g)) is not None]
                node = min(contenders, key=lambda n: (
                    n.name in avoid,
                    -score(spec, n, load[n.name], index.max_load + 1, by_spec_node.get((spec_name, n.name), ()),
                           smallest, restorable(n, images)),
                    load[n.name], n.name))
            # Spread a node's GPU instances over its GPUs.
            gpu_index = load[node.name] % max(node.gpu_count, 1) if spec.hardware.gpu else None
            index.add(node.name)
            desired.append(Desired(name, spec_name, spec.model_id, node.name, _tier_on(node, tier), gpu_index))
    return Plan(tuple(desired), unplaced)


def _place_chain(members: Sequence[str], specs: Mapping[str, api.ModelSpecSpec], node_list: Sequence[nodes.NodeProfile],
                 by_load: NodeIndex, by_spec_node: Mapping[tuple[str, str], Sequence[Observed]],
                 desired: list[Desired], unplaced: dict[str, str], avoid: frozenset[str] = frozenset()) -> None:
    """One chain's instances: the K-th instance of every member on one node, on one GPU where memory allows."""
    load = by_load.load
    reasons = {n.name: next((f"{specs[m].model_id}: {why}" for m in members
                             if (why := eligible(specs[m], n)) is not None), None) for n in node_list}
    candidates = [n for n in node_list if reasons[n.name] is None]
    if not candidates:
        why = "; ".join(f"{n}: {r}" for n, r in sorted(reasons.items())) or "no nodes"
        unplaced.update({m: f"no node is eligible for every model of its chain ({why})" for m in members})
        return
    slots = {m: _slots(specs[m].pool) for m in members}
    mine = {m: [o for n in candidates for o in by_spec_node.get((m, n.name), ())] for m in members}
    smallest = {m: min((o.snapshot_bytes for o in mine[m] if o.snapshot_bytes > 0), default=0) for m in members}
    for index in range(max(len(tiers) for tiers in slots.values())):
        kept = sorted(o.node for m in members for o in mine[m] if o.name == f"{m}-{index}")
        if kept:
            node_name = max(sorted(set(kept)), key=kept.count)
            node = next(n for n in candidates if n.name == node_name)
        else:
            max_load = by_load.max_load + 1
            node = min(candidates, key=lambda n: (
                n.name in avoid,
                -sum(score(specs[m], n, load[n.name], max_load, by_spec_node.get((m, n.name), ()), smallest[m])
                     for m in members), load[n.name], n.name))
        gpu_members = [m for m in members if specs[m].hardware.gpu and index < len(slots[m])]
        need = sum(specs[m].hardware.min_memory_gi_b for m in gpu_members) * 2**30
        shared = load[node.name] % max(node.gpu_count, 1) if need <= node.gpu_memory_bytes else None
        for m in members:
            if index >= len(slots[m]):
                continue
            gpu_index = None
            if specs[m].hardware.gpu:
                gpu_index = shared if shared is not None else load[node.name] % max(node.gpu_count, 1)
            by_load.add(node.name)
            desired.append(Desired(f"{m}-{index}", m, specs[m].model_id, node.name,
                                   _tier_on(node, slots[m][index]), gpu_index))
