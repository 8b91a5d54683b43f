"""The models a gateway can route to, and where their instances are.

The catalog holds each model's ModelSpec (from the local store, or a ModelSpec watch in a cluster), the
tensors its worker declares and the hash of its input schema; in a cluster an EMI watch adds placements,
so a gateway knows which models its node holds and which other nodes' gateways to forward to. Chains the
ModelSpecs declare as ensembles (`spec.ensemble`) are models here too (`find_ensemble`), served by `ensemble.py`.

A model whose answers contradict its declared output shapes (its worker's warm-up saw them, and the agent says so:
`links.InstanceState.answered_outputs`) has those outputs' answered shapes here (`answered`, `outputs`), which its
metadata and configuration say instead of the declaration.

The gateway reads the worker's contract (tensor declarations, input checks) here and nowhere else; see
`docs/architecture.md`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from volga_agent.gateway import ensemble, oip
from volga_agent.worker import contract, protocol
from volga_core import api

Decls = tuple[contract.TensorDecl, ...]


def tensor_decls(tensors: Sequence[api.TensorSpec]) -> Decls:
    """A ModelSpec's tensors as its worker declares them."""
    return tuple(contract.TensorDecl(t.name, t.dtype.value, tuple(t.shape)) for t in tensors)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an instance of a model is, as the cluster's EMIs say (cluster mode only)."""

    instance: str
    node: str
    tier: str
    ready: bool
    gateway: str = ""  # the gRPC address of that node's gateway, as its agent reports it
    gateway_http: str = ""  # its HTTP address (host:port), where the agent reports one


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A model this gateway names but does not serve, and why (a ModelSpec `volga up` could not load)."""

    model_id: str
    version: str
    reason: str

    @property
    def message(self) -> str:
        return f"model {self.model_id!r} is unavailable: {self.reason}"


class Catalog:
    """The models this gateway can route to (from the local store, or a ModelSpec watch in a cluster), and those
    it refuses, with the reason (`refuse`)."""

    def __init__(self, specs: Mapping[str, api.ModelSpecSpec] | None = None) -> None:
        self._models: dict[str, api.ModelSpecSpec] = {}
        self._decls: dict[str, Decls] = {}
        self._hashes: dict[str, str] = {}
        self._ensembles: dict[str, ensemble.Ensemble] = {}
        # model id -> output name -> the shape its answers have, where that contradicts the declaration
        self._answered: dict[str, dict[str, tuple[int, ...]]] = {}
        # model id -> its instances in the cluster (an EMI watch fills it); None: not known (no cluster).
        self._placements: dict[str, tuple[Placement, ...]] | None = None
        self._refused: dict[str, Refusal] = {}
        # False while a cluster's catalog waits for its first lists (`cluster.catalog.CatalogSync`): the gateway
        # then says it is not ready, rather than answering 404 for models it has not heard of yet.
        self.loaded = True
        self.replace(list((specs or {}).values()))

    def refuse(self, model_id: str, version: str, reason: str) -> None:
        """Name a model that is not served, and why: every request for it (inference, metadata, configuration) is
        UNAVAILABLE with the reason, it is never ready, and the repository index lists it as UNAVAILABLE. A
        ModelSpec with the same modelId (`replace`) goes before it."""
        self._refused[model_id] = Refusal(model_id, version, reason)

    def refusal(self, model_id: str) -> Refusal | None:
        """Why the model is not served; None for a model with a ModelSpec, or one never named."""
        return None if model_id in self._models else self._refused.get(model_id)

    def refusals(self) -> list[Refusal]:
        return sorted((r for r in self._refused.values() if r.model_id not in self._models), key=lambda r: r.model_id)

    def set_placements(self, placements: Mapping[str, Sequence[Placement]]) -> None:
        self._placements = {model: tuple(p) for model, p in placements.items()}

    def local(self, model_id: str, node: str) -> tuple[Placement, ...] | None:
        """This node's instances of the model; None when placements are not known (embedded mode)."""
        if self._placements is None or not node:
            return None
        return tuple(p for p in self._placements.get(model_id, ()) if p.node == node)

    def require_local(self, model_id: str, node: str) -> None:
        """Fail fast, before any wake, when the cluster placed the model only on other nodes."""
        here = self.local(model_id, node)
        if here is None or here:
            return
        assert self._placements is not None
        elsewhere = sorted({p.node for p in self._placements.get(model_id, ())})
        where = f"its instances are on {', '.join(elsewhere)}" if elsewhere else "it has no instance yet"
        raise oip.error("UNAVAILABLE", f"model {model_id!r} has no instance on node {node}: {where}; "
                        "send the request to a gateway on one of those nodes")

    def remote_gateways(self, model_id: str, node: str) -> list[str]:
        """Gateways (gRPC addresses) of other nodes holding the model: ready HOT instances first, then ready, then
        any."""
        return [p.gateway for p in self.remote_placements(model_id, node)]

    def remote_placements(self, model_id: str, node: str) -> list[Placement]:
        """As `remote_gateways`, one placement per gateway (with its HTTP address, where reported)."""
        if self._placements is None:
            return []
        others = [p for p in self._placements.get(model_id, ()) if p.node != node and p.gateway]
        others.sort(key=lambda p: (not p.ready, p.tier != "HOT", p.node))
        first: dict[str, Placement] = {}
        for p in others:
            first.setdefault(p.gateway, p)
        return list(first.values())

    def ready(self, model_id: str, node: str) -> bool:
        if model_id not in self._models:
            return False
        here = self.local(model_id, node)
        return here is None or any(p.ready for p in here)

    def replace(self, specs: list[api.ModelSpecSpec]) -> None:
        # What a model answers holds while its ModelSpec stays the same.
        self._answered = {m: a for m, a in self._answered.items()
                          if any(s.model_id == m and s == self._models.get(m) for s in specs)}
        self._models = {s.model_id: s for s in specs}
        self._decls = {s.model_id: tensor_decls(s.inputs) for s in specs}
        self._hashes = {s.model_id: s.input_hash() for s in specs}
        self._ensembles = ensemble.declared(specs)

    def find_ensemble(self, model_id: str) -> ensemble.Ensemble | None:
        """The ensemble a chain's head declares under this id; None for any other name."""
        return self._ensembles.get(model_id)

    def ensembles(self) -> list[ensemble.Ensemble]:
        return sorted(self._ensembles.values(), key=lambda e: e.model_id)

    def known(self, model_id: str) -> bool:
        return model_id in self._models

    def get(self, model_id: str) -> api.ModelSpecSpec:
        spec = self._models.get(model_id)
        if spec is None:
            if (refused := self._refused.get(model_id)) is not None:
                raise oip.error("UNAVAILABLE", refused.message)
            raise oip.error("NOT_FOUND", f"unknown model {model_id!r}: no ModelSpec has this modelId")
        return spec

    def decls(self, model_id: str) -> Decls:
        return self._decls[model_id]

    def input_hash(self, model_id: str) -> str:
        return self._hashes[model_id]

    def answered(self, model_id: str, shapes: Sequence[tuple[str, Sequence[int]]]) -> None:
        """The shapes the model's outputs answer with, where they contradict the declaration (as the agent reports
        them from a worker's warm-up); outputs the model does not declare are left out."""
        declared = {t.name for t in self.get(model_id).outputs}
        self._answered[model_id] = {name: tuple(shape) for name, shape in shapes if name in declared}

    def outputs(self, model_id: str) -> list[api.TensorSpec]:
        """The model's outputs as its answers have them: declared, but for the answered shapes known (`answered`)."""
        answered = self._answered.get(model_id, {})
        return [t.model_copy(update={"shape": list(answered[t.name])}) if t.name in answered else t
                for t in self.get(model_id).outputs]

    def check_inputs(self, model_id: str, inputs: dict[str, np.ndarray]) -> None:
        """Names, dtypes, shapes and batch size against the model's declaration, as its worker checks them."""
        try:
            contract.check_inputs(self.decls(model_id), inputs, self.get(model_id).runtime.max_batch_size)
        except protocol.WorkerError as exc:
            raise oip.error(exc.code, exc.message) from None

    def all(self) -> list[api.ModelSpecSpec]:
        return sorted(self._models.values(), key=lambda s: s.model_id)
