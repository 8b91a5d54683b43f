#!/usr/bin/env bash
# Builds the operator image and the agent image (CPU flavour; the GPU flavour with BUILD_GPU=1) with buildah,
# on a Debian base made here with mmdebstrap, so no container registry is needed. Idempotent and cached: the
# base is made once, and an image is rebuilt only when the files it is built from changed (a hash of them is
# kept in the image's label volga.dev/source).
#
# Usage: scripts/build-images.sh            (needs root; installs mmdebstrap and buildah with apt when missing)
# Images: localhost/volga-operator:dev, localhost/volga-agent:dev-cpu (and localhost/volga-agent:dev-gpu).
# Run one with buildah's chroot isolation (podman run needs cgroups and rlimits this machine refuses):
#   ctr=$(buildah from localhost/volga-agent:dev-cpu); buildah run --isolation chroot "$ctr" -- volga --help
set -euo pipefail
cd "$(dirname "$0")/.."

suite=${VOLGA_BASE_SUITE:-bookworm}
base=localhost/volga-base:$suite
ca=${VOLGA_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}

need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v buildah >/dev/null || need+=(buildah)
command -v podman >/dev/null || need+=(podman)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "[images] base: mmdebstrap $suite (python3, python3-venv, ca-certificates)"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$work/base.tar"
  podman import --quiet "$work/base.tar" "$base" >/dev/null
fi

# Build args that make pip reach PyPI here: the machine's CA bundle, mounted for the build only.
pip_ca=()
if [ -f "$ca" ]; then
  pip_ca=(-v "$ca:/host-ca.crt:ro" --build-arg PIP_CERT=/host-ca.crt)
fi

build() {  # build TAG DOCKERFILE [BUILD ARGS...]
  local tag=$1 dockerfile=$2; shift 2
  local source
  source=$(cat "$dockerfile" pyproject.toml README.md scripts/install-criu.sh \
             <(tar -c --sort=name --mtime=@0 --owner=0 --group=0 --exclude=__pycache__ volga_operator volga_agent) \
             <(printf '%s\n' "$@") | sha256sum | cut -c1-16)
  if [ "$(buildah inspect --type image --format '{{index .ImageAnnotations "volga.dev/source"}}{{index .Docker.Config.Labels "volga.dev/source"}}' "$tag" 2>/dev/null)" = "$source" ]; then
    echo "[images] $tag is up to date ($source)"
    return
  fi
  echo "[images] building $tag from $dockerfile"
  buildah bud --quiet --format docker --isolation chroot --layers -f "$dockerfile" --label "volga.dev/source=$source" \
    "${pip_ca[@]}" "$@" -t "$tag" . >/dev/null
}

build localhost/volga-operator:dev Dockerfile.operator --build-arg BASE_IMAGE="$base"
build localhost/volga-agent:dev-cpu Dockerfile.agent --build-arg FLAVOUR=cpu --build-arg BASE_IMAGE="$base" \
  --build-arg BUILD_IMAGE="$base"
if [ "${BUILD_GPU:-0}" = 1 ]; then
  build localhost/volga-agent:dev-gpu Dockerfile.agent --build-arg BUILD_IMAGE="$base"
fi
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E 'volga-(operator|agent|base)' || true
