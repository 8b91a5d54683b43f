"""The Open Inference Protocol codec against an unmodified tritonclient, without a server.

Requests are built by tritonclient's own builders and parsed by ours; our responses are parsed by tritonclient's
InferResult. The descriptor test makes any drift of proto/inference/grpc_service.proto from Triton's fail.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import descriptor_pb2
from tritonclient.grpc import _utils as triton_grpc_utils
from tritonclient.grpc import model_config_pb2 as triton_config_pb
from tritonclient.grpc import service_pb2 as triton_pb

from volga_agent.gateway import oip
from volga_agent.rpc.inference import grpc_service_pb2 as pb
from volga_agent.rpc.inference import grpc_service_pb2_grpc as pb_grpc

NUMERIC = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"]


def sample(datatype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Values that exercise the type: extremes for integers, fractions and signs for floats."""
    rng = np.random.default_rng(seed)
    dtype = oip.NUMPY_DTYPES[datatype].newbyteorder("=")
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        arr = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
        if arr.size >= 2:
            arr.flat[0], arr.flat[1] = info.min, info.max
        return arr
    return (rng.standard_normal(size=shape) * 1000).astype(dtype)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert got.dtype.newbyteorder("=") == want.dtype.newbyteorder("=")
    np.testing.assert_array_equal(got, want)


def raises_invalid(match: str) -> Any:
    return pytest.raises(oip.OipError, match=match)


def check_invalid(info: pytest.ExceptionInfo[oip.OipError]) -> None:
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.http_status == 400


# --- descriptors ------------------------------------------------------------------------------------------------


def _field_rows(msg: descriptor_pb2.DescriptorProto, path: str = "") -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for f in msg.field:
        oneof = msg.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else ""
        rows.append((path + msg.name, f.name, f.number, f.type, f.label, f.type_name, oneof))
    for nested in msg.nested_type:
        rows += _field_rows(nested, path + msg.name + ".")
    return rows


def _message_proto(file: Any, name: str) -> descriptor_pb2.DescriptorProto:
    proto = descriptor_pb2.DescriptorProto()
    file.message_types_by_name[name].CopyToProto(proto)
    return proto


# Messages of Triton's model_config.proto, of which ours carry a subset of the fields.
CONFIG_MESSAGES = {"ModelConfig", "ModelInput", "ModelOutput", "ModelDynamicBatching", "ModelQueuePolicy",
                   "ModelEnsembling"}


@pytest.mark.parametrize("name", sorted(set(pb.DESCRIPTOR.message_types_by_name) - CONFIG_MESSAGES))
def test_message_descriptor_matches_triton(name: str) -> None:
    assert name in triton_pb.DESCRIPTOR.message_types_by_name, f"{name} is not a Triton message"
    ours, theirs = _message_proto(pb.DESCRIPTOR, name), _message_proto(triton_pb.DESCRIPTOR, name)
    # Field by field first for a readable diff, then everything (map entries, oneofs, options).
    assert _field_rows(ours) == _field_rows(theirs)
    assert ours == theirs


@pytest.mark.parametrize("name", sorted(CONFIG_MESSAGES))
def test_model_config_messages_are_a_subset_of_triton(name: str) -> None:
    ours, theirs = _message_proto(pb.DESCRIPTOR, name), _message_proto(triton_config_pb.DESCRIPTOR, name)
    theirs_rows = set(_field_rows(theirs))
    assert [row for row in _field_rows(ours) if row not in theirs_rows] == []


def test_data_type_enum_matches_triton() -> None:
    ours = pb.DESCRIPTOR.enum_types_by_name["DataType"]
    theirs = triton_config_pb.DESCRIPTOR.enum_types_by_name["DataType"]
    assert [(v.name, v.number) for v in ours.values] == [(v.name, v.number) for v in theirs.values]


def test_service_methods_match_triton() -> None:
    assert pb.DESCRIPTOR.package == triton_pb.DESCRIPTOR.package == "inference"
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == "inference.GRPCInferenceService"
    names = [m.name for m in ours.methods]
    assert names == [
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
        "ModelStreamInfer", "RepositoryIndex", "ModelConfig",
    ]
    for method in ours.methods:
        a, b = descriptor_pb2.MethodDescriptorProto(), descriptor_pb2.MethodDescriptorProto()
        method.CopyToProto(a)
        theirs.methods_by_name[method.name].CopyToProto(b)
        assert a == b, method.name
    # The generated servicer registers under the same gRPC paths tritonclient calls.
    assert hasattr(pb_grpc, "add_GRPCInferenceServiceServicer_to_server")


