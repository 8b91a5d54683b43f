"""A node's model servers (`framework: server`) as the pool's instances: what `pool.Pool` hands them to.

The pool gives every EMI of a server ModelSpec to `ServerPool`, which runs it as a `server.ServerInstance` with the
tiers a server has on this node: HOT, FROZEN (a CRIU image of its process tree) and COLD, and on a GPU node (the
pool's driver checkpoint API) WARM (its sleep hooks) and SUSPENDED (the driver's checkpoint of its CUDA processes).
Like a model's instance, each is brought to its EMI's resting tier (a FROZEN floor: started once, then frozen),
woken by an activation (the gateway's request, through the Agent API), and taken back down its ladder to its floor
when idle (`settings.idle`: hot_sec before WARM, warm_sec before SUSPENDED, suspended_sec before FROZEN; a COLD
floor stops it after suspended_sec). An activation keeps the
server from being frozen until its `release`: a request is never frozen mid-answer. An activation whose release never
comes (its gateway died mid-request) is given back after `LEASE_MAX_SEC`.

Where the server's files come from: its ModelSpec's `source` names a file or folder on the node, inside the model
roots (`settings.model_roots`), and it runs there (or in `server.workingDir`, inside them too). A server runs the
command its ModelSpec gives, so a cluster's node runs servers only where model code is allowed
(`settings.allow_model_code`); `volga up`, which runs the ModelSpecs its user hands it, allows them
(`commands_allowed`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import pathlib
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from volga_agent import errors, metrics
from volga_agent.host import process
from volga_agent.node import admission, instance, server
from volga_agent.node.settings import Settings
from volga_agent.snapshot import criu, cuda
from volga_core import api, planner

Tier = api.Tier
log = logging.getLogger(__name__)
# The resting tiers a server has on a node without a GPU driver: a WARM or SUSPENDED floor rests FROZEN.
RESTING = {Tier.HOT: Tier.HOT, Tier.WARM: Tier.FROZEN, Tier.SUSPENDED: Tier.FROZEN, Tier.FROZEN: Tier.FROZEN,
           Tier.COLD: Tier.COLD}
ASLEEP = (Tier.WARM, Tier.SUSPENDED)  # a process still there, its wake in place
LEASE_MAX_SEC = 3600.0  # an activation not released within this is taken for one whose gateway is gone
MOVE_ERRORS = (server.ServerError, criu.CriuError, instance.IllegalTransition, instance.CanaryMismatch, OSError,
               cuda.DriverCheckpointError)
# A failed idle demotion is tried again after these seconds, doubled after each failure up to the last: each try
# runs the server's hooks and has criu seize its tree, which a server that cannot go down yet (it holds connections
# open, say) should not pay every second.
RETRY_FIRST_SEC, RETRY_MAX_SEC = 2.0, 300.0


def is_server(spec: api.ModelSpecSpec) -> bool:
    return spec.framework is api.Framework.SERVER


def check_source(spec: api.ModelSpecSpec, roots: Sequence[str], allow_model_code: bool) -> None:
    """A server may run on this node: model code is allowed, and its source (and working folder) lie inside the
    model roots. ValueError naming the field and the reason otherwise."""
    if not allow_model_code:
        raise ValueError("spec.framework: server runs the command the ModelSpec gives, and this node does not allow "
                         "model code; allow it with settings.allow_model_code (allowModelCode in the agent's "
                         "settings) on nodes whose ModelSpec authors may run code there")
    working = spec.server.working_dir if spec.server else None
    for field, given in (("spec.source", str(spec.source_path)),
                         ("spec.server.workingDir", str(instance.server_folder(spec)) if working else None)):
        if given is None:
            continue
        path = pathlib.Path(given)
        if not path.is_absolute():
            raise ValueError(f"{field}: {given}: must be an absolute path on the node")
        try:
            resolved = path.resolve(strict=True)
        except (OSError, RuntimeError):
            raise ValueError(f"{field}: {given} does not exist on this node") from None
        if roots and not any(resolved.is_relative_to(pathlib.Path(root).resolve()) for root in roots):
            raise ValueError(f"{field}: resolves to {resolved}, outside the model roots ({', '.join(roots)}); a "
                             f"server's files must live under settings.model_roots ({admission.ROOTS_FLAG})")


@dataclasses.dataclass
class ServerSlot:
    inst: server.ServerInstance
    target: Tier  # the resting tier (`ServerPool.resting` of the EMI's)
    reason: str = ""  # why it is not where it should be; "" when fine
    last_wake_ms: float = 0.0
    last_used_unix: float = 0.0
    refused: bool = False  # CRIU cannot dump it (FreezeRefused): it stays HOT, idle or not
    removed: bool = False
    failures: int = 0  # idle demotions failed in a row
    retry_at: float = 0.0  # (monotonic) no idle demotion before this, after a failed one
    leases: list[float] = dataclasses.field(default_factory=list)  # when each unreleased activation began


@dataclasses.dataclass(frozen=True)
class Activated:
    slot: ServerSlot
    woke_from: Tier
    wake_ms: float
    fallback: bool


class ServerPool:
    """The server instances of a node by EMI name; every move on the pool's executor or the caller's thread."""

    def __init__(self, node: str, workroot: pathlib.Path, engine: criu.CriuEngine | None, settings: Settings,
                 agent_metrics: metrics.AgentMetrics, executor: concurrent.futures.Executor,
                 driver: cuda.DriverCheckpoint | None = None) -> None:
        self.node = node
        self.driver = driver  # a GPU node's: its servers get WARM and SUSPENDED
        self.workroot = workroot / "servers"
        self.engine = engine
        self.settings = settings
        # A server runs its ModelSpec's command: a cluster's nodes only where model code is allowed; `volga up`
        # runs the ModelSpecs its own user hands it, and allows them.
        self.commands_allowed = settings.allow_model_code
        self.metrics = agent_metrics
        self.executor = executor
        self.slots: dict[str, ServerSlot] = {}
        self.failed: dict[str, tuple[api.ModelSpecSpec, str]] = {}  # could not be created, and why
        self._lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future[None]] = {}

    # -- desired state -------------------------------------------------------------------------------------------
    def apply(self, desired: Sequence[planner.Desired], specs: Mapping[str, api.ModelSpecSpec]) -> None:
        """Make the node's servers match the plan (only server EMIs of this node are given): create, retarget,
        remove; moves run on the executor."""
        mine = {d.name: d for d in desired if d.node == self.node}
        with self._lock:
            stale = [n for n, slot in self.slots.items()
                     if n not in mine or slot.inst.spec != specs[mine[n].model_spec]]
            self.failed = {n: f for n, f in self.failed.items() if n in mine}
        for name in stale:
            self.remove(name)
        moving = []
        with self._lock:
            for name, want in mine.items():
                target = self.resting(want.target_tier)
                slot = self.slots.get(name)
                if slot is not None:
                    slot.target = target
                    if _rank(slot.inst.tier) > _rank(target):
                        moving.append(slot)
                    continue
                spec = specs[want.model_spec]
                try:
                    admission.check_instance_name(name)
                    check_source(spec, self.settings.model_roots, self.commands_allowed)
                    if self.engine is None:
                        raise ValueError("this node has no usable CRIU: a server needs it for its FROZEN tier")
                    inst = server.ServerInstance(spec, self.workroot / name, self.engine, name, self.metrics,
                                                 driver=self.driver, lazy_restore=self.settings.lazy_restore,
                                                 cuda_stack_bytes=self.settings.gpu_stack_bytes)
                except (OSError, ValueError) as exc:
                    self.failed[name] = (spec, f"{type(exc).__name__}: {exc}")
                    log.error("%s: cannot create the server instance: %s", name, exc)
                    continue
                self.failed.pop(name, None)
                self.slots[name] = slot = ServerSlot(inst, target)
                moving.append(slot)
        for slot in moving:
            self._converge_async(slot)

    def resting(self, tier: Tier) -> Tier:
        """Where a server of an EMI whose target is `tier` rests on this node."""
        return tier if self.driver is not None and tier in ASLEEP else RESTING[tier]

    def _converge_async(self, slot: ServerSlot) -> None:
        self._submit(slot, self._converge)

    def _submit(self, slot: ServerSlot, move: Callable[[ServerSlot], None]) -> None:
        """`move` of the slot on the executor, unless one of its moves is still pending."""
        name = slot.inst.name
        future = self._pending.get(name)
        if future is None or future.done():
            self._pending[name] = self.executor.submit(move, slot)

    def _converge(self, slot: ServerSlot) -> None:
        """Up to its resting tier: a FROZEN floor is a cold start and a freeze (the first request restores); a
        WARM or SUSPENDED one a cold start and the moves down to it (`ServerInstance.settle`)."""
        if slot.removed:
            return
        if slot.target is Tier.COLD:
            if _died(slot.inst):
                slot.inst.close()
                slot.reason = ""
            return
        try:
            slot.inst.ensure_hot()
            _share_socket(slot.inst)
            if slot.target is not Tier.HOT and not slot.refused:
                slot.inst.settle(slot.target)
            slot.reason = ""
        except server.Busy:
            slot.reason = ""  # a request woke it first: the idle demotion takes it down later
        except server.FreezeRefused as exc:
            slot.refused, slot.reason = True, f"FreezeRefused: {exc}"
            log.warning("%s stays HOT: %s", slot.inst.name, exc)
        except MOVE_ERRORS as exc:
            slot.reason = f"{type(exc).__name__}: {exc}"
            log.warning("%s: could not reach %s: %s", slot.inst.name, slot.target.value, exc)

    def remove(self, name: str) -> None:
        """Stop the server and remove its image."""
        with self._lock:
            slot = self.slots.pop(name, None)
        if slot is not None:
            slot.removed = True
            slot.inst.close()

    def owns(self, name: str) -> bool:
        return name in self.slots

    def serves(self, model_id: str) -> bool:
        with self._lock:
            return any(s.inst.spec.model_id == model_id for s in self.slots.values()) or any(
                spec.model_id == model_id for spec, _ in self.failed.values())

    # -- the request path ----------------------------------------------------------------------------------------
    def activate(self, model_id: str, name: str = "") -> Activated:
        """The model's server HOT (the HOT one first, else the one whose wake is a restore) and kept from being
        frozen until `release(name)`."""
        with self._lock:
            slots = [s for s in self.slots.values() if s.inst.spec.model_id == model_id and (not name or
                                                                                          s.inst.name == name)]
            failed = [f"{n}: {why}" for n, (spec, why) in sorted(self.failed.items()) if spec.model_id == model_id]
        if not slots:
            if failed:
                raise errors.ActivationFailed(f"no server of model {model_id!r} could be created on node {self.node}: "
                                              + "; ".join(failed))
            raise errors.UnknownModel(f"no instance of model {model_id!r} on node {self.node}")
        slot = min(slots, key=lambda s: (_rank(s.inst.tier), s.inst.name))
        inst = slot.inst
        try:
            move = inst.acquire()
        except MOVE_ERRORS as exc:
            slot.reason = f"ActivationFailed: {exc}"
            raise errors.ActivationFailed(f"{inst.name}: {exc}") from exc
        source, wake_ms, fallback = Tier.HOT, 0.0, False
        if move is not None:  # this call's wake (concurrent ones wait for it, and count none of their own)
            _share_socket(inst)
            source, wake_ms, fallback = move.source, move.seconds * 1e3, move.fallback
            slot.last_wake_ms = wake_ms
            self.metrics.activations.labels(source.value, model_id).inc()
            slot.reason = "RestoreFailed" if fallback else ""
        slot.last_used_unix = time.time()
        with self._lock:
            slot.leases.append(time.monotonic())
        return Activated(slot, source, wake_ms, fallback)

    def release(self, name: str) -> None:
        slot = self.slots.get(name)
        if slot is None:
            raise errors.UnknownModel(f"no instance {name!r} on node {self.node}")
        with self._lock:
            if not slot.leases:
                return  # given back already (LEASE_MAX_SEC), or a release without its activation
            slot.leases.pop(0)
        slot.inst.release()
        slot.last_used_unix = time.time()

    def move_to(self, name: str, target: Tier) -> instance.Transition | None:
        """Move one server now (the node's autonomy loop, operators' tools): HOT wakes it (no activation held: it
        counts as idle from then on); a tier below its own takes it down its ladder to `target`, or where its ladder
        lacks `target` (WARM without sleep hooks, SUSPENDED without a CUDA context, both on a node without the
        driver's checkpoint API) to the next tier below it; COLD stops it. The last move; None when it did not move
        (already there or below; CRIU cannot dump it: FreezeRefused, which leaves it HOT as the idle demotion does)
        or was stopped. `server.Busy` while a request runs: a server is never moved down mid-answer."""
        slot = self.slots.get(name)
        if slot is None or slot.removed:
            raise errors.UnknownModel(f"no instance {name!r} on node {self.node}")
        inst = slot.inst
        moves = len(inst.transitions)
        if target is Tier.HOT:
            inst.ensure_hot()
            _share_socket(inst)
            inst.last_used = time.monotonic()
        elif target is Tier.COLD:
            if inst.in_flight:
                raise server.Busy(f"{name}: {inst.in_flight} request(s) in flight")
            inst.close()
        elif slot.refused and inst.tier is Tier.HOT:
            return None
        else:
            try:
                inst.settle(self.resting(target))
            except server.FreezeRefused as exc:
                slot.refused, slot.reason = True, f"FreezeRefused: {exc}"
                log.warning("%s stays HOT: %s", inst.name, exc)
                return None
        return inst.transitions[-1] if len(inst.transitions) > moves else None

    # -- the local control loop ----------------------------------------------------------------------------------
    def tick(self) -> None:
        """Servers that died while HOT started again (and brought to their floors), idle ones back down to their
        floors (on the executor)."""
        idle = self.settings.idle
        first_step = min(idle.hot_sec, idle.warm_sec, idle.suspended_sec) if self.driver else idle.suspended_sec
        for slot in list(self.slots.values()):
            with self._lock:
                expired = [t for t in slot.leases if time.monotonic() - t > LEASE_MAX_SEC]
                del slot.leases[:len(expired)]
            for _ in expired:
                slot.inst.release()
                log.warning("%s: an activation not released within %g s is given back", slot.inst.name,
                            LEASE_MAX_SEC)
            inst = slot.inst
            if (inst.tier is Tier.HOT or inst.tier in ASLEEP) and _died(inst) and not slot.removed:
                log.warning("%s: the server died while %s; starting it again", inst.name, inst.tier.value)
                self.metrics.worker_deaths.labels(inst.spec.model_id).inc()
                slot.reason = f"ServerDied: its process exited while {inst.tier.value}"
                inst.close()  # its tier, hooks and driver state go with the process
                self._converge_async(slot)
                continue
            if ((inst.tier is Tier.HOT or inst.tier in ASLEEP) and _rank(inst.tier) < _rank(slot.target)
                    and not slot.refused and not inst.in_flight and time.monotonic() - inst.last_used >= first_step
                    and time.monotonic() >= slot.retry_at):
                self._converge_down(slot)

    def _converge_down(self, slot: ServerSlot) -> None:
        self._submit(slot, self._demote)

    def _demote(self, slot: ServerSlot) -> None:
        """One step down its ladder towards its floor when idle long enough (a COLD floor: stopped)."""
        if slot.removed:
            return
        idle = self.settings.idle
        moved = False
        try:
            if slot.target is not Tier.COLD:
                moved = slot.inst.demote_if_idle(idle.suspended_sec, (idle.hot_sec, idle.warm_sec), slot.target)
            elif not slot.inst.in_flight and time.monotonic() - slot.inst.last_used >= idle.suspended_sec:
                slot.inst.close()
        except server.FreezeRefused as exc:
            slot.refused, slot.reason = True, f"FreezeRefused: {exc}"
            log.warning("%s stays HOT: %s", slot.inst.name, exc)
        except MOVE_ERRORS as exc:
            slot.failures += 1
            wait = min(RETRY_MAX_SEC, RETRY_FIRST_SEC * 2 ** (slot.failures - 1))
            slot.retry_at = time.monotonic() + wait
            slot.reason = f"Idle: {type(exc).__name__}: {exc}"
            log.warning("%s: idle demotion failed (tried again in %g s): %s", slot.inst.name, wait, exc)
        else:
            slot.failures, slot.retry_at = 0, 0.0
            if moved and slot.inst.tier is slot.target:
                slot.reason = ""  # at its floor: what kept it from there (a failed freeze, say) is over

    def wait_converged(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for future in list(self._pending.values()):
            future.result(timeout=max(0.0, deadline - time.monotonic()))

    def restore_failures(self) -> int:
        return sum(s.inst.restore_failures for s in list(self.slots.values()))

    def close(self) -> None:
        for name in list(self.slots):
            self.remove(name)


def _died(inst: server.ServerInstance) -> bool:
    pid = inst.pid
    return pid is not None and (not process.alive(pid) or process.is_zombie(pid))


def _share_socket(inst: server.ServerInstance) -> None:
    """A Unix socket the server made group-writable: the gateway may run as another user of the group (the chart's
    fsGroup, which the instance's folder passes on). CRIU keeps the mode across freezes."""
    if not inst.unix:
        return
    with contextlib.suppress(OSError):
        mode = stat.S_IMODE(inst.socket_path.stat().st_mode)
        if mode & 0o060 != 0o060:
            os.chmod(inst.socket_path, mode | 0o060)


def _rank(tier: Tier) -> int:
    """How far from serving: HOT 0, WARM 1, SUSPENDED 2, FROZEN 3, COLD 4."""
    return {Tier.HOT: 0, Tier.WARM: 1, Tier.SUSPENDED: 2, Tier.FROZEN: 3}.get(tier, 4)
