"""Cluster mode of the node daemons: the Kubernetes API as the source of desired state.

- `AgentSync` publishes the node's hardware profile as Node annotations (the operator places EMIs only on
  nodes that carry one), watches the ModelSpecs and the EMIs labelled with its node, hands them to the pool,
  and reports each instance's tier and conditions back into EMI status in batches, through a token bucket.
- `CatalogSync` keeps a gateway's model catalog in step with the cluster's ModelSpecs.
- `NeighbourDirectory` publishes the node's Agent API address for its neighbours and finds theirs
  (`volga_agent/neighbours.py`).
- `TierSync` (with the autonomy loop on) is the node's part of the cluster tier: it publishes the loop's state as
  the `volga.dev/autonomy` Node annotation, at once on a change and every `autonomy_heartbeat_sec`, through
  AgentSync's token bucket and never on a request's path, and reads the cluster's watermarks the operator
  publishes (a ConfigMap) into the loop and the agent's metrics.

Both survive an unreachable API server: watches (`kube.watch`) retry with backoff, and until they succeed
the pool keeps its instances and the gateway its catalog, so requests for known models keep being routed
and woken. Only new or changed ModelSpecs wait for the API server to return.

The `kubernetes` client is synchronous; each watch runs on its own thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import kubernetes
import prometheus_client as prom
import pydantic

from volga_agent.autonomy import loop as autonomy_loop
from volga_agent.gateway import catalog as gateway_catalog
from volga_agent.host import gpus
from volga_agent.node import pool, signature
from volga_core import api, nodes, planner
from volga_core.api import conditions, labels
from volga_core.kube import client as kube_client
from volga_core.kube import ratelimit, watch

log = logging.getLogger(__name__)
Tier = api.Tier


def _with_signature(key: str, obj: Any) -> api.ModelSpecSpec | None:
    """A valid ModelSpec with the inputs and outputs it leaves out read from its model file (on this node), or
    None (logged): the operator keeps specs as written, since only the nodes can read the model files."""
    parsed, _ = api.validate_spec(obj.get("spec") or {})
    if parsed is None:
        return None
    try:
        return signature.fill(parsed)
    except api.SpecError as exc:
        log.warning("ModelSpec %s: %s", key, exc)
        return None


def _emi_key(namespace: str, name: str) -> str:
    return f"{namespace}.{name}"  # instance names: unique on the node, and safe in paths


class AgentSync:
    def __init__(self, node_pool: pool.Pool, node: str, found: Sequence[gpus.GpuInfo],
                 writes_per_sec: float = 200.0, report_sec: float = 2.0, gateway_address: str = "",
                 calibrator: Calibrator | None = None) -> None:
        self.pool = node_pool
        self.node = node
        self.gateway_address = gateway_address  # reported in EMI status: where other gateways forward to
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
        self.calibrations = (Calibrations(self.custom, node, calibrator, self.bucket, lambda: self._specs)
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
        await asyncio.to_thread(self.client.close)

    # -- desired state -------------------------------------------------------------------------------

    def _on_specs(self, objects: dict[tuple[str, str], Any]) -> None:
        # Validated here, once per change of the ModelSpecs, not on every EMI event (the agent's own status
        # reports come back as EMI events).
        specs: dict[str, api.ModelSpecSpec] = {}
        for (ns, name), obj in objects.items():
            parsed = _with_signature(f"{ns}/{name}", obj)
            if parsed is not None:
                specs[f"{ns}/{name}"] = parsed
        measured = measured_baselines(objects, specs)
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
        self.pool.apply(desired, specs)
        if self.calibrations is not None:
            self.calibrations.consider(self._spec_objects, self._emis, self.gpus)

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
                        "gateway": self.gateway_address,
                        "lastWakeMs": round(info.last_wake_ms, 3),
                        "lastUsed": conditions.timestamp(info.last_used_unix) if info.last_used_unix else None,
                        "conditions": [ready]}
            shared_ref = self._shared_ref(info)
            if shared_ref is not None:
                out[key]["sharedSnapshot"] = shared_ref
        for name, problem in self.pool.failed.items():
            key = by_instance.get(name)
            if key is not None:
                out[key] = {"tier": Tier.COLD.value, "conditions": [
                    conditions.condition("Ready", False, "CreateFailed", problem, previous(key), now)]}
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


class CatalogSync:
    """A gateway's routing table: the cluster's ModelSpecs and where their EMIs are, from two watches.

    The last good table stays while the API server is unreachable.
    """

    def __init__(self, catalog: gateway_catalog.Catalog) -> None:
        self.catalog = catalog
        self.client = kube_client.api_client()
        custom = kubernetes.client.CustomObjectsApi(self.client)
        self.watches = [
            watch.Watch("modelspecs", custom.list_cluster_custom_object, self._on_specs, group=api.GROUP,
                  version=api.VERSION, plural="modelspecs"),
            watch.Watch("emis", custom.list_cluster_custom_object, self._on_emis, group=api.GROUP, version=api.VERSION,
                  plural="executablemodelinstances"),
        ]

    def _on_emis(self, objects: dict[tuple[str, str], Any]) -> None:
        placements: dict[str, list[gateway_catalog.Placement]] = {}
        for (_, name), obj in objects.items():
            spec, status = obj.get("spec") or {}, obj.get("status") or {}
            ready = conditions.is_true(status.get("conditions", ()))
            placements.setdefault(str(spec.get("modelId", "")), []).append(gateway_catalog.Placement(
                name, str(spec.get("node", "")), str(status.get("tier", "")), ready, str(status.get("gateway", ""))))
        self.catalog.set_placements(placements)

    def _on_specs(self, objects: dict[tuple[str, str], Any]) -> None:
        specs = []
        for (ns, name), obj in objects.items():
            parsed = _with_signature(f"{ns}/{name}", obj)
            if parsed is not None:
                specs.append(parsed)
        self.catalog.replace(specs)

    async def start(self) -> None:
        for w in self.watches:
            w.start()

    async def stop(self) -> None:
        for w in self.watches:
            w.stop()
        await asyncio.to_thread(self.client.close)


class NeighbourDirectory:
    """The cluster's agents that trade water levels (`neighbours.py`): publishes this node's Agent API address as
    the Node annotation `labels.AGENT_API_KEY` and hands `on_change` the node -> address map of every Node that
    carries one (this one included)."""

    def __init__(self, node: str, address: str, on_change: Callable[[dict[str, str]], None],
                 writes_per_sec: float = 200.0) -> None:
        self.node = node
        self.address = address
        self.on_change = on_change
        self.bucket = ratelimit.TokenBucket.within(writes_per_sec)
        self.client = kube_client.api_client()
        self.core = kubernetes.client.CoreV1Api(self.client)
        self._stop = threading.Event()
        self.watch = watch.Watch("nodes", watch.json_lister(self.core.list_node), self._on_nodes)
        self._thread = threading.Thread(target=self._publish, name="agent-api-annotation", daemon=True)

    def _on_nodes(self, objects: dict[tuple[str, str], Any]) -> None:
        found = {}
        for (_, name), obj in objects.items():
            address = ((obj.get("metadata") or {}).get("annotations") or {}).get(labels.AGENT_API_KEY)
            if address:
                found[name] = str(address)
        self.on_change(found)

    def _publish(self) -> None:
        body = {"metadata": {"annotations": {labels.AGENT_API_KEY: self.address}}}

        def publish() -> None:
            ratelimit.write_sync(self.bucket, lambda: self.core.patch_node(self.node, body, _request_timeout=10))

        def failed(exc: BaseException | None, _delay: float) -> None:
            log.info("node %s: cannot publish its Agent API address yet: %s", self.node, exc)

        kube_client.until_stopped(publish, self._stop, 0.5, 30.0, failed)

    async def start(self) -> None:
        self._thread.start()
        self.watch.start()

    async def stop(self) -> None:
        self._stop.set()
        self.watch.stop()
        await asyncio.to_thread(self.client.close)


class TierSync:
    """The node's autonomy state out (a Node annotation, a heartbeat of seconds), the cluster's watermarks in."""

    def __init__(self, sync: AgentSync, autonomy: autonomy_loop.Loop, heartbeat_sec: float,
                 namespace: str | None = None) -> None:
        self.sync = sync
        self.loop = autonomy
        self.period = heartbeat_sec
        self.namespace = namespace or os.environ.get("VOLGA_NAMESPACE") or os.environ.get("POD_NAMESPACE") or "default"
        self._stop = threading.Event()
        registry = sync.pool.metrics.registry
        self.heartbeats = prom.Counter(
            "volga_autonomy_heartbeats", "Writes of the node's autonomy annotation, by why (change, refresh)",
            ["why"], registry=registry)
        self.cluster_memory = prom.Gauge(
            "volga_cluster_memory_pct", "Memory use of the nodes with a fresh heartbeat (mean, max), as the operator "
            "published it", ["stat"], registry=registry)
        self.cluster_nodes = prom.Gauge(
            "volga_cluster_nodes", "Nodes with a fresh heartbeat (all, emergency), as the operator published it",
            ["state"], registry=registry)
        self.watch = watch.Watch("cluster-watermarks", watch.json_lister(sync.core.list_namespaced_config_map),
                                 self._on_watermarks, namespace=self.namespace,
                                 field_selector=f"metadata.name={labels.CLUSTER_CONFIGMAP}")
        self._thread = threading.Thread(target=self._beat, name="autonomy-heartbeat", daemon=True)

    async def start(self) -> None:
        self.watch.start()
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        self.watch.stop()
        await asyncio.to_thread(self._thread.join, 5)

    def _on_watermarks(self, objects: dict[tuple[str, str], Any]) -> None:
        for obj in objects.values():
            marks = nodes.ClusterWatermarks.from_json((obj.get("data") or {}).get(labels.CLUSTER_WATERMARKS_KEY))
            if marks is None:
                log.warning("ConfigMap %s/%s: no readable %s", self.namespace, labels.CLUSTER_CONFIGMAP,
                            labels.CLUSTER_WATERMARKS_KEY)
                continue
            self.loop.cluster = marks
            self.cluster_memory.labels("mean").set(marks.mean_memory_pct)
            self.cluster_memory.labels("max").set(marks.max_memory_pct)
            self.cluster_nodes.labels("all").set(marks.nodes)
            self.cluster_nodes.labels("emergency").set(marks.emergency_nodes)

    def beat(self, why: str) -> None:
        """Write the loop's standing now."""
        standing = self.loop.standing
        value = nodes.NodeAutonomy(standing.state.value, standing.since, time.time(), standing.memory_pct,
                                     self.period).annotation()
        body = {"metadata": {"annotations": {labels.AUTONOMY_KEY: value}}}
        ratelimit.write_sync(self.sync.bucket, lambda: self.sync.core.patch_node(self.sync.node, body,
                                                                                 _request_timeout=10))
        self.heartbeats.labels(why).inc()

    def _beat(self) -> None:
        written: Any = None
        last = float("-inf")
        while not self._stop.wait(min(0.25, self.period / 4)):
            state = self.loop.standing.state
            if state == written and time.monotonic() - last < self.period:
                continue
            try:
                self.beat("change" if state != written else "refresh")
            except kube_client.TRANSIENT as exc:
                log.info("node %s: autonomy heartbeat deferred: %s", self.sync.node, exc)
                self._stop.wait(min(self.period, 5.0))
                continue
            written, last = state, time.monotonic()


