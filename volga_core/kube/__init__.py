"""The Kubernetes client kit the operator and the node daemons share: the API client (`client`), rate-limited
writes with retries (`ratelimit`), a list+watch that survives API server outages (`watch`), and bearer tokens
(`bearer`: the tokens every guarded surface checks, and the `/metrics` endpoint of every process)."""
