"""Kubernetes-style status conditions and timestamps, as the operator (ModelSpec status) and the agents (EMI
status) write them: one format on both sides, so each can read what the other wrote."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Mapping
from typing import Any

TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def timestamp(unix: float | None = None) -> str:
    """RFC 3339 in UTC, to the second (now, without an argument)."""
    return datetime.datetime.fromtimestamp(time.time() if unix is None else unix, datetime.UTC).strftime(TIME_FORMAT)


def unix(stamp: str) -> float | None:
    """The time a `timestamp` names, or None when it is not one."""
    try:
        return datetime.datetime.strptime(stamp, TIME_FORMAT).replace(tzinfo=datetime.UTC).timestamp()
    except (TypeError, ValueError):
        return None


def condition(type_: str, ok: bool, reason: str, message: str, previous: Iterable[Mapping[str, Any]],
              now: str) -> dict[str, Any]:
    """A condition that keeps its lastTransitionTime while its status does not change."""
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == type_), None)
    since = old.get("lastTransitionTime", now) if old and old.get("status") == status else now
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}


def is_true(conditions: Iterable[Mapping[str, Any]], type_: str = "Ready") -> bool:
    return any(c.get("type") == type_ and c.get("status") == "True" for c in conditions)
