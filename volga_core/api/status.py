"""Statuses: written by the operator (ModelSpec) and the agents (EMI), read by people and by the other side. The
models exist for the CRDs' schemas and descriptions; the writers build plain mappings (`conditions`).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from volga_core.api import base


class Condition(base.Model):
    """One Kubernetes-style condition."""

    type: str = pydantic.Field(description="Ready, Valid or Placed")
    status: Literal["True", "False", "Unknown"] = pydantic.Field(description="True, False or Unknown")
    reason: str | None = pydantic.Field(default=None, description="one CamelCase word saying why")
    message: str | None = pydantic.Field(default=None, description="why, for people")
    last_transition_time: str | None = pydantic.Field(
        default=None, json_schema_extra={"format": "date-time"},
        description="when the status last changed, RFC 3339 in UTC")
    observed_generation: int | None = pydantic.Field(
        default=None, description="the object's metadata.generation the condition was written for")


def _conditions() -> Any:
    return pydantic.Field(default=None, description="Ready (and for a ModelSpec Valid and Placed), with why",
                          json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})


class TierCounts(base.Model):
    """Instances per tier."""

    hot: int | None = pydantic.Field(default=None, alias="HOT", description="instances HOT")
    warm: int | None = pydantic.Field(default=None, alias="WARM", description="instances WARM")
    suspended: int | None = pydantic.Field(default=None, alias="SUSPENDED", description="instances SUSPENDED")
    frozen: int | None = pydantic.Field(default=None, alias="FROZEN", description="instances FROZEN")
    cold: int | None = pydantic.Field(default=None, alias="COLD", description="instances COLD")


class BatchProfile(base.Model):
    """One batch size as measured alone on a device."""

    batch_size: int = pydantic.Field(ge=1, description="samples per request")
    p50_ms: float = pydantic.Field(ge=0, description="median latency, in milliseconds")
    p99_ms: float = pydantic.Field(ge=0, description="p99 latency (the baseline), in milliseconds")
    memory_bytes: int = pydantic.Field(ge=0, description="the worker's peak memory at this batch size (host RSS "
                                                         "on a CPU, GPU memory allocated on a GPU), in bytes")
    throughput_per_sec: float = pydantic.Field(ge=0, description="samples per second, one request at a time")
    worker_p50_ms: float | None = pydantic.Field(
        default=None, ge=0, description="median latency of the worker alone (the gateway's worker client, no "
                                        "gateway), in milliseconds; unset when only the worker was measured")
    worker_p99_ms: float | None = pydantic.Field(
        default=None, ge=0, description="p99 latency of the worker alone, in milliseconds; the gateway's overhead "
                                        "is p99Ms minus this")


class Calibration(base.Model):
    """Baselines and a node profile measured on one device kind (`volga calibrate`)."""

    device: str = pydantic.Field(min_length=1, max_length=256, description="cpu, or the GPU's product name")
    version: str = pydantic.Field(description="spec.version measured")
    input_hash: str = pydantic.Field(description="the input hash measured")
    measured_at: str = pydantic.Field(default="", description="when, RFC 3339 in UTC")
    node: str = pydantic.Field(default="", description="the node measured on")
    iterations: int = pydantic.Field(default=0, ge=0, description="timed requests per batch size")
    pace_ms: float = pydantic.Field(default=0.0, ge=0, description="milliseconds between the starts of two timed "
                                                                   "requests; 0: back to back")
    batches: list[BatchProfile] = pydantic.Field(default_factory=list, max_length=64,
                                                 description="per batch size, ascending")

    measured_through: Literal["gateway", "worker"] = pydantic.Field(
        default="worker", description="what p50Ms and p99Ms time: gateway (an unmodified tritonclient through a "
                                      "gateway data plane to the worker, the path requests take) or worker (the "
                                      "gateway's worker client straight to the worker). Default: worker")

    def baselines(self) -> dict[str, float]:
        """batch size -> p99 ms, as slo.baselineLatencyMs writes it."""
        return {str(b.batch_size): b.p99_ms for b in self.batches}

    def holds_for(self, version: str, input_hash: str) -> bool:
        """Whether these baselines count for a ModelSpec of this version and input hash."""
        return (self.version, self.input_hash) == (version, input_hash)


class SharedSnapshotRef(base.Model):
    """A CRIU image on the nodes' shared snapshot storage, which any node of its GPU product and driver restores
    instead of cold-starting."""

    key: str = pydantic.Field(description="digest of the image's compatibility key (model, version, input hash, "
                                          "runtimes, CRIU, GPU, CPU features, kernel)")
    node: str = pydantic.Field(description="the node that published it")
    size_bytes: int = pydantic.Field(ge=0, description="size of the image, in bytes")
    published_at: str = pydantic.Field(description="when it was published, RFC 3339 in UTC")
    gpu_product: str = pydantic.Field(default="", description="the GPU product it needs; empty for a CPU image")
    gpu_driver: str = pydantic.Field(default="", description="the GPU driver version it was written with")
    role: str | None = pydantic.Field(default=None, description="in an EMI status: restored (the instance came "
                                                                "from it) or published (the instance wrote it)")


class ChainMigration(base.Model):
    """A move of a chain's instances off a node whose agent reported EMERGENCY for too long."""

    from_node: str = pydantic.Field(description="the node the chain left")
    to_node: str = pydantic.Field(description="the node the chain went to")
    time: str = pydantic.Field(description="when the operator moved it, RFC 3339 in UTC")
    reason: str = pydantic.Field(description="why, e.g. how long the node had been in EMERGENCY")


