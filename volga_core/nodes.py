"""The node wire formats: what an agent publishes of its node and what the operator publishes back.

Both sides read and write these, so they live in the shared core: a node's profile (Node annotations, read by the
planner), its autonomy heartbeat (the `labels.AUTONOMY_KEY` annotation) and the cluster's memory watermarks (the
`labels.CLUSTER_CONFIGMAP` ConfigMap).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from volga_core.api import labels


@dataclasses.dataclass(frozen=True)
class NodeProfile:
    """A node as the planner sees it; agents publish it as node annotations."""

    name: str
    gpu_count: int = 0
    gpu_product: str = ""
    gpu_memory_bytes: int = 0
    numa_nodes: tuple[int, ...] = ()
    ready: bool = True
    gpu_driver: str = ""

    def annotations(self) -> dict[str, str]:
        return {f"{labels.ANNOTATION_PREFIX}gpu-count": str(self.gpu_count),
                f"{labels.ANNOTATION_PREFIX}gpu-product": self.gpu_product,
                f"{labels.ANNOTATION_PREFIX}gpu-memory-bytes": str(self.gpu_memory_bytes),
                f"{labels.ANNOTATION_PREFIX}numa-nodes": ",".join(str(n) for n in self.numa_nodes)}

    @classmethod
    def from_annotations(cls, name: str, annotations: Mapping[str, str], ready: bool = True) -> NodeProfile:
        def get(key: str) -> str:
            return annotations.get(f"{labels.ANNOTATION_PREFIX}{key}", "")

        def integer(key: str) -> int:
            try:
                return int(get(key) or 0)
            except ValueError:
                return 0

        numa = tuple(int(n) for n in get("numa-nodes").split(",") if n.strip().lstrip("-").isdigit())
        return cls(name, integer("gpu-count"), get("gpu-product"), integer("gpu-memory-bytes"), numa, ready,
                   get("gpu-driver"))


@dataclasses.dataclass(frozen=True)
class NodeAutonomy:
    """A node's autonomy state as its agent publishes it (the `labels.AUTONOMY_KEY` annotation, JSON): the state,
    when it began and when the agent last said so, both on the agent's clock (unix seconds), the node's memory
    use in percent, and how often the agent refreshes it."""

    state: str
    since: float
    heartbeat: float
    memory_pct: float = 0.0
    period_sec: float = 5.0

    def annotation(self) -> str:
        return json.dumps({"state": self.state, "since": round(self.since, 3), "heartbeat": round(self.heartbeat, 3),
                           "memoryPct": round(self.memory_pct, 1), "periodSec": self.period_sec},
                          separators=(",", ":"))

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str] | None) -> NodeAutonomy | None:
        """The node's published state, or None when it has none (no autonomy loop) or it cannot be read."""
        raw = (annotations or {}).get(labels.AUTONOMY_KEY)
        if not raw:
            return None
        try:
            doc = json.loads(raw)
            return cls(str(doc["state"]), float(doc["since"]), float(doc["heartbeat"]),
                       float(doc.get("memoryPct", 0.0)), float(doc.get("periodSec", 5.0)))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


@dataclasses.dataclass(frozen=True)
class ClusterWatermarks:
    """The cluster's memory level over the nodes with a fresh autonomy heartbeat, as the operator publishes it for
    the agents (the `labels.CLUSTER_CONFIGMAP` ConfigMap, JSON)."""

    mean_memory_pct: float = 0.0
    max_memory_pct: float = 0.0
    nodes: int = 0
    emergency_nodes: int = 0

    def to_json(self) -> str:
        return json.dumps({"meanMemoryPct": self.mean_memory_pct, "maxMemoryPct": self.max_memory_pct,
                           "nodes": self.nodes, "emergencyNodes": self.emergency_nodes}, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | None) -> ClusterWatermarks | None:
        try:
            doc = json.loads(raw or "")
            return cls(float(doc["meanMemoryPct"]), float(doc["maxMemoryPct"]), int(doc["nodes"]),
                       int(doc["emergencyNodes"]))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
