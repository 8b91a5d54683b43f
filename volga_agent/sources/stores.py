"""The stores a model is fetched from, behind one small interface: `describe` lists what a source holds (its
objects, their sizes and versions) and `read` streams a byte range of one object.

S3-compatible stores go through botocore (any endpoint, path-style or virtual-hosted); HTTPS servers and OCI
registries (the distribution API, as ORAS pushes artifacts to it) go through requests. Credentials come as a
mapping of environment-variable names (a Kubernetes Secret's keys, or the node's environment for `volga up`):

    S3     AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION (or AWS_DEFAULT_REGION),
           AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) for a store other than AWS, S3_ADDRESSING_STYLE (path,
           virtual or auto; path when an endpoint is given)
    HTTPS  SOURCE_TOKEN (a bearer token) or SOURCE_USERNAME and SOURCE_PASSWORD (basic)
    OCI    SOURCE_USERNAME and SOURCE_PASSWORD (or SOURCE_TOKEN), for the registry's basic or token auth;
           SOURCE_PLAIN_HTTP=true for a registry without TLS (=false for TLS on a loopback registry, which is
           otherwise reached over HTTP)
    TLS    the system's CAs; SOURCE_CA_BUNDLE for a store whose certificate a private CA signed (in a Secret: the
           CA's PEM text; in `volga up`'s environment: a PEM file); REQUESTS_CA_BUNDLE and AWS_CA_BUNDLE in the
           environment work too (requests' and botocore's own settings). A certificate not trusted is a
           configuration error (SourceUntrusted), not retried.

No credential is ever logged or put into an error message: errors name the source and, where given, the Secret.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import requests

from volga_agent.sources import errors, uri

READ_BYTES = 1 << 20
TIMEOUT = (10.0, 60.0)  # connect, read (seconds)
OCI_MANIFESTS = ("application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json")
OCI_TITLE = "org.opencontainers.image.title"
CA_BUNDLE = "SOURCE_CA_BUNDLE"  # a PEM file of the CAs to trust for this source (the cache writes a Secret's PEM)
ORAS_UNPACK = "io.deis.oras.content.unpack"


@dataclasses.dataclass(frozen=True)
class Object:
    """One object of a source. relpath: its path in the model's folder; version: what changes when its bytes do
    (an ETag, a layer digest); digest: the sha256 the store promises for it, checked after the fetch ('' where the
    store promises none); unpack: a gzipped tar of a folder (as ORAS pushes a folder)."""

    key: str
    relpath: str
    size: int
    version: str
    digest: str = ""
    unpack: bool = False


@dataclasses.dataclass(frozen=True)
class Listing:
    """What a source holds now. version: changes when any object does (a new model version under the same URI)."""

    objects: tuple[Object, ...]
    version: str
    folder: bool

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)


class Store(Protocol):
    def describe(self, source: uri.Source) -> Listing: ...

    def read(self, obj: Object, start: int, end: int) -> Iterator[bytes | memoryview]:
        """Bytes [start, end) of `obj`, as they arrive (a memoryview piece holds only until the next is asked for);
        SourceUnavailable when the object changed meanwhile."""
        ...


def _where(secret: str) -> str:
    return f" (credentials from Secret {secret!r})" if secret else ""


_VERIFY_FAILED = re.compile(r"certificate verify failed:?\s*([^()\]]*)", re.IGNORECASE)


def _untrusted(source: str, exc: Exception, secret: str) -> errors.SourceUntrusted | None:
    """SourceUntrusted when `exc` is a TLS certificate the node does not trust (else None)."""
    found = _VERIFY_FAILED.search(str(exc))
    if found is None:
        return None
    why = found.group(1).strip().rstrip(".") or "certificate verify failed"
    where = (f"add the CA that signed it (PEM) to Secret {secret!r} as key {CA_BUNDLE}" if secret else
             f"give the CA that signed it as {CA_BUNDLE} (a PEM file in volga up's environment, or a key of the "
             "Secret spec.sourceSecret names)")
    return errors.SourceUntrusted(f"{source}: the server's TLS certificate was not trusted ({why}): {where}")


def open_store(source: uri.Source, credentials: Mapping[str, str], secret: str = "", connections: int = 8) -> Store:
    """The store `source` lives in. `secret`: the name of the Secret the credentials came from, for errors."""
    if source.scheme == "s3":
        return S3Store(credentials, secret, connections)
    if source.scheme in ("https", "http"):
        return HttpStore(credentials, secret, connections)
    if source.scheme == "oci":
        return OciStore(source, credentials, secret, connections)
    raise ValueError(f"{source}: not a remote source")


# -- S3 -----------------------------------------------------------------------------------------------------------

_S3_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
              "AllAccessDisabled", "403", "401"}
_S3_MISSING = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}


class S3Store:
    def __init__(self, credentials: Mapping[str, str], secret: str, connections: int) -> None:
        import botocore.config
        import botocore.session

        self.secret = secret
        self._bucket = ""
        endpoint = credentials.get("AWS_ENDPOINT_URL_S3") or credentials.get("AWS_ENDPOINT_URL") or None
        style = credentials.get("S3_ADDRESSING_STYLE") or ("path" if endpoint else "auto")
        config = botocore.config.Config(
            s3={"addressing_style": style}, max_pool_connections=max(connections, 10),
            retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=TIMEOUT[0], read_timeout=TIMEOUT[1])
        session = botocore.session.Session()
        keys = {}
        if credentials.get("AWS_ACCESS_KEY_ID"):
            keys = {"aws_access_key_id": credentials["AWS_ACCESS_KEY_ID"],
                    "aws_secret_access_key": credentials.get("AWS_SECRET_ACCESS_KEY", ""),
                    "aws_session_token": credentials.get("AWS_SESSION_TOKEN") or None}
        region = credentials.get("AWS_REGION") or credentials.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.client: Any = session.create_client("s3", region_name=region, endpoint_url=endpoint, config=config,
                                                 verify=credentials.get(CA_BUNDLE) or None, **keys)

    def _error(self, source: str, exc: Exception) -> errors.SourceError:
        import botocore.exceptions as bx

        if isinstance(exc, bx.SSLError) and (untrusted := _untrusted(source, exc, self.secret)) is not None:
            return untrusted
        if isinstance(exc, bx.NoCredentialsError):
            return errors.SourceDenied(f"{source}: no S3 credentials{_where(self.secret)}: set AWS_ACCESS_KEY_ID "
                                       "and AWS_SECRET_ACCESS_KEY")
        if isinstance(exc, bx.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in _S3_DENIED or status in (401, 403):
                return errors.SourceDenied(f"{source}: the store refused the credentials{_where(self.secret)}: "
                                           f"{code or status}")
            if code in _S3_MISSING or status == 404:
                return errors.SourceNotFound(f"{source}: no such object or bucket ({code or status})")
            if code in ("PreconditionFailed", "412") or status == 412:
                return errors.SourceUnavailable(f"{source}: the object changed during the fetch")
            return errors.SourceUnavailable(f"{source}: the store answered {code or status}")
        return errors.SourceUnavailable(f"{source}: the store is unreachable: {type(exc).__name__}")

    def describe(self, source: uri.Source) -> Listing:
        self._bucket = source.host
        try:
            if source.folder:
                objects = []
                pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=source.host, Prefix=source.path)
                for page in pages:
                    for item in page.get("Contents", []):
                        rel = item["Key"][len(source.path):]
                        if rel.startswith("/") or ".." in rel.split("/"):
                            raise errors.SourceNotFound(f"{source}: object {item['Key']!r} would land outside the "
                                                        "model's folder")
                        if rel and not rel.endswith("/"):
                            objects.append(Object(item["Key"], rel, int(item["Size"]), item["ETag"].strip('"')))
                if not objects:
                    raise errors.SourceNotFound(f"{source}: no objects under the prefix {source.path!r}")
            else:
                head = self.client.head_object(Bucket=source.host, Key=source.path)
                objects = [Object(source.path, source.name, int(head["ContentLength"]), head["ETag"].strip('"'))]
        except errors.SourceError:
            raise
        except Exception as exc:
            raise self._error(source.uri, exc) from None
        objects.sort(key=lambda o: o.relpath)
        version = hashlib.sha256(json.dumps([(o.relpath, o.size, o.version) for o in objects]).encode()).hexdigest()
        return Listing(tuple(objects), version, source.folder)

    def read(self, obj: Object, start: int, end: int) -> Iterator[bytes | memoryview]:
        """The range's bytes, read into one buffer that each piece yielded is a view of (the caller writes it out
        before asking for the next): 5-8 % less CPU per fetched GiB than a new bytes object per read, measured."""
        bucket = self._bucket
        try:
            reply = self.client.get_object(Bucket=bucket, Key=obj.key, Range=f"bytes={start}-{end - 1}",
                                           IfMatch=f'"{obj.version}"')
            body = reply["Body"]
            # botocore's body wraps urllib3's response (no content decoding), which wraps http.client's: read
            # straight from the latter where it is there, as botocore's own read does through the two layers.
            raw: Any = getattr(body, "_raw_stream", None)
            into = getattr(getattr(raw, "_fp", None), "readinto", None)
            if into is None or not hasattr(raw, "release_conn"):
                while chunk := body.read(READ_BYTES):
                    yield chunk
                return
            buffer = bytearray(READ_BYTES)
            view = memoryview(buffer)
            ended = False
            try:
                while n := into(buffer):
                    yield view[:n]
                ended = True
            finally:
                if ended:
                    raw.release_conn()  # read to its end: the connection serves the next range
                else:
                    body.close()  # cut short: the connection is not reused
        except Exception as exc:
            raise self._error(f"s3://{bucket}/{obj.key}", exc) from None


# -- HTTP(S) ------------------------------------------------------------------------------------------------------

class _Session(requests.Session):
    """A session that verifies TLS against `ca` (a PEM file) when given: requests lets REQUESTS_CA_BUNDLE in the
    environment override a session's own `verify`, so it is passed with every request."""

    ca = ""

    def request(self, *args: Any, **kwargs: Any) -> requests.Response:
        if self.ca:
            kwargs.setdefault("verify", self.ca)
        return super().request(*args, **kwargs)


