"""A node's instances: the agent's state, its local decisions, and the one place that moves tiers.

The pool owns one `Instance` per EMI placed on this node. It:

- brings each instance to the resting tier the planner asked for (a FROZEN floor means: cold start once,
  then freeze, so the first request wakes from the snapshot instead of from nothing); an instance above it,
  woken by requests, goes down only as the idle policy says, however often the plan comes again;
- activates on demand: picks the instance of a model that is fastest to wake (HOT, then WARM, SUSPENDED,
  FROZEN, COLD; `device_hint` first when instances differ) and wakes it; a failed restore falls back to a
  cold start inside `Instance.to` and is counted here; activating a model of a chain (`chains`) starts the
  wakes of the chain's other models below HOT on the executor, beside this one, without waiting for them;
- every tick applies the local policy (`policy.plan_demotions`): idle instances go down a tier, budgets
  evict by LRU or hybrid; notices workers that died and restarts them; keeps the circuit breaker that
  stops snapshotting a model whose restores keep failing;
- hands the EMIs of model servers (`framework: server`) to `serverpool.ServerPool`, which runs them as server
  instances with the same activations, releases, idle demotion and views;
- with shared snapshots (`settings.shared.folder`), gives its instances the shared store (a COLD instance
  restores a compatible image another node published) and collects the store's garbage: images of versions no
  ModelSpec it was given has, and whatever exceeds the budget.

An instance's work folder (and the folder its GPU weights are parked in) is named by its model and a slot on
this node (`work_folder`), not by the instance: CRIU restores a process at the paths it had, so an image written
by replica `ms-0` on one node fits replica `ms-1` alone on another, in the same slot.

Every move of one instance happens under that instance's lock; different instances move in parallel on a
small thread pool. Nothing here knows about gRPC or HTTP: `server.py` and `local.py` wrap it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import pathlib
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from volga_agent import errors, metrics
from volga_agent.host import gpus as gpu_discovery
from volga_agent.host import process, tmpfs
from volga_agent.node import admission, chains, instance, policy, serverpool
from volga_agent.node.settings import Settings
from volga_agent.snapshot import criu, cuda, shared
from volga_agent.sources import cache
from volga_agent.worker import contract, protocol
from volga_core import api, planner

Tier = api.Tier
log = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")
SHARED_COLLECT_SEC = 60.0  # how often a tick collects the shared images' garbage
# What may stand in a work folder's name as it is; anything else in a model id or version becomes '_'.
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_FOLDER_PREFIX = 64  # longer: cut, with a digest of the whole (socket paths are short)


@dataclasses.dataclass(frozen=True)
class InstanceInfo:
    name: str
    model_id: str
    model_version: str
    tier: Tier
    device: str
    socket: str
    node: str
    snapshot_bytes: int
    last_used_unix: float
    last_wake_ms: float
    input_hash: str
    state_reason: str
    target_tier: Tier
    shared_snapshot: str = ""  # the shared image the worker was restored from, or the last one it published
    shared_snapshot_role: str = ""  # "restored" or "published"
    # What the worker's warm-up found, once it said (`warmup_reported`): why the made-up warm-up was skipped, how the
    # answers contradict the declared outputs ("" for none), and the shapes those outputs answer with (name, shape).
    warmup_reported: bool = False
    warmup_skipped: str = ""
    output_mismatch: str = ""
    answered_outputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # Where the model's bytes came from (the remote URI fetched into the model cache, else the model file) and their
    # content digest ("" for a node file no sourceDigest pins)
    source: str = ""
    source_digest: str = ""


@dataclasses.dataclass(frozen=True)
class Activation:
    instance: InstanceInfo
    woke_from: Tier
    wake_ms: float
    fallback: bool
    # The model's other HOT instances here (on the hinted device kind): requests may spread over them too.
    also: tuple[InstanceInfo, ...] = ()


@dataclasses.dataclass(frozen=True)
class NodeStatus:
    node: str
    host_memory_used_bytes: int
    gpu_memory_used_bytes: int
    snapshot_disk_used_bytes: int
    activations: int
    restore_failures: int
    evictions: int
    open_circuits: tuple[str, ...]


@dataclasses.dataclass
class Slot:
    inst: instance.Instance
    target: Tier
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    last_wake_ms: float = 0.0
    reason: str = ""
    requests_seen: int = 0
    gpu_bytes: int = 0  # what the worker last said it holds on the GPU while HOT
    last_used_unix: float = 0.0
    removed: bool = False


class Pool:
    def __init__(self, node: str, workroot: str | pathlib.Path, snapshot_root: str | pathlib.Path | None,
                 settings: Settings | None = None, agent_metrics: metrics.AgentMetrics | None = None,
                 gpus: Sequence[gpu_discovery.GpuInfo] = (), workers: int = 2) -> None:
        self.node = node
        self.workroot = pathlib.Path(workroot)
        self.workroot.mkdir(parents=True, exist_ok=True)
        self.settings = settings or Settings()
        self.metrics = agent_metrics or metrics.AgentMetrics()
        self.gpus = list(gpus)
        # What an agent killed before us left: its processes, then its instances' work folders.
        for pid in process.kill_orphans():
            log.warning("killed pid %d, left by an agent that is gone", pid)
        process.remove_abandoned(self.workroot.iterdir())
        self.criu: criu.CriuEngine | None = None
        if snapshot_root is not None:
            try:
                self.criu = criu.CriuEngine(snapshot_root, keep_failed=self.settings.keep_failed_restores,
                                            deadlines=criu.Deadlines(self.settings.criu.timeout_floor_sec,
                                                                     self.settings.criu.timeout_sec_per_gib),
                                            checksums=self.settings.verify_image_checksums,
                                            lazy_pages_server=self.settings.criu.lazy_pages_server,
                                            lazy_pages_threads=self.settings.criu.lazy_pages_threads or None,
                                            lazy_pages_fill=self.settings.criu.lazy_pages_fill)
            except criu.CriuError as exc:
                log.warning("FROZEN tier unavailable: %s", exc)
        # FROZEN GPU instances park their weights under the snapshot root: on huge pages where it may be.
        self._huge_parked = bool(self.gpus) and self.criu is not None and self.settings.parked_huge_pages and \
            tmpfs.mount_huge(self.criu.root / instance.PARKED)
        self.shared: shared.Context | None = None
        if self.settings.shared.folder and self.criu is not None:
            self.shared = shared.Context(shared.Store(self.settings.shared.folder), node, shared.NodeFacts(
                self.criu.version(), self.gpus[0].product if self.gpus else "",
                self.gpus[0].driver if self.gpus else ""))
        self._collected = float("-inf")
        self._specs: dict[tuple[str, str], str] = {}  # (model id, version) of every ModelSpec seen -> name
        self.driver: cuda.DriverCheckpoint | None = None
        if self.gpus:
            try:
                self.driver = cuda.DriverCheckpoint(restores_at_once=self.settings.gpu_restores_at_once,
                                                    lead=self.settings.gpu_restore_lead)
            except cuda.DriverCheckpointUnsupported as exc:
                log.warning("SUSPENDED tier unavailable: %s", exc)
        self.breaker = policy.CircuitBreaker.from_settings(self.settings)
        self.slots: dict[str, Slot] = {}
        self.failed: dict[str, str] = {}  # instances that could not even be created, and why
        self._failed_specs: dict[str, api.ModelSpecSpec] = {}  # ... and their ModelSpecs
        self._slots_lock = threading.Lock()
        self._closing: set[str] = set()  # work folders of instances being removed
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pool")
        self._pending: dict[str, concurrent.futures.Future[None]] = {}
        self.chains = chains.Chains()
        self._joint: dict[str, concurrent.futures.Future[None]] = {}  # chain members being woken with a peer
        self._eviction_times: collections.deque[float] = collections.deque()
        self.activations = 0
        self.evictions = 0
        self.servers = serverpool.ServerPool(node, self.workroot, self.criu, self.settings, self.metrics,
                                             self._executor, self.driver)
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        # Cluster mode sets it (`cluster.fetches`): model id -> an Event set once the model's remote source is on
        # this node and its instances exist; None when no fetch is under way for it. Activations wait on it.
        self.awaiting: Callable[[str], threading.Event | None] = lambda model_id: None

    # -- desired state -------------------------------------------------------------------------------

    def apply(self, desired: Sequence[planner.Desired], specs: Mapping[str, api.ModelSpecSpec]) -> None:
        """Make this node's instances match the plan: create, retarget, remove; moves run in background."""
        servers = {name for name, spec in specs.items() if serverpool.is_server(spec)}
        if servers or self.servers.slots or self.servers.failed:
            self.servers.apply([d for d in desired if d.model_spec in servers], specs)
            desired = [d for d in desired if d.model_spec not in servers]
            specs = {name: spec for name, spec in specs.items() if name not in servers}
        mine = {d.name: d for d in desired if d.node == self.node}
        self.chains = chains.Chains.of(specs.values())
        self._specs = {(spec.model_id, spec.version): name for name, spec in specs.items()}
        with self._slots_lock:
            stale = [name for name, slot in self.slots.items()
                     if name not in mine or slot.inst.spec != specs[mine[name].model_spec]]
        for name in stale:
            self.remove(name)  # gone from the plan, or its ModelSpec changed: replace it
        s = self.settings
        # Instances to move now: new ones, and those below their resting tier. One above it (a request woke it)
        # stays until the idle policy takes it down: in a cluster the same plan comes again with every watch
        # event, the agent's own status reports among them, and must not undo each wake.
        moving = []
        with self._slots_lock:
            for name, want in mine.items():
                slot = self.slots.get(name)
                if slot is not None:
                    slot.target = want.target_tier
                    if policy.is_colder(slot.inst.tier, self._allowed(slot, want.target_tier)):
                        moving.append(name)
                    continue
                spec = specs[want.model_spec]
                device = f"cuda:{want.gpu_index}" if spec.hardware.gpu and want.gpu_index is not None else "cpu"
                try:
                    admission.check_instance_name(name)
                    admission.check_source(spec, s.model_roots, s.allow_model_code)
                    if s.max_instances and len(self.slots) >= s.max_instances:
                        raise ValueError(f"settings.max_instances: this node runs at most {s.max_instances} instances")
                    inst = instance.Instance(name, spec, self._free_folder(spec), self.criu,
                                             self.driver if device != "cpu" else None, device,
                                             reuse_image_sec=self.settings.snapshot_interval_sec,
                                             lazy_restore=self.settings.lazy_restores,
                                             cpus=self._cpus(spec, want.gpu_index),
                                             warmup_cache_ratio=self.settings.warmup_cache_ratio,
                                             reset_rng_on_restore=self.settings.reset_rng_on_restore,
                                             verify_restores=self.settings.verify_restores,
                                             shared_store=self.shared,
                                             cuda_stack_bytes=self.settings.gpu_stack_bytes,
                                             worker_user=self.settings.worker_ids(),
                                             unprivileged_snapshots=self.settings.unprivileged_snapshots,
                                             model_roots=s.model_roots,
                                             graphs_in_images=self.settings.gpu_graphs_in_images)
                except (OSError, ValueError) as exc:
                    self.failed[name] = f"{type(exc).__name__}: {exc}"
                    self._failed_specs[name] = spec
                    log.error("%s: cannot create instance: %s", name, exc)
                    continue
                self.failed.pop(name, None)
                self._failed_specs.pop(name, None)
                self.slots[name] = Slot(inst, want.target_tier)
                moving.append(name)
        for name in moving:
            self.converge_async(name)

    def refuse(self, name: str, spec: api.ModelSpecSpec, reason: str) -> None:
        """An instance this node will not create, and why (a ModelSpec `volga up` could not load): listed and
        activated as one whose creation failed (`instances(include_failed=True)`, `pick`)."""
        with self._slots_lock:
            self.failed[name] = reason
            self._failed_specs[name] = spec

    def _free_folder(self, spec: api.ModelSpecSpec) -> pathlib.Path:
        """The work folder of a new instance of `spec`: its model's lowest slot that no live instance (nor one
        being removed) of this node holds. Called under the slots lock."""
        taken = {slot.inst.workdir.name for slot in self.slots.values()} | self._closing
        k = 0
        while work_folder(spec.model_id, spec.version, k) in taken:
            k += 1
        return self.workroot / work_folder(spec.model_id, spec.version, k)

    def _cpus(self, spec: api.ModelSpecSpec, gpu_index: int | None) -> tuple[int, ...]:
        """With numaAffinity, the CPUs of the NUMA node the instance's GPU hangs off (none when unknown)."""
        if not (spec.hardware.numa_affinity or self.settings.numa_affinity) or gpu_index is None:
            return ()
        node = next((g.numa_node for g in self.gpus if g.index == gpu_index), -1)
        return gpu_discovery.numa_cpus(node)

    def remove(self, name: str, keep_kept: bool = False) -> None:
        """Stop an instance and delete its snapshots; on a node-local shared store (settings.shared.node_local),
        also the kept images of its model once no instance of this node holds that model, unless `keep_kept`
        (the agent stopping: the next one restores them)."""
        with self._slots_lock:
            slot = self.slots.pop(name, None)
            if slot is None:
                return
            self._closing.add(slot.inst.workdir.name)  # its worker may still run there until close returns
        try:
            with slot.lock:
                slot.removed = True
                slot.inst.close()
        finally:
            with self._slots_lock:
                self._closing.discard(slot.inst.workdir.name)
        if not keep_kept:
            self._forget_kept(slot.inst.spec.model_id)

    def _forget_kept(self, model_id: str) -> None:
        if self.shared is None or not self.settings.shared.node_local:
            return
        with self._slots_lock:
            if any(s.inst.spec.model_id == model_id for s in self.slots.values()):
                return
        for entry in self.shared.store.entries():
            if entry.model_id == model_id:
                self.shared.store.discard(entry.digest)

    def converge_async(self, name: str) -> concurrent.futures.Future[None]:
        future = self._pending.get(name)
        if future is not None and not future.done():
            return future
        future = self._executor.submit(self._converge, name)
        self._pending[name] = future
        return future

    def _converge(self, name: str) -> None:
        slot = self.slots.get(name)
        if slot is None:
            return
        with slot.lock:
            if slot.removed:
                return
            target = self._allowed(slot, slot.target)
            try:
                self._walk(slot, target)
                slot.reason = ""
            except Exception as exc:  # an instance that cannot reach its tier must not stop the others
                slot.reason = f"{type(exc).__name__}: {exc}"
                log.warning("%s: could not reach %s: %s", name, target.value, exc)

    def _allowed(self, slot: Slot, target: Tier) -> Tier:
        """The tier we may actually use: no GPU tiers on CPU, no snapshots while the breaker is open."""
        if target in (Tier.WARM, Tier.SUSPENDED) and not slot.inst.gpu:
            target = Tier.FROZEN
        if target == Tier.FROZEN and slot.inst.criu is None:
            target = Tier.COLD
        # Only an open breaker keeps snapshots off here: the half-open attempt is a wake's (activate) to take.
        state = self.breaker.state(slot.inst.spec.model_id, time.monotonic())
        if target in (Tier.SUSPENDED, Tier.FROZEN) and state is policy.BreakerState.OPEN:
            target = Tier.HOT if slot.inst.tier == Tier.HOT else Tier.COLD
        return target

    def _walk(self, slot: Slot, target: Tier) -> instance.Transition | None:
        """Move along legal edges (an illegal step goes through HOT, which reaches every tier); the last move."""
        inst = slot.inst
        last = None
        if inst.tier != target and target not in instance.LEGAL[inst.tier]:
            last = self._move(slot, Tier.HOT)
        if inst.tier != target:
            last = self._move(slot, target)
        return last

    def _move(self, slot: Slot, target: Tier) -> instance.Transition:
        inst = slot.inst
        model = inst.spec.model_id
        source = inst.tier
        lazy_failures = inst.lazy_restore_failures
        shared_counts = inst.shared_restores, inst.shared_restore_failures, inst.shared_publishes
        warmup_counts = inst.warmups_skipped, inst.output_mismatches
        try:
            transition = inst.to(target)
        finally:
            self._count_warmups(inst, *warmup_counts)
        if inst.lazy_restore_failures > lazy_failures:
            self.metrics.lazy_restore_failures.labels(model).inc()
        self._count_shared(inst, *shared_counts)
        ms = transition.seconds * 1e3
        self.metrics.transition_latency.labels(source.value, transition.target.value, model).observe(ms)
        if transition.target == Tier.HOT and source in (Tier.WARM, Tier.SUSPENDED, Tier.FROZEN):
            if transition.fallback:
                self.metrics.restore_failures.labels(source.value, model).inc()
                self.breaker.record_failure(model, time.monotonic())
                self._publish_breaker(model, time.monotonic())
            else:
                self.metrics.restore_latency.labels(source.value, model).observe(ms)
                for phase, seconds in transition.phases.items():
                    self.metrics.wake_phase_latency.labels(source.value, phase, model).observe(seconds * 1e3)
                self.breaker.record_success(model)
        return transition

    def _count_warmups(self, inst: instance.Instance, skipped: int, mismatches: int) -> None:
        if inst.warmups_skipped > skipped:
            self.metrics.warmup_skipped.labels(inst.spec.model_id).inc(inst.warmups_skipped - skipped)
        if inst.output_mismatches > mismatches:
            self.metrics.output_shape_mismatches.labels(inst.spec.model_id).inc(inst.output_mismatches - mismatches)

    def _count_shared(self, inst: instance.Instance, restores: int, failures: int, publishes: int) -> None:
        self.metrics.shared_restores.labels(inst.spec.model_id).inc(inst.shared_restores - restores)
        self.metrics.shared_restore_failures.labels(inst.spec.model_id).inc(inst.shared_restore_failures - failures)
        self.metrics.shared_publishes.labels(inst.spec.model_id).inc(inst.shared_publishes - publishes)

    def collect_shared(self, now: float | None = None) -> list[str]:
        """Remove shared images of versions no ModelSpec has (after the grace period) and keep the store within
        its budget; only once this pool has been told the ModelSpecs."""
        if self.shared is None or not self._specs:
            return []
        s = self.settings.shared
        return self.shared.store.collect(self._specs, {model for model, _ in self._specs},
                                         s.grace_sec, s.budget_bytes, now)

    def shared_images(self) -> list[shared.Entry]:
        return self.shared.store.entries() if self.shared is not None else []

    def shared_entry(self, digest: str) -> shared.Entry | None:
        return self.shared.store.entry(digest) if self.shared is not None and digest else None

    # -- the request path ----------------------------------------------------------------------------

    def pick(self, model_id: str, name: str = "", device_hint: str = "") -> Slot:
        with self._slots_lock:
            slots = [s for s in self.slots.values() if s.inst.spec.model_id == model_id and (not name or
                                                                                          s.inst.name == name)]
        if not slots:
            with self._slots_lock:
                failed = [(n, why) for n, why in sorted(self.failed.items())
                          if (spec := self._failed_specs.get(n)) is not None and spec.model_id == model_id
                          and (not name or n == name)]
            if failed:  # the model's only instances are those that could not be created: say why
                raise errors.ActivationFailed(f"no instance of model {model_id!r} could be created on node "
                                              f"{self.node}: " + "; ".join(f"{n}: {why}" for n, why in failed))
            raise errors.UnknownModel(f"no instance of model {model_id!r} on node {self.node}")

        def rank(slot: Slot) -> tuple[int, int, str]:
            device = slot.inst.device
            hinted = 0 if not device_hint or device_hint in (device, gpu_discovery.kind_of(device, self.gpus)) else 1
            return hinted, policy.RANK[slot.inst.tier], slot.inst.name

        return min(slots, key=rank)

    def activate(self, model_id: str, name: str = "", device_hint: str = "", joint: bool = True) -> Activation:
        """Bring the best instance of the model to HOT and say where it listens; with `joint`, the other models
        of its chain start waking too, in parallel, and this call does not wait for them. A model server's is
        kept HOT until `release`."""
        if self.servers.serves(model_id):
            return self._activate_server(model_id, name)
        slot = self.pick(model_id, name, device_hint)
        if joint:
            self._wake_peers(model_id, device_hint)
        with slot.lock:
            inst = slot.inst
            if slot.removed:
                raise errors.UnknownModel(f"instance {inst.name} was removed")
            source = inst.tier
            if source == Tier.HOT and inst.worker_gone():
                self._worker_died(slot)
                source = inst.tier
            wake_ms, fallback = 0.0, False
            if source != Tier.HOT:
                if source in (Tier.SUSPENDED, Tier.FROZEN) and self.breaker.is_open(model_id, time.monotonic()):
                    self._move(slot, Tier.COLD)  # restores keep failing for this model: straight to a cold start
                try:
                    transition = self._move(slot, Tier.HOT)
                except (process.WorkerStartError, protocol.WorkerError, protocol.ProtocolError, OSError,
                        criu.CriuCancelled) as exc:
                    slot.reason = f"ActivationFailed: {exc}"
                    raise errors.ActivationFailed(f"{inst.name}: {exc}") from exc
                wake_ms, fallback = transition.seconds * 1e3, transition.fallback
                slot.last_wake_ms = wake_ms
                self.activations += 1
                self.metrics.activations.labels(source.value, model_id).inc()
                slot.reason = "RestoreFailed" if fallback else ""
            inst.last_used = time.monotonic()
            slot.last_used_unix = time.time()
            activated = self._info(slot)
        return Activation(activated, source, wake_ms, fallback, () if name else self._hot_besides(slot))

    def _activate_server(self, model_id: str, name: str) -> Activation:
        activated = self.servers.activate(model_id, name)
        if activated.woke_from is not Tier.HOT:
            self.activations += 1
        return Activation(self._server_info(activated.slot), activated.woke_from, activated.wake_ms,
                          activated.fallback)

    def _server_info(self, slot: serverpool.ServerSlot) -> InstanceInfo:
        """A server's view; its `socket` is where it listens (`api.listen_address`: http://127.0.0.1:PORT or unix:PATH,
        and an oip-grpc server's gRPC address)."""
        inst = slot.inst
        return InstanceInfo(
            name=inst.name, model_id=inst.spec.model_id, model_version=inst.spec.version, tier=inst.tier,
            device="cpu", socket=inst.address, node=self.node,
            snapshot_bytes=inst.image.size_bytes if inst.image else 0, last_used_unix=slot.last_used_unix,
            last_wake_ms=slot.last_wake_ms, input_hash="", state_reason=slot.reason, target_tier=slot.target,
            source=cache.origin(inst.spec.source) or inst.spec.source, source_digest=inst.spec.source_digest or "")

    def _hot_besides(self, chosen: Slot) -> tuple[InstanceInfo, ...]:
        """The model's instances other than `chosen` that are HOT now, with a live worker, on the device kind of
        `chosen` (so of the hinted one, when a hint chose it), and not moving."""
        kind = gpu_discovery.kind_of(chosen.inst.device, self.gpus)
        with self._slots_lock:
            others = [s for s in self.slots.values() if s is not chosen and not s.removed
                      and s.inst.spec.model_id == chosen.inst.spec.model_id]
        found = []
        for slot in sorted(others, key=lambda s: s.inst.name):
            if slot.inst.tier != Tier.HOT or gpu_discovery.kind_of(slot.inst.device, self.gpus) != kind:
                continue
            if not slot.lock.acquire(blocking=False):
                continue  # on its way somewhere: not a place to send requests to now
            try:
                if slot.inst.tier == Tier.HOT and not slot.removed and not slot.inst.worker_gone():
                    found.append(self._info(slot))
            finally:
                slot.lock.release()
        return tuple(found)

    def _wake_peers(self, model_id: str, device_hint: str) -> None:
        """Start waking the chain's other models that have an instance here and none settled HOT, once each at a
        time. An instance HOT while it moves (its lock held: a walk through HOT to its resting tier) is not settled:
        the wake waits for the move and brings it back."""
        for peer in self.chains.peers(model_id):
            with self._slots_lock:
                peers = [s for s in self.slots.values() if s.inst.spec.model_id == peer and not s.removed]
                pending = self._joint.get(peer)
                settled = any(s.inst.tier == Tier.HOT and not s.lock.locked() for s in peers)
                if not peers or settled or (pending is not None and not pending.done()):
                    continue
                self._joint[peer] = self._executor.submit(self._joint_wake, peer, device_hint)

    def _joint_wake(self, model_id: str, device_hint: str) -> None:
        try:
            self.activate(model_id, "", device_hint, joint=False)
        except Exception as exc:  # the request for it, when it comes, wakes it again and reports the failure
            log.warning("%s: waking it with its chain failed: %s", model_id, exc)

    def wake(self, model_id: str) -> Activation:
        """`activate` for a caller that sends no request (the autonomy loop's preload): a model server's activation
        is given back at once, so that it counts as idle from its wake on and goes back to its floor once idle."""
        activated = self.activate(model_id)
        if self.servers.owns(activated.instance.name):
            self.servers.release(activated.instance.name)
        return activated

    def release(self, name: str) -> None:
        """The caller is done with it: it counts as idle from now on, and the policy demotes it next tick. A model
        server counts as idle from now on once no other activation holds it."""
        if self.servers.owns(name):
            self.servers.release(name)
            return
        with self._slots_lock:
            slot = self.slots.get(name)
        if slot is None:
            raise errors.UnknownModel(f"no instance {name!r} on node {self.node}")
        slot.inst.last_used = float("-inf")

    def move_to(self, name: str, target: Tier) -> instance.Transition | None:
        """Move one instance now (the node's autonomy loop, operators' tools, demos, benchmarks); None when it is
        already there. A model server's goes to `ServerPool.move_to` (down its own ladder)."""
        if self.servers.owns(name):
            return self.servers.move_to(name, target)
        slot = self.slots.get(name)
        if slot is None:
            raise errors.UnknownModel(f"no instance {name!r} on node {self.node}")
        with slot.lock:
            return self._walk(slot, target)

    def _worker_died(self, slot: Slot) -> None:
        inst = slot.inst
        log.warning("%s: worker %s died while %s", inst.name, inst.pid, inst.tier.value)
        self.metrics.worker_deaths.labels(inst.spec.model_id).inc()
        inst.to(Tier.COLD)
        slot.reason = "WorkerDied"

    # -- views ---------------------------------------------------------------------------------------

    def _info(self, slot: Slot) -> InstanceInfo:
        inst = slot.inst
        return InstanceInfo(
            name=inst.name, model_id=inst.spec.model_id, model_version=inst.spec.version, tier=inst.tier,
            device=inst.device, socket=inst.config.socket, node=self.node,
            snapshot_bytes=inst.image.size_bytes if inst.image else 0, last_used_unix=slot.last_used_unix,
            last_wake_ms=slot.last_wake_ms, input_hash=inst.spec.input_hash(), state_reason=slot.reason,
            target_tier=slot.target, shared_snapshot=inst.shared_from or inst.shared_published,
            shared_snapshot_role="restored" if inst.shared_from else "published" if inst.shared_published else "",
            source=cache.origin(inst.spec.source) or inst.spec.source, source_digest=inst.spec.source_digest or "",
            **_warmup_fields(inst.warmup))

    def instances(self, model_id: str = "", include_failed: bool = False) -> list[InstanceInfo]:
        """Every instance (of one model); with `include_failed`, also those that could not be created, as COLD
        with the reason."""
        with self._slots_lock:
            slots = sorted(self.slots.values(), key=lambda s: s.inst.name)
            failed = [(n, self._failed_specs[n], why) for n, why in sorted(self.failed.items())
                      if include_failed and n in self._failed_specs]
        infos = [self._info(s) for s in slots if not model_id or s.inst.spec.model_id == model_id]
        infos += [self._server_info(s) for _, s in sorted(self.servers.slots.copy().items())
                  if not model_id or s.inst.spec.model_id == model_id]
        failed += [(n, spec, why) for n, (spec, why) in sorted(self.servers.failed.copy().items()) if include_failed]
        return infos + [InstanceInfo(name, spec.model_id, spec.version, Tier.COLD, "", "", self.node, 0, 0.0, 0.0,
                                     spec.input_hash(), f"cannot create the instance: {why}", Tier.COLD)
                        for name, spec, why in failed if not model_id or spec.model_id == model_id]

    def usage(self, views: Sequence[policy.InstanceView] | None = None) -> policy.Usage:
        host = gpu = disk = 0
        for view in self._views() if views is None else views:
            host, gpu, disk = host + view.host_bytes, gpu + view.gpu_bytes, disk + view.snapshot_bytes
        return policy.Usage(host, gpu, disk, sum(g.memory_total_bytes for g in self.gpus) if self.driver else 0)

    def status(self) -> NodeStatus:
        usage = self.usage()
        return NodeStatus(self.node, usage.host_bytes, usage.gpu_bytes, usage.snapshot_bytes, self.activations,
                          sum(s.inst.restore_failures for s in list(self.slots.values()))
                          + self.servers.restore_failures(), self.evictions,
                          tuple(self.breaker.open_keys(time.monotonic())))

    def _views(self) -> list[policy.InstanceView]:
        views = []
        for slot in list(self.slots.values()):
            inst = slot.inst
            host = _rss(inst.pid) if inst.pid is not None else 0
            # WARM keeps only the context and SUSPENDED nothing; the context is left out of the estimate.
            gpu_bytes = slot.gpu_bytes if inst.tier == Tier.HOT else 0
            views.append(policy.InstanceView(
                name=inst.name, model_id=inst.spec.model_id, tier=inst.tier,
                gpu=inst.gpu, last_used=inst.last_used,
                host_bytes=host, gpu_bytes=gpu_bytes, snapshot_bytes=inst.image.size_bytes if inst.image else 0,
                floor_tier=None if slot.target == Tier.COLD else slot.target, busy=slot.lock.locked(),
                chain=self.chains.head(inst.spec.model_id)))
        return views

    # -- the local control loop ----------------------------------------------------------------------

    def tick(self, now: float | None = None) -> list[policy.Move]:
        """One round of local decisions: dead workers, usage, demotions and evictions, gauges."""
        now = time.monotonic() if now is None else now
        for slot in list(self.slots.values()):
            self._observe(slot)
        views = self._views()
        moves = policy.plan_demotions(views, self.settings, now, self.usage(views))
        for move in moves:
            self._executor.submit(self._demote, move)
        self.servers.tick()
        self._publish(now)
        if self.shared is not None and now - self._collected >= SHARED_COLLECT_SEC:
            self._collected = now
            self._executor.submit(self.collect_shared)
        return moves

    def _observe(self, slot: Slot) -> None:
        """Notice dead workers and requests that went to the worker directly (from gateways)."""
        if not slot.lock.acquire(blocking=False):
            return
        try:
            inst = slot.inst
            if inst.tier in (Tier.HOT, Tier.WARM, Tier.SUSPENDED) and inst.pid is not None:
                if inst.worker_gone():
                    self._worker_died(slot)
                    self.converge_async(inst.name)
                    return
                if inst.tier == Tier.HOT:
                    try:
                        stats = inst.client().call("stats").header
                    except (OSError, protocol.ProtocolError, protocol.WorkerError):
                        inst.disconnect()
                        return
                    seen = int(stats.get("requests", 0))
                    slot.gpu_bytes = int(stats.get("gpu_allocated_bytes", 0))
                    if seen != slot.requests_seen:
                        slot.requests_seen = seen
                        inst.last_used = time.monotonic()
                        slot.last_used_unix = time.time()
        finally:
            slot.lock.release()

    def _demote(self, move: policy.Move) -> None:
        slot = self.slots.get(move.instance)
        if slot is None:
            return
        with slot.lock:
            if slot.removed or not policy.is_colder(move.target, slot.inst.tier):
                return
            target = self._allowed(slot, move.target)
            if not policy.is_colder(target, slot.inst.tier):
                return
            try:
                self._walk(slot, target)
            except Exception as exc:
                slot.reason = f"{move.reason}: {type(exc).__name__}: {exc}"
                if target in (Tier.SUSPENDED, Tier.FROZEN):
                    self.breaker.record_failure(slot.inst.spec.model_id, time.monotonic())
                log.warning("%s: demotion to %s failed: %s", move.instance, target.value, exc)
                return
        if move.reason != "Idle":
            self.evictions += 1
            self.metrics.evictions.labels(move.reason).inc()
            self._eviction_times.append(time.monotonic())

    def _publish(self, now: float) -> None:
        tiers = [s.inst.tier for s in list(self.slots.values())]
        counts = collections.Counter(tiers + [s.inst.tier for s in list(self.servers.slots.values())])
        for tier in Tier:
            self.metrics.emis_active.labels(tier.value).set(counts.get(tier, 0))
        while self._eviction_times and self._eviction_times[0] < now - 60:
            self._eviction_times.popleft()
        self.metrics.eviction_rate.set(len(self._eviction_times))
        self.metrics.snapshot_bytes.set(sum(s.inst.image.size_bytes for s in list(self.slots.values())
                                            if s.inst.image))
        for model in {s.inst.spec.model_id for s in list(self.slots.values())}:
            self._publish_breaker(model, now)

    def _publish_breaker(self, model: str, now: float) -> None:
        # state(), not is_open(): reading must not use up the one attempt a half-open breaker allows.
        self.metrics.circuit_open.labels(model).set(int(self.breaker.state(model, now) is policy.BreakerState.OPEN))

    def start(self, interval: float = 1.0) -> None:
        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.tick()
                except Exception:
                    log.exception("pool tick failed")

        self._ticker = threading.Thread(target=loop, name="pool-tick", daemon=True)
        self._ticker.start()

    def wait_converged(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for future in [*self._pending.values(), *self._joint.values()]:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        self.servers.wait_converged(max(0.0, deadline - time.monotonic()))

    def interrupt(self) -> None:
        """The agent is stopping: CRIU calls in flight are killed (their wakes fail at once), none start."""
        self._stop.set()
        if self.criu is not None:
            self.criu.close()

    def close(self) -> None:
        """Stop every worker and remove every snapshot this pool made (the kept images of a node-local shared
        store stay for the next agent)."""
        self.interrupt()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        self._executor.shutdown(wait=True, cancel_futures=True)
        for name in list(self.slots):
            self.remove(name, keep_kept=True)
        self.servers.close()
        if self._huge_parked and self.criu is not None:
            tmpfs.unmount(self.criu.root / instance.PARKED)


def _warmup_fields(report: contract.WarmupReport | None) -> dict[str, Any]:
    """An instance view's warm-up fields from the worker's report (None: not told yet)."""
    if report is None:
        return {}
    return {"warmup_reported": True, "warmup_skipped": report.skipped, "output_mismatch": report.mismatch,
            "answered_outputs": report.answered}


def work_folder(model_id: str, version: str, slot: int) -> str:
    """The name of the work folder of slot `slot` of a model version on a node, e.g. `resnet-v1-0`: the same on
    every node, whichever instance holds it. Characters a path must not hold become '_', and a long name is cut
    and ends with a digest of the whole, so the name is always one plain path component."""
    whole = f"{model_id}-v{version}"
    prefix = _UNSAFE.sub("_", whole)
    if len(prefix) > MAX_FOLDER_PREFIX:
        prefix = f"{prefix[:MAX_FOLDER_PREFIX - 17]}-{hashlib.sha256(whole.encode()).hexdigest()[:16]}"
    return f"{prefix}-{slot}"


def _rss(pid: int) -> int:
    try:
        return int(pathlib.Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0
