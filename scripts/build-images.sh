#!/usr/bin/env bash
# Builds the operator image and both flavours of the agent image with buildah, on a Debian base made here with
# mmdebstrap, so no container registry is needed (the GPU flavour's CUDA libraries are NVIDIA's PyPI wheels).
# Idempotent and cached: the base is made once, an image is rebuilt only when the files it is built from changed
# (a hash of them is kept in the image's label volga.dev/source), pip's downloads stay in buildah's cache mount
# (/var/tmp/buildah-cache*/volga-wheels), and the image a rebuild replaces is removed.
#
# Usage: scripts/build-images.sh            (needs root; installs mmdebstrap and buildah with apt when missing)
# Images: localhost/volga-operator:dev, localhost/volga-agent:dev-cpu, localhost/volga-agent:dev-gpu, and the real
# node's sandbox image localhost/volga-pause:3.10.
# The GPU flavour (6.8 GB) needs VOLGA_GPU_MIN_FREE_GB (default 24) GiB free in buildah's storage to build (its
# build peaks ~18 GiB above its start, plus 3.2 GB of wheels the first time);
# with less it is skipped (and a stale one removed), and the reason is written to $skipped for tests/images/test_images.py.
# BUILD_GPU=0 does not build it (an up-to-date one stays), BUILD_GPU=1 builds it without the disk check.
# Run one with buildah's chroot isolation (podman run needs cgroups and rlimits this machine refuses):
#   ctr=$(buildah from localhost/volga-agent:dev-cpu); buildah run --isolation chroot "$ctr" -- volga --help
set -euo pipefail
cd "$(dirname "$0")/.."

suite=${VOLGA_BASE_SUITE:-bookworm}
base=localhost/volga-base:$suite
ca=${VOLGA_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}
gpu_min_free_gb=${VOLGA_GPU_MIN_FREE_GB:-24}
skipped=${VOLGA_IMAGES_STATE:-$HOME/.cache/volga/images}/volga-agent-dev-gpu.skipped

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

source_hash() {  # source_hash DOCKERFILE [BUILD ARGS...]: what an image is built from
  local dockerfile=$1; shift
  cat "$dockerfile" pyproject.toml README.md scripts/install-criu.sh \
    <(tar -c --sort=name --mtime=@0 --owner=0 --group=0 --exclude=__pycache__ volga_core volga_operator volga_agent) \
    <(printf '%s\n' "$@") | sha256sum | cut -c1-16
}

built_from() {  # built_from TAG: the source hash the image was built from, empty when there is no image
  buildah inspect --type image --format '{{index .ImageAnnotations "volga.dev/source"}}{{index .Docker.Config.Labels "volga.dev/source"}}' "$1" 2>/dev/null || true
}

build() {  # build TAG DOCKERFILE [BUILD ARGS...]
  local tag=$1 dockerfile=$2; shift 2
  local source old new
  source=$(source_hash "$dockerfile" "$@")
  if [ "$(built_from "$tag")" = "$source" ]; then
    echo "[images] $tag is up to date ($source)"
    return
  fi
  old=$(buildah inspect --type image --format '{{.FromImageID}}' "$tag" 2>/dev/null || true)
  echo "[images] building $tag from $dockerfile"
  local start=$SECONDS
  buildah bud --quiet --format docker --isolation chroot --layers -f "$dockerfile" --label "volga.dev/source=$source" \
    "${pip_ca[@]}" "$@" -t "$tag" . >/dev/null
  new=$(buildah inspect --type image --format '{{.FromImageID}}' "$tag")
  echo "[images] built $tag in $((SECONDS - start)) s"
  rebuilt=1
  # The replaced image (and the build steps only it used); one still in use by a container stays.
  if [ -n "$old" ] && [ "$old" != "$new" ]; then
    buildah rmi "$old" >/dev/null 2>&1 || true
  fi
}

rebuilt=0
build localhost/volga-operator:dev Dockerfile.operator --build-arg BASE_IMAGE="$base"
build localhost/volga-agent:dev-cpu Dockerfile.agent --build-arg FLAVOUR=cpu --build-arg BASE_IMAGE="$base" \
  --build-arg BUILD_IMAGE="$base"

gpu_tag=localhost/volga-agent:dev-gpu
gpu_args=(--build-arg FLAVOUR=gpu --build-arg BASE_IMAGE="$base" --build-arg BUILD_IMAGE="$base")
skip_gpu() {  # skip_gpu REASON: no GPU image (a stale one is removed), and the reason for the tests
  echo "[images] not building $gpu_tag: $1"
  buildah rmi "$gpu_tag" >/dev/null 2>&1 || true
  mkdir -p "$(dirname "$skipped")"
  echo "$1" >"$skipped"
}
free_gb=$(( $(df -P -k "$(buildah info --format '{{.store.GraphRoot}}')" | awk 'NR == 2 {print $4}') / 1024 / 1024 ))
if [ "$(built_from "$gpu_tag")" != "$(source_hash Dockerfile.agent "${gpu_args[@]}")" ] && [ "${BUILD_GPU:-}" = 0 ]; then
  skip_gpu "BUILD_GPU=0"
elif [ "$(built_from "$gpu_tag")" != "$(source_hash Dockerfile.agent "${gpu_args[@]}")" ] && [ "${BUILD_GPU:-}" != 1 ] \
     && [ "$free_gb" -lt "$gpu_min_free_gb" ]; then
  skip_gpu "$free_gb GiB free in buildah's storage, the GPU flavour's build needs $gpu_min_free_gb (VOLGA_GPU_MIN_FREE_GB)"
else
  rm -f "$skipped"
  build "$gpu_tag" Dockerfile.agent "${gpu_args[@]}"
fi
# The real node's sandbox image (scripts/pause.c, statically linked): containerd's CRI needs one for every pod
# and no registry is reachable to pull registry.k8s.io/pause from.
pause_tag=localhost/volga-pause:3.10
pause_source=$(sha256sum scripts/pause.c | cut -c1-16)
if [ "$(built_from "$pause_tag")" = "$pause_source" ]; then
  echo "[images] $pause_tag is up to date ($pause_source)"
else
  pause_work=$(mktemp -d)
  gcc -static -O2 -Wall -o "$pause_work/pause" scripts/pause.c
  pause_ctr=$(buildah from --quiet scratch)
  buildah copy --quiet "$pause_ctr" "$pause_work/pause" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' --user 65535:65535 --label "volga.dev/source=$pause_source" "$pause_ctr"
  buildah commit --quiet --format docker --rm "$pause_ctr" "$pause_tag" >/dev/null
  rm -rf "$pause_work"
  echo "[images] built $pause_tag"
fi
# What a rebuild left untagged and unused: the build stages' last images (the operator's ~650 MB), replaced steps.
if [ "$rebuilt" = 1 ]; then
  buildah rmi --prune >/dev/null 2>&1 || true
fi
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E 'volga-(operator|agent|base|pause)' || true