def test_both_inference_modules_live_in_one_process() -> None:
    # Ours sits in a private descriptor pool, so importing tritonclient alongside does not clash.
    assert pb.ModelInferRequest.DESCRIPTOR.file.pool is not triton_pb.ModelInferRequest.DESCRIPTOR.file.pool
    assert pb.ModelInferRequest.DESCRIPTOR.full_name == triton_pb.ModelInferRequest.DESCRIPTOR.full_name


# --- gRPC -------------------------------------------------------------------------------------------------------


def triton_grpc_request(
    inputs: dict[str, np.ndarray], outputs: list[str] | None = None, request_id: str = ""
) -> bytes:
    """The bytes tritonclient.grpc sends for InferenceServerClient.infer(...)."""
    tensors = []
    for name, arr in inputs.items():
        t = grpcclient.InferInput(name, list(arr.shape), grpcclient.np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        tensors.append(t)
    requested = None if outputs is None else [grpcclient.InferRequestedOutput(n) for n in outputs]
    req = triton_grpc_utils._get_inference_request(
        model_name="m",
        inputs=tensors,
        model_version="",
        request_id=request_id,
        outputs=requested,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        parameters=None,
    )
    return req.SerializeToString()


def parse_ours(data: bytes) -> tuple[dict[str, np.ndarray], list[str] | None]:
    return oip.decode_grpc_request(pb.ModelInferRequest.FromString(data))


def triton_grpc_result(resp: pb.ModelInferResponse) -> grpcclient.InferResult:
    return grpcclient.InferResult(triton_pb.ModelInferResponse.FromString(resp.SerializeToString()))


@pytest.mark.parametrize("datatype", NUMERIC)
def test_grpc_request_from_tritonclient(datatype: str) -> None:
    x = sample(datatype, (2, 3))
    inputs, outputs = parse_ours(triton_grpc_request({"x": x}, outputs=["y"], request_id="r1"))
    assert list(inputs) == ["x"]
    assert_same(inputs["x"], x)
    assert outputs == ["y"]


def test_grpc_request_several_inputs_scalar_and_empty() -> None:
    arrays = {"a": sample("FP32", (4, 5)), "s": np.array(7, dtype=np.int64), "e": np.zeros((0, 3), np.float32)}
    inputs, outputs = parse_ours(triton_grpc_request(arrays))
    assert list(inputs) == ["a", "s", "e"]
    for name, arr in arrays.items():
        assert_same(inputs[name], arr)
    assert outputs is None


@pytest.mark.parametrize("datatype", NUMERIC)
def test_grpc_response_read_by_tritonclient(datatype: str) -> None:
    y = sample(datatype, (3, 2), seed=1)
    resp = oip.encode_grpc_response("m", "1", "r1", {"y": y, "z": np.arange(3, dtype=np.int64)})
    result = triton_grpc_result(resp)
    assert_same(result.as_numpy("y"), y)
    assert_same(result.as_numpy("z"), np.arange(3, dtype=np.int64))
    got = result.get_response()
    assert (got.model_name, got.model_version, got.id) == ("m", "1", "r1")
    assert [o.datatype for o in got.outputs] == [datatype, "INT64"]


def test_grpc_response_big_endian_and_strided_arrays_go_out_little_endian() -> None:
    base = sample("FP32", (4, 6), seed=2)
    outputs = {"be": base.astype(">f4"), "t": base.T, "sliced": base[::2, 1::3]}
    result = triton_grpc_result(oip.encode_grpc_response("m", "", "", outputs))
    for name, arr in outputs.items():
        assert_same(result.as_numpy(name), arr.astype("<f4"))


def test_grpc_full_round_trip() -> None:
    x = sample("FP32", (8, 16), seed=3)
    inputs, requested = parse_ours(triton_grpc_request({"x": x}, outputs=["y"], request_id="abc"))
    model_outputs = {"y": inputs["x"] * 2, "unused": inputs["x"]}
    resp = oip.encode_grpc_response("m", "1", "abc", oip.select_outputs(model_outputs, requested))
    result = triton_grpc_result(resp)
    assert_same(result.as_numpy("y"), x * 2)
    assert result.as_numpy("unused") is None


@pytest.mark.parametrize(
    ("datatype", "field", "values"),
    [
        ("BOOL", "bool_contents", [True, False, True, True]),
        ("INT8", "int_contents", [-128, 0, 5, 127]),
        ("INT32", "int_contents", [-(2**31), 0, 1, 2**31 - 1]),
        ("INT64", "int64_contents", [-(2**63), 0, 1, 2**63 - 1]),
        ("UINT16", "uint_contents", [0, 1, 2, 65535]),
        ("UINT64", "uint64_contents", [0, 1, 2, 2**64 - 1]),
        ("FP32", "fp32_contents", [0.5, -1.25, 3.0, 1e30]),
        ("FP64", "fp64_contents", [0.1, -1e300, 3.0, 2.5]),
    ],
)
def test_grpc_typed_contents(datatype: str, field: str, values: list[Any]) -> None:
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="x", datatype=datatype, shape=[2, 2])
    getattr(t.contents, field).extend(values)
    inputs, _ = oip.decode_grpc_request(req)
    assert_same(inputs["x"], np.array(values, dtype=oip.NUMPY_DTYPES[datatype]).reshape(2, 2))


