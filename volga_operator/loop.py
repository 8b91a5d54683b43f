"""The operator's reconcile loop: what the watches have seen, the ModelSpecs to plan again, and the writes.

Why a module of its own, and why not kopf's resource handlers: kopf takes every watch event through its own
machinery (cause detection, a deep-copied diff base, a worker per object), which at thousands of ModelSpecs cost more
CPU than all the rest of the operator, and its change handlers write progress and last-handled-configuration
annotations. So kopf only runs the process (`handlers.py`: startup, cleanup, the liveness endpoint, signals), and the
watches and the writes are this loop's. Three list+watches (`watch.Events`, each on a thread) hand each object to the
event loop, where `Loop.see_*` record it and wake the reconcile loop. The writes are the ones the desired state and
the ModelSpec status need, and no more:

- a write is assumed done as soon as it is queued, so the next pass plans around it instead of sending it again,
  and the server's answer (with its resourceVersion) replaces the assumption; a watch event no newer than what
  the operator holds changes nothing, so its own writes coming back do not start another pass;
- a new ModelSpec's status is written once, for the EMIs it is getting (`reconcile.compute(settle=True)`);
- a ModelSpec with writes in flight is not planned again until they land;
- at start, everything is listed (a page at a time) before the first pass, so a restart plans against the whole
  cluster and writes nothing where all is right.

Every write goes through one token bucket (`ratelimit`, `Settings.api_writes_per_sec`: VOLGA_API_WRITES_PER_SEC,
default 200 per second including bursts) and a window that lets no more than that many complete in any second however
the API server's latency bunches them, on a pool of writer threads fed from a queue: planning (on the event loop) and
writing overlap, so the bucket stays busy while work is queued, and a large plan is cut into passes of
`KEYS_PER_PASS` so the watches keep flowing. The decisions themselves are in `reconcile.compute`, a pure function.

The cluster tier (docs/architecture.md): the node watch also reads each agent's autonomy heartbeat (a Node
annotation) into `State.autonomy` without planning anything; every TIER_CHECK_SEC the loop looks for nodes that
have stayed in EMERGENCY past `chainMigrationAfterSec` and plans their chains again (the move itself is
`reconcile.compute`'s), and every WATERMARKS_SEC it publishes the cluster's memory watermarks to the agents in a
ConfigMap, when they changed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import kubernetes

from volga_core import api, nodes
from volga_core.api import labels
from volga_core.kube import client as kube_client
from volga_core.kube import ratelimit, watch
from volga_operator import metrics as operator_metrics
from volga_operator import reconcile
from volga_operator.settings import Settings

log = logging.getLogger("volga.operator")

WRITE_THREADS = 64  # writes in flight: at 0.2 s of API server latency, 16 would cap the rate at 80/s
KEYS_PER_PASS = 100  # ModelSpecs planned between two looks at the watches (a new one costs ~0.2 ms at 1000 nodes)
# The bucket paces the starts at (1 - JITTER_SHARE) of the limit, JITTER_SHARE of it as burst; the completion
# window, not the bucket, keeps completions (what the API server counts) within the limit however they bunch, so
# the bucket keeps only a sliver back: at 200/s it starts 197 a second, not 191.
JITTER_SHARE = 0.01
RETRY_SEC = 2.0  # a failed write (after its own retries) is planned again this much later
WRITERS_STOP_SEC = 10.0  # how long a stopping operator waits for the writes in flight
FIRST_PASS_DONE = "first pass done"
TIER_CHECK_SEC = 1.0  # how often nodes in EMERGENCY are looked at for chains to move
WATERMARKS_SEC = 5.0  # how often the cluster's watermarks are worked out (and written when they changed)


def write_bucket(limit_per_sec: float) -> ratelimit.TokenBucket:
    return ratelimit.TokenBucket.within(limit_per_sec * (1 - JITTER_SHARE), burst_share=JITTER_SHARE)


@dataclasses.dataclass(frozen=True)
class Write:
    key: reconcile.Key  # the ModelSpec the write is for
    action: reconcile.Action
    undo: Callable[[], None]  # takes the assumption back if the write fails


def stale(old: int, new: int) -> bool:
    """Whether an object at resourceVersion `new` is no newer than the one held at `old` (0: unknown)."""
    return old > 0 and 0 < new <= old


class Loop:
    """The state the watches fill, the set of ModelSpecs to look at again, and the writers."""

    def __init__(self, settings: Settings | None = None, threads: int = WRITE_THREADS) -> None:
        self.settings = settings or Settings()
        writes_per_sec = self.settings.api_writes_per_sec
        self.metrics = operator_metrics.OperatorMetrics()
        self.state = reconcile.State(tier=reconcile.TierSettings(self.settings.chain_migration_after_sec,
                                                                 self.settings.chain_migration_min_interval_sec))
        self._published: nodes.ClusterWatermarks | None = None
        self.dirty: set[reconcile.Key] = set()
        self.busy: collections.Counter[reconcile.Key] = collections.Counter()  # writes queued or in flight
        self.wake = asyncio.Event()
        self.idle = asyncio.Event()  # set while no write is queued or in flight
        self.idle.set()
        self.bucket = write_bucket(writes_per_sec)
        self.window = ratelimit.CompletionWindow(max(1, int(writes_per_sec)))
        self.threads = threads
        self.writes = 0
        self.failed = 0
        self._queue: queue.SimpleQueue[Write | None] = queue.SimpleQueue()
        self._api: kubernetes.client.CustomObjectsApi | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.synced = {kind: asyncio.Event() for kind in ("modelspecs", "executablemodelinstances", "nodes")}
        self._listing: dict[str, set[reconcile.Key]] = {}  # the names a (re)list in progress has shown so far
        self.watches: list[watch.Events] = []

    def touch(self, *keys: reconcile.Key) -> None:
        self.dirty.update(keys)
        self.wake.set()

    def touch_all(self) -> None:
        self.touch(*self.state.specs, *self.state.emis.owners())

    @property
    def api(self) -> kubernetes.client.CustomObjectsApi:
        if self._api is None:
            self._api = kubernetes.client.CustomObjectsApi(kube_client.api_client(connections=self.threads))
        return self._api

    # --- what the watches see ---------------------------------------------------------------------------------

    def see_spec(self, body: Mapping[str, Any], deleted: bool = False) -> None:
        record = reconcile.SpecRecord.from_body(body)
        key = (record.namespace, record.name)
        old = self.state.specs.get(key)
        if old is not None and stale(old.resource_version, record.resource_version):
            return  # what the operator holds already (often its own write coming back)
        if deleted:
            self.state.specs.pop(key, None)
        else:
            self.state.specs[key] = record
        self.touch(key)

    def see_emi(self, body: Mapping[str, Any], deleted: bool = False) -> None:
        record = reconcile.EmiRecord.from_body(body)
        key = (record.namespace, record.name)
        old = self.state.emis.get(key)
        if old is not None and stale(old.resource_version, record.resource_version):
            return
        if deleted:
            self.state.emis.pop(key, None)
        else:
            self.state.emis[key] = record
        if deleted or old is None or old.spec != record.spec or old.status != record.status:
            self.touch(*{(e.namespace, e.owner) for e in (old, record) if e is not None})

    def see_node(self, body: Mapping[str, Any], deleted: bool = False) -> None:
        meta = body.get("metadata", {})
        name = meta["name"]
        profile = None if deleted else reconcile.node_profile(
            name, meta.get("annotations"), (body.get("status") or {}).get("conditions"))
        before = self.state.nodes.get(name)
        if profile is None:
            self.state.nodes.pop(name, None)
        else:
            self.state.nodes[name] = profile
        # The autonomy heartbeat changes every few seconds and plans nothing by itself (`_tier` reads it).
        heard = reconcile.hear(self.state.autonomy.get(name), None if deleted else
                               nodes.NodeAutonomy.from_annotations(meta.get("annotations")), time.time())
        if heard is None:
            self.state.autonomy.pop(name, None)
        else:
            self.state.autonomy[name] = heard
        if before != profile:
            self.touch_all()  # capacity changed: every ModelSpec may place differently

    def see_page(self, kind: str, items: list[Any], first: bool = True) -> None:
        """One page of a (re)list: each object as an event; the names are kept until the list is complete."""
        see = {"modelspecs": self.see_spec, "executablemodelinstances": self.see_emi, "nodes": self.see_node}[kind]
        if first:
            self._listing[kind] = set()
        listing = self._listing.setdefault(kind, set())
        for body in items:
            see(body)
            meta = body["metadata"]
            listing.add((meta.get("namespace", "default"), meta["name"]))

    def see_list(self, kind: str, items: list[Any]) -> None:
        """The end of a (re)list of one kind, with the objects of its last pages (`see_page` had the others): what
        the list no longer has is gone."""
        self.see_page(kind, items, first=False)
        listed = self._listing.pop(kind, set())
        if kind == "nodes":
            listed_nodes = {name for _, name in listed}
            for name in [n for n in self.state.nodes if n not in listed_nodes]:
                self.see_node({"metadata": {"name": name}}, deleted=True)
        else:
            held: Mapping[reconcile.Key, Any] = self.state.specs if kind == "modelspecs" else self.state.emis
            see = self.see_spec if kind == "modelspecs" else self.see_emi
            for ns, name in [k for k in held if k not in listed]:
                see({"metadata": {"namespace": ns, "name": name}, "spec": dict(held[(ns, name)].spec)},
                    deleted=True)
        self.synced[kind].set()

    async def start_watching(self) -> None:
        """List and watch ModelSpecs, EMIs and nodes (each on a thread; what they see is handed to this event
        loop); return once all three lists are in, so the first pass plans against the whole cluster."""
        self._loop = asyncio.get_running_loop()
        custom = kubernetes.client.CustomObjectsApi(kube_client.api_client(connections=len(self.synced)))
        core = kubernetes.client.CoreV1Api(custom.api_client)

        def handed_over(kind: str) -> tuple[Callable[[list[Any]], None], Callable[[str, Any], None],
                                            Callable[[list[Any], bool], None]]:
            assert self._loop is not None
            post = self._loop.call_soon_threadsafe
            see = {"modelspecs": self.see_spec, "executablemodelinstances": self.see_emi, "nodes": self.see_node}[kind]

            def listed(items: list[Any]) -> None:
                post(self.see_list, kind, items)

            def event(type_: str, body: Any) -> None:
                post(functools.partial(see, body, deleted=type_ == "DELETED"))

            def page(items: list[Any], first: bool) -> None:
                # The next page is fetched once this one is recorded: a relist holds a page at a time, not all.
                assert self._loop is not None
                asyncio.run_coroutine_threadsafe(self._see_page(kind, items, first), self._loop).result()

            return listed, event, page

        for kind in self.synced:
            lister = watch.json_lister(core.list_node) if kind == "nodes" else functools.partial(
                custom.list_cluster_custom_object, api.GROUP, api.VERSION, kind)
            self.watches.append(watch.Events(kind, lister, *handed_over(kind)))
        for w in self.watches:
            w.start()
        await asyncio.gather(*(event.wait() for event in self.synced.values()))
        log.info("listed %d ModelSpecs, %d EMIs, %d nodes with a profile", len(self.state.specs),
                 len(self.state.emis), len(self.state.nodes))

    async def _see_page(self, kind: str, items: list[Any], first: bool) -> None:
        self.see_page(kind, items, first)

    def stop_watching(self) -> None:
        for w in self.watches:
            w.stop()

    # --- planning -----------------------------------------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        threads = [threading.Thread(target=self._writer, name=f"volga-write-{i}", daemon=True)
                   for i in range(self.threads)]
        for thread in threads:
            thread.start()
        tier = asyncio.get_running_loop().create_task(self._tier(), name="volga-cluster-tier")
        try:
            await self._plan()
        finally:
            tier.cancel()
            self._stop_writers(threads)

    def _stop_writers(self, threads: list[threading.Thread]) -> None:
        """The writers end once their write in flight is done; writes still queued are dropped (the next operator
        plans them again). Waited for, within WRITERS_STOP_SEC: a writer still in a request while the interpreter
        shuts down can take the process down with SIGABRT instead of a clean exit."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        for _ in threads:
            self._queue.put(None)
        deadline = time.monotonic() + WRITERS_STOP_SEC
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    async def _plan(self) -> None:
        resync_sec, debounce_sec = self.settings.resync_sec, self.settings.debounce_sec
        started = last_full = time.monotonic()
        self.touch_all()
        first: asyncio.Task[None] | None = None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=max(0.1, resync_sec / 4))
            await asyncio.sleep(debounce_sec)  # let a burst of events land before planning
            self.wake.clear()
            full = time.monotonic() - last_full > resync_sec
            if full:
                self.touch_all()
                last_full = time.monotonic()
            ready = sorted(k for k in self.dirty if k not in self.busy)
            queued = 0
            for chunk in (ready[i:i + KEYS_PER_PASS] for i in range(0, len(ready), KEYS_PER_PASS)):
                self.dirty.difference_update(chunk)
                actions = reconcile.compute(self.state, chunk, settle=True)
                self.submit(actions)
                queued += len(actions)
                await asyncio.sleep(0)  # let the watches and the writers' answers in
            if ready:
                log.debug("%s: %d ModelSpecs, %d writes queued", "resync pass" if full else "pass", len(ready), queued)
            if first is None:
                first = asyncio.create_task(self._first_pass_done(started, len(ready)))

    async def _tier(self) -> None:
        """Chains on nodes in EMERGENCY for too long are planned again; the watermarks go to the agents."""
        last_marks = float("-inf")
        while True:
            await asyncio.sleep(TIER_CHECK_SEC)
            now = time.time()
            due = reconcile.due_nodes(self.state, now)
            if due:
                self.touch(*reconcile.chains_on(self.state, due))
            fresh = [h.autonomy.state for h in self.state.autonomy.values() if h.fresh(now)]
            for state in ("PRELOAD", "ACCEPT", "OPTIMIZE", reconcile.EMERGENCY):
                self.metrics.nodes_by_state.labels(state).set(fresh.count(state))
            self.metrics.nodes_by_state.labels("stale").set(len(self.state.autonomy) - len(fresh))
            if now - last_marks >= WATERMARKS_SEC:
                last_marks = now
                self.publish_watermarks(reconcile.watermarks(self.state, now))

    def publish_watermarks(self, marks: nodes.ClusterWatermarks) -> None:
        """Write the watermarks ConfigMap when they changed (nothing while no node publishes a heartbeat)."""
        self.metrics.cluster_memory.labels("mean").set(marks.mean_memory_pct)
        self.metrics.cluster_memory.labels("max").set(marks.max_memory_pct)
        if marks == self._published or (self._published is None and not marks.nodes):
            return
        self._published = marks
        self.submit([reconcile.Action("apply_configmap", self.settings.namespace, labels.CLUSTER_CONFIGMAP, {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": labels.CLUSTER_CONFIGMAP, "namespace": self.settings.namespace},
            "data": {labels.CLUSTER_WATERMARKS_KEY: marks.to_json()}})])

    async def _first_pass_done(self, started: float, keys: int) -> None:
        await self.idle.wait()
        log.info("%s: %d ModelSpecs looked at, %d writes, %d failed, %.1f s after start", FIRST_PASS_DONE, keys,
                 self.writes, self.failed, time.monotonic() - started)

    def submit(self, actions: list[reconcile.Action]) -> None:
        for action in actions:
            if action.verb == "create_event" and action.body.get("reason") == reconcile.REASON_CHAIN_MIGRATED:
                self.metrics.chain_migrations.labels(str(action.body.get("related", {}).get("name", ""))).inc()
                log.info("%s/%s: %s", action.namespace, action.name, action.body.get("message"))
            key = self._owner(action)
            undo = self._assume(action)
            self.busy[key] += 1
            self.idle.clear()
            self._queue.put(Write(key, action, undo))
        if not self.busy:
            self.idle.set()

    def _owner(self, action: reconcile.Action) -> reconcile.Key:
        if action.verb in ("patch_spec_status", "patch_spec_meta", "create_event", "apply_configmap"):
            return action.namespace, action.name
        emi = self.state.emis.get((action.namespace, action.name))
        owner = emi.owner if emi is not None else str(action.body.get("spec", {}).get("modelSpec", action.name))
        return action.namespace, owner

    def _assume(self, action: reconcile.Action) -> Callable[[], None]:
        """Reflect a write in the state now, before it is even sent: the next pass plans around it. Returns what
        takes it back."""
        key = (action.namespace, action.name)
        emis, specs = self.state.emis, self.state.specs
        if action.verb in ("create_event", "apply_configmap"):
            return lambda: None
        if action.verb in ("create_emi", "patch_emi", "delete_emi"):
            before = emis.get(key)
            after: reconcile.EmiRecord | None = None
            if action.verb == "create_emi":
                after = reconcile.EmiRecord(action.namespace, action.name, action.body["spec"], {},
                                            owner_uid=reconcile.owner_uid(action.body["metadata"]))
            elif action.verb == "patch_emi" and before is not None:
                after = dataclasses.replace(before, spec=action.body["spec"])
            if after is None:
                emis.pop(key, None)
            else:
                emis[key] = after

            def undo_emi() -> None:
                if emis.get(key) is after and before is not None:
                    emis[key] = before
                elif emis.get(key) is after:
                    emis.pop(key, None)

            return undo_emi
        spec_before = specs.get(key)
        if spec_before is None:
            return lambda: None
        if action.verb == "patch_spec_status":
            spec_after = dataclasses.replace(spec_before, status={**spec_before.status, **action.body["status"]})
        else:
            spec_after = dataclasses.replace(spec_before, finalizers=tuple(action.body["metadata"]["finalizers"]))
        specs[key] = spec_after

        def undo_spec() -> None:
            if specs.get(key) is spec_after:
                specs[key] = spec_before

        return undo_spec

    # --- writing ------------------------------------------------------------------------------------------------

    def _writer(self) -> None:
        while (write := self._queue.get()) is not None:
            try:
                answer, error = ratelimit.write_sync(self.bucket, functools.partial(self._send, write.action)), None
            except Exception as exc:  # retried already where that helps; the write is planned again later
                answer, error = None, exc
            try:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._done, write, answer, error)
            except RuntimeError:  # the event loop is gone: the operator is stopping
                return

    def _done(self, write: Write, answer: Any, error: BaseException | None) -> None:
        action = write.action
        if error is None:
            self.writes += 1
            self.metrics.writes.labels(action.verb).inc()
            if self._settle(action, answer):
                self.touch(write.key)
        else:
            self.failed += 1
            self.metrics.write_failures.labels(action.verb).inc()
            log.warning("%s %s/%s failed: %s", action.verb, action.namespace, action.name, error)
            write.undo()
            asyncio.get_running_loop().call_later(RETRY_SEC, self.touch, write.key)
        self.busy[write.key] -= 1
        if self.busy[write.key] <= 0:
            del self.busy[write.key]
            if write.key in self.dirty:
                self.wake.set()
        if not self.busy:
            self.idle.set()

    def _settle(self, action: reconcile.Action, answer: Any) -> bool:
        """Hold the server's answer to a write in place of the assumption; True when it differs from what was
        written (an EMI that existed already), so the ModelSpec is planned again."""
        if (not isinstance(answer, Mapping) or "metadata" not in answer
                or action.verb in ("delete_emi", "create_event", "apply_configmap")):
            return False
        key = (action.namespace, action.name)
        if action.verb in ("create_emi", "patch_emi"):
            emi = reconcile.EmiRecord.from_body(answer)
            held = self.state.emis.get(key)
            if held is not None and not stale(held.resource_version, emi.resource_version):
                self.state.emis[key] = emi
            return dict(emi.spec) != dict(action.body["spec"])
        spec = reconcile.SpecRecord.from_body(answer)
        held_spec = self.state.specs.get(key)
        if held_spec is not None and not stale(held_spec.resource_version, spec.resource_version):
            self.state.specs[key] = spec
        return False

    def _send(self, action: reconcile.Action) -> Any:
        self.window.acquire()
        try:
            return self._do(action)
        finally:
            self.window.release()

    def _do(self, action: reconcile.Action) -> Any:
        group, version = api.GROUP, api.VERSION
        ns, name = action.namespace, action.name
        if action.verb == "create_emi":
            try:
                return self.api.create_namespaced_custom_object(group, version, ns, "executablemodelinstances",
                                                                dict(action.body))
            except kubernetes.client.ApiException as exc:
                if exc.status != 409:
                    raise
                # It exists already (made before a restart the watch had not shown yet): read it, not retry.
                return self.api.get_namespaced_custom_object(group, version, ns, "executablemodelinstances", name)
        if action.verb == "patch_emi":
            return self.api.patch_namespaced_custom_object(group, version, ns, "executablemodelinstances", name,
                                                           dict(action.body))
        if action.verb == "delete_emi":
            try:
                return self.api.delete_namespaced_custom_object(group, version, ns, "executablemodelinstances", name)
            except kubernetes.client.ApiException as exc:
                if exc.status == 404:
                    return None
                raise
        if action.verb == "patch_spec_status":
            return self.api.patch_namespaced_custom_object_status(group, version, ns, "modelspecs", name,
                                                                  dict(action.body))
        if action.verb == "patch_spec_meta":
            return self.api.patch_namespaced_custom_object(group, version, ns, "modelspecs", name, dict(action.body))
        core: Any = kubernetes.client.CoreV1Api(self.api.api_client)  # JSON bodies in, the HTTP status out
        if action.verb == "create_event":
            return core.create_namespaced_event(ns, dict(action.body), _preload_content=False).status
        if action.verb == "apply_configmap":
            try:
                return core.patch_namespaced_config_map(name, ns, dict(action.body), _preload_content=False).status
            except kubernetes.client.ApiException as exc:
                if exc.status != 404:
                    raise
                return core.create_namespaced_config_map(ns, dict(action.body), _preload_content=False).status
        raise ValueError(f"unknown action {action.verb}")
