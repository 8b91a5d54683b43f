"""An ensemble in the load the autonomy loop reads, with real workers, the real gateway and an unmodified
tritonclient: each step counts as a request of its model (once, a batched step too), a shed model refuses the
whole ensemble before its first step, and the chain's end-to-end p99 is judged against its head's SLO."""

from __future__ import annotations

import concurrent.futures
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from procs import wait_for
from traffic import assert_retry_hints
from tritonclient.utils import InferenceServerException

from volga_agent import load
from volga_agent.app import up as volga_up
from volga_agent.autonomy import decider, loop, window
from volga_bench import chain, harness
from volga_core import api

Tier = api.Tier
CHAIN = [f"load-{name}" for name, *_ in chain.STAGES]
ENSEMBLE = f"load-{chain.ENSEMBLE}"
HEAD_BASELINE_MS = 0.001  # below any real pipeline's p99: the ensemble violates its head's SLO in every window


def specs(files: dict[str, pathlib.Path]) -> list[api.ModelSpec]:
    """The bench's chain; its middle model batches (two rows make a batch, or ten seconds pass), and its head
    declares an end-to-end baseline no pipeline meets."""
    docs = [s.model_dump(by_alias=True, exclude_none=True, mode="json") for s in chain.model_specs(files, "load", True)]
    docs[0]["spec"]["slo"] = {"baselineLatencyMs": {"1": HEAD_BASELINE_MS}, "interferenceTolerancePct": 10,
                              "recoveryDeadlineMs": 60_000}
    docs[1]["spec"]["runtime"]["dynamicBatching"] = {"enabled": True, "preferredBatchSizes": [2],
                                                     "maxQueueDelayMicroseconds": 10_000_000}
    return [api.parse_model_spec(doc) for doc in docs]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[volga_up.Embedded]:
    files = chain.build_models(tmp_path_factory.mktemp("chain"))
    bg, embedded = harness.start_embedded(specs(files), tick_sec=3600.0)  # only requests move instances
    bg.call(embedded.wait_converged(), timeout=300)
    yield embedded
    bg.call(embedded.stop(), timeout=60)
    bg.close()


class Totals:
    """The data plane's drained load, summed over drains (queue depths: the latest)."""

    def __init__(self, drain: Callable[[], dict[str, load.ModelLoad]]) -> None:
        self.drain = drain
        self.got: dict[str, load.ModelLoad] = {}

    def read(self) -> dict[str, load.ModelLoad]:
        for model, new in self.drain().items():
            old = self.got.get(model, load.ModelLoad())
            self.got[model] = load.ModelLoad(old.arrivals + new.arrivals, old.completed + new.completed,
                                             new.queue_depth, old.latencies_ms + new.latencies_ms, old.shed + new.shed)
        return self.got

    def counts(self, model: str) -> tuple[int, int, int, int, int]:
        """(arrivals, completed, queue depth, latencies, shed)."""
        got = self.got[model]
        return got.arrivals, got.completed, got.queue_depth, len(got.latencies_ms), got.shed


def tensor(client: Any, name: str, value: np.ndarray) -> Any:
    t = client.InferInput(name, list(value.shape), "FP32")
    t.set_data_from_numpy(value)
    return t


def rows(n: int, width: int = chain.IMAGE_WIDTH) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, width)).astype(np.float32)


def test_each_step_of_an_ensemble_counts_once_in_its_models_load(up: volga_up.Embedded,
                                                                  g: grpcclient.InferenceServerClient) -> None:
    plane = up.gateway.dataplane
    totals = Totals(plane.drain_load)
    totals.read()
    totals.got.clear()
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        whole = threads.submit(g.infer, ENSEMBLE, [tensor(grpcclient, "image", rows(1))])
        # The middle model's batcher holds the ensemble's step until a second row comes: the step is in that
        # model's queue (once), the head's step is answered, the last has not arrived.
        wait_for("the ensemble's step in the middle model's queue",
                 lambda: CHAIN[1] in totals.read() and totals.got[CHAIN[1]].queue_depth == 1, timeout=120, every=0.02)
        assert totals.counts(CHAIN[0]) == (1, 1, 0, 1, 0)
        assert totals.counts(CHAIN[1]) == (1, 0, 1, 0, 0)
        assert totals.counts(CHAIN[2]) == (0, 0, 0, 0, 0)
        assert totals.counts(ENSEMBLE) == (1, 0, 0, 0, 0)  # its requests wait in its models' queues
        plain = threads.submit(g.infer, CHAIN[1], [tensor(grpcclient, "features", rows(1, 1024))])
        assert whole.result(timeout=120).as_numpy("fields").shape == (1, 16)
        assert plain.result(timeout=120).as_numpy("codes").shape == (1, 1024)
    totals.read()
    assert totals.counts(CHAIN[0]) == (1, 1, 0, 1, 0)
    assert totals.counts(CHAIN[1]) == (2, 2, 0, 2, 0)  # the step and the plain request, each once
    assert totals.counts(CHAIN[2]) == (1, 1, 0, 1, 0)
    assert totals.counts(ENSEMBLE) == (1, 1, 0, 1, 0)
    steps = totals.got[CHAIN[0]].latencies_ms[0] + totals.got[CHAIN[2]].latencies_ms[0]
    assert totals.got[ENSEMBLE].latencies_ms[0] > steps  # the steps ran inside the ensemble's request

    # A plain request of a model counts for that model alone.
    g.infer(CHAIN[0], [tensor(grpcclient, "image", rows(2))])
    got = plane.drain_load()
    assert (got[CHAIN[0]].arrivals, got[CHAIN[0]].completed) == (1, 1)
    assert all(got[m].arrivals == 0 for m in (*CHAIN[1:], ENSEMBLE))


