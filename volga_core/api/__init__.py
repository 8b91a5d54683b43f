"""The ModelSpec and ExecutableModelInstance (EMI) types: the contract every Volga component shares.

These pydantic models are the one source of truth. The CRD schemas are generated from them, the operator
validates against them, `volga up` loads ModelSpec YAML through them, and the agent reads pool floors and
runtime options from them. Field names on the wire are camelCase (Kubernetes convention); Python attributes
are snake_case.

The package is the contract between the operator and the node side (docs/architecture.md). It imports nothing
else of Volga. This module only gathers the names the rest of the code reads as `api.X`; they live in:

    base        the API group and version, name rules and limits, the enums (Framework, Tier, DType,
                Precision), `Model` (the base of every type) and the small validators the fields share
    servers     a model server a ModelSpec runs instead of a model file (`framework: server`)
    modelspec   a ModelSpec's spec (`ModelSpecSpec`) and its parts: tensors, hardware, targets, SLO, pool
                floors, dynamic batching, warm-up, runtime
    documents   the ModelSpec document (metadata around a spec), parsed and loaded from YAML, `SpecError`
    chains      the checks across a store's ModelSpecs: chains and ensembles
    emi         an EMI's spec: the model, the node and GPU it is placed on, its target tier
    status      the statuses the operator (ModelSpec) and the agents (EMI) write

and beside them, imported by their own names: `crds` (the CustomResourceDefinitions generated from these
types), `conditions` (status conditions and timestamps, as both sides write them) and `labels` (the label,
annotation and finalizer names both sides use). A model file's tensor signature, which an ONNX ModelSpec may
leave out, is read on the node (`volga_agent.node.signature`).
"""

from __future__ import annotations

from volga_core.api.base import (
    API_VERSION,
    GROUP,
    MAX_CHAIN,
    MAX_DIM,
    MAX_FLOOR,
    MAX_NAME,
    NAME_RULE,
    VERSION,
    Count,
    Dim,
    DType,
    Framework,
    Model,
    Precision,
    Tier,
    bad_characters,
)
from volga_core.api.chains import chain_errors, chain_invalid, chain_peers, chain_problems, ensemble_problems
from volga_core.api.documents import (
    ModelSpec,
    ObjectMeta,
    SpecError,
    load_labelled,
    load_model_specs,
    parse_model_spec,
    problems_of,
    repeated,
    validate_spec,
)
from volga_core.api.emi import EmiSpec, GpuRef
from volga_core.api.modelspec import (
    MAX_BATCH,
    MAX_WARMUP_ELEMENTS,
    NO_SIGNATURE,
    NOT_BATCHED,
    BaselineTag,
    DynamicBatching,
    Hardware,
    ModelSpecSpec,
    Pool,
    Runtime,
    Slo,
    Targets,
    TensorSpec,
    ToleranceStep,
    WarmupInput,
    WarmupSample,
    warmup_problems,
)
from volga_core.api.servers import (
    Canary,
    Connections,
    Hooks,
    HttpCall,
    Listen,
    Protocol,
    Readiness,
    ServerSpec,
    listen_address,
    split_address,
)
from volga_core.api.status import (
    BatchProfile,
    Calibration,
    CalibrationAnswer,
    ChainMigration,
    ChainStatus,
    Condition,
    EmiStatus,
    ModelSpecStatus,
    SharedSnapshotRef,
    SourceStatus,
    TierCounts,
)

__all__ = [
    "API_VERSION", "GROUP", "MAX_BATCH", "MAX_CHAIN", "MAX_DIM", "MAX_FLOOR", "MAX_NAME", "MAX_WARMUP_ELEMENTS",
    "NAME_RULE", "NOT_BATCHED", "NO_SIGNATURE", "VERSION", "BaselineTag", "BatchProfile", "Calibration",
    "CalibrationAnswer", "Canary", "ChainMigration", "ChainStatus", "Condition", "Connections", "Count", "DType", "Dim",
    "DynamicBatching", "EmiSpec", "EmiStatus", "Framework", "GpuRef", "Hardware", "Hooks", "HttpCall", "Listen",
    "Model", "ModelSpec", "ModelSpecSpec", "ModelSpecStatus", "ObjectMeta", "Pool", "Precision", "Protocol",
    "Readiness", "Runtime", "ServerSpec", "SharedSnapshotRef", "Slo", "SourceStatus", "SpecError", "Targets",
    "TensorSpec", "Tier", "TierCounts", "ToleranceStep", "WarmupInput", "WarmupSample", "bad_characters",
    "chain_errors", "chain_invalid", "chain_peers", "chain_problems", "ensemble_problems", "listen_address",
    "load_labelled", "load_model_specs", "parse_model_spec", "problems_of", "repeated", "split_address",
    "validate_spec", "warmup_problems",
]
