"""The node autonomy loop: the sampler's windows through the decider, and the decisions applied.

Wakes (`Preload`) and demotions (`Demote`) go to the pool (`Pool.activate`, `Pool.move_to`) on a small thread pool
of their own, one at a time per model, so that a CRIU restore never holds up the next decision. A model's CPU
priority (`LowerPriority`, `RestorePriority`) is set on its HOT workers' threads right away, a few system calls
after the decision and outside it (`priority`); workers that wake while their model yields are lowered after the
next window, and every lowered worker gets its normal priority back when the loop stops. A throttled model's
(`Throttle`, `Unthrottle`) HOT workers are stopped and continued by a duty cycle on a thread of its own
(`throttle.DutyCycle`), which holds an instance's lock while its worker is stopped, so that no tier move finds it
stopped, and continues every worker when the loop stops. Batch caps and
shedding go to the gateway, which the loop knows only as the `Gateway` protocol: the gateway's data plane
provides those four methods, and the autonomy package imports nothing of the gateway (docs/architecture.md).

Model servers (`framework: server`, the pool's `ServerPool`) are models like the others in the decider's views, their
load counted by the gateway's proxies: a preload wakes one (`Pool.wake`, no activation held) and a demotion takes it
down its own ladder (`Pool.move_to`), and a lowered CPU priority reaches every thread of every process of its tree
(a server restored from an image taken while it yielded is set back to normal by its instance), and shedding goes to
the gateway as a built-in model's does (its proxies refuse a shed server's requests before any wake, with the same
retry hint). A throttled server's HOT tree is stopped and continued whole, as a process group (the server is a
session of its own), by the same duty cycle, which holds the instance's stop gate while it is stopped: a move waits
for the tree to be continued, and no tree is stopped while a move is under way (`ServerInstance.stoppable`), so no
image records a stopped tree. What does not apply to a server is skipped, logged at debug level: batch caps (a server
batches itself; its view's batch limit is 1, so the decider never picks it to lower one).

For the cluster tier the loop keeps its `Standing` (state, since when, the node's memory) for the agent's heartbeat
to publish, and holds the cluster's watermarks the operator published (`cluster`), which its debug lines show.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from volga_agent import errors, metrics
from volga_agent.autonomy import decider, sampler
from volga_agent.autonomy import window as windows
from volga_agent.host import gpus, priority, process, throttle
from volga_agent.node import pool, server
from volga_agent.node.settings import Settings
from volga_core import api, nodes

log = logging.getLogger(__name__)
DEBUG_EVERY_S = 0.1


@dataclasses.dataclass(frozen=True)
class Standing:
    """The loop's state as the cluster sees it: since when (unix seconds) and the node's memory use (percent)."""

    state: decider.State
    since: float
    memory_pct: float


class Gateway(Protocol):
    """What the loop needs of the node's gateway."""

    def set_batch_cap(self, model: str, cap: int | None) -> None: ...

    def shed(self, model: str, retry_after_ms: int) -> None: ...

    def unshed(self, model: str) -> None: ...

    def drain_load(self) -> Mapping[str, windows.LoadReading]: ...


class Actuator(Protocol):
    """Where decisions take effect."""

    def preload(self, model: str) -> None: ...

    def demote(self, model: str, tier: api.Tier) -> None: ...

    def set_batch_cap(self, model: str, cap: int | None) -> None: ...

    def shed(self, model: str, retry_after_ms: int) -> None: ...

    def unshed(self, model: str) -> None: ...

    def lower_priority(self, model: str, nice: int) -> None: ...

    def restore_priority(self, model: str) -> None: ...

    def throttle(self, model: str, share: float) -> None: ...

    def unthrottle(self, model: str) -> None: ...

    def refresh(self) -> None:
        """The pool's workers may have changed (woken, frozen, restored)."""


