#!/usr/bin/env bash
# Installs what the real node (volga_bench/realnode.py, tests/node) runs besides the binaries that
# scripts/build-k8s-bins.sh builds: Debian's containerd (its CRI runs the pods), runc (crun refuses the hybrid
# cgroups of these machines), the CNI plugins (bridge, host-local, loopback, portmap), iptables (kube-proxy) and
# conntrack. Only the packages: nothing is started or enabled, and the machine's own containerd service, if any,
# is left as it is (the node runs a containerd of its own, on its own socket). Idempotent; needs root for apt-get.
#
# Usage: scripts/install-node.sh
set -euo pipefail

need=()
for tool in containerd:containerd runc:runc iptables-save:iptables conntrack:conntrack; do
  command -v "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
containerd --version
runc --version | sed -n 1p
