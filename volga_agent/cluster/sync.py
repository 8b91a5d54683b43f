"""The node agent's side of cluster mode (`AgentSync`).

It publishes the node's hardware profile as Node annotations (the operator places EMIs only on nodes that carry
one), watches the ModelSpecs and the EMIs labelled with its node, hands them to the pool, and reports each
instance's tier and conditions back into EMI status in batches, through a token bucket. It takes up the
calibrations the ModelSpecs request of this node (`calibrations`).

It survives an unreachable API server: watches (`kube.watch`) retry with backoff, and until they succeed the pool
keeps its instances, so requests for known models keep being routed and woken. Only new or changed ModelSpecs wait
for the API server to return. The `kubernetes` client is synchronous; each watch runs on its own thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import kubernetes

from volga_agent.cluster import calibrations, common, fetches
from volga_agent.host import gpus
from volga_agent.node import pool
from volga_core import api, planner
from volga_core.api import conditions, labels
from volga_core.kube import client as kube_client
from volga_core.kube import ratelimit, watch

log = logging.getLogger(__name__)
Tier = api.Tier


def _emi_key(namespace: str, name: str) -> str:
    return f"{namespace}.{name}"  # instance names: unique on the node, and safe in paths


# EMI conditions beside Ready, once the instance's worker has said what its warm-up found (`pool.InstanceInfo`).
WARMED_UP = "WarmedUp"  # False, reason WarmupSkipped: the model refused the made-up warm-up and serves unwarmed
OUTPUTS_MATCH = "OutputsMatchDeclaration"  # False, reason OutputShapeMismatch: answers contradict declared outputs


def warmup_conditions(info: pool.InstanceInfo, previous: Sequence[Mapping[str, Any]],
                      now: str) -> list[dict[str, Any]]:
    """WarmedUp and OutputsMatchDeclaration for an instance whose worker reported its warm-up; [] before that."""
    if not info.warmup_reported:
        return []
    skipped, mismatch = info.warmup_skipped, info.output_mismatch
    return [conditions.condition(WARMED_UP, not skipped, "WarmupSkipped" if skipped else "WarmedUp",
                                 skipped or "the worker ran its warm-up", previous, now),
            conditions.condition(OUTPUTS_MATCH, not mismatch, "OutputShapeMismatch" if mismatch else "OutputsMatch",
                                 mismatch or "the warm-up's answers have the declared output shapes", previous, now)]


class AgentSync:
    def __init__(self, node_pool: pool.Pool, node: str, found: Sequence[gpus.GpuInfo],
                 writes_per_sec: float = 200.0, report_sec: float = 2.0, gateway_address: str = "",
                 gateway_http_address: str = "",
                 calibrator: calibrations.Calibrator | None = None) -> None:
        self.pool = node_pool
        self.node = node
        self.gateway_address = gateway_address  # reported in EMI status: where other gateways forward to
        self.gateway_http_address = gateway_http_address  # and where they pass a server's HTTP requests on
        self.gpus = list(found)
        self.report_sec = report_sec
        self.bucket = ratelimit.TokenBucket.within(writes_per_sec)
        self.client = kube_client.api_client()
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.core = kubernetes.client.CoreV1Api(self.client)
        self._lock = threading.Lock()
        self._specs: dict[str, api.ModelSpecSpec] = {}  # valid ModelSpecs by namespace/name
        self._emis: dict[tuple[str, str], Any] = {}
        self._reported: dict[tuple[str, str], dict[str, Any]] = {}
        self._shared_refs: dict[str, dict[str, Any]] = {}  # shared image digest -> its status entry
        self._stop = threading.Event()
        self._spec_objects: dict[tuple[str, str], Any] = {}
        self._measured: dict[str, tuple[api.Calibration, ...]] = {}
        self.fetches = fetches.Fetches(self.core, self._refetched, metrics=node_pool.metrics)
        node_pool.awaiting = self.fetches.awaiting
        self.calibrations = (calibrations.Calibrations(self.custom, node, calibrator, self.bucket, lambda: self._specs)
                             if calibrator is not None else None)
        self.watches = [
            watch.Watch("modelspecs", self.custom.list_cluster_custom_object, self._on_specs, group=api.GROUP,
                  version=api.VERSION, plural="modelspecs"),
            watch.Watch("emis", self.custom.list_cluster_custom_object, self._on_emis, group=api.GROUP,
                  version=api.VERSION, plural="executablemodelinstances",
                  label_selector=f"{labels.LABEL_NODE}={node}"),
        ]
        self._threads = [threading.Thread(target=self._publish_profile, name="profile", daemon=True),
                         threading.Thread(target=self._report_loop, name="report", daemon=True)]

    async def start(self) -> None:
        for w in self.watches:
            w.start()
        for t in self._threads:
            t.start()
        if self.calibrations is not None:
            self.calibrations.start()

    async def stop(self) -> None:
        self._stop.set()
        if self.calibrations is not None:
            await asyncio.to_thread(self.calibrations.stop)
        for w in self.watches:
            w.stop()
        self.fetches.stop()
        await asyncio.to_thread(self.client.close)

    # -- desired state -------------------------------------------------------------------------------

    def _on_specs(self, objects: dict[tuple[str, str], Any]) -> None:
        # Validated here, once per change of the ModelSpecs, not on every EMI event (the agent's own status
        # reports come back as EMI events).
        specs: dict[str, api.ModelSpecSpec] = {}
        for (ns, name), obj in objects.items():
            parsed = common.with_signature(f"{ns}/{name}", obj, fetched_later=True)
            if parsed is not None:
                specs[f"{ns}/{name}"] = parsed
        measured = calibrations.measured_baselines(objects, specs)
        with self._lock:
            self._specs = specs
            self._spec_objects = objects
            if measured != self._measured:
                self._measured = measured
            self._apply()

    def _on_emis(self, objects: dict[tuple[str, str], Any]) -> None:
        with self._lock:
            self._emis = objects
            self._apply()

    def _apply(self) -> None:
        if not all(w.synced.is_set() for w in self.watches):
            return  # until both have been listed once, "empty" means "not known yet", not "remove everything"
        specs = self._specs
        desired = []
        for (ns, name), obj in self._emis.items():
            spec = obj.get("spec") or {}
            owner = f"{ns}/{spec.get('modelSpec', '')}"
            if spec.get("node") != self.node or owner not in specs or obj["metadata"].get("deletionTimestamp"):
                continue
            gpu = spec.get("gpu") or {}
            try:
                tier = Tier(spec.get("targetTier", "FROZEN"))
            except ValueError:
                tier = Tier.FROZEN
            desired.append(planner.Desired(_emi_key(ns, name), owner, specs[owner].model_id, self.node, tier,
                                           gpu.get("index") if specs[owner].hardware.gpu else None))
        specs, desired = self.fetches.localise(specs, desired, self._running_spec)
        self.pool.apply(desired, specs)
        self.fetches.applied()
        if self.calibrations is not None:
            self.calibrations.consider(self._spec_objects, self._emis, self.gpus)

    def _running_spec(self, name: str) -> api.ModelSpecSpec | None:
        slot = self.pool.slots.get(name)
        return slot.inst.spec if slot is not None else None

    def _refetched(self) -> None:
        """A remote source's fetch ended (its bytes are here, or it failed): apply the ModelSpecs again."""
        with self._lock:
            self._apply()

    def measured(self) -> Mapping[str, tuple[api.Calibration, ...]]:
        """model id -> status.calibrated entries of its current version (the same mapping while none changed)."""
        return self._measured

    # -- the node's profile --------------------------------------------------------------------------

    def _publish_profile(self) -> None:
        annotations = gpus.node_profile(self.gpus, self.node).annotations()
        # The driver, for the planner's preference for nodes that can restore a shared snapshot.
        annotations[f"{labels.ANNOTATION_PREFIX}gpu-driver"] = ",".join(sorted({g.driver for g in self.gpus}))
        body = {"metadata": {"annotations": annotations}}

        def publish() -> None:
            ratelimit.write_sync(self.bucket, lambda: self.core.patch_node(self.node, body, _request_timeout=10))
            log.info("published the hardware profile of node %s", self.node)

        def failed(exc: BaseException | None, _delay: float) -> None:
            log.info("node %s: cannot publish its profile yet: %s", self.node, exc)

        kube_client.until_stopped(publish, self._stop, 0.5, 30.0, failed)

    # -- status reports ------------------------------------------------------------------------------

    def statuses(self) -> dict[tuple[str, str], dict[str, Any]]:
        """EMI status for every instance of this node (and for EMIs whose instance could not be created)."""
        out: dict[tuple[str, str], dict[str, Any]] = {}
        with self._lock:
            emis = dict(self._emis)
        by_instance = {_emi_key(ns, name): (ns, name) for ns, name in emis}
        now = conditions.timestamp()

        def previous(key: tuple[str, str]) -> list[dict[str, Any]]:
            # What we last wrote, else what the API server holds: transition times survive restarts.
            reported = self._reported.get(key) or (emis[key].get("status") or {})
            return list(reported.get("conditions") or ())

        for info in self.pool.instances():
            key = by_instance.get(info.name)
            if key is None:
                continue
            reason = info.state_reason.split(":", 1)[0] if info.state_reason else ""
            settled = info.tier in (info.target_tier, Tier.HOT) and not reason
            message = info.state_reason or (f"{info.tier.value}, on the way to {info.target_tier.value}"
                                            if not settled else f"wakes from {info.tier.value}")
            ready = conditions.condition("Ready", settled, "Ready" if settled else (reason or "Converging"), message,
                                         previous(key), now)
            out[key] = {"tier": info.tier.value, "snapshotBytes": info.snapshot_bytes, "device": info.device,
                        "gateway": self.gateway_address, "gatewayHttp": self.gateway_http_address or None,
                        "lastWakeMs": round(info.last_wake_ms, 3),
                        "lastUsed": conditions.timestamp(info.last_used_unix) if info.last_used_unix else None,
                        "conditions": [ready, *warmup_conditions(info, previous(key), now)]}
            shared_ref = self._shared_ref(info)
            if shared_ref is not None:
                out[key]["sharedSnapshot"] = shared_ref
        failed = {**self.pool.failed, **{n: why for n, (_, why) in self.pool.servers.failed.copy().items()}}
        for name, problem in failed.items():
            key = by_instance.get(name)
            if key is not None:
                out[key] = {"tier": Tier.COLD.value, "conditions": [
                    conditions.condition("Ready", False, "CreateFailed", problem, previous(key), now)]}
        for key, obj in emis.items():  # remote sources: where the bytes came from, or how their fetch goes
            owner = f"{key[0]}/{(obj.get('spec') or {}).get('modelSpec', '')}"
            if (loaded := self.fetches.loaded.get(owner)) is not None and key in out:
                out[key]["source"] = loaded.to_wire()
            elif (pending := self.fetches.pending.get(owner)) is not None and key not in out:
                out[key] = {"tier": Tier.COLD.value, "source": pending.source.to_wire(), "conditions": [
                    conditions.condition("Ready", False, pending.reason, pending.message, previous(key), now)]}
        return out

    def _shared_ref(self, info: pool.InstanceInfo) -> dict[str, Any] | None:
        """The shared image the instance restored from or published, as its status lists it (manifests read
        once per image)."""
        if not info.shared_snapshot:
            return None
        cached = self._shared_refs.get(info.shared_snapshot)
        if cached is None:
            entry = self.pool.shared_entry(info.shared_snapshot)
            if entry is None:
                return None
            cached = self._shared_refs[info.shared_snapshot] = entry.ref().to_wire()
        return {**cached, "role": info.shared_snapshot_role}

    def report_once(self) -> int:
        """Write the statuses that changed since the last report; returns how many were written."""
        written = 0
        for (ns, name), status in self.statuses().items():
            if self._reported.get((ns, name)) == status:
                continue
            try:
                ratelimit.write_sync(self.bucket, lambda ns=ns, name=name, status=status:  # type: ignore[misc]
                                     self.custom.patch_namespaced_custom_object_status(
                                         api.GROUP, api.VERSION, ns, "executablemodelinstances", name,
                                         {"status": status}, _request_timeout=10))
            except kubernetes.client.ApiException as exc:
                if exc.status != 404:
                    raise
            self._reported[(ns, name)] = status
            written += 1
        return written

    def _report_loop(self) -> None:
        while not self._stop.wait(self.report_sec):
            try:
                self.report_once()
            except kube_client.TRANSIENT as exc:
                log.info("status report deferred: %s", exc)
