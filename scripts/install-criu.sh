#!/usr/bin/env bash
# Installs CRIU 4.2 into a private root without touching the machine's apt sources.
#
# Debian 12's criu 3.17 fails on kernels >= 6.x with new vDSO layouts. Debian 13's criu 4.1.1 works, but cannot dump
# a process holding a TCP or UDP socket on kernels >= 6.16 (they refuse getsockopt(SO_PASSCRED/SO_PASSSEC) on INET
# sockets; fixed upstream in CRIU 4.2), and model servers hold such sockets. Debian forky's criu 4.2.1 dumps them, and
# passes the worker's CRIU tests as 4.1.1 did; one CRIU serves both (two releases on a node would spoil each other's
# kernel-probe cache, `volga_agent.snapshot.kdat`, and cost every call ~100 ms).
#
# criu's .deb and its libraries (glibc included) are unpacked into one folder and run through that folder's own
# dynamic loader; the result is a wrapper script at $PREFIX/bin/criu that behaves like a normal criu binary. The
# packages are criu's dependencies as apt resolves them in the chosen suite (library names differ between suites).
# An installed CRIU older than the suite's minimum (4.2; 4.0 for trixie) is replaced.
#
# Beside it, $PREFIX/bin/tini: Debian's static tini (tini-static) from the same suite, the init a model server's PID
# namespace runs under (volga_agent/worker/nsinit.py, --init): criu's dump of a PID namespace needs its init's working
# folder writable, and a server's own folder may be read-only.
#
# Usage: scripts/install-criu.sh [PREFIX [SUITE]]
#        (defaults: $VOLGA_CRIU_PREFIX or ~/.cache/volga/criu; $VOLGA_CRIU_SUITE or forky)
set -euo pipefail

prefix=${1:-${VOLGA_CRIU_PREFIX:-$HOME/.cache/volga/criu}}
suite=${2:-${VOLGA_CRIU_SUITE:-forky}}
mirror=${VOLGA_CRIU_MIRROR:-http://deb.debian.org/debian}
case $suite in
  trixie) want='Version: 4' ;;
  *) want='Version: 4\.([2-9]|[1-9][0-9])' ;;
esac

if [ -x "$prefix/bin/criu" ] && "$prefix/bin/criu" --version 2>/dev/null | grep -Eq "$want" &&
   [ -x "$prefix/bin/tini" ]; then
  echo "criu already installed: $("$prefix/bin/criu" --version | sed -n 1p) at $prefix/bin/criu, tini beside it"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/debs" "$work/cache/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" >"$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/nonexistent"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "Debug::NoLocking=1"
          -o "APT::Get::List-Cleanup=0"
          # A testing suite's Release carries a Valid-Until a few days ahead; a mirror that lags the clock (or an
          # image build on a machine whose own apt config allows it) would otherwise be refused outright. The
          # packages are still checked against the archive's signature and the Release's hashes.
          -o "Acquire::Check-Valid-Until=false")
apt-get "${apt_opts[@]}" -qq update
# criu and everything it needs at run time in that suite (glibc included), real packages only.
mapfile -t packages < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests \
  --no-conflicts --no-breaks --no-replaces --no-enhances criu | grep -v '^[ <]' | sort -u)
chmod 755 "$work"
(cd "$work/debs" && chmod 777 . && apt-get "${apt_opts[@]}" -qq download "${packages[@]}")
mkdir -p "$work/tini" && chmod 777 "$work/tini"
# Its own package from forky on; trixie's tini package carries it beside the dynamic one.
(cd "$work/tini" && { apt-get "${apt_opts[@]}" -qq download tini-static 2>/dev/null ||
  apt-get "${apt_opts[@]}" -qq download tini; } && for deb in ./*.deb; do dpkg-deb -x "$deb" .; done)

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
install -m 755 "$work/tini/usr/bin/tini-static" "$prefix/bin/tini"
"$prefix/bin/criu" --version
"$prefix/bin/tini" --version
echo "installed criu at $prefix/bin/criu, tini beside it"
