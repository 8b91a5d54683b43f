"""Plans for the pool tests, and a pool's releases for the Agent API's."""

from __future__ import annotations

from volga_core import api, planner

Tier = api.Tier


def desired(name: str, model_spec: str, model_id: str, tier: Tier, node: str = "n1") -> planner.Desired:
    return planner.Desired(name, model_spec, model_id, node, tier)


class Releases:
    """What the Agent API's server leases touch of the pool: which instances are servers (their names start with
    srv), and their releases, counted."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.servers = self

    def owns(self, name: str) -> bool:
        return name.startswith("srv")

    def release(self, name: str) -> None:
        self.released.append(name)
