"""The operator writes only what the desired state and the status need: the decisions (`reconcile`) and the
loop's bookkeeping (`loop.Loop`) without an API server. tests/k8s/test_operator_writes_k8s.py shows the same on
a real one."""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
from typing import Any

import pytest
from procs import wait_for

from volga_core import nodes, planner
from volga_core.api import labels
from volga_core.kube import ratelimit, watch
from volga_operator import loop as reconcile_loop
from volga_operator import reconcile

NOW = "2026-11-29T00:00:00Z"


def spec_body(index: int) -> dict[str, Any]:
    return {"modelId": f"m{index}", "framework": "onnx", "source": "/models/m.onnx",
            "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, 1]}],
            "hardware": {"gpu": True}, "pool": {"hot": 0, "warm": 1, "frozen": 1}}


def cluster(specs: int, profiles: int = 3) -> reconcile.State:
    state = reconcile.State()
    state.nodes = {f"n{i}": nodes.NodeProfile(f"n{i}", gpu_count=4) for i in range(profiles)}
    for i in range(specs):
        state.specs[("ns", f"ms{i}")] = reconcile.SpecRecord("ns", f"ms{i}", f"uid-{i}", 1, spec_body(i), {},
                                                             (labels.FINALIZER,))
    return state


def land(state: reconcile.State, actions: list[reconcile.Action]) -> None:
    """What the API server does with the writes."""
    for a in actions:
        key = (a.namespace, a.name)
        if a.verb == "create_emi":
            state.emis[key] = reconcile.EmiRecord(a.namespace, a.name, a.body["spec"], {})
        elif a.verb == "patch_emi":
            state.emis[key] = dataclasses.replace(state.emis[key], spec=a.body["spec"])
        elif a.verb == "delete_emi":
            state.emis.pop(key, None)
        elif a.verb == "patch_spec_status":
            state.specs[key] = dataclasses.replace(state.specs[key], status=a.body["status"])


def test_a_new_modelspec_gets_one_status_write_for_the_emis_it_is_getting() -> None:
    state = cluster(1)
    first = reconcile.compute(state, [("ns", "ms0")], NOW, settle=True)
    assert collections.Counter(a.verb for a in first) == {"create_emi": 2, "patch_spec_status": 1}
    assert first[-1].body["status"]["instances"] == 2
    land(state, first)
    assert reconcile.compute(state, [("ns", "ms0")], NOW, settle=True) == []


def test_planning_a_few_then_all_moves_nothing() -> None:
    """Specs planned a few at a time (as they arrive), then all at once (a resync, a restart): no EMI changes,
    though the planner's GPU index for a kept instance depends on the load it sees while planning."""
    state = cluster(12)
    keys = sorted(state.specs)
    for i in range(0, len(keys), 5):
        land(state, reconcile.compute(state, keys[i:i + 5], NOW, settle=True))
    assert reconcile.compute(state, keys, NOW, settle=True) == []
    assert reconcile.compute(state, keys[3:4], NOW, settle=True) == []


def test_the_shortcut_for_kept_specs_plans_as_the_planner_does() -> None:
    state = cluster(8)
    keys = sorted(state.specs)
    land(state, reconcile.compute(state, keys, NOW, settle=True))
    specs = {f"{ns}/{name}": spec for (ns, name) in keys
             if (spec := reconcile.api.validate_spec(state.specs[(ns, name)].spec)[0]) is not None}
    full = planner.plan(specs, state.nodes.values(), reconcile.observed(state, NOW))
    fast = reconcile.place(state, specs, NOW)

    def where(plan: planner.Plan) -> set[tuple[str, str, str]]:
        return {(d.name, d.node, d.target_tier.value) for d in plan.desired}

    assert where(fast) == where(full) and not fast.unplaced
    # A lost node sends its specs back to the whole cluster.
    lost = state.emis[("ns", "ms0-0")].node
    state.nodes[lost] = nodes.NodeProfile(lost, gpu_count=4, ready=False)
    moved = reconcile.place(state, specs, NOW)
    assert lost not in {d.node for d in moved.desired}
    assert where(moved) == where(planner.plan(specs, state.nodes.values(), reconcile.observed(state, NOW)))


