"""A Kubernetes API client for Volga's components: in-cluster credentials, else the kubeconfig."""

from __future__ import annotations

import kubernetes


def api_client() -> kubernetes.client.ApiClient:
    """The client sends each request once: callers retry with backoff (`ratelimit`) and must notice an outage
    quickly, not behind urllib3's own retries."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    config = kubernetes.client.Configuration.get_default_copy()
    config.retries = 0
    return kubernetes.client.ApiClient(config)
