"""`spec.runtime.dynamicBatching` on a real API server: the CRD's schema and CEL rules refuse what `volga validate`
refuses (tests/unit/test_batching_spec.py), each naming the field and the reason."""

from __future__ import annotations

from kubernetes import client as k8s_client
from specs import create, modelspec

pytest_plugins = ["k8s_fixtures"]


def test_the_api_server_refuses_what_validate_refuses(custom: tuple[k8s_client.CustomObjectsApi, str]) -> None:
    assert create(custom, modelspec("ok", runtime={"maxBatchSize": 64, "dynamicBatching": {
        "enabled": True, "preferredBatchSizes": [8, 64], "maxQueueDelayMicroseconds": 100}})) == ""
    over = create(custom, modelspec("over", runtime={"maxBatchSize": 16, "dynamicBatching": {
        "preferredBatchSizes": [32]}}))
    assert "preferredBatchSizes must be at most maxBatchSize" in over
    assert "preferredBatchSizes must be at most maxBatchSize" in create(custom, modelspec(
        "over-default", runtime={"dynamicBatching": {"preferredBatchSizes": [512]}}))  # maxBatchSize: 256
    assert "must not repeat" in create(custom, modelspec("rep", runtime={"dynamicBatching": {
        "preferredBatchSizes": [8, 8]}}))
    assert "maxQueueDelayMicroseconds" in create(custom, modelspec("slow", runtime={"dynamicBatching": {
        "maxQueueDelayMicroseconds": 10_000_001}}))
    unbatched = modelspec("flat", runtime={"dynamicBatching": {"enabled": True}})
    unbatched["spec"]["outputs"][0]["shape"] = [3]
    assert "batch as its first dimension (-1)" in create(custom, unbatched)
    unbatched["spec"]["runtime"]["dynamicBatching"]["enabled"] = False
    assert create(custom, unbatched) == ""
