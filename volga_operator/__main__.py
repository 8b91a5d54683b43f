"""`volga-operator`: reconcile ModelSpecs into EMIs across the cluster (kopf, cluster-wide)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

import kopf

from volga_core import http
from volga_operator import handlers  # importing handlers registers them with kopf
from volga_operator import settings as operator_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="volga-operator", description=__doc__)
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint")
    defaults = operator_settings.Settings.from_environ()  # the environment, read once; the flags override it
    parser.add_argument("--metrics-port", type=int, default=defaults.metrics_port,
                        help="the operator's /metrics (VOLGA_METRICS_PORT; -1: none, 0: a free port)")
    parser.add_argument("--metrics-token-file", default=defaults.metrics_token_file,
                        help="bearer tokens (one a line) a /metrics scrape must carry (VOLGA_METRICS_TOKEN_FILE); "
                             "default: none asked")
    parser.add_argument("--chain-migration-after-sec", type=float, default=defaults.chain_migration_after_sec,
                        help="move the chains off a node whose agent has reported EMERGENCY this long "
                             "(VOLGA_CHAIN_MIGRATION_AFTER_SEC)")
    parser.add_argument("--chain-migration-min-interval-sec", type=float,
                        default=defaults.chain_migration_min_interval_sec,
                        help="move no chain again within this time of its last move "
                             "(VOLGA_CHAIN_MIGRATION_MIN_INTERVAL_SEC)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    for flag in ("metrics_port", "chain_migration_after_sec", "chain_migration_min_interval_sec"):
        if getattr(args, flag) < (-1 if flag == "metrics_port" else 0):
            parser.error(f"--{flag.replace('_', '-')}: must be >= {-1 if flag == 'metrics_port' else 0}, "
                         f"got {getattr(args, flag)}")
    if args.metrics_token_file:
        try:
            http.Tokens.from_file(args.metrics_token_file)
        except (OSError, ValueError) as exc:
            parser.error(f"--metrics-token-file: {exc}")
    settings = dataclasses.replace(defaults, metrics_port=args.metrics_port,
                                   metrics_token_file=args.metrics_token_file,
                                   chain_migration_after_sec=args.chain_migration_after_sec,
                                   chain_migration_min_interval_sec=args.chain_migration_min_interval_sec)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The operator's own lines are few (what it listed at start, when its first pass is done): always shown;
    # with -v, every planning pass too.
    logging.getLogger("volga.operator").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    kopf.run(clusterwide=True, standalone=True, liveness_endpoint=args.liveness or None,
             memo=kopf.Memo({handlers.SETTINGS_KEY: settings}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
