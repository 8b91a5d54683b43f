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
py=${PYTHON:-python3}
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$dir" \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
  grpcio==1.85.3 protobuf==6.33.6 prometheus_client==0.26.0 tenacity==9.2.1 ruamel.yaml==0.19.1 pyyaml==6.0.4 \
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1 \
  propcache==0.5.4 yarl==1.25.1 idna==3.20 uvloop==0.23.0 nvidia-ml-py==13.615.71 \
  tritonclient==2.73.0 python-rapidjson==1.25 \
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 anyio==4.16.0 uvicorn==0.55.0 h11==0.16.0 click==8.5.1 \
  httptools==0.9.0 opentelemetry-api==1.45.3 \
  kubernetes==37.0.1 durationpy==0.11 oauthlib==4.0.1 requests-oauthlib==2.0.0 websocket-client==1.9.2 \
  python-dateutil==2.9.0.post0 six==1.17.0 \
  pytest==9.2.0 pytest-timeout==2.4.0 pluggy==1.7.0 iniconfig==2.3.1
criu_prefix=${VOLGA_CRIU_PREFIX:-$HOME/.cache/volga/criu}
[ -x "$criu_prefix/bin/criu" ] || scripts/install-criu.sh "$criu_prefix"
mkdir -p .cache
tar -C "$(dirname "$criu_prefix")" --transform "s,^$(basename "$criu_prefix"),criu," -cJf .cache/criu.tar.xz \
  "$(basename "$criu_prefix")"
du -sh "$dir" .cache/criu.tar.xz
