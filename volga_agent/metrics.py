"""Prometheus metrics of the agent and the gateway (names in `docs/architecture.md`); their `/metrics` endpoint is
`volga_core.http.serve_metrics`.

Each component gets its own registry, so several agents or gateways can live in one process (tests,
`volga up`) and each one's HTTP endpoint shows only its own series. Latencies are in milliseconds, as the
dashboards and alerts read them.
"""

from __future__ import annotations

import prometheus_client as prom

LATENCY_MS_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 350, 500, 1000, 2000, 5000, 10000, 30000, 60000)
FAST_MS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 50)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)


class AgentMetrics:
    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = registry or prom.CollectorRegistry()
        r = self.registry
        self.restore_latency = prom.Histogram(
            "volga_snapshot_restore_latency_ms", "Wake -> instance ready, by the tier it woke from",
            ["tier", "model"], buckets=LATENCY_MS_BUCKETS, registry=r)
        self.transition_latency = prom.Histogram(
            "volga_tier_transition_latency_ms", "Duration of every tier move", ["source", "target", "model"],
            buckets=LATENCY_MS_BUCKETS, registry=r)
        self.wake_phase_latency = prom.Histogram(
            "volga_wake_phase_latency_ms", "Where a wake's time went: restore (criu), driver (the CUDA driver's "
            "restore), wake (the worker's own: weights back, canary answer), and the agent's steps between them: "
            "adopt, resume, release", ["tier", "phase", "model"],
            buckets=LATENCY_MS_BUCKETS, registry=r)
        self.restore_failures = prom.Counter(
            "volga_snapshot_restore_failures", "Wakes that failed and fell back to a cold start", ["tier", "model"],
            registry=r)
        self.lazy_restore_failures = prom.Counter(
            "volga_snapshot_lazy_restore_failures", "Lazy restores that failed and were served by an eager restore",
            ["model"], registry=r)
        self.activations = prom.Counter(
            "volga_activations", "Activations that woke an instance (not already HOT)", ["tier", "model"], registry=r)
        self.emis_active = prom.Gauge(
            "volga_emis_active_total", "Instances on this node per tier", ["tier"], registry=r)
        self.evictions = prom.Counter(
            "volga_snapshot_evictions", "Instances demoted by a budget (not by idle time)", ["reason"], registry=r)
        self.eviction_rate = prom.Gauge(
            "volga_snapshot_eviction_rate", "Evictions per minute over the last minute", registry=r)
        self.circuit_open = prom.Gauge(
            "volga_snapshot_circuit_open", "1 while the snapshot circuit breaker of a model is open", ["model"],
            registry=r)
        self.worker_deaths = prom.Counter(
            "volga_worker_deaths", "Workers found dead while HOT", ["model"], registry=r)
        # The worker's warm-up (volga_agent/worker/warmup.py).
        self.warmup_skipped = prom.Counter(
            "volga_warmup_skipped", "Worker starts whose made-up warm-up the model refused: it serves unwarmed "
            "(declare runtime.warmup)", ["model"], registry=r)
        self.output_shape_mismatches = prom.Counter(
            "volga_output_shape_mismatches", "Worker starts whose warm-up answers contradicted the model's declared "
            "output shapes", ["model"], registry=r)
        self.snapshot_bytes = prom.Gauge(
            "volga_snapshot_disk_used_bytes", "Bytes of CRIU images on this node", registry=r)
        # The node's model cache (volga_agent/sources): remote sources fetched and kept by content digest.
        self.fetched_bytes = prom.Counter(
            "volga_source_fetched_bytes", "Bytes of models fetched from remote sources", ["scheme"], registry=r)
        self.fetch_latency = prom.Histogram(
            "volga_source_fetch_latency_ms", "Duration of each remote source's fetch (and its verification)",
            ["scheme"], buckets=LATENCY_MS_BUCKETS, registry=r)
        self.cache_hits = prom.Counter(
            "volga_model_cache_hits", "Remote sources served from the model cache without a download", registry=r)
        self.cache_bytes = prom.Gauge(
            "volga_model_cache_bytes", "Bytes of models in the node's model cache", registry=r)
        self.cache_evictions = prom.Counter(
            "volga_model_cache_evictions", "Models evicted from the model cache to make room", registry=r)
        # The node autonomy loop (volga_agent/autonomy).
        self.autonomy_state = prom.Gauge(
            "volga_autonomy_state", "1 for the autonomy loop's current state (PRELOAD, ACCEPT, OPTIMIZE, EMERGENCY)",
            ["state"], registry=r)
        self.autonomy_decisions = prom.Counter(
            "volga_autonomy_decisions", "Actions the autonomy loop decided, by action", ["action"], registry=r)
        self.slo_violating_windows = prom.Counter(
            "volga_slo_violating_windows", "Windows whose p99 exceeded the model's baseline x (1 + tolerance)",
            ["model"], registry=r)
        self.slo_past_deadline = prom.Gauge(
            "volga_slo_past_recovery_deadline", "1 while a model has violated its SLO for longer than its "
            "recoveryDeadlineMs", ["model"], registry=r)
        self.sample_jitter = prom.Histogram(
            "volga_autonomy_sample_jitter_ms", "How late each node sample came against its period",
            buckets=FAST_MS_BUCKETS, registry=r)
        self.decision_latency = prom.Histogram(
            "volga_autonomy_decision_latency_us", "Time to decide one window, in microseconds",
            buckets=(5, 10, 20, 50, 100, 200, 500, 1000, 5000), registry=r)
        # Shared snapshot storage (volga_agent/snapshot/shared.py).
        self.shared_restores = prom.Counter(
            "volga_snapshot_shared_restores", "Cold starts served by restoring a shared image another node published",
            ["model"], registry=r)
        self.shared_restore_failures = prom.Counter(
            "volga_snapshot_shared_restore_failures", "Shared images that failed their restore or its checks (a "
            "cold start instead)", ["model"], registry=r)
        self.shared_publishes = prom.Counter(
            "volga_snapshot_shared_publishes", "Images this node published to the shared storage", ["model"],
            registry=r)
        # The neighbour exchange (volga_agent/neighbours.py).
        self.neighbour_sent = prom.Counter("volga_neighbour_exchanges_sent", "ExchangeLevel calls to a neighbour",
                                           ["neighbour"], registry=r)
        self.neighbour_failed = prom.Counter("volga_neighbour_exchanges_failed", "ExchangeLevel calls to a "
                                             "neighbour that got no answer", ["neighbour"], registry=r)
        self.neighbour_age = prom.Gauge("volga_neighbour_level_age_ms", "How old the latest level of each neighbour "
                                        "is", ["neighbour"], registry=r)
        self.neighbour_level_bytes = prom.Gauge("volga_neighbour_level_bytes", "Size of this node's level message",
                                                registry=r)