def test_a_shed_model_refuses_its_ensemble_before_the_first_step(up: volga_up.Embedded,
                                                                 g: grpcclient.InferenceServerClient,
                                                                 h: httpclient.InferenceServerClient) -> None:
    plane = up.gateway.dataplane
    registry = up.gateway.metrics.registry
    for model in CHAIN:
        up.pool.move_to(up.pool.instances(model)[0].name, Tier.FROZEN)
    shed_before = registry.get_sample_value("volga_gateway_shed_requests_total", {"model": ENSEMBLE}) or 0.0
    x = rows(2)
    plane.drain_load()
    plane.shed(CHAIN[2], 700)
    plane.shed(CHAIN[1], 1500)
    try:
        with pytest.raises(InferenceServerException, match=f"ensemble '{ENSEMBLE}': its model '{CHAIN[1]}' is "
                                                           "shedding load; retry after 1500 ms") as err:
            g.infer(ENSEMBLE, [tensor(grpcclient, "image", x)])
        assert str(err.value.status()) == "StatusCode.RESOURCE_EXHAUSTED"
        with pytest.raises(InferenceServerException, match="shedding load") as err:
            h.infer(ENSEMBLE, [tensor(httpclient, "image", x)])
        assert str(err.value.status()) == "429"
        assert_retry_hints(up.endpoints(), ENSEMBLE, {"image": x})
        # No step ran: nothing woke, nothing was answered; each model counts the refusals as shed.
        assert [up.pool.instances(m)[0].tier for m in CHAIN] == [Tier.FROZEN] * 3
        got = plane.drain_load()
        for model in (ENSEMBLE, *CHAIN):
            assert (got[model].arrivals, got[model].shed, got[model].completed, got[model].queue_depth) == (4, 4, 0, 0)
        # The head alone is not shed.
        assert g.infer(CHAIN[0], [tensor(grpcclient, "image", x)]).as_numpy("features").shape == (2, 1024)
    finally:
        plane.unshed(CHAIN[1])
        plane.unshed(CHAIN[2])
    assert registry.get_sample_value("volga_gateway_shed_requests_total", {"model": ENSEMBLE}) == shed_before + 4
    answer = g.infer(ENSEMBLE, [tensor(grpcclient, "image", rows(2))], timeout=120)
    assert answer.as_numpy("fields").shape == (2, 16)


def test_the_loop_judges_the_ensemble_against_its_heads_slo(up: volga_up.Embedded,
                                                            g: grpcclient.InferenceServerClient) -> None:
    """The loop's views of the node hold the ensemble to its head's contract; the window of the data plane's real
    load, with the ensemble's end-to-end latency in it, violates it."""
    views = loop.Views(up.pool)()
    ensemble = views[ENSEMBLE]
    assert ensemble.members == tuple(CHAIN) and not ensemble.awake
    assert ensemble.baselines == ((1, HEAD_BASELINE_MS),) and ensemble.slo.interference_tolerance_pct == 10
    assert views[CHAIN[1]].members == ()
    plane = up.gateway.dataplane
    plane.drain_load()
    g.infer(ENSEMBLE, [tensor(grpcclient, "image", rows(2))], timeout=120)
    reading = plane.drain_load()
    built = window.build([window.NodeSample(1.0, 10.0, 0.0)], [reading], 0.9)
    decision = decider.Decider().decide(built, views)
    violated = {v.model: v for v in decision.violations}
    assert violated[ENSEMBLE].p99_ms == reading[ENSEMBLE].latencies_ms[0]
    assert violated[ENSEMBLE].limit_ms == pytest.approx(HEAD_BASELINE_MS * 1.1)
    assert decision.candidate is decider.State.OPTIMIZE
