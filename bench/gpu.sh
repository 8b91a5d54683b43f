#!/usr/bin/env bash
# Everything one GPU-machine session needs, in one command: the gpu tests, then `volga bench tiers --gpu`.
#
# On the GPU machine (its python3 has torch; pydantic and friends travel as wheels in .whl/, CRIU as the
# relocatable private root in .cache/criu):
#     bash bench/gpu.sh [MODEL_GIB...]
# Results go to $OUT (or bench/results/tiers/ when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/tiers}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
[ -x .cache/criu/bin/criu ] && export VOLGA_CRIU=$PWD/.cache/criu/bin/criu
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$out/gpu-machine.txt"
uname -r | tee -a "$out/gpu-machine.txt"
"${VOLGA_CRIU:-criu}" check 2>&1 | tail -1 | tee -a "$out/gpu-machine.txt"

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
