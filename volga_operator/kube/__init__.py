"""The Kubernetes client kit the operator and the node daemons share: the API client (`client`), rate-limited
writes with retries (`ratelimit`) and a list+watch that survives API server outages (`watch`)."""
