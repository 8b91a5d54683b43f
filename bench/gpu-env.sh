# Sourced on the GPU machine, in the repository's root, before Volga runs there: installs the wheels in .whl/ to
# /tmp/site, unpacks CRIU from .cache/criu.tar.xz (both made here by scripts/gpu-carry.sh) and writes the machine's
# description to $1 (default $OUT/gpu-machine.txt).
#     . bench/gpu-env.sh [DESCRIPTION_FILE]
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
[ -x .cache/criu/bin/criu ] || { [ -f .cache/criu.tar.xz ] && tar -C .cache -xJf .cache/criu.tar.xz; }
[ -x .cache/criu/bin/criu ] && export VOLGA_CRIU=$PWD/.cache/criu/bin/criu
gpu_machine=${1:-${OUT:-.}/gpu-machine.txt}
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$gpu_machine"
uname -r | tee -a "$gpu_machine"
"${VOLGA_CRIU:-criu}" check 2>&1 | tail -1 | tee -a "$gpu_machine"
