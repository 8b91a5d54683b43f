"""The errors a source fetch raises, one family: each says what failed and what to do, and none carries a
credential."""

from __future__ import annotations


class SourceError(Exception):
    """A model source could not be fetched or verified. `retry`: whether trying again later may succeed."""

    retry = False
    reason = "SourceFailed"  # the EMI condition's reason


class SourceUnavailable(SourceError):
    """The store did not answer, or answered with a server error: tried again with backoff."""

    retry = True
    reason = "SourceUnavailable"


class SourceDenied(SourceError):
    """The store refused the credentials (or their absence): not retried until the ModelSpec or its Secret changes."""

    reason = "SourceDenied"


class SourceUntrusted(SourceError):
    """The store's TLS certificate is not signed by a CA this node trusts (a self-signed or private CA): a
    configuration error, not retried until the ModelSpec or its Secret changes (SOURCE_CA_BUNDLE gives the CA)."""

    reason = "SourceCertificateUntrusted"


class SourceNotFound(SourceError):
    """The store has no such object, bucket, repository or tag."""

    reason = "SourceNotFound"


class SourceMismatch(SourceError):
    """The bytes fetched are not the ones promised (spec.sourceDigest, the object's size, an OCI layer's digest):
    refused, never served."""

    reason = "SourceDigestMismatch"


class CacheFull(SourceError):
    """The model does not fit the cache's disk budget (or the disk) even after evicting every model no instance
    holds."""

    retry = True
    reason = "CacheFull"
