"""Chains with real workers, real CRIU and the real gateway: a frozen chain wakes as one, idles as one, and its
ensemble answers through an unmodified tritonclient as Triton's ensembles do."""

from __future__ import annotations

import concurrent.futures
import pathlib
import time
from collections.abc import Iterator

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import numpy_helper
from tritonclient.utils import InferenceServerException

from volga_agent.app import up as volga_up
from volga_bench import chain, harness
from volga_core import api

Tier = api.Tier
CHAIN = [f"chain-{name}" for name, *_ in chain.STAGES]
SEPARATE = [f"separate-{name}" for name, *_ in chain.STAGES]
ENSEMBLE = f"chain-{chain.ENSEMBLE}"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    return chain.build_models(tmp_path_factory.mktemp("chain"))


@pytest.fixture(scope="module")
def up(files: dict[str, pathlib.Path]) -> Iterator[volga_up.Embedded]:
    specs = [*chain.model_specs(files, "chain", True), *chain.model_specs(files, "separate", False)]
    bg, embedded = harness.start_embedded(specs, tick_sec=3600.0)  # only the tests move instances
    bg.call(embedded.wait_converged(), timeout=300)
    yield embedded
    bg.call(embedded.stop(), timeout=60)
    bg.close()


def image(batch: int = 3) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((batch, chain.IMAGE_WIDTH)).astype(np.float32)


def by_numpy(files: dict[str, pathlib.Path], x: np.ndarray) -> np.ndarray:
    for index, (name, *_) in enumerate(chain.STAGES):
        x = x @ numpy_helper.to_array(onnx.load(str(files[name])).graph.initializer[0])
        if index < len(chain.STAGES) - 1:
            x = np.maximum(x, 0)
    return x


def infer(client: grpcclient.InferenceServerClient, model: str, name: str, value: np.ndarray,
          output: str) -> np.ndarray:
    tensor = grpcclient.InferInput(name, list(value.shape), "FP32")
    tensor.set_data_from_numpy(value)
    answer: np.ndarray = client.infer(model, [tensor]).as_numpy(output)
    return answer


def freeze(up: volga_up.Embedded, models: list[str]) -> list[str]:
    names = [up.pool.instances(m)[0].name for m in models]
    for name in names:
        up.pool.move_to(name, Tier.FROZEN)
    return names


def tiers(up: volga_up.Embedded, models: list[str]) -> list[Tier]:
    return [up.pool.instances(m)[0].tier for m in models]


def test_waking_one_model_of_a_frozen_chain_wakes_the_others_without_waiting(up: volga_up.Embedded) -> None:
    freeze(up, CHAIN + SEPARATE)
    before = up.pool.activations
    last = up.pool.slots[up.pool.instances(CHAIN[-1])[0].name]
    # Hold the last model's lock: an activation that waited for the whole chain could not return.
    with last.lock, concurrent.futures.ThreadPoolExecutor(1) as pool:
        activation = pool.submit(up.pool.activate, CHAIN[0]).result(timeout=120)
        assert activation.woke_from is Tier.FROZEN and tiers(up, CHAIN)[-1] is Tier.FROZEN
    up.pool.wait_converged(120)
    assert tiers(up, CHAIN) == [Tier.HOT] * 3
    assert tiers(up, SEPARATE) == [Tier.FROZEN] * 3  # models in no chain stay where they are
    assert up.pool.activations == before + 3
    up.pool.activate(SEPARATE[0])
    up.pool.wait_converged(120)
    assert tiers(up, SEPARATE) == [Tier.HOT, Tier.FROZEN, Tier.FROZEN]


