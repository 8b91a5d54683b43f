#!/usr/bin/env bash
# Build the real Kubernetes binaries the k8s tests run (kube-apiserver, etcd, kwok, helm; for the real node also
# kubelet, kube-controller-manager, kube-scheduler and kube-proxy; kubectl on request) from the Go module proxy
# alone: no Docker, no release downloads.
#
#   scripts/build-k8s-bins.sh [DEST]        DEST defaults to ${VOLGA_K8S_BIN:-$HOME/.cache/volga/k8s-bin}
#
# Environment:
#   ONLY="etcd kube-apiserver"   build only these (default: all but kubectl, which is also known)
#   FORCE=1                      rebuild even when a binary is present and reports the wanted version
#   K8S_VERSION, ETCD_VERSION, KWOK_VERSION, HELM_VERSION   override the pinned versions below
#
# Idempotent: a binary already in DEST that answers its version command with the wanted version is skipped.
# DEST/VERSIONS records what was built with which version and how long it took.
set -euo pipefail

DEST="${1:-${VOLGA_K8S_BIN:-$HOME/.cache/volga/k8s-bin}}"
K8S_VERSION="${K8S_VERSION:-v1.34.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
KWOK_VERSION="${KWOK_VERSION:-v0.7.0}"
HELM_VERSION="${HELM_VERSION:-v3.19.0}"
ONLY="${ONLY:-kube-apiserver etcd kwok helm kubelet kube-controller-manager kube-scheduler kube-proxy}"
FORCE="${FORCE:-0}"
# A niced build keeps the rest of a 2-core machine responsive.
NICE=(nice -n "${NICE_LEVEL:-10}")

log() { printf '[build-k8s-bins] %s\n' "$*" >&2; }
die() { printf '[build-k8s-bins] ERROR: %s\n' "$*" >&2; exit 1; }

command -v go >/dev/null || die "go is not on PATH (Go >= 1.24 is needed)"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
# One build at a time into DEST (two makes at once would race on the same temporary files); the second waits and
# then finds the binaries built.
exec 9>"$DEST/.lock"
flock 9 || die "cannot lock $DEST/.lock"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/volga-build-k8s-bins.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# Static binaries, no C toolchain needed; -mod=mod lets the wrapper modules resolve their requirements.
export CGO_ENABLED=0
export GOFLAGS="-mod=mod -buildvcs=false"

# The version command of each binary and the text its output must contain for the binary to count as built.
version_cmd() {
  case "$1" in
    kube-apiserver|etcd|kwok|kubelet|kube-controller-manager|kube-scheduler|kube-proxy) echo "--version" ;;
    helm) echo "version --short" ;;
    kubectl) echo "version --client" ;;
    *) die "unknown binary: $1" ;;
  esac
}
wanted_version() {
  case "$1" in
    kube-apiserver|kubectl|kubelet|kube-controller-manager|kube-scheduler|kube-proxy) echo "$K8S_VERSION" ;;
    etcd) echo "${ETCD_VERSION#v}" ;;
    kwok) echo "${KWOK_VERSION#v}" ;;
    helm) echo "$HELM_VERSION" ;;
  esac
}

is_built() {
  local bin="$DEST/$1" out
  [[ -x "$bin" ]] || return 1
  # shellcheck disable=SC2046
  out="$("$bin" $(version_cmd "$1") 2>&1)" || return 1
  [[ "$out" == *"$(wanted_version "$1")"* ]]
}

record_version() {
  local name="$1" version="$2" source="$3" seconds="$4" file="$DEST/VERSIONS"
  touch "$file"
  grep -v "^$name " "$file" >"$file.tmp" || true
  printf '%s %s %s built_in=%ss %s\n' "$name" "$version" "$source" "$seconds" "$(go env GOVERSION)" >>"$file.tmp"
  sort "$file.tmp" >"$file" && rm -f "$file.tmp"
}

# k8s.io/kubernetes replaces its staging modules (k8s.io/api, client-go, ...) with local paths, so it cannot be
# built as a dependency as is: a wrapper module pins every one of them to the matching v0.Y.Z release instead.
k8s_wrapper() {
  local dir="$WORK/k8s" modcache staging_version="v0.${K8S_VERSION#v1.}"
  [[ -f "$dir/go.mod" ]] && { echo "$dir"; return; }
  mkdir -p "$dir"
  log "downloading k8s.io/kubernetes@$K8S_VERSION to read its replace block"
  (cd "$dir" && go mod download "k8s.io/kubernetes@$K8S_VERSION") >&2 ||
    die "go mod download k8s.io/kubernetes@$K8S_VERSION failed (is the Go module proxy reachable?)"
  modcache="$(go env GOMODCACHE)/k8s.io/kubernetes@$K8S_VERSION"
  [[ -f "$modcache/go.mod" ]] || die "no go.mod at $modcache"
  {
    echo "module volga.local/k8s-build"
    echo
    echo "go 1.24.0"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    # Lines like "k8s.io/api => ./staging/src/k8s.io/api" become "k8s.io/api => k8s.io/api v0.34.4".
    awk -v v="$staging_version" '$2 == "=>" && $3 ~ /^\.\/staging\// { printf "\t%s => %s %s\n", $1, $1, v }' \
      "$modcache/go.mod"
    echo ")"
  } >"$dir/go.mod"
  grep -q "k8s.io/client-go =>" "$dir/go.mod" || die "could not read the staging replace block of $modcache/go.mod"
  # A tools file makes `go mod tidy` resolve what the commands import; the build tag keeps it out of any build.
  cat >"$dir/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
GO
  log "resolving the wrapper module ($(grep -c ' => ' "$dir/go.mod") staging modules pinned to $staging_version)"
  (cd "$dir" && "${NICE[@]}" go mod tidy) >&2 || die "go mod tidy of the k8s.io/kubernetes wrapper failed"
  echo "$dir"
}

