"""What the operator should write, computed from what it has seen: pure functions over a snapshot.

The kopf handlers (`handlers.py`) only record what the watches deliver into a `State` and wake the loop;
the loop calls `compute` for the ModelSpecs that changed and applies the returned `Action`s through the rate
limiter. Keeping the decisions here, free of I/O, is what lets the unit tests cover them and what makes
the operator level-triggered: the same state always yields the same actions, and a periodic full pass
repairs anything a missed event left behind.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from volga_operator import api, planner
from volga_operator.api import conditions, labels

Key = tuple[str, str]  # (namespace, name)


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


@dataclasses.dataclass(frozen=True)
class EmiRecord:
    namespace: str
    name: str
    spec: Mapping[str, Any]
    status: Mapping[str, Any]

    @property
    def owner(self) -> str:
        return str(self.spec.get("modelSpec", ""))


@dataclasses.dataclass
class State:
    specs: dict[Key, SpecRecord] = dataclasses.field(default_factory=dict)
    emis: dict[Key, EmiRecord] = dataclasses.field(default_factory=dict)
    nodes: dict[str, planner.NodeProfile] = dataclasses.field(default_factory=dict)

    def emis_by_owner(self) -> collections.defaultdict[Key, list[EmiRecord]]:
        """Each ModelSpec's EMIs, by name; one pass over all EMIs (a reconcile pass builds it once)."""
        owned: collections.defaultdict[Key, list[EmiRecord]] = collections.defaultdict(list)
        for emi in sorted(self.emis.values(), key=lambda e: e.name):
            owned[(emi.namespace, emi.owner)].append(emi)
        return owned


@dataclasses.dataclass(frozen=True)
class Action:
    """One API write. `verb`: create_emi | patch_emi | delete_emi | patch_spec_status | patch_spec_meta."""

    verb: str
    namespace: str
    name: str
    body: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def node_profile(name: str, annotations: Mapping[str, str] | None,
                 node_conditions: Iterable[Mapping[str, Any]] | None) -> planner.NodeProfile | None:
    """A node hosts Volga instances only once its agent has published a hardware profile."""
    if not annotations or labels.PROFILE_KEY not in annotations:
        return None
    ready = True
    for condition in node_conditions or ():
        if condition.get("type") == "Ready":
            ready = condition.get("status") == "True"
    return planner.NodeProfile.from_annotations(name, annotations, ready)


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


def compute(state: State, keys: Iterable[Key], now: str | None = None) -> list[Action]:
    """The writes that bring the given ModelSpecs (and their EMIs) to where they should be."""
    now = now or conditions.timestamp()
    owned = state.emis_by_owner()
    actions: list[Action] = []
    valid: dict[str, api.ModelSpecSpec] = {}
    invalid: dict[Key, str] = {}
    for key in sorted(api.chain_peers(keys, {k: record.spec for k, record in state.specs.items()})):
        record = state.specs.get(key)
        if record is None:
            # The ModelSpec is gone (deleted while we were not looking): its EMIs are orphans.
            actions += [Action("delete_emi", e.namespace, e.name) for e in owned[key]]
            continue
        if record.deleting:
            actions += _finalize(record, owned[key])
            continue
        if labels.FINALIZER not in record.finalizers:
            actions.append(Action("patch_spec_meta", record.namespace, record.name,
                                  {"metadata": {"finalizers": [*record.finalizers, labels.FINALIZER]}}))
        spec, problem = api.validate_spec(record.spec)
        if spec is None:
            invalid[key] = problem
        else:
            valid[f"{record.namespace}/{record.name}"] = spec
    everything = {f"{ns}/{name}": record.spec for (ns, name), record in state.specs.items()}
    for plan_key, problem in api.chain_invalid(valid, everything).items():
        del valid[plan_key]
        invalid[(plan_key.partition("/")[0], plan_key.partition("/")[2])] = problem
    result = planner.plan(valid, state.nodes.values(), observed(state, now))
    by_spec: dict[str, list[planner.Desired]] = {}
    for d in result.desired:
        by_spec.setdefault(d.model_spec, []).append(d)
    for plan_key in sorted(valid):
        ns, name = plan_key.split("/", 1)
        record = state.specs[(ns, name)]
        actions += _converge_emis(record, owned[(ns, name)], by_spec.get(plan_key, []))
        actions += _status(record, owned[(ns, name)], valid[plan_key], result.unplaced.get(plan_key), now)
    for (ns, name), problem in sorted(invalid.items()):
        record = state.specs[(ns, name)]
        actions += [Action("delete_emi", e.namespace, e.name) for e in owned[(ns, name)]]
        actions += _invalid_status(record, problem, now)
    return actions


def _finalize(record: SpecRecord, emis: list[EmiRecord]) -> list[Action]:
    if emis:
        return [Action("delete_emi", e.namespace, e.name) for e in emis]
    if labels.FINALIZER in record.finalizers:
        kept = [f for f in record.finalizers if f != labels.FINALIZER]
        return [Action("patch_spec_meta", record.namespace, record.name, {"metadata": {"finalizers": kept}})]
    return []


def _converge_emis(record: SpecRecord, emis: list[EmiRecord], desired: list[planner.Desired]) -> list[Action]:
    actions = []
    existing = {e.name: e for e in emis}
    for d in desired:
        body = emi_body(record, d)
        name = body["metadata"]["name"]
        current = existing.pop(name, None)
        if current is None:
            actions.append(Action("create_emi", record.namespace, name, body))
        elif dict(current.spec) != body["spec"]:
            actions.append(Action("patch_emi", record.namespace, name,
                                  {"metadata": {"labels": body["metadata"]["labels"]}, "spec": body["spec"]}))
    actions += [Action("delete_emi", e.namespace, e.name) for e in existing.values()]
    return actions


def tier_counts(emis: Iterable[EmiRecord]) -> dict[str, int]:
    counts = {t.value: 0 for t in api.Tier}
    for emi in emis:
        tier = emi.status.get("tier")
        if tier in counts:
            counts[tier] += 1
    return counts


def _status(record: SpecRecord, emis: list[EmiRecord], spec: api.ModelSpecSpec, unplaced: str | None,
            now: str) -> list[Action]:
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
