"""Chains and ensembles across the ModelSpecs of one store (a `volga up` set, a namespace): the checks no
single spec can make alone (members that exist, no cycles, a model in one chain at most, ensemble inputs that
the outputs before them provide), and which ModelSpecs must be planned together (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from volga_core.api import documents, modelspec


def _way_back(head: str, member: str, chains: Mapping[str, list[str]]) -> list[str] | None:
    """The model ids from `head` through `member` along chains back to `head`; None when there is no cycle."""
    stack, seen = [[head, member]], set()
    while stack:
        path = stack.pop()
        if path[-1] in seen:
            continue
        seen.add(path[-1])
        for nxt in chains.get(path[-1], ()):
            if nxt == head:
                return [*path, head]
            stack.append([*path, nxt])
    return None


def _fits(given: modelspec.TensorSpec, wanted: modelspec.TensorSpec) -> bool:
    return given.dtype == wanted.dtype and len(given.shape) == len(wanted.shape) and all(
        g == w or -1 in (g, w) for g, w in zip(given.shape, wanted.shape, strict=True))


def _tensor_text(t: modelspec.TensorSpec) -> str:
    return f"{t.dtype.value} {modelspec._shape_text(t.shape)}"


def ensemble_problems(steps: Sequence[modelspec.ModelSpecSpec]) -> list[tuple[str, str]]:
    """(field path in the head, reason) for each input of a chain's later members that neither the head's inputs
    nor an output before it provides by name, with that dtype and a shape that fits; [] while a signature is
    unread."""
    if not all(step.has_signature for step in steps):
        return []
    available: dict[str, tuple[modelspec.TensorSpec, str]] = {
        t.name: (t, "the ensemble's input") for t in steps[0].inputs}
    problems = []
    for index, step in enumerate(steps):
        for t in step.inputs if index else ():
            source = available.get(t.name)
            path = f"spec.chain[{index - 1}]"
            if source is None:
                problems.append((path, f"input {t.name!r} of {step.model_id!r} is neither an input of the head nor "
                                       f"an output of a model before it (those are "
                                       f"{', '.join(repr(n) for n in available)})"))
            elif not _fits(source[0], t):
                problems.append((path, f"input {t.name!r} of {step.model_id!r} is {_tensor_text(t)}, and "
                                       f"{source[1]} {t.name!r} is {_tensor_text(source[0])}"))
        available.update({t.name: (t, f"the output of {step.model_id!r}") for t in step.outputs})
    return problems


def chain_problems(specs: Mapping[str, modelspec.ModelSpecSpec]) -> dict[str, list[tuple[str, str]]]:
    """The chains of one store's ModelSpecs (a `volga up` set, a namespace), keyed as `specs` is (where each was
    found): (field path, reason) for a member no ModelSpec has, a cycle, a model in two chains (the later head in
    `specs`' order is the one refused, and a head listed as another's member), an ensemble id another model or
    ensemble uses, and an ensemble whose members' inputs the outputs before them do not provide."""
    by_id = {spec.model_id: label for label, spec in specs.items()}
    chains = {spec.model_id: spec.chain for spec in specs.values() if spec.chain}
    claimed: dict[str, str] = {}  # model id -> the head of the chain it is in
    ensembles: dict[str, str] = {}
    found: dict[str, list[tuple[str, str]]] = {}
    for label, spec in specs.items():
        if not spec.chain:
            continue
        problems = []
        if spec.model_id in claimed:
            problems.append(("spec.chain", f"{spec.model_id!r} is already in the chain headed by "
                                           f"{claimed[spec.model_id]!r} ({by_id[claimed[spec.model_id]]}): a model "
                                           "is in one chain at most"))
        mine = []
        for index, member in enumerate(spec.chain):
            path = f"spec.chain[{index}]"
            if member not in by_id:
                problems.append((path, f"no ModelSpec has modelId {member!r}"))
            elif cycle := _way_back(spec.model_id, member, chains):
                problems.append((path, f"{' -> '.join(cycle)} is a cycle: a chain runs one way"))
            elif member in chains:
                problems.append((path, f"{member!r} heads a chain of its own ({by_id[member]}): a model is in one "
                                       "chain at most (list its members here instead)"))
            elif member in claimed:
                problems.append((path, f"{member!r} is already in the chain headed by {claimed[member]!r} "
                                       f"({by_id[claimed[member]]}): a model is in one chain at most"))
            else:
                mine.append(member)
        if spec.ensemble is not None:
            if spec.ensemble in by_id:
                problems.append(("spec.ensemble", f"{spec.ensemble!r} is the modelId of the ModelSpec in "
                                                  f"{by_id[spec.ensemble]}"))
            elif spec.ensemble in ensembles:
                problems.append(("spec.ensemble", f"{spec.ensemble!r} is already the ensemble of the chain headed "
                                                  f"by {ensembles[spec.ensemble]!r}"))
            elif not problems:
                problems += ensemble_problems([spec, *(specs[by_id[m]] for m in spec.chain)])
        if problems:
            found[label] = problems
            continue
        claimed.update({m: spec.model_id for m in [spec.model_id, *mine]})
        if spec.ensemble is not None:
            ensembles[spec.ensemble] = spec.model_id
    return found


def chain_errors(labelled: Iterable[tuple[str, documents.ModelSpec]]) -> list[documents.SpecError]:
    """`chain_problems` of labelled ModelSpecs (as `load_labelled` gives them), one SpecError per ModelSpec."""
    found = chain_problems({label: spec.spec for label, spec in labelled})
    return [documents.SpecError(label, problems) for label, problems in found.items()]


def chain_peers(keys: Iterable[tuple[str, str]], specs: Mapping[tuple[str, str], Mapping[str, Any]]
                ) -> set[tuple[str, str]]:
    """`keys` (namespace, name) and the ModelSpecs in a chain with one of them, so that a chain is planned as one;
    `specs` holds every ModelSpec's spec as the cluster has it. Reads only modelId and chain."""
    found = set(keys)
    by_id = {(key[0], str(spec.get("modelId", ""))): key for key, spec in specs.items()}
    for key, spec in specs.items():
        chain = spec.get("chain")
        if isinstance(chain, list) and chain:
            group = {key, *(by_id[key[0], m] for m in chain if isinstance(m, str) and (key[0], m) in by_id)}
            if group & found:
                found |= group
    return found


def chain_invalid(valid: Mapping[str, modelspec.ModelSpecSpec], everything: Mapping[str, Mapping[str, Any]]
                  ) -> dict[str, str]:
    """Of the ModelSpecs in `valid` (keyed 'namespace/name'), those whose chain cannot be used, with the message
    their Valid condition carries; `everything` holds every ModelSpec's spec as the cluster has it, by the same
    keys. A namespace in which no ModelSpec lists a chain costs one look at each of its specs."""
    invalid: dict[str, str] = {}
    for namespace in sorted({key.partition("/")[0] for key in valid}):
        keys = sorted(key for key in everything if key.partition("/")[0] == namespace)
        if not any(everything[key].get("chain") or everything[key].get("ensemble") for key in keys):
            continue
        typed = {key: spec for key in keys
                 if (spec := valid.get(key) or documents.validate_spec(everything[key])[0]) is not None}
        for key, problems in chain_problems(typed).items():
            if key in valid:
                invalid[key] = "; ".join(f"{path}: {reason}" for path, reason in problems)
    return invalid
