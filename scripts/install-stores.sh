#!/usr/bin/env bash
# Installs the model stores and clients that the source tests (tests/integration/test_sources.py) and
# `volga bench fetch` run against:
#   docker-registry  Debian's docker-registry package (distribution 2.8): a real OCI registry
#   versitygw        an S3-compatible server (github.com/versity/versitygw, POSIX backend), built from the Go
#                    module proxy into $PREFIX/bin
#   oras             the ORAS CLI (oras.land/oras), built from the Go module proxy into $PREFIX/bin: it pushes
#                    models as OCI artifacts the way users push them
#   boto3            the AWS SDK (PyPI) into the venv: it uploads models to the S3 server
# Idempotent; needs root for apt-get.
#
# Usage: scripts/install-stores.sh [PREFIX] [VENV]   (defaults: ~/.cache/volga/stores, .venv)
set -euo pipefail

prefix=${1:-$HOME/.cache/volga/stores}
venv=${2:-.venv}
versitygw_version=${VERSITYGW_VERSION:-v1.8.0}
oras_version=${ORAS_VERSION:-v1.3.0}
mkdir -p "$prefix/bin"
command -v go >/dev/null || { echo "install-stores.sh: go is not on PATH (Go >= 1.24 is needed)" >&2; exit 1; }

if ! command -v docker-registry >/dev/null; then
  apt-get -o DPkg::Lock::Timeout=900 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends docker-registry >/dev/null
  # The package starts a registry service where an init system runs; the tests start their own.
  (systemctl disable --now docker-registry || service docker-registry stop) >/dev/null 2>&1 || true
fi

build() {  # build NAME MODULE@VERSION
  local name=$1 module=$2
  if [[ -x "$prefix/bin/$name" && "$(cat "$prefix/bin/$name.version" 2>/dev/null)" == "$module" ]]; then
    return
  fi
  CGO_ENABLED=0 GOBIN="$prefix/bin" GOFLAGS=-trimpath go install "$module"
  echo "$module" >"$prefix/bin/$name.version"
}
build versitygw "github.com/versity/versitygw/cmd/versitygw@$versitygw_version"
build oras "oras.land/oras/cmd/oras@$oras_version"

if ! "$venv/bin/python" -c 'import boto3' 2>/dev/null; then
  "$venv/bin/python" -m pip install -q 'boto3>=1.34'
fi

{ docker-registry --version; "$prefix/bin/versitygw" --version | sed -n 1p; "$prefix/bin/oras" version | sed -n 1p; } 2>&1
