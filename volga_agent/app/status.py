"""What `volga status` shows: each model's instances, their tiers, last use and wake, and snapshot image sizes.

Two sources, one view: a running `volga up` (or an agent) through its Agent API (`ListInstances`), or a
cluster, whose ModelSpecs and EMIs (ExecutableModelInstances) the kubernetes client reads. Instances are
grouped per model; a model without instances is shown too (from its ModelSpec), so that one that was never
placed does not vanish from the view.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc

from volga_agent.rpc.volga.v1 import agent_pb2 as pb
from volga_agent.rpc.volga.v1 import agent_pb2_grpc as pb_grpc
from volga_core import api


class SourceError(RuntimeError):
    """The agent or the API server could not be read; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Instance:
    name: str
    model_id: str
    node: str
    tier: str
    snapshot_bytes: int
    last_used: str  # RFC 3339 in UTC; "" when never used
    last_wake_ms: float
    reason: str  # why it is not where it should be (a failed start, a failed wake); "" when fine
    # What else went wrong though it serves: a made-up warm-up the model refused, answers that contradict its
    # declared outputs (the EMI's other conditions that are False, in a cluster)
    notices: tuple[str, ...] = ()
    # Where its model's bytes came from, for a remote source or a pinned digest (the EMI's status.source, or the
    # Agent API's source and source_digest): "bytes from URI, digest", or how the fetch goes
    source: str = ""


@dataclasses.dataclass(frozen=True)
class Model:
    model_id: str
    instances: tuple[Instance, ...]

    @property
    def tiers(self) -> dict[str, int]:
        """Instances per tier, fastest to wake first."""
        order = [t.value for t in api.Tier]
        counts: dict[str, int] = {}
        for inst in sorted(self.instances, key=lambda i: order.index(i.tier) if i.tier in order else len(order)):
            counts[inst.tier] = counts.get(inst.tier, 0) + 1
        return counts

    @property
    def last_used(self) -> str:
        return max((i.last_used for i in self.instances), default="")

    @property
    def last_wake_ms(self) -> float | None:
        """The wake of the instance used last (the one a user last waited for)."""
        woken = [i for i in self.instances if i.last_wake_ms]
        return max(woken, key=lambda i: i.last_used).last_wake_ms if woken else None

    @property
    def image_bytes(self) -> int:
        return sum(i.snapshot_bytes for i in self.instances)

    def to_json(self) -> dict[str, Any]:
        return {"modelId": self.model_id, "instances": len(self.instances), "tiers": self.tiers,
                "lastUsed": self.last_used or None, "lastWakeMs": self.last_wake_ms, "imageBytes": self.image_bytes,
                "instanceList": [{"name": i.name, "node": i.node, "tier": i.tier, "snapshotBytes": i.snapshot_bytes,
                                  "lastUsed": i.last_used or None, "lastWakeMs": i.last_wake_ms or None,
                                  "reason": i.reason or None, "notices": list(i.notices), "source": i.source or None}
                                 for i in self.instances]}


def group(instances: Iterable[Instance], model_ids: Iterable[str] = ()) -> list[Model]:
    """Instances per model, by model id; `model_ids` without instances appear with none."""
    by_model: dict[str, list[Instance]] = {m: [] for m in model_ids}
    for inst in instances:
        by_model.setdefault(inst.model_id, []).append(inst)
    return [Model(m, tuple(sorted(by_model[m], key=lambda i: i.name))) for m in sorted(by_model)]


