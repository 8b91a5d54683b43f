"""What several parts of cluster mode share: the ModelSpecs they read, filled on this node."""

from __future__ import annotations

import logging
from typing import Any

from volga_agent.node import signature
from volga_agent.sources import cache, errors
from volga_core import api

log = logging.getLogger(__name__)


def with_signature(key: str, obj: Any) -> api.ModelSpecSpec | None:
    """A valid ModelSpec with the inputs and outputs it leaves out read from its model file (on this node), or
    None (logged): the operator keeps specs as written, since only the nodes can read the model files."""
    parsed, _ = api.validate_spec(obj.get("spec") or {})
    if parsed is None:
        return None
    if parsed.remote_source:
        return parsed  # read once its bytes are on this node (`fetches`)
    try:
        if parsed.source_digest:
            cache.verify_local(parsed.source_path, parsed.source_digest)
    except errors.SourceError as exc:
        log.warning("ModelSpec %s: spec.sourceDigest: %s", key, exc)
        return None
    try:
        return signature.fill(parsed)
    except api.SpecError as exc:
        log.warning("ModelSpec %s: %s", key, exc)
        return None
