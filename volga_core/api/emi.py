"""An ExecutableModelInstance's spec: one instance of a ModelSpec's model, the node and GPU the operator placed
it on, and the tier its pool wants it to rest in. The node's agent runs it. The second resource of the
contract, next to the ModelSpec: the operator writes it, and nothing of the ModelSpec's types is in it.
"""

from __future__ import annotations

import pydantic

from volga_core.api import base


class GpuRef(base.Model):
    """The GPU of the node an instance runs on."""

    index: int = pydantic.Field(ge=0, description="the GPU's index on its node, as CUDA numbers it (>= 0)")
    uuid: str = pydantic.Field(default="", description="the GPU's UUID, where known. Default: ''")


class EmiSpec(base.Model):
    """Desired state of one instance: which model, where, and the tier the pool wants it in."""

    model_spec: str = pydantic.Field(description="name of the owning ModelSpec, in the same namespace")
    model_id: str = pydantic.Field(description="the owning ModelSpec's spec.modelId")
    node: str = pydantic.Field(description="the node the instance is placed on; that node's agent runs it")
    gpu: GpuRef | None = pydantic.Field(default=None, description="the GPU it runs on. Default: unset, a CPU "
                                                                  "instance")
    target_tier: base.Tier = pydantic.Field(default=base.Tier.FROZEN, description=(
        "the tier the pool wants the instance to rest in (HOT, WARM, SUSPENDED, FROZEN or COLD); a request wakes it "
        "to HOT, idleness brings it back. Default: FROZEN"))
