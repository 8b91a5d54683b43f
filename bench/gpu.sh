#!/usr/bin/env bash
# Everything one GPU-machine session needs, in one command: the gpu tests, then `volga bench tiers --gpu`.
#
# On the GPU machine (its python3 has torch; the rest travels as wheels in .whl/ and CRIU as .cache/criu.tar.xz,
# both made here by scripts/gpu-carry.sh; bench/gpu-env.sh sets them up there):
#     bash bench/gpu.sh [MODEL_GIB...]
# Results go to $OUT (or bench/results/tiers/ when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/tiers}
mkdir -p "$out"
. bench/gpu-env.sh "$out/gpu-machine.txt"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -m gpu -p no:cacheprovider -q tests/gpu ${TESTS_K:+-k "$TESTS_K"} 2>&1 |
    tee "$out/gpu-tests.log"
fi
# bench/gpu.sh SIZES [NAME]: e.g. "0.1,2" small; N wakes per tier, COLD_N cold starts, BURST instances.
sizes=${1:-0.5}
name=${2:-tiers-gpu}
python3 -m volga_agent.cli bench tiers --gpu --sizes "$sizes" -n "${N:-20}" --cold-n "${COLD_N:-10}" \
  --burst "${BURST:-0}" --tiers "${TIERS:-warm,suspended,frozen}" ${LAZY:+--lazy} --out "$out/$name.json" 2>"$out/$name.log"
tail -3 "$out/$name.log"