# -- calibration on request ------------------------------------------------------------------------------

LEASE_SEC = 60
CALIBRATED = "Calibrated"  # the condition type of a status.calibratedFor entry


class Calibrator(Protocol):
    """Measures a ModelSpec's baselines on this node with a worker of its own (`volga calibrate`'s measurement,
    passed in by the daemons): blocking; raises `CalibrationFailed` with the reason, or any error."""

    def __call__(self, spec: api.ModelSpecSpec, device: str, /) -> api.Calibration: ...


class CalibrationFailed(RuntimeError):
    """A calibration that did not give a result; `reason` goes into the Calibrated condition (StartFailed: the
    model did not start; InvalidSpec; CalibrationFailed)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class CalibrationRequest:
    """One device kind of this node asked to answer a ModelSpec's volga.dev/calibrate token."""

    namespace: str
    name: str
    token: str
    kind: str  # cpu, or the GPU product: status.calibrated's key
    device: str  # where to measure: cpu or cuda:N


def _answer(status: Mapping[str, Any] | None, kind: str) -> api.CalibrationAnswer | None:
    for entry in (status or {}).get("calibratedFor") or ():
        if entry.get("device") == kind:
            try:
                return api.CalibrationAnswer.model_validate(entry)
            except pydantic.ValidationError:
                return None
    return None