def test_model_metadata_grpc_and_rest() -> None:
    specs_in = [("x", "FP32", [-1, 16])]
    specs_out = [("y", "FP32", [-1, 1]), ("z", "INT64", [-1])]
    resp = oip.model_metadata_grpc("ctr", ["1", "2"], "onnxruntime_onnx", specs_in, specs_out)
    theirs = triton_pb.ModelMetadataResponse.FromString(resp.SerializeToString())
    assert (theirs.name, list(theirs.versions), theirs.platform) == ("ctr", ["1", "2"], "onnxruntime_onnx")
    assert [(t.name, t.datatype, list(t.shape)) for t in theirs.inputs] == specs_in
    assert [(t.name, t.datatype, list(t.shape)) for t in theirs.outputs] == specs_out
    rest = oip.model_metadata_rest("ctr", ["1", "2"], "onnxruntime_onnx", specs_in, specs_out)
    assert json.loads(json.dumps(rest)) == {
        "name": "ctr",
        "versions": ["1", "2"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 16]}],
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [-1, 1]},
            {"name": "z", "datatype": "INT64", "shape": [-1]},
        ],
    }


# --- REST -------------------------------------------------------------------------------------------------------


def triton_http_request(
    inputs: dict[str, tuple[np.ndarray, bool]], outputs: list[tuple[str, bool]] | None = None, request_id: str = ""
) -> tuple[bytes, int | None]:
    """The body and Inference-Header-Content-Length tritonclient.http sends; inputs map to (array, binary)."""
    tensors = []
    for name, (arr, binary) in inputs.items():
        t = httpclient.InferInput(name, list(arr.shape), httpclient.np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr, binary_data=binary)
        tensors.append(t)
    requested = None if outputs is None else [httpclient.InferRequestedOutput(n, binary_data=b) for n, b in outputs]
    body, header_length = httpclient.InferenceServerClient.generate_request_body(
        tensors, outputs=requested, request_id=request_id
    )
    return body, header_length


def triton_http_result(body: bytes, header_length: int | None) -> httpclient.InferResult:
    return httpclient.InferenceServerClient.parse_response_body(body, header_length=header_length)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", NUMERIC)
def test_rest_request_from_tritonclient(datatype: str, binary: bool) -> None:
    x = sample(datatype, (2, 3))
    body, header_length = triton_http_request({"x": (x, binary)}, outputs=[("y", True), ("z", False)], request_id="r1")
    assert (header_length is not None) == binary
    req = oip.decode_rest_request(body, header_length)
    assert_same(req.inputs["x"], x)
    assert req.outputs == [("y", True), ("z", False)]
    assert req.request_id == "r1"


def test_rest_request_mixed_inputs_and_default_outputs() -> None:
    a, b, c = sample("FP32", (3, 4)), sample("INT64", (5,)), sample("UINT8", (2, 2))
    body, header_length = triton_http_request({"a": (a, True), "b": (b, False), "c": (c, True)})
    req = oip.decode_rest_request(body, header_length)
    for name, arr in {"a": a, "b": b, "c": c}.items():
        assert_same(req.inputs[name], arr)
    # tritonclient asks for every output in binary when it names none.
    assert req.outputs is None
    assert req.request_id is None
    assert req.binary_default is True