def body(kind: str, name: str, rv: int, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "metadata": {"namespace": "ns", "name": name, "resourceVersion": str(rv),
                                       "uid": "u", "generation": 1}, **fields}


def test_the_loop_ignores_what_it_holds_already() -> None:
    """Its own writes come back as watch events: an event no newer than what the loop holds plans nothing."""
    loop = reconcile_loop.Loop()
    loop.see_spec(body("ModelSpec", "ms", 10, spec=spec_body(0)))
    assert loop.dirty == {("ns", "ms")}
    loop.dirty.clear()
    loop.see_spec(body("ModelSpec", "ms", 10, spec=spec_body(0)))
    loop.see_spec(body("ModelSpec", "ms", 9, spec=spec_body(0)))
    assert loop.dirty == set()
    loop.see_spec(body("ModelSpec", "ms", 11, spec=spec_body(0)))
    assert loop.dirty == {("ns", "ms")}


def test_an_emi_event_touches_its_owner_only_when_something_changed() -> None:
    loop = reconcile_loop.Loop()
    spec = {"modelSpec": "ms", "node": "n0"}
    loop.see_emi(body("ExecutableModelInstance", "ms-0", 5, spec=spec))
    loop.dirty.clear()
    loop.see_emi(body("ExecutableModelInstance", "ms-0", 6, spec=spec, status={}))
    assert loop.dirty == set()
    loop.see_emi(body("ExecutableModelInstance", "ms-0", 7, spec=spec, status={"tier": "FROZEN"}))
    assert loop.dirty == {("ns", "ms")}


def test_emi_records_keep_only_the_status_the_operator_reads() -> None:
    status = {"tier": "HOT", "lastUsed": NOW, "snapshotBytes": 3, "conditions": [], "gateway": "x", "log": "y" * 999}
    record = reconcile.EmiRecord.from_body(body("ExecutableModelInstance", "e", 1, spec={}, status=status))
    assert set(record.status) == set(reconcile.EMI_STATUS_FIELDS)


def test_a_failed_write_is_taken_back() -> None:
    loop = reconcile_loop.Loop()
    loop.state = cluster(1)
    actions = reconcile.compute(loop.state, [("ns", "ms0")], NOW, settle=True)
    undos = [loop._assume(a) for a in actions]
    assert len(loop.state.emis) == 2 and loop.state.specs[("ns", "ms0")].status["instances"] == 2
    for undo in undos:
        undo()
    assert len(loop.state.emis) == 0 and loop.state.specs[("ns", "ms0")].status == {}


@pytest.mark.parametrize("limit", [20.0, 200.0])
def test_the_write_bucket_leaves_room_for_completion_jitter(limit: float) -> None:
    now = [0.0]
    bucket = reconcile_loop.write_bucket(limit)
    bucket.clock = lambda: now[0]
    bucket._stamp = 0.0
    starts = [bucket._reserve() for _ in range(int(limit * 5))]
    most = max(bisect.bisect_right(starts, at + 1.0 - 1e-9) - i for i, at in enumerate(starts))
    assert most <= limit * (1 - reconcile_loop.JITTER_SHARE)


def test_the_completion_window_holds_a_slot_until_a_second_after_the_write() -> None:
    """However the writes bunch up at the API server, no more than `limit` complete in any one second."""
    now = [0.0]
    window = ratelimit.CompletionWindow(2, 1.0, clock=lambda: now[0])
    window.acquire()
    window.acquire()
    window.release()  # one completed at t=0, one still in flight: both slots taken
    got = threading.Event()
    waiter = threading.Thread(target=lambda: (window.acquire(), got.set()), daemon=True)
    waiter.start()
    assert not got.wait(0.3)
    now[0] = 1.0
    with window._changed:
        window._changed.notify_all()
    assert got.wait(10)
    waiter.join()


