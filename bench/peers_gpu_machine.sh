#!/usr/bin/env bash
# `volga bench peers` on the GPU machine's CPUs, where the servers get cores of their own and the clients others:
# KServe 0.21 beside Volga, the default model on the CPU, as in docs/measurements.md, "Against KServe".
#
# The GPU machine has no package index. Its python3 (3.12) has numpy, pandas, onnxruntime, grpcio and protobuf; the
# rest travels as wheels: Volga's in .whl/ with CRIU (scripts/gpu-carry.sh, set up by bench/gpu-env.sh), KServe's in
# .whl-peers/, fetched here with
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_34_x86_64 -d .whl-peers kserve==0.21.0 uvicorn==0.54.0 watchfiles==1.3.0 \
#       fastapi==0.165.0 starlette==1.10.0 cloudevents==1.13.0 deprecation==2.1.0 kubernetes==37.0.1 \
#       durationpy==0.11 oauthlib==4.0.1 requests-oauthlib==2.0.0 websocket-client==1.9.2 grpc-interceptor==0.15.4 \
#       protobuf==6.33.6 grpcio==1.85.3 orjson==3.13.0 timing-asgi==0.3.2 python-multipart==0.0.34 pyjwt==2.15.1 \
#       pyasn1==0.6.5 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 httptools==0.9.0 websockets==17.4 \
#       python-dotenv==1.2.4 opentelemetry-api==1.45.2
# KServe runs from its own folder (/tmp/kserve-site, then the shared /tmp/site for pydantic and the like, through
# a wrapper interpreter), so that its protobuf 6 and
# grpcio stay out of Volga's processes.
#
#     bash bench/peers_gpu_machine.sh [SERVER_CPUS] [CLIENT_CPUS] [NAME]     (defaults: 0,1  2-9  peers-h200-2-server-cores)
# runs the bench twice: Volga as `volga up` runs by default, then with 2 gateway processes and, beside it, 2 HOT
# instances of the model (NAME-2x). Results go to $OUT (or bench/results/peers/ when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/peers}
mkdir -p "$out"
. bench/gpu-env.sh "$out/gpu-machine.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kserve-site \
  .whl-peers/*.whl
printf '#!/bin/sh\nPYTHONPATH=/tmp/kserve-site:/tmp/site exec python3 "$@"\n' >/tmp/kserve-python
chmod +x /tmp/kserve-python
name=${3:-peers-h200-2-server-cores}
for run in "$name" "$name-2x"; do
  extra=()
  [ "$run" = "$name-2x" ] && extra=(--gateway-processes 2 --hot-instances 2 --no-batched)
  python3 -m volga_agent.cli bench peers --kserve-python /tmp/kserve-python --server-cpus "${1:-0,1}" \
    --client-cpus "${2:-2-9}" "${extra[@]}" --out "$out/$run.json" 2>"$out/$run.log" | tee "$out/$run.txt"
  tail -3 "$out/$run.log"
done