def test_rest_request_nested_json_data() -> None:
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "INT32", "shape": [2, 3], "data": [[1, 2, 3], [4, 5, 6]]}]}
    ).encode()
    req = oip.decode_rest_request(body, None)
    assert_same(req.inputs["x"], np.arange(1, 7, dtype=np.int32).reshape(2, 3))
    assert req.outputs is None and req.binary_default is False


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", NUMERIC)
def test_rest_response_read_by_tritonclient(datatype: str, binary: bool) -> None:
    y = sample(datatype, (3, 2), seed=1)
    body, header_length = oip.encode_rest_response("m", "1", "r1", {"y": y}, [("y", binary)], binary_default=False)
    assert (header_length is not None) == binary
    result = triton_http_result(body, header_length)
    assert_same(result.as_numpy("y"), y)
    got = result.get_response()
    assert (got["model_name"], got["model_version"], got["id"]) == ("m", "1", "r1")


def test_rest_response_mixed_outputs_in_requested_order() -> None:
    y, z, w = sample("FP32", (2, 2)), sample("INT64", (3,)), sample("BOOL", (4,))
    outputs = {"y": y, "z": z, "w": w}
    requested = [("w", True), ("z", False), ("y", True)]
    body, header_length = oip.encode_rest_response("m", "", None, outputs, requested, binary_default=False)
    result = triton_http_result(body, header_length)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["w", "z", "y"]
    assert "data" in result.get_output("z") and "data" not in result.get_output("y")
    for name, arr in outputs.items():
        assert_same(result.as_numpy(name), arr)


@pytest.mark.parametrize("binary_default", [True, False])
def test_rest_response_all_outputs_by_default(binary_default: bool) -> None:
    outputs = {"y": sample("FP64", (2,)), "z": sample("INT16", (2, 2))}
    body, header_length = oip.encode_rest_response("m", "1", None, outputs, None, binary_default)
    assert (header_length is not None) == binary_default
    result = triton_http_result(body, header_length)
    for name, arr in outputs.items():
        assert_same(result.as_numpy(name), arr)


def test_rest_full_round_trip() -> None:
    x = sample("FP32", (4, 8), seed=5)
    body, header_length = triton_http_request({"x": (x, True)}, request_id="q")
    req = oip.decode_rest_request(body, header_length)
    outputs = {"y": req.inputs["x"] + 1, "n": np.array([x.shape[0]], dtype=np.int64)}
    out, out_length = oip.encode_rest_response("m", "1", req.request_id, outputs, req.outputs, req.binary_default)
    result = triton_http_result(out, out_length)
    assert_same(result.as_numpy("y"), x + 1)
    assert_same(result.as_numpy("n"), np.array([4], dtype=np.int64))


def test_rest_error_body_is_what_tritonclient_reads() -> None:
    err = oip.OipError("NOT_FOUND", 404, "model 'x' is not served")
    assert json.loads(oip.rest_error_body(err)) == {"error": "model 'x' is not served"}


# --- errors -----------------------------------------------------------------------------------------------------


def grpc_request(datatype: str, shape: list[int], raw: bytes | None = None) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype=datatype, shape=shape)
    if raw is not None:
        req.raw_input_contents.append(raw)
    return req


def test_grpc_wrong_byte_count() -> None:
    req = pb.ModelInferRequest.FromString(triton_grpc_request({"x": sample("FP32", (2, 3))}))
    req.raw_input_contents[0] = req.raw_input_contents[0][:-1]
    with raises_invalid(r"input 'x': 23 bytes of data, but shape \[2, 3\] of FP32 needs 24 bytes") as info:
        oip.decode_grpc_request(req)
    check_invalid(info)


@pytest.mark.parametrize(
    ("datatype", "match"),
    [("FP8", r"input 'x': unknown datatype 'FP8'"), ("BYTES", r"input 'x': datatype BYTES is not supported")],
)
def test_grpc_unknown_or_unsupported_datatype(datatype: str, match: str) -> None:
    with raises_invalid(match) as info:
        oip.decode_grpc_request(grpc_request(datatype, [1], b"\0"))
    check_invalid(info)