def test_a_relist_comes_a_page_at_a_time() -> None:
    pages = {"": {"items": [{"metadata": {"name": "a"}}, {"metadata": {"name": "b"}}], "metadata": {"continue": "t"}},
             "t": {"items": [{"metadata": {"name": "c"}}], "metadata": {"resourceVersion": "9"}}}
    seen: list[tuple[list[str], bool]] = []
    events = watch.Events("x", lambda **kw: pages[kw.get("_continue", "")], lambda items: None, lambda *_: None,
                          lambda items, first: seen.append(([o["metadata"]["name"] for o in items], first)))
    assert events._list() == ([], "9")
    assert seen == [(["a", "b"], True), (["c"], False)]


def test_the_loop_drops_what_a_paged_relist_no_longer_has() -> None:
    loop = reconcile_loop.Loop()
    for name in ("kept", "gone", "later"):
        loop.see_spec({"metadata": {"name": name, "namespace": "ns", "resourceVersion": "1"}, "spec": spec_body(0)})
    loop.see_page("modelspecs", [{"metadata": {"name": "kept", "namespace": "ns"}, "spec": spec_body(0)}], True)
    loop.see_list("modelspecs", [{"metadata": {"name": "later", "namespace": "ns"}, "spec": spec_body(0)}])
    assert sorted(loop.state.specs) == [("ns", "kept"), ("ns", "later")]


def test_the_spec_index_counts_chained_specs_per_namespace() -> None:
    state = cluster(2)
    assert not state.specs.chained
    head = dataclasses.replace(state.specs[("ns", "ms0")], spec={**spec_body(0), "chain": ["m1"]})
    state.specs[("ns", "ms0")] = head
    state.specs[("other", "ms0")] = dataclasses.replace(head, namespace="other")
    assert state.specs.chained == {"ns": 1, "other": 1}
    state.specs[("ns", "ms0")] = dataclasses.replace(head, spec=spec_body(0))
    state.specs.pop(("other", "ms0"))
    assert not state.specs.chained


def test_writers_waiting_for_the_completion_window_take_slots_in_order() -> None:
    now = [0.0]
    window = ratelimit.CompletionWindow(1, 1.0, clock=lambda: now[0])
    window.acquire()
    order: list[int] = []
    waiters = []
    for i in range(3):
        waiter = threading.Thread(target=lambda i=i: (window.acquire(), order.append(i), window.release()),
                                  daemon=True)
        waiter.start()
        waiters.append(waiter)
        # In line before the next one starts.
        wait_for(f"writer {i} in line", lambda i=i: len(window._line) == i + 1, timeout=10, every=0.01)
    window.release()
    for step in range(1, 4):
        now[0] = float(step)
        with window._changed:
            window._changed.notify()
        wait_for(f"{step} writers through", lambda step=step: len(order) == step, timeout=10, every=0.01)
    for waiter in waiters:
        waiter.join(10)
    assert order == [0, 1, 2]


def test_a_stopping_operator_waits_for_its_writes_in_flight_and_drops_the_queued_ones() -> None:
    """Cancelled (the operator stopping), the loop's run ends only once no writer thread is left: the writes in
    flight finish, those still queued are dropped (the next operator plans them again). A writer still in a request
    while the interpreter shuts down can take the process down with SIGABRT."""
    import asyncio
    import contextlib

    loop = reconcile_loop.Loop(threads=2)
    loop.state = cluster(4)
    started = threading.Semaphore(0)
    release = threading.Event()
    sent: list[reconcile.Action] = []

    def slow(action: reconcile.Action) -> Any:
        started.release()
        release.wait(10)
        sent.append(action)
        raise RuntimeError("the API server is gone")  # taken back and planned again, as a failed write is

    loop._do = slow  # type: ignore[method-assign]

    async def main() -> None:
        task = asyncio.create_task(loop.run())
        for _ in range(2):  # the planner's first pass queues the four ModelSpecs' writes; both writers take one
            await asyncio.to_thread(started.acquire, True, 10)
        task.cancel()
        threading.Timer(0.2, release.set).start()  # the requests in flight answer after the stop began
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not [t for t in threading.enumerate() if t.name.startswith("volga-write-")]
    assert len(sent) == 2
