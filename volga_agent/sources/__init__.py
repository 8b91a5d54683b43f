"""Model sources: where a ModelSpec's `spec.source` points (file://, s3://, https://, oci://) and the node's
content-addressed model cache that remote sources are fetched into before an instance loads them.

`uri` parses a source; `stores` talks to S3-compatible stores, HTTPS servers and OCI registries; `download`
fetches one object in ranges over several connections, resumably; `cache` keeps one verified copy per content
digest under a disk budget and resolves a source to a local path. See docs/models.md, Sources.
"""