class ChainStatus(base.Model):
    """A head ModelSpec's chain as the operator placed it (the chain registry)."""

    members: list[str] = pydantic.Field(max_length=64, description="the chain's ModelSpecs, head first")
    node: str = pydantic.Field(default="", description="the node of the chain's first instances (index 0); empty "
                                                       "while it is not placed")
    nodes: list[str] = pydantic.Field(default_factory=list, max_length=1024,
                                      description="the node of the chain's K-th instances, by K")
    migrations: int = pydantic.Field(default=0, ge=0, description="moves off a node in EMERGENCY so far")
    last_migration: ChainMigration | None = pydantic.Field(default=None, description="the latest such move")


class CalibrationAnswer(base.Model):
    """One device kind's answer to a calibration request: the request's token, the node that took it (and holds
    it while it runs: a lease, renewed), and how it went as a `Calibrated` condition."""

    device: str = pydantic.Field(min_length=1, max_length=256, description="cpu, or the GPU's product name")
    token: str = pydantic.Field(description="the value of the volga.dev/calibrate annotation answered")
    node: str = pydantic.Field(description="the node that measured (or is measuring)")
    renewed_at: str = pydantic.Field(
        default="", json_schema_extra={"format": "date-time"},
        description="when the node last renewed its hold on the request, RFC 3339 in UTC")
    lease_sec: int = pydantic.Field(
        default=60, ge=1, description="while the condition is Unknown (measuring): how long after renewedAt "
                                      "another node of the device may take the request over, in seconds")
    condition: Condition = pydantic.Field(
        description="type Calibrated: Unknown while measuring; True when status.calibrated holds the result; "
                    "False with the reason (StartFailed: the model did not start; CalibrationFailed; InvalidSpec)")


class ModelSpecStatus(base.Model):
    """What the operator last made of a ModelSpec."""

    observed_generation: int | None = pydantic.Field(
        default=None, description="the metadata.generation this status was written for")
    conditions: list[Condition] | None = _conditions()
    input_hash: str | None = pydantic.Field(
        default=None, description="SHA-256 (hex) of the input schema, as clients send it in x-input-hash; empty "
                                  "while the inputs are to be read from the model file on the nodes")
    tiers: TierCounts | None = pydantic.Field(default=None, description="the model's instances per tier")
    instances: int | None = pydantic.Field(default=None, description="the model's instances (EMIs)")
    calibrated: list[Calibration] | None = pydantic.Field(
        default=None, max_length=64,
        description="baselines measured per device (GPU product, or cpu), with the node profile",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["device"]})
    shared_snapshots: list[SharedSnapshotRef] | None = pydantic.Field(
        default=None, max_length=64, description="the images of this model on the shared snapshot storage that "
                                                 "its instances report (restored from or published)")
    chain: ChainStatus | None = pydantic.Field(
        default=None, description="on a chain's head: its members and the nodes their instances are on")
    calibrated_for: list[CalibrationAnswer] | None = pydantic.Field(
        default=None, max_length=64,
        description="per device (GPU product, or cpu): the calibration request (the volga.dev/calibrate "
                    "annotation) last taken up by a node of that device, and how it went",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["device"]})


class SourceStatus(base.Model):
    """Where an instance's model bytes came from: a remote source fetched into the node's model cache."""

    uri: str = pydantic.Field(description="the ModelSpec's spec.source")
    digest: str = pydantic.Field(default="", description="the content digest of the bytes loaded (sha256:...); "
                                                          "empty while they are being fetched")
    fetching: bool = pydantic.Field(default=False, description="the fetch is under way")
    bytes: int = pydantic.Field(default=0, ge=0, description="bytes on the node (fetched so far, while fetching)")
    total_bytes: int = pydantic.Field(default=0, ge=0, description="the source's size, in bytes")
    rate_bytes_per_sec: float = pydantic.Field(default=0.0, ge=0, description="the fetch's current rate")


class EmiStatus(base.Model):
    """What the instance's agent last reported."""

    tier: base.Tier | None = pydantic.Field(default=None, description="the tier the instance is in now")
    conditions: list[Condition] | None = _conditions()
    snapshot_id: str | None = pydantic.Field(default=None, description="the instance's latest snapshot image")
    snapshot_bytes: int | None = pydantic.Field(default=None, description="size of that image, in bytes")
    last_used: str | None = pydantic.Field(default=None, description="when a request last reached the instance, "
                                                                     "RFC 3339 in UTC")
    last_wake_ms: float | None = pydantic.Field(default=None, description="how long the last wake took (to an "
                                                                          "answering HOT instance), in milliseconds")
    device: str | None = pydantic.Field(default=None, description="where it runs: cpu, or cuda:N")
    observed_generation: int | None = pydantic.Field(
        default=None, description="the metadata.generation this status was written for")
    gateway: str | None = pydantic.Field(default=None, description="gRPC address of the gateway on the instance's "
                                                                   "node")
    gateway_http: str | None = pydantic.Field(default=None, description=(
        "HTTP address (host:port) of the gateway on the instance's node, where other gateways pass a model server's "
        "HTTP requests on; unset: that gateway's host on the asking gateway's own HTTP port"))
    shared_snapshot: SharedSnapshotRef | None = pydantic.Field(
        default=None, description="the shared image the instance was restored from, or the last one it published")
    source: SourceStatus | None = pydantic.Field(
        default=None, description="a remote source's fetch (Fetching: bytes and rate) and then the digest loaded")