# The version that `--version` and the /version endpoint report (hack/lib/version.sh sets the same variables).
k8s_ldflags() {
  local minor="${K8S_VERSION#v1.}"
  minor="${minor%%.*}"
  local x
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    x+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
    x+=" -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  done
  echo "-s -w$x"
}

build_k8s_cmd() {
  local name="$1" dir
  dir="$(k8s_wrapper)"
  log "go build k8s.io/kubernetes/cmd/$name@$K8S_VERSION -> $DEST/$name"
  (cd "$dir" && "${NICE[@]}" go build -trimpath -ldflags "$(k8s_ldflags)" -o "$DEST/$name.tmp" \
    "k8s.io/kubernetes/cmd/$name") || die "building $name failed"
  mv "$DEST/$name.tmp" "$DEST/$name"
}

build_etcd() {
  local dir="$WORK/etcd"
  mkdir -p "$dir"
  # etcd publishes no installable main module for the server, so a two-line main calls etcdmain.
  printf 'module volga.local/etcd-build\n\ngo 1.24.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION" \
    >"$dir/go.mod"
  cat >"$dir/main.go" <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  log "go build go.etcd.io/etcd/server/v3/etcdmain@$ETCD_VERSION -> $DEST/etcd"
  (cd "$dir" && "${NICE[@]}" go mod tidy && "${NICE[@]}" go build -trimpath -ldflags '-s -w' -o "$DEST/etcd.tmp" .) ||
    die "building etcd failed"
  mv "$DEST/etcd.tmp" "$DEST/etcd"
}

go_install() {
  local name="$1" pkg="$2" version="$3" ldflags="${4:-}"
  log "go install $pkg@$version -> $DEST/$name"
  # go install pkg@version ignores the current module, so it runs from the empty work folder.
  (cd "$WORK" && GOFLAGS=-buildvcs=false GOBIN="$DEST" "${NICE[@]}" go install -trimpath -ldflags "-s -w $ldflags" \
    "$pkg@$version") || die "go install $pkg@$version failed"
}

build_one() {
  local name="$1" start source version
  if [[ "$FORCE" != 1 ]] && is_built "$name"; then
    log "$name: present and reports $(wanted_version "$name"), skipped"
    return
  fi
  start=$SECONDS
  case "$name" in
    kube-apiserver|kubectl|kubelet|kube-controller-manager|kube-scheduler|kube-proxy)
      build_k8s_cmd "$name"; source="k8s.io/kubernetes"; version="$K8S_VERSION" ;;
    etcd) build_etcd; source="go.etcd.io/etcd/server/v3"; version="$ETCD_VERSION" ;;
    kwok) go_install kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION"
          source="sigs.k8s.io/kwok"; version="$KWOK_VERSION" ;;
    # helm's own version variable holds only "v3.Y" unless the release ldflags set it.
    helm) go_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" \
            "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
          source="helm.sh/helm/v3"; version="$HELM_VERSION" ;;
  esac
  is_built "$name" ||
    die "$name was built but '$DEST/$name $(version_cmd "$name")' does not report $(wanted_version "$name")"
  record_version "$name" "$version" "$source" "$((SECONDS - start))"
  log "$name: built in $((SECONDS - start))s, $(du -h "$DEST/$name" | cut -f1)"
}

KNOWN="kube-apiserver etcd kwok helm kubelet kube-controller-manager kube-scheduler kube-proxy kubectl"
for name in $ONLY; do
  [[ " $KNOWN " == *" $name "* ]] || die "unknown binary '$name' in ONLY (known: $KNOWN)"
done
log "destination $DEST; building: $ONLY"
# The documented order, whatever order ONLY lists them in.
for name in $KNOWN; do
  if [[ " $ONLY " == *" $name "* ]]; then build_one "$name"; fi
done
log "done; $DEST/VERSIONS:"
cat "$DEST/VERSIONS" >&2
