"""What several parts of cluster mode share: the ModelSpecs they read, filled on this node."""

from __future__ import annotations

import logging
from typing import Any

from volga_agent.node import signature
from volga_agent.sources import cache, errors
from volga_core import api

log = logging.getLogger(__name__)


def with_signature(key: str, obj: Any, fetched_later: bool = False) -> api.ModelSpecSpec | None:
    """A valid ModelSpec with the inputs and outputs it leaves out read from its model file (on this node), or
    None (logged): the operator keeps specs as written, since only the nodes can read the model files. A remote
    source's spec comes back as written with `fetched_later` (the agent reads it once its bytes are here,
    `fetches`); without (the gateway, which reads no model file), only when it declares its inputs and outputs, or
    is a model server's (which has none to read)."""
    parsed, _ = api.validate_spec(obj.get("spec") or {})
    if parsed is None:
        return None
    if parsed.remote_source:
        if fetched_later or parsed.has_signature or parsed.framework is api.Framework.SERVER:  # a server: no file
            return parsed
        log.warning("ModelSpec %s: source %s is remote and the ModelSpec leaves out its inputs or outputs; a "
                    "gateway reads no model file: declare them to serve it in a cluster", key, parsed.source)
        return None
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