class PoolActuator:
    """Wakes and demotions through the pool (in the background, one in flight per model); batch caps and shedding
    through the gateway, when there is one."""

    def __init__(self, node_pool: pool.Pool, gateway: Gateway | None = None, workers: int = 2) -> None:
        self.pool = node_pool
        self.gateway = gateway
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="autonomy")
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self._yielding: dict[str, int] = {}  # model -> the nice its workers run at
        self._lowered: dict[int, tuple[str, int | None]] = {}  # worker PID -> (model, its start time)
        self._throttled: dict[str, float] = {}  # model -> the share of each period its workers are stopped
        self._throttled_slots: dict[str, tuple[int, ...]] = {}  # model -> the slots its duty cycle covers (ids)
        settings = node_pool.settings.autonomy
        # Guarded where the gateway is in this process and says when protected work is in flight.
        self._guarded = gateway if settings.throttle_guard and hasattr(gateway, "set_guard") else None
        if settings.throttle_guard and self._guarded is None and settings.throttle_share:
            log.warning("autonomy: autonomy_throttle_guard needs the gateway in the agent's process; the throttle "
                        "stops co-runners by the plain duty cycle")
        self.cycle = throttle.DutyCycle(settings.throttle_period_ms / 1e3, guarded=self._guarded is not None)
        if self._guarded is not None:
            self._guarded.set_guard(self.cycle)

    def _once(self, model: str, work: Callable[[], None]) -> None:
        with self._lock:
            if model in self._busy:
                return
            self._busy.add(model)

        def run() -> None:
            try:
                work()
            except Exception as exc:  # the loop goes on; the pool counts and reports the failure
                log.warning("autonomy: %s: %s", model, exc)
            finally:
                with self._lock:
                    self._busy.discard(model)

        self._executor.submit(run)

    def preload(self, model: str) -> None:
        self._once(model, lambda: self._wake(model))

    def _wake(self, model: str) -> None:
        try:
            self.pool.wake(model)
        except errors.UnknownModel:
            return

    def demote(self, model: str, tier: api.Tier) -> None:
        def move() -> None:
            for info in self.pool.instances(model):
                if info.tier == api.Tier.HOT:
                    try:
                        self.pool.move_to(info.name, tier)
                    except server.Busy as exc:  # a model server answering a request that came after the window
                        log.info("autonomy: %s not demoted: %s", info.name, exc)

        self._once(model, move)

    def _not_applied(self, model: str, what: str) -> bool:
        """Whether the model is a model server, to which `what` does not apply (logged at debug level)."""
        if not self.pool.servers.serves(model):
            return False
        log.debug("autonomy: %s is a model server: %s not applied", model, what)
        return True

    def set_batch_cap(self, model: str, cap: int | None) -> None:
        if self.gateway is not None and not self._not_applied(model, "batch cap (a server batches itself)"):
            self.gateway.set_batch_cap(model, cap)

    def shed(self, model: str, retry_after_ms: int) -> None:
        if self.gateway is not None:  # a model server's too: its proxies refuse its requests as `observe` does
            self.gateway.shed(model, retry_after_ms)

    def unshed(self, model: str) -> None:
        if self.gateway is not None:
            self.gateway.unshed(model)

    def lower_priority(self, model: str, nice: int) -> None:
        self._yielding[model] = nice
        self._lower(model, nice)

    def _hot(self, model: str) -> list[int]:
        """The processes of the model's HOT instances: each worker, and every process of each server's tree."""
        pids = []
        for slot in list(self.pool.slots.values()):
            inst = slot.inst
            if inst.spec.model_id == model and inst.pid is not None and inst.tier == api.Tier.HOT:
                pids.append(inst.pid)
        for server_slot in list(self.pool.servers.slots.values()):
            served = server_slot.inst
            pid = served.pid
            if served.spec.model_id == model and pid is not None and served.tier == api.Tier.HOT:
                pids += process.tree(pid)
        return pids

    def _lower(self, model: str, nice: int) -> None:
        for pid in self._hot(model):
            if pid in self._lowered:
                continue
            started = process.start_time(pid)
            try:
                applied = priority.set_nice(pid, nice, idle=self.pool.settings.autonomy.yield_sched_idle)
            except ProcessLookupError:
                continue
            except PermissionError as exc:
                log.warning("autonomy: %s yields no CPU: %s", model, exc)
                continue
            self._lowered[pid] = (model, started)
            log.info("autonomy: %s yields the CPU: worker %d at nice %d%s (%d threads%s)", model, pid, nice,
                     " under SCHED_IDLE" if self.pool.settings.autonomy.yield_sched_idle else "", applied.threads,
                     ", its session's group too" if applied.group else "")

    def restore_priority(self, model: str) -> None:
        self._yielding.pop(model, None)
        for pid, (owner, started) in list(self._lowered.items()):
            if owner == model:
                self._give_back(pid, started)

    def _give_back(self, pid: int, started: int | None) -> None:
        model, _ = self._lowered.pop(pid)
        if process.start_time(pid) != started:
            return  # gone: a restored worker is given its normal priority by its instance
        try:
            priority.restore(pid)
        except ProcessLookupError:
            return
        except PermissionError as exc:
            log.warning("autonomy: %s: worker %d keeps its lowered priority: %s", model, pid, exc)
            return
        log.info("autonomy: %s: worker %d back at normal priority", model, pid)

    def throttle(self, model: str, share: float) -> None:
        self._throttled[model] = share
        self._throttled_slots.pop(model, None)
        self._cover(model, share)
        log.info("autonomy: %s is throttled: its HOT workers and server trees stopped %.0f%% of every %g ms", model,
                 share * 100, self.cycle.period * 1e3)

    def _cover(self, model: str, share: float) -> None:
        """The model's instances in its duty cycle; a worker that wakes, or is restored, is covered as it is (the
        cycle reads the PID under the instance's lock), so only instances that came or went change it."""
        slots = [slot for slot in list(self.pool.slots.values()) if slot.inst.spec.model_id == model]
        servers = [slot for slot in list(self.pool.servers.slots.values())
                   if slot.inst.spec.model_id == model and not slot.removed]
        ids = tuple(id(slot) for slot in [*slots, *servers])
        if self._throttled_slots.get(model) == ids:
            return
        self._throttled_slots[model] = ids
        self.cycle.set(model, [throttle.Target(slot.lock, functools.partial(_running, slot), share)
                               for slot in slots]
                       + [throttle.Target(slot.inst.stop_gate, slot.inst.stoppable, share) for slot in servers])

    def unthrottle(self, model: str) -> None:
        self._throttled.pop(model, None)
        self._throttled_slots.pop(model, None)
        self.cycle.drop(model)
        log.info("autonomy: %s is no longer throttled", model)

    def refresh(self) -> None:
        live = {slot.inst.pid for slot in list(self.pool.slots.values())}
        if self._lowered:
            for server_slot in list(self.pool.servers.slots.values()):
                if (pid := server_slot.inst.pid) is not None:
                    live.update(process.tree(pid))
        for pid in [pid for pid in self._lowered if pid not in live]:
            del self._lowered[pid]  # frozen or gone: a restored worker starts at normal priority
        for model, nice in self._yielding.items():
            self._lower(model, nice)
        for model, share in self._throttled.items():
            self._cover(model, share)

    def close(self) -> None:
        self._throttled.clear()
        if self._guarded is not None:
            self._guarded.set_guard(None)
        self.cycle.close()
        self._yielding.clear()
        for pid, (_, started) in list(self._lowered.items()):
            self._give_back(pid, started)
        self._executor.shutdown(wait=True, cancel_futures=True)


