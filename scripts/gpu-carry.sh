#!/usr/bin/env bash
# What the GPU machine (python3 3.12 with PyTorch, numpy and onnxruntime; no package index) lacks to run Volga's
# agent, benches, LLM server and gpu tests, made here beside the checkout for the device call to carry:
#   .whl/                 the wheels, for Python 3.12 on x86-64
#   .cache/criu.tar.xz    CRIU and tini as scripts/install-criu.sh installs them (~/.cache/volga/criu), packed
# bench/gpu-env.sh sets both up there. Carry both paths: `carry: [".whl", ".cache/criu.tar.xz"]` (about 40 MB).
#
# Usage: scripts/gpu-carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.whl
mkdir -p "$dir"
# The packages by name; their versions are those `make setup` installed in .venv (Python 3.11 here), fetched for 3.12.
py=${PYTHON:-.venv/bin/python}
names=(pydantic pydantic_core annotated-types typing-inspection typing_extensions grpcio protobuf prometheus_client
  tenacity ruamel.yaml pyyaml aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna uvloop
  nvidia-ml-py tritonclient python-rapidjson fastapi starlette annotated-doc anyio uvicorn h11 click httptools
  opentelemetry-api kubernetes durationpy oauthlib requests-oauthlib websocket-client python-dateutil six pytest
  pytest-timeout pluggy iniconfig)
# A package missing there stops the script here (set -e), not with a partial list.
pins=$("$py" -c 'import importlib.metadata as m, sys; print(*(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
  "${names[@]}")
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
rm -f "$dir"/*.whl  # one version of each: two stop the install there
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$dir" $pins  # split on purpose: one argument a pin
criu_prefix=${VOLGA_CRIU_PREFIX:-$HOME/.cache/volga/criu}
[ -x "$criu_prefix/bin/criu" ] || scripts/install-criu.sh "$criu_prefix"
mkdir -p .cache
tar -C "$(dirname "$criu_prefix")" --transform "s,^$(basename "$criu_prefix"),criu," -cJf .cache/criu.tar.xz \
  "$(basename "$criu_prefix")"
du -sh "$dir" .cache/criu.tar.xz
