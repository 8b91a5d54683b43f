"""`spec.runtime.dynamicBatching`: what `volga validate` (pydantic) refuses, naming the field and the reason. What a
real API server (the CRD's schema and CEL rules) refuses: tests/k8s/test_batching_spec_k8s.py."""

from __future__ import annotations

from typing import Any

from specs import modelspec

from volga_core import api


def problems(runtime: dict[str, Any], output_shape: list[int] | None = None) -> dict[str, str]:
    doc = modelspec("b", runtime=runtime)
    if output_shape is not None:
        doc["spec"]["outputs"][0]["shape"] = output_shape
    try:
        api.parse_model_spec(doc)
    except api.SpecError as exc:
        return dict(exc.problems)
    return {}


def test_valid_dynamic_batching() -> None:
    doc = modelspec("b", runtime={"maxBatchSize": 64, "dynamicBatching": {
        "enabled": True, "preferredBatchSizes": [32, 8], "maxQueueDelayMicroseconds": 500, "maxQueueSize": 100}})
    batching = api.parse_model_spec(doc).spec.runtime.dynamic_batching
    assert batching.preferred_batch_sizes == [8, 32]  # ascending
    assert (batching.max_queue_delay_microseconds, batching.max_queue_size) == (500, 100)
    defaults = api.parse_model_spec(modelspec("d")).spec.runtime.dynamic_batching
    assert (defaults.enabled, defaults.preferred_batch_sizes, defaults.max_queue_delay_microseconds,
            defaults.max_queue_size) == (False, [], 0, 1024)


def test_invalid_dynamic_batching_names_the_field() -> None:
    path = "spec.runtime.dynamicBatching"
    found = problems({"maxBatchSize": 16, "dynamicBatching": {"enabled": True, "preferredBatchSizes": [8, 32]}})
    assert "32 over runtime.maxBatchSize 16" in found[f"{path}.preferredBatchSizes"]
    found = problems({"dynamicBatching": {"preferredBatchSizes": [4, 4, 0]}})
    assert "greater than or equal to 1" in found[f"{path}.preferredBatchSizes[2]"]
    found = problems({"dynamicBatching": {"preferredBatchSizes": [4, 4]}})
    assert "repeated: 4" in found[f"{path}.preferredBatchSizes"]
    found = problems({"dynamicBatching": {"maxQueueDelayMicroseconds": -1, "maxQueueSize": 0, "size": 3}})
    assert "greater than or equal to 0" in found[f"{path}.maxQueueDelayMicroseconds"]
    assert "greater than or equal to 1" in found[f"{path}.maxQueueSize"]
    assert found[f"{path}.size"] == "unknown field"


def test_only_batch_first_models_can_batch() -> None:
    found = problems({"dynamicBatching": {"enabled": True}}, output_shape=[3])
    reason = found["spec.runtime.dynamicBatching.enabled"]
    assert "first dimension (-1)" in reason and "outputs[0] 'y' has shape [3]" in reason
    assert problems({"dynamicBatching": {"enabled": False}}, output_shape=[3]) == {}
