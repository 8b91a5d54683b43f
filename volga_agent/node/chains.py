"""Chains of models as the node sees them: which models wake, idle and sit together.

A ModelSpec that lists `chain` heads a pipeline of models (OCR detection -> recognition -> field extraction, say)
that a request goes through one after the other. The pool wakes the whole chain when any member is activated, and
its idle rule treats the chain as one model; this module turns the ModelSpecs a node holds into that grouping.
The declarations are checked in `volga_core.api` (`chain_problems`); a chain that slipped past the checks is
read leniently here (members the node does not know are left out, a model two chains list stays in the first).
See docs/models.md ("Chains") and docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from volga_core import api


@dataclasses.dataclass(frozen=True)
class Chains:
    """Model id -> its chain's model ids, head first, for every model in a chain."""

    groups: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, specs: Iterable[api.ModelSpecSpec]) -> Chains:
        ordered = sorted(specs, key=lambda s: s.model_id)
        known = {s.model_id for s in ordered}
        groups: dict[str, tuple[str, ...]] = {}
        for spec in ordered:
            if not spec.chain or spec.model_id in groups:
                continue
            members = tuple(dict.fromkeys(m for m in (spec.model_id, *spec.chain) if m in known and m not in groups))
            if len(members) > 1:
                groups.update({m: members for m in members})
        return cls(groups)

    def members(self, model_id: str) -> tuple[str, ...]:
        """The model's chain, head first; the model alone when it is in none."""
        return self.groups.get(model_id, (model_id,))

    def peers(self, model_id: str) -> tuple[str, ...]:
        """The other models of its chain."""
        return tuple(m for m in self.members(model_id) if m != model_id)

    def head(self, model_id: str) -> str:
        """The chain's head ("" for a model in no chain): what the idle rule groups by."""
        return self.groups[model_id][0] if model_id in self.groups else ""
