"""A ModelSpec source parsed: its scheme and the parts each store needs. Pure: no network, no files."""

from __future__ import annotations

import dataclasses
import re
import urllib.parse

from volga_core import api

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# An OCI reference: registry[:port]/repository[:tag|@sha256:...] (the distribution spec's grammar, simplified).
_OCI = re.compile(r"^(?P<registry>[A-Za-z0-9.-]+(?::[0-9]+)?)/(?P<repo>[a-z0-9]+(?:[._/-][a-z0-9]+)*)"
                  r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9._-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")


@dataclasses.dataclass(frozen=True)
class Source:
    """scheme: file, s3, https (http too, for a loopback or plain-HTTP server) or oci. For s3: host is the bucket,
    path the key (a folder when it ends in '/'). For oci: host the registry, path the repository, ref the tag or
    the manifest digest."""

    uri: str
    scheme: str
    host: str = ""
    path: str = ""
    ref: str = ""

    @property
    def remote(self) -> bool:
        return self.scheme != "file"

    @property
    def folder(self) -> bool:
        return self.scheme == "s3" and self.path.endswith("/")

    @property
    def name(self) -> str:
        """The file name the source's bytes keep in the cache (a loader may care: ONNX external data is found
        beside the model file by name)."""
        last = self.path.rstrip("/").rsplit("/", 1)[-1]
        return last or "model"

    def __str__(self) -> str:
        return self.uri


def parse(uri: str) -> Source:
    """The source `uri` names; ValueError saying why it is not one."""
    if "://" not in uri:
        return Source(uri, "file", path=uri)
    scheme, rest = uri.split("://", 1)
    if scheme == "file":
        return Source(uri, "file", path=rest)
    if scheme == "s3":
        bucket, _, key = rest.partition("/")
        if not bucket or not key:
            raise ValueError(f"{uri}: an s3 source is s3://bucket/key (a folder: s3://bucket/prefix/)")
        return Source(uri, "s3", bucket, key)
    if scheme in ("https", "http"):
        parts = urllib.parse.urlsplit(uri)
        if not parts.hostname or not parts.path.strip("/"):
            raise ValueError(f"{uri}: an {scheme} source names a file on a server: {scheme}://host/path")
        if parts.path.endswith("/"):
            raise ValueError(f"{uri}: a folder cannot be listed over HTTP; push it to an OCI registry or an S3 "
                             "bucket, or name its files one ModelSpec each")
        return Source(uri, scheme, parts.netloc, parts.path)
    if scheme == "oci":
        match = _OCI.match(rest)
        if match is None:
            raise ValueError(f"{uri}: an oci source is oci://registry/repository:tag or "
                             "oci://registry/repository@sha256:<64 hex digits>")
        return Source(uri, "oci", match["registry"], match["repo"], match["digest"] or match["tag"] or "latest")
    raise ValueError(f"{uri}: unknown scheme {scheme}://; a source is a node path, file://, s3://, https:// or oci://")


def check_digest(value: str) -> str:
    if not _DIGEST.match(value):
        raise ValueError(f"{value!r} is not a content digest: write sha256: and 64 lowercase hex digits")
    return value


def of_spec(spec: api.ModelSpecSpec) -> Source:
    return parse(spec.source)