def test_grpc_bytes_tensor_from_tritonclient_is_refused() -> None:
    data = triton_grpc_request({"x": np.array([b"ab", b"c"], dtype=np.object_)})
    with raises_invalid(r"input 'x': datatype BYTES is not supported") as info:
        parse_ours(data)
    check_invalid(info)


def test_grpc_missing_data() -> None:
    with raises_invalid(r"input 'x': no data") as info:
        oip.decode_grpc_request(grpc_request("FP32", [2]))
    check_invalid(info)


def test_grpc_raw_contents_count_mismatch() -> None:
    req = grpc_request("FP32", [1], b"\0" * 4)
    req.inputs.add(name="w", datatype="FP32", shape=[1])
    with raises_invalid(r"raw_input_contents has 1 entries for 2 inputs") as info:
        oip.decode_grpc_request(req)
    check_invalid(info)


def test_grpc_negative_shape() -> None:
    with raises_invalid(r"input 'x': shape \[-1, 2\] has a negative dimension") as info:
        oip.decode_grpc_request(grpc_request("FP32", [-1, 2], b""))
    check_invalid(info)


@pytest.mark.parametrize(
    ("datatype", "field", "values", "match"),
    [
        ("FP32", "int64_contents", [1, 2], r"input 'x': contents has int64_contents, but datatype FP32 uses fp32"),
        ("INT8", "int_contents", [1, 300], r"input 'x': value 300 is out of range for INT8"),
        ("INT32", "int_contents", [1], r"input 'x': 1 values, but shape \[2\] needs 2"),
        ("FP16", "fp32_contents", [1.0, 2.0], r"input 'x': FP16 data cannot be sent in contents"),
    ],
)
def test_grpc_bad_contents(datatype: str, field: str, values: list[Any], match: str) -> None:
    req = grpc_request(datatype, [2])
    getattr(req.inputs[0].contents, field).extend(values)
    with raises_invalid(match) as info:
        oip.decode_grpc_request(req)
    check_invalid(info)


def test_rest_malformed_json() -> None:
    with raises_invalid(r"request JSON is malformed") as info:
        oip.decode_rest_request(b'{"inputs": [', None)
    check_invalid(info)


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        ({"datatype": "FP32", "shape": [2], "data": [1.0, "a"]}, r"input 'x': `data` holds \"a\""),
        ({"datatype": "INT32", "shape": [2], "data": [1.5, 2]}, r"input 'x': INT32 data must be integers"),
        ({"datatype": "FP32", "shape": [3], "data": [1.0, 2.0]}, r"input 'x': 2 values, but shape \[3\] needs 3"),
        ({"datatype": "FP32", "shape": [2]}, r"input 'x': no data"),
        ({"datatype": "FP8", "shape": [1], "data": [1]}, r"input 'x': unknown datatype 'FP8'"),
        ({"datatype": "FP32", "shape": [2, "a"], "data": [1]}, r"input 'x': shape \[2, 'a'\] must be a list of int"),
        (
            {"datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}},
            r"input 'x': has binary_data_size, but the request has no Inference-Header-Content-Length",
        ),
        (
            {"datatype": "FP32", "shape": [1], "data": [1], "parameters": {"shared_memory_region": "r"}},
            r"input 'x': parameter shared_memory_region",
        ),
    ],
)
def test_rest_bad_json_input(tensor: dict[str, Any], match: str) -> None:
    body = json.dumps({"inputs": [{"name": "x", **tensor}]}).encode()
    with raises_invalid(match) as info:
        oip.decode_rest_request(body, None)
    check_invalid(info)


def test_rest_header_length_past_body() -> None:
    body, header_length = triton_http_request({"x": (sample("FP32", (2,)), True)})
    assert header_length is not None
    with raises_invalid(rf"Inference-Header-Content-Length is {len(body) + 1}, but the body has {len(body)}") as info:
        oip.decode_rest_request(body, len(body) + 1)
    check_invalid(info)


def test_rest_binary_data_runs_past_body() -> None:
    body, header_length = triton_http_request({"x": (sample("FP32", (2,)), True)})
    with raises_invalid(r"input 'x': binary_data_size 8 runs past the end of the body \(7 bytes") as info:
        oip.decode_rest_request(body[:-1], header_length)
    check_invalid(info)


