"""Why an activation did not give a HOT instance: raised by the pool, read by the agent API and the gateway.

Both sides import these two from here, so the in-process gateway link (`volga up`) passes the pool's errors
on unchanged and the gRPC link raises the same ones from the Agent API's status codes (`docs/architecture.md`).
"""

from __future__ import annotations


class UnknownModel(LookupError):
    """No instance of this model (or no such instance) is placed on this node."""


class ActivationFailed(RuntimeError):
    """The instance could not be brought to HOT, not even by a cold start."""
