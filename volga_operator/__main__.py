"""`volga-operator`: reconcile ModelSpecs into EMIs across the cluster (kopf, cluster-wide)."""

from __future__ import annotations

import argparse
import logging
import sys

import kopf

from volga_operator import handlers  # noqa: F401  (registers the handlers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="volga-operator", description=__doc__)
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The operator's own lines are few (what it listed at start, when its first pass is done): always shown;
    # with -v, every planning pass too.
    logging.getLogger("volga.operator").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    kopf.run(clusterwide=True, standalone=True, liveness_endpoint=args.liveness or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