def apply(action: decider.Action, actuator: Actuator) -> None:
    match action:
        case decider.Preload(model):
            actuator.preload(model)
        case decider.Demote(model, tier):
            actuator.demote(model, tier)
        case decider.LowerBatchCap(model, cap):
            actuator.set_batch_cap(model, cap)
        case decider.RestoreBatchCap(model):
            actuator.set_batch_cap(model, None)
        case decider.Shed(model, retry_after_ms):
            actuator.shed(model, retry_after_ms)
        case decider.Unshed(model):
            actuator.unshed(model)
        case decider.LowerPriority(model, nice):
            actuator.lower_priority(model, nice)
        case decider.RestorePriority(model):
            actuator.restore_priority(model)
        case decider.Throttle(model, share):
            actuator.throttle(model, share)
        case decider.Unthrottle(model):
            actuator.unthrottle(model)


def _running(slot: pool.Slot) -> int | None:
    """The worker of a HOT instance, the one a duty cycle may stop (read under the instance's lock)."""
    inst = slot.inst
    return inst.pid if inst.tier == api.Tier.HOT and not slot.removed else None


# model id -> baselines measured on the cluster (the ModelSpec status' `calibrated` entries of its current version):
# the same mapping while none changed.
Measured = Callable[[], Mapping[str, Sequence[api.Calibration]]]
NONE_MEASURED: Mapping[str, Sequence[api.Calibration]] = types.MappingProxyType({})


