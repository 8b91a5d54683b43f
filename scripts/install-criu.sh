#!/usr/bin/env bash
# Installs CRIU 4.x into a private root without touching the machine's apt sources.
#
# Debian 12's criu 3.17 fails on kernels >= 6.x with new vDSO layouts; Debian 13's criu 4.1 works when its
# .deb and its libraries (glibc included) are unpacked into one folder and run through that folder's own
# dynamic loader. The result is a wrapper script at $PREFIX/bin/criu that behaves like a normal criu binary.
#
# Usage: scripts/install-criu.sh [PREFIX]     (default: $VOLGA_CRIU_PREFIX or ~/.cache/volga/criu)
set -euo pipefail

prefix=${1:-${VOLGA_CRIU_PREFIX:-$HOME/.cache/volga/criu}}
suite=${VOLGA_CRIU_SUITE:-trixie}
mirror=${VOLGA_CRIU_MIRROR:-http://deb.debian.org/debian}

if [ -x "$prefix/bin/criu" ] && "$prefix/bin/criu" --version 2>/dev/null | grep -q 'Version: 4'; then
  echo "criu already installed: $("$prefix/bin/criu" --version | head -1) at $prefix/bin/criu"
  exit 0
fi

packages=(criu libcompel1 libc6 libgnutls30t64 libnftables1 libprotobuf-c1 libnl-3-200 libnet1 libbsd0
          libuuid1 libmd0 libp11-kit0 libidn2-0 libunistring5 libtasn1-6 libnettle8t64 libhogweed6t64
          libgmp10 libmnl0 libnftnl11 libxtables12 libjansson4 libffi8)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/debs" "$work/cache/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" >"$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/nonexistent"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "Debug::NoLocking=1"
          -o "APT::Get::List-Cleanup=0")
apt-get "${apt_opts[@]}" -qq update
chmod 755 "$work"
(cd "$work/debs" && chmod 777 . && apt-get "${apt_opts[@]}" -qq download "${packages[@]}")

root="$prefix/root"
rm -rf "$root.new"
mkdir -p "$root.new"
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$root.new"; done
rm -rf "$root"
mv "$root.new" "$root"

mkdir -p "$prefix/bin"
# Relocatable: the wrapper finds the private root beside itself, so the folder can be copied elsewhere.
cat >"$prefix/bin/criu" <<'WRAP'
#!/bin/sh
root=$(dirname "$(readlink -f "$0")")/../root
lib=$root/usr/lib/x86_64-linux-gnu
exec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$root/usr/sbin/criu" "$@"
WRAP
chmod +x "$prefix/bin/criu"
"$prefix/bin/criu" --version
echo "installed criu at $prefix/bin/criu"
