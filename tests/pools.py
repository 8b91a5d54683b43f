"""Plans for the pool tests."""

from __future__ import annotations

from volga_core import api, planner

Tier = api.Tier


def desired(name: str, model_spec: str, model_id: str, tier: Tier, node: str = "n1") -> planner.Desired:
    return planner.Desired(name, model_spec, model_id, node, tier)
