"""Open Inference Protocol (KServe v2 / Triton) codec: wire messages <-> numpy tensors, with no networking.

The gateway answers unmodified `tritonclient` over gRPC (`inference.GRPCInferenceService`) and REST
(`/v2/models/{name}/infer`, including Triton's binary tensor extension). Everything that turns request bytes
into arrays and arrays into response bytes lives here, as pure functions, so that:

- wire compatibility is tested against tritonclient's own request builders and response parsers without a
  server (tests/unit/test_oip.py);
- a malformed request is rejected before any model instance is woken, with an `OipError` that names the input
  and the reason and carries both the gRPC status name and the HTTP status the servers answer with;
- the gRPC and REST servers stay thin adapters.

Tensors decoded from raw bytes are numpy views of the request's buffers (no copy): they may be read-only and
unaligned, so copy one before writing into it. Multi-byte values are little-endian on the wire, whatever the
host. BYTES (string) tensors are not served: Volga's models take numeric tensors.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from volga_agent.rpc.inference import grpc_service_pb2 as pb
from volga_agent.worker import protocol

Tensor = npt.NDArray[Any]
# (name, OIP datatype, shape) as a model declares it; -1 marks a variable dimension.
TensorSpec = tuple[str, str, Sequence[int]]

# OIP datatype -> numpy dtype, little-endian as on the wire: the types the workers carry.
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {name: dt.newbyteorder("<") for name, dt in protocol.NP_DTYPES.items()}
# numpy (kind, itemsize) -> OIP datatype; keyed so that a big-endian array still maps to its datatype.
_DATATYPES: dict[tuple[str, int], str] = {(dt.kind, dt.itemsize): name for name, dt in NUMPY_DTYPES.items()}
# Datatypes of the protocol that Volga knows but does not serve.
UNSUPPORTED_DATATYPES = frozenset({"BYTES", "BF16"})

# The InferTensorContents field that carries each datatype (FP16 has none: it travels as raw bytes only).
_CONTENTS_FIELDS: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
_ALL_CONTENTS_FIELDS = (
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
    "bytes_contents",
)

# Tensor parameters for features the gateway does not serve; silently ignoring them would return wrong data.
_SHARED_MEMORY_PARAMS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")

INVALID_ARGUMENT = "INVALID_ARGUMENT"
NOT_FOUND = "NOT_FOUND"
INTERNAL = "INTERNAL"
UNAVAILABLE = "UNAVAILABLE"


class OipError(Exception):
    """A request the protocol layer refuses, or a result it cannot encode.

    `code` is a gRPC status name (`grpc.StatusCode[code]` gives the enum), `http_status` the REST status.
    """

    def __init__(self, code: str, http_status: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.http_status = http_status
        self.message = message

    def __repr__(self) -> str:
        return f"OipError({self.code!r}, {self.http_status}, {self.message!r})"


# gRPC status -> the REST status the same failure gets (499: the client went away, as nginx counts it).
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 413,
               "CANCELLED": 499, "INTERNAL": 500, "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
# A tensor larger than this (counting a 0 dimension as 1) is refused before numpy is asked to shape it.
MAX_ELEMENTS = 2**40
# Non-finite floats in JSON data, as the protobuf JSON mapping writes them: JSON has no NaN or Infinity.
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def error(code: str, message: str) -> OipError:
    """An OipError whose REST status follows from its gRPC status (502 for anything unlisted)."""
    return OipError(code, HTTP_STATUS.get(code, 502), message)


def _invalid(message: str) -> OipError:
    return OipError(INVALID_ARGUMENT, 400, message)


def rest_error_body(err: OipError) -> bytes:
    """The JSON body of a REST error response: tritonclient.http reads the `error` field."""
    return json.dumps({"error": err.message}).encode()


def retry_after_header(err: OipError) -> dict[str, str]:
    """The REST headers of a refusal that says when to retry (a shed model: `retry_after_ms`): Retry-After, in whole
    seconds rounded up; none for any other error."""
    retry_after_ms = getattr(err, "retry_after_ms", None)
    return {} if retry_after_ms is None else {"Retry-After": str(math.ceil(retry_after_ms / 1000))}


def retry_after_trailer(err: OipError) -> tuple[tuple[str, str], ...]:
    """The gRPC trailing metadata of a refusal that says when to retry (a shed model): `retry-after-ms`."""
    retry_after_ms = getattr(err, "retry_after_ms", None)
    return () if retry_after_ms is None else (("retry-after-ms", str(retry_after_ms)),)


class RestRequest(NamedTuple):
    """A decoded REST inference request."""

    inputs: dict[str, Tensor]
    # Requested outputs in order, each with whether it goes back as binary data; None: all outputs.
    outputs: list[tuple[str, bool]] | None
    request_id: str | None
    # How outputs are returned when none are requested (request parameter `binary_data_output`).
    binary_default: bool


# --- datatypes and shapes ---------------------------------------------------------------------------------------


def numpy_dtype(datatype: str, where: str) -> np.dtype[Any]:
    """The numpy dtype of an OIP datatype string; `where` names the tensor for the error."""
    dtype = NUMPY_DTYPES.get(datatype)
    if dtype is not None:
        return dtype
    if datatype in UNSUPPORTED_DATATYPES:
        raise _invalid(f"{where}: datatype {datatype} is not supported (Volga serves numeric tensors)")
    raise _invalid(f"{where}: unknown datatype {datatype!r}; expected one of {', '.join(NUMPY_DTYPES)}")


def oip_datatype(dtype: np.dtype[Any], where: str) -> str:
    """The OIP datatype string of a numpy dtype (a model output's); unsupported dtypes are a server error."""
    name = _DATATYPES.get((dtype.kind, dtype.itemsize))
    if name is None:
        raise OipError(INTERNAL, 500, f"{where}: numpy dtype {dtype} has no Open Inference Protocol datatype")
    return name


def _shape(dims: Sequence[Any], where: str) -> tuple[int, ...]:
    shape: list[int] = []
    for d in dims:
        # bool is an int in Python; a JSON `true` is no dimension.
        if not isinstance(d, int) or isinstance(d, bool):
            raise _invalid(f"{where}: shape {list(dims)} must be a list of integers")
        if d < 0:
            raise _invalid(f"{where}: shape {list(dims)} has a negative dimension")
        shape.append(d)
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise _invalid(f"{where}: shape {list(dims)} is too large (over {MAX_ELEMENTS} elements)")
    return tuple(shape)


def _grpc_shape(dims: tuple[int, ...], where: str) -> tuple[int, ...]:
    """`_shape` for the dimensions of a protobuf message, which are integers already."""
    if dims and (min(dims) < 0 or math.prod(dims) > MAX_ELEMENTS or (0 in dims and len(dims) > 1)):
        return _shape(dims, where)  # what is wrong, or a 0 dimension beside others (counted as 1 there)
    return dims


def _from_bytes(data: bytes | memoryview, dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> Tensor:
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise _invalid(
            f"{where}: {len(data)} bytes of data, but shape {list(shape)} of {oip_datatype(dtype, where)} "
            f"needs {expected} bytes"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _checked_array(values: Sequence[Any], dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> Tensor:
    """Typed values (protobuf contents or flattened JSON data) -> an array, checking count, kind and range."""
    count = math.prod(shape)
    if len(values) != count:
        raise _invalid(f"{where}: {len(values)} values, but shape {list(shape)} needs {count}")
    datatype = oip_datatype(dtype, where)
    # Python-level checks: numpy would silently turn 1.5 into 1, True into 1 or 300 into 44 for INT8. The set
    # of value types is one C-level pass; bool is its own type, so it never passes for an int.
    types = set(map(type, values))
    if dtype.kind == "b":
        if not types <= {bool}:
            raise _invalid(f"{where}: {datatype} data must be true/false values")
    elif dtype.kind in "iu":
        if not types <= {int}:
            raise _invalid(f"{where}: {datatype} data must be integers")
        if count:
            info = np.iinfo(dtype)
            lo, hi = min(values), max(values)
            if lo < info.min or hi > info.max:
                raise _invalid(f"{where}: value {lo if lo < info.min else hi} is out of range for {datatype}")
    elif not types <= {int, float}:
        if not types <= {int, float, str}:
            raise _invalid(f"{where}: {datatype} data must be numbers")
        # `_flatten` lets through only the strings of _NON_FINITE.
        values = [_NON_FINITE[v] if isinstance(v, str) else v for v in values]
    return np.array(values, dtype=dtype).reshape(shape)


def _reject_shared_memory(params: Mapping[str, Any], where: str) -> None:
    for key in _SHARED_MEMORY_PARAMS:
        if key in params:
            raise _invalid(f"{where}: parameter {key}: shared-memory tensors are not supported by the gateway")


def _le_bytes(arr: Tensor) -> bytes:
    """Row-major little-endian bytes of an array (the wire format): one copy, plus a conversion first when the
    array is not already contiguous and little-endian."""
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def select_outputs(outputs: Mapping[str, Tensor], requested: Sequence[str] | None) -> dict[str, Tensor]:
    """The outputs a request asked for, in the order it asked; all of them when it named none."""
    if requested is None:
        return dict(outputs)
    selected: dict[str, Tensor] = {}
    for name in requested:
        if name not in outputs:
            raise _invalid(f"requested output {name!r} is not an output of the model (outputs: {', '.join(outputs)})")
        selected[name] = outputs[name]
    return selected


# --- gRPC -------------------------------------------------------------------------------------------------------


def decode_grpc_request(req: pb.ModelInferRequest) -> tuple[dict[str, Tensor], list[str] | None]:
    """The input tensors of a gRPC request by name, and the names of the requested outputs (None: all).

    Data comes from `raw_input_contents` (one entry per input, in order, as tritonclient sends it) or from each
    input's typed `contents`.
    """
    raw = req.raw_input_contents
    if raw and len(raw) != len(req.inputs):
        raise _invalid(
            f"raw_input_contents has {len(raw)} entries for {len(req.inputs)} inputs; "
            "when used it needs one entry per input, in order"
        )
    inputs: dict[str, Tensor] = {}
    for i, tensor in enumerate(req.inputs):
        name = tensor.name
        if not name:
            raise _invalid(f"input #{i} has no name")
        where = f"input {name!r}"
        if name in inputs:
            raise _invalid(f"{where} appears more than once")
        if tensor.parameters:
            _reject_shared_memory(tensor.parameters, where)
        dtype = NUMPY_DTYPES.get(tensor.datatype) or numpy_dtype(tensor.datatype, where)
        shape = _grpc_shape(tuple(tensor.shape), where)
        if raw:
            if tensor.HasField("contents"):
                raise _invalid(f"{where}: has both contents and raw_input_contents; send one of them")
            inputs[name] = _from_bytes(raw[i], dtype, shape, where)
        elif tensor.HasField("contents"):
            inputs[name] = _from_contents(tensor.contents, tensor.datatype, dtype, shape, where)
        elif math.prod(shape) == 0:
            inputs[name] = np.empty(shape, dtype=dtype)
        else:
            raise _invalid(f"{where}: no data (neither raw_input_contents nor contents)")

    requested: list[str] = []
    for out in req.outputs:
        if not out.name:
            raise _invalid("a requested output has no name")
        if "classification" in out.parameters:
            raise _invalid(f"output {out.name!r}: parameter classification is not supported")
        _reject_shared_memory(out.parameters, f"output {out.name!r}")
        if out.name in requested:
            raise _invalid(f"output {out.name!r} is requested more than once")
        requested.append(out.name)
    return inputs, requested or None


def _from_contents(
    contents: pb.InferTensorContents, datatype: str, dtype: np.dtype[Any], shape: tuple[int, ...], where: str
) -> Tensor:
    field = _CONTENTS_FIELDS.get(datatype)
    if field is None:
        raise _invalid(f"{where}: {datatype} data cannot be sent in contents; send it in raw_input_contents")
    for other in _ALL_CONTENTS_FIELDS:
        if other != field and len(getattr(contents, other)):
            raise _invalid(f"{where}: contents has {other}, but datatype {datatype} uses {field}")
    return _checked_array(list(getattr(contents, field)), dtype, shape, where)


def encode_grpc_response(
    model_name: str, model_version: str, request_id: str, outputs: Mapping[str, Tensor]
) -> pb.ModelInferResponse:
    """A gRPC response carrying every output in `raw_output_contents`, in order (what tritonclient reads)."""
    resp = pb.ModelInferResponse(model_name=model_name, model_version=model_version, id=request_id)
    _append_raw(resp.outputs, resp.raw_output_contents, outputs, "output")
    return resp


def _append_raw(tensors: Any, raw: Any, values: Mapping[str, Tensor], kind: str) -> None:
    """Describe each tensor in `tensors` and put its bytes, in order, in `raw` (the raw_*_contents field)."""
    for name, value in values.items():
        arr = np.asarray(value)
        tensor = tensors.add()
        tensor.name = name
        tensor.datatype = oip_datatype(arr.dtype, f"{kind} {name!r}")
        tensor.shape.extend(arr.shape)
        raw.append(_le_bytes(arr))


def encode_grpc_request(model_name: str, inputs: Mapping[str, Tensor], request_id: str = "") -> pb.ModelInferRequest:
    """A gRPC request carrying every input in `raw_input_contents` (for forwarding to another gateway)."""
    req = pb.ModelInferRequest(model_name=model_name, id=request_id)
    _append_raw(req.inputs, req.raw_input_contents, inputs, "input")
    return req


def decode_grpc_response(resp: pb.ModelInferResponse) -> dict[str, Tensor]:
    """The outputs of a gRPC response that carries them in `raw_output_contents`, as this gateway sends them."""
    if len(resp.raw_output_contents) != len(resp.outputs):
        raise OipError(INTERNAL, 502, f"response has {len(resp.raw_output_contents)} raw outputs for "
                                      f"{len(resp.outputs)} outputs")
    out: dict[str, Tensor] = {}
    for tensor, raw in zip(resp.outputs, resp.raw_output_contents, strict=True):
        where = f"output {tensor.name!r}"
        out[tensor.name] = _from_bytes(raw, numpy_dtype(tensor.datatype, where), _shape(tensor.shape, where), where)
    return out


# --- REST -------------------------------------------------------------------------------------------------------


def rest_header_length(value: str | None) -> int | None:
    """The `Inference-Header-Content-Length` header of a REST request as a number; None when not sent."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise _invalid(f"Inference-Header-Content-Length {value[:40]!r} is not a number") from None


def decode_content(body: bytes, encoding: str | None, limit: int) -> bytes:
    """A request body as its `Content-Encoding` header says: identity, gzip or deflate (zlib, or raw deflate).

    A compressed body must be whole and well-formed, and decompress to at most `limit` bytes (RESOURCE_EXHAUSTED
    past that, without decompressing further). zlib releases the GIL, so a large body can be decoded in a thread.
    """
    name = (encoding or "identity").strip().lower()
    if name == "identity":
        return body
    if name in ("gzip", "x-gzip"):
        return _inflate(body, 16 + zlib.MAX_WBITS, name, limit)
    if name == "deflate":
        try:
            return _inflate(body, zlib.MAX_WBITS, name, limit)
        except OipError as exc:
            if exc.code != INVALID_ARGUMENT:
                raise
            return _inflate(body, -zlib.MAX_WBITS, name, limit)  # raw deflate, as some clients send it
    raise OipError(INVALID_ARGUMENT, 415, f"Content-Encoding {encoding!r} is not supported; send gzip, deflate "
                                          "or an uncompressed body")


def _inflate(body: bytes, wbits: int, name: str, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise _invalid(f"Content-Encoding {name}: the body is not valid {name} data ({exc})") from None
    if len(data) > limit:
        raise error("RESOURCE_EXHAUSTED", f"Content-Encoding {name}: the body decompresses to over {limit} bytes")
    if not inflater.eof:
        raise _invalid(f"Content-Encoding {name}: the body ends before its compressed stream does (truncated)")
    if inflater.unused_data:
        raise _invalid(f"Content-Encoding {name}: {len(inflater.unused_data)} bytes follow the compressed stream")
    return data


def _python_float(text: str) -> float:
    return float(text)


def _python_int(text: str) -> int:
    return int(text)


def decode_rest_request(body: bytes, header_length: int | None, yielding: bool = False) -> RestRequest:
    """A REST inference request: JSON alone, or (Triton's binary tensor extension) a JSON header of
    `header_length` bytes (the `Inference-Header-Content-Length` header) followed by the binary data of the
    inputs whose parameters carry `binary_data_size`, back to back in input order.

    Returns the inputs by name, the requested outputs with their binary flag (None: all outputs), the request
    id and the default binary flag (request parameter `binary_data_output`) for outputs not requested by name.

    `yielding` (for a large body decoded in a thread) parses numbers through Python functions: slower, but the
    interpreter can hand the GIL to the event loop between numbers, which C-level `json.loads` never does.
    """
    if header_length is None:
        header, binary = body, memoryview(b"")
    else:
        if header_length < 0 or header_length > len(body):
            raise _invalid(f"Inference-Header-Content-Length is {header_length}, but the body has {len(body)} bytes")
        header, binary = body[:header_length], memoryview(body)[header_length:]
    try:
        if yielding:
            request = json.loads(header, parse_float=_python_float, parse_int=_python_int)
        else:
            request = json.loads(header)
    except (UnicodeDecodeError, ValueError) as e:
        raise _invalid(f"the request JSON is malformed: {e}") from None
    except RecursionError:
        raise _invalid("the request JSON nests too deeply (arrays or objects within each other)") from None
    if not isinstance(request, dict):
        raise _invalid("the request JSON must be an object with an `inputs` list")

    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise _invalid("request id must be a string")
    params = _params(request, "the request")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise _invalid("request parameter binary_data_output must be true or false")

    raw_inputs = request.get("inputs")
    if not isinstance(raw_inputs, list):
        raise _invalid("the request JSON has no `inputs` list")
    inputs: dict[str, Tensor] = {}
    offset = 0
    for i, tensor in enumerate(raw_inputs):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str) or not tensor["name"]:
            raise _invalid(f"input #{i} must be an object with a `name`")
        name: str = tensor["name"]
        where = f"input {name!r}"
        if name in inputs:
            raise _invalid(f"{where} appears more than once")
        datatype = tensor.get("datatype")
        if not isinstance(datatype, str):
            raise _invalid(f"{where}: no datatype")
        dtype = numpy_dtype(datatype, where)
        dims = tensor.get("shape")
        if not isinstance(dims, list):
            raise _invalid(f"{where}: no shape list")
        shape = _shape(dims, where)
        tparams = _params(tensor, where)
        _reject_shared_memory(tparams, where)
        size = tparams.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise _invalid(f"{where}: parameter binary_data_size must be a non-negative integer")
            if header_length is None:
                raise _invalid(
                    f"{where}: has binary_data_size, but the request has no Inference-Header-Content-Length header"
                )
            if "data" in tensor:
                raise _invalid(f"{where}: has both data and binary_data_size; send one of them")
            if offset + size > len(binary):
                raise _invalid(
                    f"{where}: binary_data_size {size} runs past the end of the body "
                    f"({len(binary) - offset} bytes of binary data left)"
                )
            inputs[name] = _from_bytes(binary[offset : offset + size], dtype, shape, where)
            offset += size
        elif "data" in tensor:
            inputs[name] = _checked_array(_flatten(tensor["data"], where), dtype, shape, where)
        else:
            raise _invalid(f"{where}: no data (neither `data` nor parameters.binary_data_size)")
    if offset != len(binary):
        raise _invalid(
            f"the body has {len(binary)} bytes of binary data after the JSON header, but the inputs' "
            f"binary_data_size add up to {offset}"
        )

    outputs: list[tuple[str, bool]] | None = None
    raw_outputs = request.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise _invalid("`outputs` must be a list")
        outputs = []
        for i, out in enumerate(raw_outputs):
            if not isinstance(out, dict) or not isinstance(out.get("name"), str) or not out["name"]:
                raise _invalid(f"requested output #{i} must be an object with a `name`")
            where = f"output {out['name']!r}"
            oparams = _params(out, where)
            _reject_shared_memory(oparams, where)
            if oparams.get("classification"):
                raise _invalid(f"{where}: parameter classification is not supported")
            as_binary = oparams.get("binary_data", binary_default)
            if not isinstance(as_binary, bool):
                raise _invalid(f"{where}: parameter binary_data must be true or false")
            if any(name == out["name"] for name, _ in outputs):
                raise _invalid(f"{where} is requested more than once")
            outputs.append((out["name"], as_binary))
        # An empty list asks for nothing in particular, like an absent one.
        outputs = outputs or None
    return RestRequest(inputs, outputs, request_id, binary_default)


def _params(obj: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise _invalid(f"{where}: `parameters` must be an object")
    return params


def _flatten(data: Any, where: str) -> list[Any]:
    """JSON tensor data, flat or nested lists in row-major order, as one flat list of scalars."""
    if not isinstance(data, list):
        raise _invalid(f"{where}: `data` must be a list")
    flat: list[Any] = []
    stack: list[Any] = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            if not isinstance(item, bool | int | float) and not (isinstance(item, str) and item in _NON_FINITE):
                raise _invalid(f"{where}: `data` holds {json.dumps(item)[:40]}, which is not a number or true/false")
            flat.append(item)
        else:
            stack.pop()
    return flat


def encode_rest_response(
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: Mapping[str, Tensor],
    requested: Sequence[tuple[str, bool]] | None,
    binary_default: bool,
) -> tuple[bytes, int | None]:
    """A REST response body and, when any output travels as binary data, the JSON header's length (the
    `Inference-Header-Content-Length` response header); None means the body is JSON alone.

    `requested` is what `decode_rest_request` returned: those outputs in that order, each binary or JSON as
    asked; None returns every output, binary when `binary_default`. JSON outputs carry flat `data` lists.
    """
    chosen = [(name, binary_default) for name in outputs] if requested is None else list(requested)
    selected = select_outputs(outputs, [name for name, _ in chosen])
    descs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, binary in chosen:
        arr = np.asarray(selected[name])
        desc: dict[str, Any] = {
            "name": name,
            "datatype": oip_datatype(arr.dtype, f"output {name!r}"),
            "shape": list(arr.shape),
        }
        if binary:
            data = _le_bytes(arr)
            desc["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            desc["data"] = _json_data(arr)
        descs.append(desc)
    response: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id:
        response["id"] = request_id
    response["outputs"] = descs
    header = json.dumps(response, separators=(",", ":"), allow_nan=False).encode()
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def _json_data(arr: Tensor) -> list[Any]:
    """A tensor's values as a flat JSON list. JSON has no NaN or Infinity: those are written as the strings
    "NaN", "Infinity" and "-Infinity", as the protobuf JSON mapping does (tritonclient's `as_numpy` reads them
    back as floats), never as the bare tokens Python's json would write."""
    flat = arr.reshape(-1)
    if arr.dtype.kind != "f" or np.isfinite(flat).all():
        return flat.tolist()
    return [v if math.isfinite(v) else "NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity"
            for v in flat.tolist()]


# --- metadata ---------------------------------------------------------------------------------------------------


def model_metadata_grpc(
    name: str, versions: Sequence[str], platform: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> pb.ModelMetadataResponse:
    """A gRPC ModelMetadata response; inputs and outputs are (name, OIP datatype, shape) with -1 for variable."""
    resp = pb.ModelMetadataResponse(name=name, versions=list(versions), platform=platform)
    for specs, field in ((inputs, resp.inputs), (outputs, resp.outputs)):
        for tname, datatype, shape in specs:
            field.add(name=tname, datatype=datatype, shape=list(shape))
    return resp


def model_metadata_rest(
    name: str, versions: Sequence[str], platform: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> dict[str, Any]:
    """The REST (`GET /v2/models/{name}`) equivalent of `model_metadata_grpc`, as a JSON-ready dict."""
    return {
        "name": name,
        "versions": list(versions),
        "platform": platform,
        "inputs": [{"name": n, "datatype": d, "shape": list(s)} for n, d, s in inputs],
        "outputs": [{"name": n, "datatype": d, "shape": list(s)} for n, d, s in outputs],
    }


def config_datatype(datatype: str) -> str:
    """A model configuration's data type (Triton's DataType enum name) for an OIP datatype: FP32 -> TYPE_FP32."""
    return f"TYPE_{'STRING' if datatype == 'BYTES' else datatype}"


def model_config_grpc(
    name: str, platform: str, backend: str, max_batch_size: int, inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
) -> pb.ModelConfigResponse:
    """A gRPC ModelConfig response: the fields of Triton's ModelConfig a ModelSpec fills. Tensor dims are
    given as the configuration has them (without the batch dimension when max_batch_size > 0)."""
    config = pb.ModelConfig(name=name, platform=platform, backend=backend, max_batch_size=max_batch_size)
    for tname, datatype, dims in inputs:
        config.input.add(name=tname, data_type=pb.DataType.Value(config_datatype(datatype)), dims=list(dims))
    for tname, datatype, dims in outputs:
        config.output.add(name=tname, data_type=pb.DataType.Value(config_datatype(datatype)), dims=list(dims))
    return pb.ModelConfigResponse(config=config)


def model_config_rest(
    name: str, platform: str, backend: str, max_batch_size: int, inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
) -> dict[str, Any]:
    """The REST (`GET /v2/models/{name}/config`) form of `model_config_grpc`: Triton's JSON, dims as numbers."""

    def tensors(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
        return [{"name": n, "data_type": config_datatype(d), "dims": list(s)} for n, d, s in specs]

    return {"name": name, "platform": platform, "backend": backend, "max_batch_size": max_batch_size,
            "input": tensors(inputs), "output": tensors(outputs)}
