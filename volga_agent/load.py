"""What a gateway reports of one model's load, as the node autonomy loop reads it.

The gateway's data plane drains it (`gateway.dataplane.ModelLoad`, a frozen dataclass that satisfies this
structurally); the loop reads it in-process (`volga up`) or over the Agent API (the sidecar gateway's
`links.Exchanger`). It lives here, below both, because the gateway and the autonomy loop do not import each
other (docs/architecture.md).
"""

from __future__ import annotations

from typing import Protocol


class LoadReading(Protocol):
    """One model's load since the previous reading (read-only attributes)."""

    @property
    def arrivals(self) -> int: ...

    @property
    def completed(self) -> int: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def latencies_ms(self) -> tuple[float, ...]: ...

    @property
    def shed(self) -> int: ...
