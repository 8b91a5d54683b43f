"""Generated protobuf/gRPC code (scripts/gen-proto.sh)."""
