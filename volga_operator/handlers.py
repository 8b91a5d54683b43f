"""The operator's kopf handlers: thin. They record what the watches see and wake the reconcile loop.

Only kopf's event handlers are used (no change-detecting handlers), so kopf itself writes nothing to the
API server: no progress annotations, no finalizers of its own. Every write the operator makes goes through
one token bucket (`ratelimit`, at most `VOLGA_API_WRITES_PER_SEC`, default 200 per second including bursts)
in the loop below, which is what keeps a thousand ModelSpecs applied at once from becoming an etcd write
storm. The decisions themselves are in `reconcile.compute`, a pure function.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from typing import Any

import kopf
import kubernetes

from volga_operator import api, reconcile
from volga_operator.api import labels
from volga_operator.kube import client as kube_client
from volga_operator.kube import ratelimit

log = logging.getLogger("volga.operator")

RESYNC_SEC = float(os.environ.get("VOLGA_RESYNC_SEC", "60"))
DEBOUNCE_SEC = float(os.environ.get("VOLGA_DEBOUNCE_SEC", "0.2"))
WRITES_PER_SEC = float(os.environ.get("VOLGA_API_WRITES_PER_SEC", "200"))
PARALLEL_WRITES = 8


class Loop:
    """The state the watches fill, the set of ModelSpecs to look at again, and the writer."""

    def __init__(self, writes_per_sec: float = WRITES_PER_SEC) -> None:
        self.state = reconcile.State()
        self.dirty: set[reconcile.Key] = set()
        self.wake = asyncio.Event()
        self.bucket = ratelimit.TokenBucket.within(writes_per_sec)
        self._api: kubernetes.client.CustomObjectsApi | None = None

    def touch(self, *keys: reconcile.Key) -> None:
        self.dirty.update(keys)
        self.wake.set()

    def touch_all(self) -> None:
        self.touch(*self.state.specs, *{(e.namespace, e.owner) for e in self.state.emis.values()})

    @property
    def api(self) -> kubernetes.client.CustomObjectsApi:
        if self._api is None:
            self._api = kubernetes.client.CustomObjectsApi(kube_client.api_client())
        return self._api

    async def run(self) -> None:
        last_full = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=max(0.1, RESYNC_SEC / 4))
            await asyncio.sleep(DEBOUNCE_SEC)  # let a burst of events land before planning
            self.wake.clear()
            if time.monotonic() - last_full > RESYNC_SEC:
                self.touch_all()
                last_full = time.monotonic()
            keys, self.dirty = self.dirty, set()
            if not keys:
                continue
            actions = reconcile.compute(self.state, keys)
            await self.apply(actions)

    async def apply(self, actions: list[reconcile.Action]) -> None:
        queue: asyncio.Queue[reconcile.Action] = asyncio.Queue()
        for action in actions:
            queue.put_nowait(action)

        async def worker() -> None:
            while not queue.empty():
                action = queue.get_nowait()
                try:
                    await ratelimit.write(self.bucket, lambda a=action: asyncio.to_thread(self._do, a))  # type: ignore[misc]
                    self._assume(action)
                except Exception as exc:  # retried already where that helps; the next full pass tries again
                    log.warning("%s %s/%s failed: %s", action.verb, action.namespace, action.name, exc)

        await asyncio.gather(*(worker() for _ in range(PARALLEL_WRITES)))

    def _do(self, action: reconcile.Action) -> Any:
        group, version = api.GROUP, api.VERSION
        ns, name = action.namespace, action.name
        if action.verb == "create_emi":
            return self.api.create_namespaced_custom_object(group, version, ns, "executablemodelinstances",
                                                            dict(action.body))
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
        raise ValueError(f"unknown action {action.verb}")

    def _assume(self, action: reconcile.Action) -> None:
        """Reflect a successful write in the state now, before its watch event arrives."""
        key = (action.namespace, action.name)
        if action.verb == "create_emi":
            self.state.emis[key] = reconcile.EmiRecord(action.namespace, action.name, action.body["spec"], {})
        elif action.verb == "patch_emi" and key in self.state.emis:
            self.state.emis[key] = dataclasses.replace(self.state.emis[key], spec=action.body["spec"])
        elif action.verb == "delete_emi":
            emi = self.state.emis.pop(key, None)
            if emi is not None:
                self.touch((emi.namespace, emi.owner))
        elif action.verb in ("patch_spec_status", "patch_spec_meta") and key in self.state.specs:
            record = self.state.specs[key]
            if action.verb == "patch_spec_status":
                record = dataclasses.replace(record, status={**record.status, **action.body["status"]})
            else:
                record = dataclasses.replace(record, finalizers=tuple(action.body["metadata"]["finalizers"]))
            self.state.specs[key] = record


LOOP_KEY = "loop"


def _loop(memo: kopf.Memo) -> Loop:
    return memo[LOOP_KEY]  # type: ignore[no-any-return]


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    settings.posting.level = logging.WARNING
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=labels.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=labels.KOPF_PREFIX)
    settings.watching.server_timeout = 300
    loop = Loop()
    memo[LOOP_KEY] = loop
    memo["task"] = asyncio.get_running_loop().create_task(loop.run(), name="volga-reconcile")
    logger.info("volga operator: API writes limited to %.0f/s", WRITES_PER_SEC)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("task")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@kopf.on.event(api.GROUP, api.VERSION, "modelspecs")
async def on_modelspec(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    body: dict[str, Any] = dict(event["object"])
    meta: dict[str, Any] = body.get("metadata", {})
    key = (meta.get("namespace", "default"), meta["name"])
    loop = _loop(memo)
    if event["type"] == "DELETED":
        loop.state.specs.pop(key, None)
    else:
        loop.state.specs[key] = reconcile.SpecRecord(
            key[0], key[1], meta.get("uid", ""), int(meta.get("generation", 1)), body.get("spec") or {},
            body.get("status") or {}, tuple(meta.get("finalizers") or ()), bool(meta.get("deletionTimestamp")))
    loop.touch(key)


@kopf.on.event(api.GROUP, api.VERSION, "executablemodelinstances")
async def on_emi(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    body = event["object"]
    meta = body.get("metadata", {})
    key = (meta.get("namespace", "default"), meta["name"])
    loop = _loop(memo)
    old = loop.state.emis.get(key)
    if event["type"] == "DELETED":
        loop.state.emis.pop(key, None)
    else:
        loop.state.emis[key] = reconcile.EmiRecord(key[0], key[1], body.get("spec") or {}, body.get("status") or {})
    new = loop.state.emis.get(key)
    if old is None or new is None or old.status != new.status or old.spec != new.spec:
        loop.touch((key[0], (new or old).owner))  # type: ignore[union-attr]


@kopf.on.event("", "v1", "nodes")
async def on_node(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    body = event["object"]
    meta = body.get("metadata", {})
    loop = _loop(memo)
    name = meta["name"]
    profile = None if event["type"] == "DELETED" else reconcile.node_profile(
        name, meta.get("annotations"), (body.get("status") or {}).get("conditions"))
    before = loop.state.nodes.get(name)
    if profile is None:
        loop.state.nodes.pop(name, None)
    else:
        loop.state.nodes[name] = profile
    if before != profile:
        loop.touch_all()  # capacity changed: every ModelSpec may place differently