def _session(credentials: Mapping[str, str], connections: int) -> requests.Session:
    session = _Session()
    session.ca = credentials.get(CA_BUNDLE, "")
    adapter = requests.adapters.HTTPAdapter(pool_connections=connections, pool_maxsize=max(connections, 10))
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    if credentials.get("SOURCE_TOKEN"):
        session.headers["Authorization"] = f"Bearer {credentials['SOURCE_TOKEN']}"
    elif credentials.get("SOURCE_USERNAME"):
        session.auth = (credentials["SOURCE_USERNAME"], credentials.get("SOURCE_PASSWORD", ""))
    return session


def _unreachable(source: str, exc: requests.RequestException, secret: str, what: str) -> errors.SourceError:
    if isinstance(exc, requests.exceptions.SSLError) and (untrusted := _untrusted(source, exc, secret)) is not None:
        return untrusted
    return errors.SourceUnavailable(f"{source}: the {what} is unreachable: {type(exc).__name__}")


def _check(reply: requests.Response, source: str, secret: str) -> None:
    if reply.status_code in (401, 403):
        raise errors.SourceDenied(f"{source}: the server refused the credentials{_where(secret)}: HTTP "
                                  f"{reply.status_code}")
    if reply.status_code == 404:
        raise errors.SourceNotFound(f"{source}: HTTP 404")
    if reply.status_code == 412:
        raise errors.SourceUnavailable(f"{source}: the object changed during the fetch")
    if reply.status_code >= 400:
        raise errors.SourceUnavailable(f"{source}: HTTP {reply.status_code}")


