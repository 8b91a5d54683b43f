"""The label, annotation and finalizer names the operator and the agents both write or select on.

One place for them, so that the two sides cannot drift apart (docs/architecture.md).
"""

from __future__ import annotations

from volga_core import api

PREFIX = f"{api.GROUP}/"

# On a ModelSpec: the operator removes it once the ModelSpec's EMIs are gone.
FINALIZER = f"{PREFIX}cleanup"
# On an EMI: the ModelSpec that owns it, and the node it is placed on (each agent watches its own node's).
LABEL_SPEC = f"{PREFIX}modelspec"
LABEL_NODE = f"{PREFIX}node"
# Node annotations: the hardware profile an agent publishes (`nodes.NodeProfile.annotations`). A node
# hosts Volga instances only once it carries PROFILE_KEY.
ANNOTATION_PREFIX = PREFIX
PROFILE_KEY = f"{ANNOTATION_PREFIX}gpu-count"
# kopf's own bookkeeping annotations on the objects it watches.
KOPF_PREFIX = api.GROUP
# Node annotation: the Agent API address (host:port) other nodes' agents trade water levels with (neighbours);
# an agent publishes it only when its Agent API is reachable from other nodes (it has tokens).
AGENT_API_KEY = f"{ANNOTATION_PREFIX}agent-api"
# Node annotation: the node's autonomy state as its agent publishes it (`nodes.NodeAutonomy`, JSON), refreshed
# every autonomy_heartbeat_sec while the agent runs its autonomy loop.
AUTONOMY_KEY = f"{ANNOTATION_PREFIX}autonomy"
# The ConfigMap (in the operator's namespace) where the operator publishes the cluster's memory watermarks for the
# agents, under CLUSTER_WATERMARKS_KEY (`nodes.ClusterWatermarks`, JSON).
CLUSTER_CONFIGMAP = "volga-cluster"
CLUSTER_WATERMARKS_KEY = "watermarks"
# On a ModelSpec: a calibration request. Any new value (a token) asks one node per device kind holding an
# instance of the ModelSpec to measure its baselines (status.calibrated); status.calibratedFor records the
# token each device answered, so a value is measured once (docs/architecture.md).
ANNOTATION_CALIBRATE = f"{PREFIX}calibrate"
