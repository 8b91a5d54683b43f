#!/usr/bin/env bash
# Regenerate the Python code for Volga's protobuf/gRPC interfaces into volga_agent/rpc/:
#   proto/volga/v1/agent.proto          -> volga_agent/rpc/volga/v1/agent_pb2{,_grpc}.py, agent_pb2.pyi
#   proto/inference/grpc_service.proto  -> volga_agent/rpc/inference/grpc_service_pb2{,_grpc}.py, .pyi
# protoc writes imports relative to the -I root ("from volga.v1 import agent_pb2"); they are rewritten to
# package imports ("from volga_agent.rpc.volga.v1 import agent_pb2") so nothing needs sys.path tricks.
# Idempotent: old generated files are removed first, the output depends only on the .proto files and the
# grpcio-tools version. Usage: scripts/gen-proto.sh   (PYTHON=... to use another interpreter)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-.venv/bin/python}"
out=volga_agent/rpc
protos=(volga/v1/agent.proto inference/grpc_service.proto)
# Top-level proto packages: the first path component of every .proto above.
roots='volga|inference'

"$python" -c 'import grpc_tools.protoc' 2>/dev/null || {
  echo "gen-proto: $python has no grpc_tools; install the dev extra (pip install -e '.[dev]')" >&2
  exit 1
}

for dir in "$out" "$out/volga" "$out/volga/v1" "$out/inference"; do
  mkdir -p "$dir"
  [ -f "$dir/__init__.py" ] || echo '"""Generated protobuf/gRPC code (scripts/gen-proto.sh)."""' >"$dir/__init__.py"
done
find "$out" \( -name '*_pb2.py' -o -name '*_pb2.pyi' -o -name '*_pb2_grpc.py' \) -delete

"$python" -m grpc_tools.protoc -I proto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "${protos[@]/#/proto/}"

# "from volga.v1 import x" -> "from volga_agent.rpc.volga.v1 import x"; rewritten lines ("from volga_agent")
# no longer match, so running the sed twice changes nothing.
find "$out" \( -name '*_pb2.py' -o -name '*_pb2.pyi' -o -name '*_pb2_grpc.py' \) -print0 |
  xargs -0 sed -i -E "s/^from (${roots})([. ])/from volga_agent.rpc.\\1\\2/"

# The inference.* message names are also registered by tritonclient's own service_pb2, and protobuf refuses a
# second definition of a name in its default descriptor pool, so a process that imports both (tests, benches
# that drive the gateway with tritonclient) would fail. Our copy goes into a private pool instead: the bytes
# on the wire and the gRPC method paths do not depend on the pool.
sed -i 's/^DESCRIPTOR = _descriptor_pool\.Default()\.AddSerializedFile(/DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile(/' \
  "$out/inference/grpc_service_pb2.py"
grep -q '^DESCRIPTOR = _descriptor_pool\.DescriptorPool()' "$out/inference/grpc_service_pb2.py" || {
  echo "gen-proto: could not move inference/grpc_service_pb2.py to a private descriptor pool (protoc output changed?)" >&2
  exit 1
}

echo "gen-proto: generated ${protos[*]} into $out"