class GatewayMetrics:
    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = registry or prom.CollectorRegistry()
        r = self.registry
        self.requests = prom.Counter(
            "volga_gateway_requests", "Inference requests by outcome", ["model", "protocol", "code"], registry=r)
        self.latency = prom.Histogram(
            "volga_gateway_request_latency_ms", "Request latency through the gateway, wake included",
            ["model", "protocol"], buckets=LATENCY_MS_BUCKETS, registry=r)
        self.zero_copy_latency = prom.Histogram(
            "volga_gateway_zero_copy_latency_ms", "Time to place inputs in and read outputs from shared memory",
            buckets=FAST_MS_BUCKETS, registry=r)
        self.activations = prom.Counter(
            "volga_gateway_activations", "Activations the gateway asked for (after single-flight)", ["model"],
            registry=r)
        self.forwards = prom.Counter(
            "volga_gateway_forwards", "Requests passed to another node's gateway (model not placed here)", ["model"],
            registry=r)
        self.neighbour_forwards = prom.Counter(
            "volga_gateway_neighbour_forwards", "Requests of an overloaded node passed to a neighbour's gateway",
            ["model", "target"], registry=r)
        self.route_cache = prom.Counter(
            "volga_gateway_route_cache", "Routing cache lookups", ["result"], registry=r)
        self.batch_size = prom.Histogram(
            "volga_gateway_batch_size", "Requests' rows (first dimension) per worker call of a dynamically "
            "batched model", ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.batch_requests = prom.Histogram(
            "volga_gateway_batch_requests", "Requests per worker call of a dynamically batched model", ["model"],
            buckets=BATCH_BUCKETS, registry=r)
        self.queue_delay = prom.Histogram(
            "volga_gateway_queue_delay_ms", "Time a request of a dynamically batched model waited in its queue",
            ["model"], buckets=LATENCY_MS_BUCKETS, registry=r)
        self.shed = prom.Counter(
            "volga_gateway_shed_requests", "Requests refused at once while their model was shed", ["model"],
            registry=r)