class Views:
    """The decider's view of each model on the node, read from the pool for every window: the same mapping (the
    same objects) while no model came, went, woke or slept, so that the decider keeps what it worked out of them;
    the baselines that hold for a ModelSpec are worked out once per ModelSpec. Where a ModelSpec's own baselines
    do not hold (none, or of another version), those `measured` for this node's device kind (GPU product or cpu)
    and the ModelSpec's version and input hash do: in a cluster, its status.calibrated.

    A chain's head that names an `ensemble` adds a view of the ensemble: the head's `slo` is the chain's end-to-end
    contract (docs/models.md, "Chains"), so the ensemble is held to the head's own baselines (those measured on the
    cluster time the head alone, and do not count for it) and tolerance."""

    def __init__(self, node_pool: pool.Pool, measured: Measured | None = None) -> None:
        self.pool = node_pool
        self.measured = measured
        self._cache: dict[str, tuple[api.ModelSpecSpec, object, decider.ModelView]] = {}
        self._key: tuple[object, tuple[tuple[str, int, bool, bool], ...]] = (None, ())
        self._views: dict[str, decider.ModelView] = {}
        self._ensembles: dict[str, tuple[api.ModelSpecSpec, int, decider.ModelView]] = {}

    def _ensemble(self, name: str, head: api.ModelSpecSpec, specs: Mapping[str, api.ModelSpecSpec]
                  ) -> decider.ModelView:
        """The view of the head's ensemble `name`: its batch limit is the smallest of its models' on the node."""
        members = (head.model_id, *head.chain)
        max_batch = min(specs[m].runtime.max_batch_size for m in members if m in specs)
        cached = self._ensembles.get(name)
        if cached is None or cached[0] is not head or cached[1] != max_batch:
            own = decider.ModelView.of(head, False, False)
            cached = self._ensembles[name] = (head, max_batch, decider.ModelView(
                name, head.slo, own.baselines, False, False, max_batch, members))
        return cached[2]

    def _view(self, spec: api.ModelSpecSpec, device: str, measured: Sequence[api.Calibration]) -> decider.ModelView:
        view = decider.ModelView.of(spec, False, False)
        if view.baselines:
            return view
        kind = gpus.kind_of(device, self.pool.gpus)
        entry = next((c for c in measured if c.device == kind and c.holds_for(spec.version, spec.input_hash())),
                     None)
        if entry is None:
            return view
        return decider.ModelView(spec.model_id, spec.slo, tuple(sorted((b.batch_size, b.p99_ms)
                                                                       for b in entry.batches)),
                                 False, False, spec.runtime.max_batch_size)

    def __call__(self) -> dict[str, decider.ModelView]:
        awake: dict[str, bool] = {}
        gpu: dict[str, bool] = {}
        specs: dict[str, api.ModelSpecSpec] = {}
        devices: dict[str, str] = {}
        for slot in list(self.pool.slots.values()):
            inst = slot.inst
            model = inst.spec.model_id
            specs[model] = inst.spec
            devices.setdefault(model, inst.device)
            awake[model] = awake.get(model, False) or inst.tier == api.Tier.HOT
            gpu[model] = gpu.get(model, False) or inst.gpu
        # Model servers: on a node with the driver's checkpoint API, a GPU server's demotion goes to WARM, which its
        # own ladder turns into the next tier it has (`ServerPool.move_to`); on the others it freezes.
        on_gpu = self.pool.servers.driver is not None
        for server_slot in list(self.pool.servers.slots.values()):
            served = server_slot.inst
            model = served.spec.model_id
            specs[model] = served.spec
            devices.setdefault(model, "cpu")
            awake[model] = awake.get(model, False) or served.tier == api.Tier.HOT
            gpu[model] = on_gpu
        measured = self.measured() if self.measured is not None else NONE_MEASURED
        key = (measured, tuple((model, id(spec), awake[model], gpu[model]) for model, spec in specs.items()))
        if key[0] is self._key[0] and key[1] == self._key[1]:
            return self._views
        views = {}
        for model, spec in specs.items():
            cached = self._cache.get(model)
            entries = measured.get(model, ())
            if cached is None or cached[0] is not spec or cached[1] is not entries:
                cached = self._cache[model] = (spec, entries, self._view(spec, devices[model], entries))
            base = cached[2]
            # A server's requests reach the gateway whole and it batches them itself: no batch cap reaches it, so
            # it is never a co-runner whose cap is lowered, and its limit is its batch-1 baseline (the smallest).
            views[model] = decider.ModelView(model, base.slo, base.baselines, awake[model], gpu[model],
                                             1 if spec.framework is api.Framework.SERVER else base.max_batch)
        ensembles = {spec.ensemble: self._ensemble(spec.ensemble, spec, specs) for spec in specs.values()
                     if spec.ensemble is not None and spec.chain}
        views.update(ensembles)
        for gone in set(self._cache) - set(specs):
            del self._cache[gone]
        for gone in set(self._ensembles) - set(ensembles):
            del self._ensembles[gone]
        self._key, self._views = key, views
        return views