def _stream(session: requests.Session, url: str, start: int, end: int, version: str, source: str,
            secret: str, headers: Mapping[str, str] | None = None) -> Iterator[bytes]:
    try:
        with session.get(url, headers={**(headers or {}), "Range": f"bytes={start}-{end - 1}"}, stream=True,
                         timeout=TIMEOUT) as reply:
            _check(reply, source, secret)
            if reply.status_code != 206 and (start, end) != (0, int(reply.headers.get("Content-Length", -1))):
                raise errors.SourceUnavailable(f"{source}: the server ignores byte ranges (HTTP {reply.status_code})")
            tag = reply.headers.get("ETag", "").strip('"')
            if version and tag and tag != version:
                raise errors.SourceUnavailable(f"{source}: the object changed during the fetch")
            yield from reply.iter_content(READ_BYTES)
    except requests.RequestException as exc:
        raise _unreachable(source, exc, secret, "server") from None


class HttpStore:
    def __init__(self, credentials: Mapping[str, str], secret: str, connections: int) -> None:
        self.secret = secret
        self.session = _session(credentials, connections)
        self._strong: dict[str, str] = {}  # URL -> its strong ETag ("" for none)

    def describe(self, source: uri.Source) -> Listing:
        try:
            reply = self.session.head(source.uri, allow_redirects=True, timeout=TIMEOUT)
        except requests.RequestException as exc:
            raise _unreachable(source.uri, exc, self.secret, "server") from None
        _check(reply, source.uri, self.secret)
        if "Content-Length" not in reply.headers:
            raise errors.SourceUnavailable(f"{source}: the server does not say the file's size (Content-Length)")
        size = int(reply.headers["Content-Length"])
        tag = reply.headers.get("ETag", "")
        self._strong[reply.url] = tag.strip('"') if tag and not tag.startswith("W/") else ""
        version = tag.strip('"') or reply.headers.get("Last-Modified", "") or str(size)
        obj = Object(reply.url, source.name, size, version)
        return Listing((obj,), hashlib.sha256(f"{size} {version}".encode()).hexdigest(), False)

    def read(self, obj: Object, start: int, end: int) -> Iterator[bytes]:
        # Each range must come from the same version of the file: its strong ETag, where the server gives one.
        yield from _stream(self.session, obj.key, start, end, self._strong.get(obj.key, ""), obj.key, self.secret)