def test_rest_binary_size_does_not_match_shape() -> None:
    header = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 4}}]}
    ).encode()
    with raises_invalid(r"input 'x': 4 bytes of data, but shape \[2\] of FP32 needs 8 bytes") as info:
        oip.decode_rest_request(header + b"\0" * 4, len(header))
    check_invalid(info)


def test_rest_trailing_binary_data() -> None:
    body, header_length = triton_http_request({"x": (sample("FP32", (2,)), True)})
    with raises_invalid(r"9 bytes of binary data after the JSON header, but the inputs' binary_data_size add up to 8"):
        oip.decode_rest_request(body + b"\0", header_length)


def test_unknown_requested_output() -> None:
    with raises_invalid(r"requested output 'nope' is not an output of the model \(outputs: y\)") as info:
        oip.encode_rest_response("m", "1", None, {"y": np.zeros(1, np.float32)}, [("nope", True)], True)
    check_invalid(info)
    with raises_invalid(r"requested output 'nope'"):
        oip.select_outputs({"y": np.zeros(1, np.float32)}, ["nope"])


def test_output_without_a_datatype_is_a_server_error() -> None:
    with pytest.raises(oip.OipError, match=r"output 'c': numpy dtype complex64") as info:
        oip.encode_grpc_response("m", "1", "", {"c": np.zeros(2, np.complex64)})
    assert (info.value.code, info.value.http_status) == ("INTERNAL", 500)


def test_forwarding_codec_round_trips() -> None:
    """What a gateway sends to another node's gateway, and reads back, keeps every tensor bit for bit."""
    tensors = {"dense": np.arange(26, dtype=np.float32).reshape(2, 13),
               "sparse": np.arange(52, dtype=np.int64).reshape(2, 26)}
    request = oip.encode_grpc_request("m", tensors)
    decoded, requested = oip.decode_grpc_request(pb.ModelInferRequest.FromString(request.SerializeToString()))
    assert requested is None and all(np.array_equal(decoded[k], v) for k, v in tensors.items())
    response = oip.encode_grpc_response("m", "1", "", {"probability": np.ones((2, 1), np.float32)})
    back = oip.decode_grpc_response(pb.ModelInferResponse.FromString(response.SerializeToString()))
    assert np.array_equal(back["probability"], np.ones((2, 1), np.float32))
    del response.raw_output_contents[:]
    with pytest.raises(oip.OipError, match="0 raw outputs for 1 outputs"):
        oip.decode_grpc_response(response)


# --- hostile bodies, non-finite values, compression, model configuration ----------------------------------------


def test_rest_deeply_nested_json_is_a_client_error() -> None:
    for body in (b"[" * 100_000 + b"]" * 100_000,
                 b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ' + b"[" * 50_000 + b"1"
                 + b"]" * 50_000 + b"}]}"):
        with raises_invalid(r"the request JSON nests too deeply") as info:
            oip.decode_rest_request(body, None)
        check_invalid(info)


@pytest.mark.parametrize("shape", [[0, 2**62], [2**41], [2**21, 2**21, 0]])
def test_huge_shapes_are_client_errors(shape: list[int]) -> None:
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": []}]}).encode()
    with raises_invalid(r"input 'x': shape .* is too large") as info:
        oip.decode_rest_request(body, None)
    check_invalid(info)
    req = grpc_request("FP32", shape)
    with raises_invalid(r"input 'x': shape .* is too large") as info:
        oip.decode_grpc_request(req)
    check_invalid(info)