def _held(answer: api.CalibrationAnswer, now: float) -> bool:
    """A running answer whose node renewed its lease in time."""
    renewed = conditions.unix(answer.renewed_at)
    return answer.condition.status == "Unknown" and renewed is not None and now < renewed + answer.lease_sec


def _replaced(entries: Sequence[Mapping[str, Any]] | None, entry: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The list keyed by device with `entry` in place of the one of its device."""
    kept = [e for e in entries or () if e.get("device") != entry["device"]]
    return sorted([*kept, entry], key=lambda e: str(e.get("device")))


def measured_baselines(objects: Mapping[tuple[str, str], Any],
                       specs: Mapping[str, api.ModelSpecSpec]) -> dict[str, tuple[api.Calibration, ...]]:
    """model id -> the ModelSpec status' calibrated entries that hold for its current version and input hash."""
    out: dict[str, tuple[api.Calibration, ...]] = {}
    for (ns, name), obj in objects.items():
        spec = specs.get(f"{ns}/{name}")
        if spec is None:
            continue
        held = []
        for entry in (obj.get("status") or {}).get("calibrated") or ():
            try:
                calibration = api.Calibration.model_validate(entry)
            except pydantic.ValidationError:
                continue
            if calibration.holds_for(spec.version, spec.input_hash()):
                held.append(calibration)
        if held:
            out[spec.model_id] = tuple(held)
    return out


class Calibrations:
    """Calibration requests (`labels.ANNOTATION_CALIBRATE` on a ModelSpec) that this node answers, one at a time
    on a thread of their own, never on a watch's or a request's path.

    A node takes a request for each device kind (GPU product, or cpu) it holds an EMI of the ModelSpec on. Of
    the nodes of one kind exactly one measures: the request is claimed by writing the kind's status.calibratedFor
    entry (token, node, condition Unknown, renewedAt) with the ModelSpec's resourceVersion as a precondition, so
    of two nodes claiming at once the API server answers one with 409 Conflict, and that one reads the claim and
    leaves it. The claim is a lease, renewed every third of `lease_sec` while measuring; a claim not renewed in
    time (its node died) is taken over. The result goes into status.calibrated (the kind's entry replaced) and
    the entry's condition turns True, or False with the reason; every status write is conditional the same way.
    A token once answered is not measured again; a new token is.
    """

    def __init__(self, custom: Any, node: str, calibrator: Calibrator, bucket: ratelimit.TokenBucket,
                 specs: Callable[[], Mapping[str, api.ModelSpecSpec]], lease_sec: int = LEASE_SEC) -> None:
        self.custom = custom
        self.node = node
        self.calibrator = calibrator
        self.bucket = bucket
        self.specs = specs
        self.lease_sec = lease_sec
        self.done = 0  # calibrations run by this node, for tests and logs
        self._queue: queue.Queue[CalibrationRequest | None] = queue.Queue()
        self._queued: set[CalibrationRequest] = set()
        self._running: CalibrationRequest | None = None
        self._seen: list[CalibrationRequest] = []  # the requests of the latest consider(), looked at again
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="calibrate", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking requests; a measurement under way is left to finish in its own process."""
        self._stop.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def consider(self, objects: Mapping[tuple[str, str], Any], emis: Mapping[tuple[str, str], Any],
                 gpus_found: Sequence[gpus.GpuInfo]) -> list[CalibrationRequest]:
        """Queue the requests this node should take up, from the ModelSpecs and this node's EMIs; the ones queued
        now."""
        devices: dict[tuple[str, str], dict[str, str]] = {}  # ModelSpec -> kind -> device (lowest EMI name)
        for (ns, _name), emi in sorted(emis.items()):
            spec = emi.get("spec") or {}
            if spec.get("node") != self.node or emi["metadata"].get("deletionTimestamp"):
                continue
            index = (spec.get("gpu") or {}).get("index")
            device = "cpu" if index is None else f"cuda:{index}"
            kind = gpus.kind_of(device, gpus_found)
            devices.setdefault((ns, str(spec.get("modelSpec", ""))), {}).setdefault(kind, device)
        wanted = []
        for (ns, name), obj in objects.items():
            token = ((obj.get("metadata") or {}).get("annotations") or {}).get(labels.ANNOTATION_CALIBRATE)
            if not token:
                continue
            for kind, device in devices.get((ns, name), {}).items():
                wanted.append(CalibrationRequest(ns, name, token, kind, device))
        with self._lock:
            self._seen = wanted
        queued = []
        for request in wanted:
            status = objects[(request.namespace, request.name)].get("status")
            if not self._answered(_answer(status, request.kind), request.token) and self._enqueue(request):
                queued.append(request)
        return queued

    def _answered(self, answer: api.CalibrationAnswer | None, token: str) -> bool:
        if answer is None or answer.token != token:
            return False
        if answer.condition.status != "Unknown":
            return True
        if answer.node != self.node:
            return _held(answer, time.time())
        return False  # ours but not running here (this agent restarted): take it up again

    def _enqueue(self, request: CalibrationRequest) -> bool:
        with self._lock:
            if request in self._queued or request == self._running:
                return False
            self._queued.add(request)
        self._queue.put(request)
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                request = self._queue.get(timeout=self.lease_sec / 3)
            except queue.Empty:
                self._recheck()  # a lease that ran out raises no event
                continue
            if request is None:
                return
            with self._lock:
                self._queued.discard(request)
                self._running = request
            try:
                self._take(request)
            except Exception:
                log.exception("calibration %s/%s (%s): failed", request.namespace, request.name, request.kind)
            finally:
                with self._lock:
                    self._running = None

    def _recheck(self) -> None:
        with self._lock:
            seen = list(self._seen)
        now = time.time()
        for request in seen:
            try:
                obj = self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, request.namespace,
                                                               "modelspecs", request.name, _request_timeout=10)
            except kube_client.TRANSIENT as exc:
                log.debug("calibration recheck: %s", exc)
                continue
            answer = _answer(obj.get("status"), request.kind)
            if answer is not None and answer.token == request.token and answer.condition.status == "Unknown" \
                    and not _held(answer, now):
                self._enqueue(request)

    # -- one request ---------------------------------------------------------------------------------

    def _write(self, request: CalibrationRequest, build: Callable[[dict[str, Any]], dict[str, Any] | None]) -> bool:
        """Patch the ModelSpec's status with what `build(current object)` returns (None: nothing to write),
        conditional on the resourceVersion read; read again on a conflict. False when nothing was written."""
        for _ in range(20):
            if self._stop.is_set():
                return False
            try:
                obj = self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, request.namespace,
                                                               "modelspecs", request.name, _request_timeout=10)
                status = build(obj)
                if status is None:
                    return False
                body = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "status": status}
                self.bucket.acquire()  # not ratelimit.write_sync: a conflict is answered by reading again
                self.custom.patch_namespaced_custom_object_status(api.GROUP, api.VERSION, request.namespace,
                                                                  "modelspecs", request.name, body,
                                                                  _request_timeout=10)
                return True
            except kubernetes.client.ApiException as exc:
                if exc.status == 404:
                    return False
                if exc.status == 409:
                    log.info("calibration %s/%s: the ModelSpec changed since read: reading it again",
                             request.namespace, request.name)
                else:
                    log.info("calibration %s/%s: status write deferred: %s", request.namespace, request.name,
                             exc.reason)
                    self._stop.wait(1.0)
            except kube_client.TRANSIENT as exc:
                log.info("calibration %s/%s: status write deferred: %s", request.namespace, request.name, exc)
                self._stop.wait(1.0)
        return False

    def _entry(self, request: CalibrationRequest, state: str, reason: str, message: str,
               previous: api.CalibrationAnswer | None) -> dict[str, Any]:
        now = conditions.timestamp()
        before = [previous.condition.to_wire()] if previous is not None and previous.token == request.token else []
        condition = conditions.condition(CALIBRATED, state == "True", reason, message, before, now)
        condition["status"] = state  # Unknown while measuring
        return api.CalibrationAnswer.model_validate({
            "device": request.kind, "token": request.token, "node": self.node, "renewedAt": now,
            "leaseSec": self.lease_sec, "condition": condition}).to_wire()

    def _take(self, request: CalibrationRequest) -> None:
        def claim(obj: dict[str, Any]) -> dict[str, Any] | None:
            token = ((obj.get("metadata") or {}).get("annotations") or {}).get(labels.ANNOTATION_CALIBRATE)
            status = obj.get("status") or {}
            answer = _answer(status, request.kind)
            if token != request.token or self._answered(answer, request.token):
                return None  # another node has it, or the request changed (its own event queues it)
            entry = self._entry(request, "Unknown", "Measuring", f"measuring on node {self.node}", answer)
            return {"calibratedFor": _replaced(status.get("calibratedFor"), entry)}

        if not self._write(request, claim):
            return
        where = f"{request.namespace}/{request.name} on {request.kind} ({request.device}, token {request.token!r})"
        log.warning("calibrating %s", where)
        renewing = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(request, renewing), name="calibrate-lease",
                                   daemon=True)
        renewer.start()
        result: api.Calibration | None = None
        try:
            spec = self.specs().get(f"{request.namespace}/{request.name}")
            if spec is None:
                raise CalibrationFailed("InvalidSpec", "the ModelSpec is not valid on this node (its model file, "
                                                       "inputs or outputs)")
            result = self.calibrator(spec, request.device).model_copy(update={"device": request.kind,
                                                                              "node": self.node})
            reason, message = "Calibrated", (
                f"measured on node {self.node} through the {result.measured_through}, version {result.version}: "
                + ", ".join(f"batch {b.batch_size} p99 {b.p99_ms:g} ms" for b in result.batches))
        except CalibrationFailed as exc:
            reason, message = exc.reason, str(exc)
        except Exception as exc:
            reason, message = "CalibrationFailed", f"{type(exc).__name__}: {exc}"
        finally:
            renewing.set()
            renewer.join()
        self.done += 1
        log.warning("calibration %s: %s: %s", where, reason, message)

        def finish(obj: dict[str, Any]) -> dict[str, Any] | None:
            status = obj.get("status") or {}
            answer = _answer(status, request.kind)
            if answer is None or (answer.token, answer.node) != (request.token, self.node):
                log.warning("calibration %s: taken over by node %s, result dropped", where,
                            answer.node if answer else "?")
                return None
            entry = self._entry(request, "True" if result is not None else "False", reason, message, answer)
            out: dict[str, Any] = {"calibratedFor": _replaced(status.get("calibratedFor"), entry)}
            if result is not None:
                out["calibrated"] = _replaced(status.get("calibrated"), result.to_wire())
            return out

        self._write(request, finish)

    def _renew(self, request: CalibrationRequest, done: threading.Event) -> None:
        def renew(obj: dict[str, Any]) -> dict[str, Any] | None:
            status = obj.get("status") or {}
            answer = _answer(status, request.kind)
            if answer is None or (answer.token, answer.node) != (request.token, self.node):
                return None
            entry = answer.model_copy(update={"renewed_at": conditions.timestamp()}).to_wire()
            return {"calibratedFor": _replaced(status.get("calibratedFor"), entry)}

        while not done.wait(self.lease_sec / 3):
            self._write(request, renew)
