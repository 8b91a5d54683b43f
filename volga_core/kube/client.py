"""A Kubernetes API client for Volga's components: in-cluster credentials, else the kubeconfig."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import kubernetes
import tenacity
import urllib3

T = TypeVar("T")
# What an unreachable or restarting API server raises: callers keep their last state and try again.
TRANSIENT = (urllib3.exceptions.HTTPError, kubernetes.client.ApiException, OSError)


def api_client(connections: int | None = None) -> kubernetes.client.ApiClient:
    """The client sends each request once: callers retry with backoff (`ratelimit`) and must notice an outage
    quickly, not behind urllib3's own retries. `connections`: how many requests may run at once on kept-alive
    connections (urllib3 drops, and later sets up again, connections beyond its pool: a TLS handshake each)."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    config = kubernetes.client.Configuration.get_default_copy()
    config.retries = 0
    if connections is not None:
        config.connection_pool_maxsize = connections
    return kubernetes.client.ApiClient(config)


def until_stopped(call: Callable[[], T], stopping: threading.Event, first_delay: float, max_delay: float,
                  on_failure: Callable[[BaseException | None, float], None]) -> T | None:
    """`call()` again while it raises TRANSIENT, waiting `first_delay`, then twice as long each time up to
    `max_delay`; `on_failure(error, delay)` before each wait. None once `stopping` is set (it cuts a wait short)."""

    def sleep(seconds: float) -> None:
        stopping.wait(seconds)

    def failed(state: tenacity.RetryCallState) -> None:
        on_failure(state.outcome.exception() if state.outcome else None, state.upcoming_sleep)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(TRANSIENT),
        wait=tenacity.wait_exponential(multiplier=first_delay, max=max_delay),
        stop=tenacity.stop_when_event_set(stopping), sleep=sleep, before_sleep=failed,
        retry_error_callback=lambda _: None)
    return retrying(lambda: None if stopping.is_set() else call())