def _rfc3339(unix: float) -> str:
    if not unix:
        return ""
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def from_agent(address: str, timeout: float = 10.0) -> list[Model]:
    """The instances a running `volga up` (or a node's agent) holds, through its Agent API at `address`."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = pb_grpc.AgentStub(channel).ListInstances(pb.ListInstancesRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise SourceError(f"agent {address}: {exc.code().name}: {exc.details()}") from None
    return group(Instance(i.name, i.model_id, i.node, pb.Tier.Name(i.tier), i.snapshot_bytes,
                          _rfc3339(i.last_used_unix), i.last_wake_ms, i.state_reason,
                          tuple(n for n in (i.warmup_skipped and f"warm-up skipped: {i.warmup_skipped}",
                                            i.output_mismatch) if n),
                          _source({"uri": i.source, "digest": i.source_digest}
                                  if i.source_digest or _remote(i.source) else {}))
                 for i in reply.instances)


def _remote(source: str) -> bool:
    return "://" in source and not source.startswith("file://")


def _emi(obj: Mapping[str, Any]) -> Instance:
    spec, status = obj.get("spec", {}), obj.get("status") or {}
    ready: Mapping[str, Any] = next((c for c in status.get("conditions") or () if c.get("type") == "Ready"), {})
    reason = "" if ready.get("status") == "True" else str(ready.get("message") or "")
    notices = tuple(f"{c.get('reason') or c.get('type')}: {c.get('message') or ''}"
                    for c in status.get("conditions") or () if c.get("type") != "Ready" and c.get("status") == "False")
    return Instance(obj["metadata"]["name"], str(spec.get("modelId", "")), str(spec.get("node", "")),
                    str(status.get("tier") or "PENDING"), int(status.get("snapshotBytes") or 0),
                    str(status.get("lastUsed") or ""), float(status.get("lastWakeMs") or 0.0), reason, notices,
                    _source(status.get("source") or {}))


def _source(source: Mapping[str, Any]) -> str:
    if not source.get("uri"):
        return ""
    if source.get("fetching"):
        return (f"fetching {source['uri']}: {_size(int(source.get('bytes') or 0))} of "
                f"{_size(int(source.get('totalBytes') or 0))} at {float(source.get('rateBytesPerSec') or 0) / 1e6:.1f} "
                "MB/s")
    return f"bytes from {source['uri']}" + (f", {source['digest']}" if source.get("digest") else "")


def from_objects(modelspecs: Sequence[Mapping[str, Any]], emis: Sequence[Mapping[str, Any]]) -> list[Model]:
    """The view of a cluster's ModelSpecs and EMIs as the API server returns them (plain mappings)."""
    model_ids = [str(m.get("spec", {}).get("modelId") or m["metadata"]["name"]) for m in modelspecs]
    return group((_emi(e) for e in emis), model_ids)


def from_cluster(kubeconfig: str | None, namespace: str | None, context: str | None = None) -> list[Model]:
    """Read ModelSpecs and EMIs with the kubernetes client: from `namespace`, or from every namespace."""
    import kubernetes

    try:
        if kubeconfig is None and context is None:
            try:
                kubernetes.config.load_incluster_config()
                client = kubernetes.client.ApiClient()
            except kubernetes.config.ConfigException:
                client = kubernetes.config.new_client_from_config()
        else:
            client = kubernetes.config.new_client_from_config(config_file=kubeconfig, context=context)
    except (kubernetes.config.ConfigException, OSError) as exc:
        raise SourceError(f"kubeconfig {kubeconfig or '(default)'}: {exc}") from None
    objects = kubernetes.client.CustomObjectsApi(client)

    def items(plural: str) -> list[dict[str, Any]]:
        listed: Any
        try:
            if namespace:
                listed = objects.list_namespaced_custom_object(api.GROUP, api.VERSION, namespace, plural,
                                                               _request_timeout=30)
            else:
                listed = objects.list_cluster_custom_object(api.GROUP, api.VERSION, plural, _request_timeout=30)
        except kubernetes.client.ApiException as exc:
            raise SourceError(f"listing {plural}: {exc.status} {exc.reason}") from None
        except OSError as exc:
            raise SourceError(f"listing {plural}: {exc}") from None
        return list(listed.get("items", ()))

    try:
        return from_objects(items("modelspecs"), items("executablemodelinstances"))
    finally:
        client.close()


def _size(n: int) -> str:
    if not n:
        return "-"
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}"
    return f"{n} B"


def table(models: Sequence[Model]) -> str:
    """One row per model: MODEL, INSTANCES, TIERS, LAST USED, LAST WAKE, IMAGES; then the reasons of instances that
    are not where they should be, and what went wrong with instances that serve anyway (their notices)."""
    rows = [("MODEL", "INSTANCES", "TIERS", "LAST USED", "LAST WAKE", "IMAGES")]
    for m in models:
        tiers = ", ".join(f"{t} {n}" for t, n in m.tiers.items()) or "-"
        wake = f"{m.last_wake_ms:.1f} ms" if m.last_wake_ms is not None else "-"
        rows.append((m.model_id, str(len(m.instances)), tiers, m.last_used or "-", wake, _size(m.image_bytes)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    for m in models:
        lines += [f"{i.name} ({m.model_id}, {i.tier}): {i.reason}" for i in m.instances if i.reason]
        lines += [f"{i.name} ({m.model_id}, {i.tier}): {notice}" for i in m.instances for notice in i.notices]
        lines += [f"{i.name} ({m.model_id}, {i.tier}): {i.source}" for i in m.instances if i.source]
    return "\n".join(lines)
