"""The operator's settings: every environment variable it reads, read in one place (`Settings.from_environ`).

`__main__` reads the environment once, lets the command line override what it offers (`--metrics-port`,
`--metrics-token-file`, `--chain-migration-after-sec`, `--chain-migration-min-interval-sec`) and hands the result
to kopf's startup handler in the memo; the loop takes it from there. Nothing else in the operator looks at
`os.environ` (the Kubernetes client's own KUBECONFIG is `volga_core.kube.client`'s). The Helm chart sets these
variables (charts/volga/templates/operator-deployment.yaml).

Values are parsed as they always were: a number that does not parse stops the operator at start; the command
line checks its own ranges.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Settings:
    """The operator's settings; the defaults are those of an unset environment. Each field names its variable."""

    # VOLGA_METRICS_HOST: the address the operator's /metrics listens on.
    metrics_host: str = "0.0.0.0"
    # VOLGA_METRICS_PORT (--metrics-port): the port of the operator's /metrics; -1: no endpoint, 0: a free port.
    metrics_port: int = -1
    # VOLGA_METRICS_TOKEN_FILE (--metrics-token-file): bearer tokens (one a line) a /metrics scrape must carry;
    # "": none asked.
    metrics_token_file: str = ""
    # VOLGA_NAMESPACE, else POD_NAMESPACE, else "default" (an empty value counts as unset): the namespace the
    # cluster's watermarks ConfigMap goes to.
    namespace: str = "default"
    # VOLGA_CHAIN_MIGRATION_AFTER_SEC (--chain-migration-after-sec): a chain leaves a node whose fresh heartbeat has
    # said EMERGENCY this long (`reconcile.TierSettings.migrate_after_sec`).
    chain_migration_after_sec: float = 30.0
    # VOLGA_CHAIN_MIGRATION_MIN_INTERVAL_SEC (--chain-migration-min-interval-sec): no chain moves again within this
    # time of its last move (`reconcile.TierSettings.min_interval_sec`).
    chain_migration_min_interval_sec: float = 300.0
    # VOLGA_RESYNC_SEC: every ModelSpec is planned again this often (level-triggered repair of missed events); the
    # loop also wakes at least every quarter of it.
    resync_sec: float = 60.0
    # VOLGA_DEBOUNCE_SEC: after a wake-up the loop waits this long for a burst of events to land before planning.
    debounce_sec: float = 0.2
    # VOLGA_API_WRITES_PER_SEC: the most API writes a second, bursts included (the write bucket and the
    # completion window, `loop.write_bucket`).
    api_writes_per_sec: float = 200.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings from `environ` (default: `os.environ`), a field's default where its variable is unset."""
        env = (os.environ if environ is None else environ).get
        return cls(
            metrics_host=env("VOLGA_METRICS_HOST", "0.0.0.0"),
            metrics_port=int(env("VOLGA_METRICS_PORT", "-1")),
            metrics_token_file=env("VOLGA_METRICS_TOKEN_FILE", ""),
            namespace=env("VOLGA_NAMESPACE") or env("POD_NAMESPACE") or "default",
            chain_migration_after_sec=float(env("VOLGA_CHAIN_MIGRATION_AFTER_SEC", "30")),
            chain_migration_min_interval_sec=float(env("VOLGA_CHAIN_MIGRATION_MIN_INTERVAL_SEC", "300")),
            resync_sec=float(env("VOLGA_RESYNC_SEC", "60")),
            debounce_sec=float(env("VOLGA_DEBOUNCE_SEC", "0.2")),
            api_writes_per_sec=float(env("VOLGA_API_WRITES_PER_SEC", "200")),
        )