def test_a_member_hot_only_on_its_way_to_its_resting_tier_wakes_with_its_chain(up: volga_up.Embedded) -> None:
    """A member that is HOT because its instance is walking through HOT to its resting tier (a new instance's cold
    start on its way to FROZEN, under the slot's lock) is woken with its chain once the walk is done, not taken
    for awake and left FROZEN."""
    for model in CHAIN:
        up.pool.activate(model)
    up.pool.wait_converged(120)
    freeze(up, CHAIN[:1])
    last = up.pool.slots[up.pool.instances(CHAIN[-1])[0].name]
    with last.lock:  # as `Pool._converge` holds it for the whole walk
        assert up.pool.activate(CHAIN[0]).woke_from is Tier.FROZEN
        last.inst.to(Tier.FROZEN)  # the walk's last step
    deadline = time.monotonic() + 120
    while tiers(up, CHAIN) != [Tier.HOT] * 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiers(up, CHAIN) == [Tier.HOT] * 3


def test_a_chain_is_demoted_for_idleness_as_one(up: volga_up.Embedded) -> None:
    for model in CHAIN:
        up.pool.activate(model)
    up.pool.wait_converged(120)
    slots = [up.pool.slots[up.pool.instances(m)[0].name] for m in CHAIN]
    now = slots[0].inst.last_used
    for slot in slots[1:]:
        slot.inst.last_used = now - 10_000  # long idle, but the head was just used
    idle = up.settings.idle.suspended_sec  # a CPU instance freezes after it
    assert [m for m in up.pool.tick(now + 1) if m.instance in {s.inst.name for s in slots}] == []
    moves = up.pool.tick(now + idle + 1)
    assert sorted(m.instance for m in moves if m.target is Tier.FROZEN) >= sorted(s.inst.name for s in slots)


def test_an_ensemble_is_one_model_to_tritonclient(up: volga_up.Embedded, files: dict[str, pathlib.Path],
                                                  g: grpcclient.InferenceServerClient,
                                                  h: httpclient.InferenceServerClient) -> None:
    config = g.get_model_config(ENSEMBLE).config
    assert config.platform == "ensemble" and config.max_batch_size == 256
    assert [(s.model_name, dict(s.input_map), dict(s.output_map)) for s in config.ensemble_scheduling.step] == [
        (CHAIN[0], {"image": "image"}, {"features": "features"}),
        (CHAIN[1], {"features": "features"}, {"codes": "codes"}),
        (CHAIN[2], {"codes": "codes"}, {"fields": "fields"})]
    assert [(i.name, list(i.dims)) for i in config.input] == [("image", [chain.IMAGE_WIDTH])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("fields", [16])]
    rest = h.get_model_config(ENSEMBLE)
    assert rest["platform"] == "ensemble"
    assert [s["model_name"] for s in rest["ensemble_scheduling"]["step"]] == CHAIN
    metadata = g.get_model_metadata(ENSEMBLE)
    assert metadata.platform == "ensemble" and [t.name for t in metadata.outputs] == ["fields"]
    assert g.is_model_ready(ENSEMBLE)
    assert ENSEMBLE in {m.name for m in g.get_model_repository_index().models}

    freeze(up, CHAIN)
    x = image()
    one = infer(g, ENSEMBLE, "image", x, "fields")  # one request: the whole chain, from FROZEN
    assert tiers(up, CHAIN) == [Tier.HOT] * 3
    steps = x
    for model, (_, source, target, _) in zip(SEPARATE, chain.STAGES, strict=True):
        steps = infer(g, model, source, steps, target)
    assert one.shape == (3, 16) and np.array_equal(one, steps)
    np.testing.assert_allclose(one, by_numpy(files, x), rtol=1e-4, atol=1e-4)

    tensor = httpclient.InferInput("image", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    assert np.array_equal(h.infer(ENSEMBLE, [tensor]).as_numpy("fields"), one)


def test_bad_input_to_an_ensemble_is_refused_with_its_reason(g: grpcclient.InferenceServerClient) -> None:
    x = image()
    with pytest.raises(InferenceServerException) as info:
        infer(g, ENSEMBLE, "features", x, "fields")
    assert "INVALID_ARGUMENT" in str(info.value.status()) and "image" in info.value.message()
    tensor = grpcclient.InferInput("image", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as info:
        g.infer(ENSEMBLE, [tensor], headers={"x-input-hash": "0" * 64})
    assert "INVALID_ARGUMENT" in str(info.value.status()) and "x-input-hash" in info.value.message()