def test_rest_json_outputs_carry_non_finite_floats_as_strings() -> None:
    y = np.array([[np.nan, np.inf, -np.inf, 1.5]], np.float32)
    body, header_length = oip.encode_rest_response("m", "1", None, {"y": y, "i": np.arange(2)}, None, False)
    assert header_length is None
    doc = json.loads(body, parse_constant=lambda token: pytest.fail(f"bare {token} in the JSON"))
    assert doc["outputs"][0]["data"] == ["NaN", "Infinity", "-Infinity", 1.5]
    got = triton_http_result(body, None).as_numpy("y")
    assert got.dtype == np.float32 and np.isnan(got[0, 0]) and list(got[0, 1:]) == [np.inf, -np.inf, 1.5]
    # ... and read back as inputs, as are the bare tokens Python's json writes.
    for data in ('["NaN", "Infinity", "-Infinity", 1.5]', "[NaN, Infinity, -Infinity, 1.5]"):
        request = f'{{"inputs": [{{"name": "y", "datatype": "FP64", "shape": [4], "data": {data}}}]}}'.encode()
        x = oip.decode_rest_request(request, None).inputs["y"]
        assert np.isnan(x[0]) and list(x[1:]) == [np.inf, -np.inf, 1.5]
    with raises_invalid(r"input 'y': INT32 data must be integers"):
        oip.decode_rest_request(b'{"inputs": [{"name": "y", "datatype": "INT32", "shape": [1], "data": ["NaN"]}]}',
                                None)


def test_rest_request_decoded_with_yielding_number_parsers_is_the_same() -> None:
    body, header_length = triton_http_request({"a": (sample("FP32", (3, 4)), False),
                                               "b": (sample("INT64", (5,)), False), "c": (sample("FP64", (2,)), True)})
    plain = oip.decode_rest_request(body, header_length)
    slow = oip.decode_rest_request(body, header_length, yielding=True)
    for name in ("a", "b", "c"):
        assert_same(slow.inputs[name], plain.inputs[name])


def test_content_encodings() -> None:
    import gzip
    import zlib

    data = b'{"inputs": []}' * 100
    assert oip.decode_content(data, None, 10**6) == data
    assert oip.decode_content(data, "identity", 10**6) == data
    assert oip.decode_content(gzip.compress(data), "gzip", 10**6) == data
    assert oip.decode_content(zlib.compress(data), "deflate", 10**6) == data
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert oip.decode_content(raw.compress(data) + raw.flush(), "Deflate", 10**6) == data
    cases = [(data, "gzip", "not valid gzip data"), (gzip.compress(data)[:-12], "gzip", "truncated"),
             (gzip.compress(data) + b"junk", "gzip", "4 bytes follow the compressed stream"),
             (b"plain", "deflate", "not valid deflate data")]
    for body, encoding, match in cases:
        with raises_invalid(match) as info:
            oip.decode_content(body, encoding, 10**6)
        check_invalid(info)
    with pytest.raises(oip.OipError, match="decompresses to over 1000 bytes") as err:
        oip.decode_content(gzip.compress(b"0" * 10**7), "gzip", 1000)
    assert (err.value.code, err.value.http_status) == ("RESOURCE_EXHAUSTED", 413)
    with pytest.raises(oip.OipError, match="Content-Encoding 'br' is not supported") as err:
        oip.decode_content(b"x", "br", 1000)
    assert (err.value.code, err.value.http_status) == ("INVALID_ARGUMENT", 415)


def test_model_config_read_by_tritonclient() -> None:
    inputs = [("dense", "FP32", [13]), ("ids", "INT64", [-1])]
    outputs = [("p", "FP16", [1])]
    resp = oip.model_config_grpc("m", "onnxruntime_onnx", "onnxruntime", 64, inputs, outputs)
    theirs = triton_pb.ModelConfigResponse.FromString(resp.SerializeToString()).config
    assert (theirs.name, theirs.platform, theirs.backend, theirs.max_batch_size) == (
        "m", "onnxruntime_onnx", "onnxruntime", 64)
    assert [(i.name, triton_config_pb.DataType.Name(i.data_type), list(i.dims)) for i in theirs.input] == [
        ("dense", "TYPE_FP32", [13]), ("ids", "TYPE_INT64", [-1])]
    assert [(o.name, triton_config_pb.DataType.Name(o.data_type), list(o.dims)) for o in theirs.output] == [
        ("p", "TYPE_FP16", [1])]
    rest = oip.model_config_rest("m", "onnxruntime_onnx", "onnxruntime", 64, inputs, outputs)
    assert rest == {"name": "m", "platform": "onnxruntime_onnx", "backend": "onnxruntime", "max_batch_size": 64,
                    "input": [{"name": "dense", "data_type": "TYPE_FP32", "dims": [13]},
                              {"name": "ids", "data_type": "TYPE_INT64", "dims": [-1]}],
                    "output": [{"name": "p", "data_type": "TYPE_FP16", "dims": [1]}]}