class Loop:
    def __init__(self, node_pool: pool.Pool, gateway: Gateway | None = None, settings: Settings | None = None,
                 agent_metrics: metrics.AgentMetrics | None = None, probe: sampler.Probe | None = None,
                 actuator: Actuator | None = None) -> None:
        self.settings = settings or node_pool.settings
        self.metrics = agent_metrics or node_pool.metrics
        s = self.settings
        self.sampler = sampler.Sampler(probe or sampler.probe_for_node(),
                                       gateway.drain_load if gateway is not None else sampler.no_load,
                                       s.autonomy.sample_ms, s.autonomy.window_samples,
                                       on_jitter=self.metrics.sample_jitter.observe)
        self.decider = decider.Decider(s)
        self._owned_actuator = actuator is None
        self.actuator: Actuator = actuator if actuator is not None else PoolActuator(node_pool, gateway)
        self.views = Views(node_pool)
        self.decisions: collections.deque[decider.Decision] = collections.deque(maxlen=1000)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_debug = float("-inf")
        self._state_seen: decider.State | None = None
        self.standing = Standing(self.decider.state, time.time(), 0.0)
        self.cluster: nodes.ClusterWatermarks | None = None  # the operator's, when the agent has read them

    def start(self) -> None:
        self.sampler.start()
        self._thread = threading.Thread(target=self._run, name="autonomy-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.sampler.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._owned_actuator and isinstance(self.actuator, PoolActuator):
            self.actuator.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                built = self.sampler.windows.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self.step(built)
            except Exception:
                log.exception("autonomy decision failed")

    def step(self, built: windows.Window) -> decider.Decision:
        """Decide one window and apply what was decided."""
        views = self.views()
        now = time.monotonic()
        explain = self.settings.autonomy.debug and now - self._last_debug >= DEBUG_EVERY_S
        started = time.perf_counter()
        decision = self.decider.decide(built, views, explain)
        self.metrics.decision_latency.observe((time.perf_counter() - started) * 1e6)
        if explain:
            self._last_debug = now
            cluster = self.cluster
            log.info("autonomy decision: inputs: memory %.1f%% (cluster: %s), util %.1f%%, %d models with load %s, "
                     "views %s; path: %s", built.memory_pct,
                     f"mean {cluster.mean_memory_pct:g}%, max {cluster.max_memory_pct:g}%" if cluster else "unknown",
                     built.util_pct, len(built.models), dict(built.models),
                     {m: (v.awake, v.baselines) for m, v in views.items()}, " | ".join(decision.path))
        self.decisions.append(decision)
        since = time.time() if decision.changed else self.standing.since
        self.standing = Standing(decision.state, since, built.memory_pct)
        self._publish(decision, views)
        for action in decision.actions:
            apply(action, self.actuator)
        if self.decider.yielding:
            self.actuator.refresh()
        return decision

    def _publish(self, decision: decider.Decision, views: Mapping[str, decider.ModelView]) -> None:
        m = self.metrics
        if decision.state != self._state_seen:
            for state in decider.State:
                m.autonomy_state.labels(state.value).set(int(state == decision.state))
            self._state_seen = decision.state
        for action in decision.actions:
            m.autonomy_decisions.labels(type(action).__name__).inc()
        late = set()
        for violation in decision.violations:
            m.slo_violating_windows.labels(violation.model).inc()
            if violation.past_deadline:
                late.add(violation.model)
        for model in views:
            m.slo_past_deadline.labels(model).set(int(model in late))