# -- OCI registries -----------------------------------------------------------------------------------------------

_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')


def _loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0][1:]
    return name in ("localhost", "::1") or name.startswith("127.")


class OciStore:
    """A registry's distribution API: the manifest names the layers, each layer is a file (its name in the
    org.opencontainers.image.title annotation) or, as ORAS pushes a folder, a gzipped tar to unpack."""

    def __init__(self, source: uri.Source, credentials: Mapping[str, str], secret: str, connections: int) -> None:
        said = credentials.get("SOURCE_PLAIN_HTTP", "").lower()
        plain = said in ("1", "true", "yes") if said else _loopback(source.host)
        self.base = f"{'http' if plain else 'https'}://{source.host}/v2/{source.path}"
        self.secret = secret
        self.credentials = dict(credentials)
        self.session = _session({CA_BUNDLE: credentials.get(CA_BUNDLE, "")}, connections)
        self.token = ""
        self.repo = source.path
        self.ref = source.ref
        self._lock = threading.Lock()

    def _auth(self, reply: requests.Response) -> bool:
        """Answer a 401's challenge once: basic credentials, or a bearer token from the registry's token service."""
        challenge = reply.headers.get("WWW-Authenticate", "")
        user, password = self.credentials.get("SOURCE_USERNAME", ""), self.credentials.get("SOURCE_PASSWORD", "")
        if challenge.lower().startswith("basic"):
            if not user or self.session.auth:
                return False
            self.session.auth = (user, password)
            return True
        if challenge.lower().startswith("bearer") and not self.token:
            params = dict(_CHALLENGE.findall(challenge))
            realm = params.pop("realm", "")
            if not realm:
                return False
            if "scope" not in params:
                params["scope"] = f"repository:{self.repo}:pull"
            try:
                got = requests.get(realm, params=params, auth=(user, password) if user else None, timeout=TIMEOUT,
                                   verify=self.credentials.get(CA_BUNDLE) or True)
            except requests.RequestException as exc:
                raise _unreachable(f"oci://{self.repo}", exc, self.secret, "registry's token service") from None
            if got.status_code in (401, 403):
                return False
            body = got.json()
            self.token = body.get("token") or body.get("access_token") or ""
            self.session.headers["Authorization"] = f"Bearer {self.token}"
            return bool(self.token)
        return False

    def _get(self, url: str, source: str, **kwargs: Any) -> requests.Response:
        try:
            reply = self.session.get(url, timeout=TIMEOUT, **kwargs)
            if reply.status_code == 401 and self._auth(reply):
                reply = self.session.get(url, timeout=TIMEOUT, **kwargs)
        except requests.RequestException as exc:
            raise _unreachable(source, exc, self.secret, "registry") from None
        _check(reply, source, self.secret)
        return reply

    def describe(self, source: uri.Source) -> Listing:
        reply = self._get(f"{self.base}/manifests/{source.ref}", source.uri, headers={"Accept": OCI_MANIFESTS})
        body = reply.content
        manifest_digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if source.ref.startswith("sha256:") and manifest_digest != source.ref:
            raise errors.SourceMismatch(f"{source}: the registry's manifest has digest {manifest_digest}")
        manifest = json.loads(body)
        if "layers" not in manifest:
            raise errors.SourceNotFound(f"{source}: {manifest.get('mediaType', 'the manifest')} is not an image "
                                        "manifest with layers (push the model with oras push)")
        objects = []
        for layer in manifest["layers"]:
            notes = layer.get("annotations") or {}
            title = notes.get(OCI_TITLE, "")
            if not title or title.startswith("/") or ".." in title.split("/"):
                raise errors.SourceNotFound(f"{source}: layer {layer['digest']} has no usable file name "
                                            f"({OCI_TITLE}); push the model with oras push")
            objects.append(Object(layer["digest"], title, int(layer["size"]), layer["digest"],
                                  digest=layer["digest"], unpack=notes.get(ORAS_UNPACK) == "true"))
        if not objects:
            raise errors.SourceNotFound(f"{source}: the manifest has no layers")
        folder = len(objects) > 1 or objects[0].unpack
        return Listing(tuple(sorted(objects, key=lambda o: o.relpath)), manifest_digest, folder)

    def read(self, obj: Object, start: int, end: int) -> Iterator[bytes]:
        # The session carries the credentials `describe` settled on (a bearer token or basic auth).
        token = self.token
        try:
            yield from _stream(self.session, f"{self.base}/blobs/{obj.key}", start, end, "",
                               f"oci://{self.repo}@{obj.key}", self.secret)
        except errors.SourceDenied:
            if not token:
                raise
            with self._lock:  # a bearer token expired during a long fetch: get a new one, and try the range again
                if self.token == token:
                    self.token = ""
                    self.session.headers.pop("Authorization", None)
                    self._get(f"{self.base}/manifests/{self.ref}", f"oci://{self.repo}",
                              headers={"Accept": OCI_MANIFESTS})
            raise errors.SourceUnavailable(f"oci://{self.repo}@{obj.key}: the registry's token expired") from None
