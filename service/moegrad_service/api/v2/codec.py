"""Protocol v2's codec: Open Inference Protocol (KServe v2) requests in, responses out. No routes here.

The one model is ``moe_init_routing_v2_grad`` (version ``"1"``): inputs ``grad_expanded_x`` and
``expanded_row_idx``, output ``grad_x``; the operator's attributes travel as request parameters.
A request body is JSON, or JSON followed by binary tensor data (the protocol's binary tensor data
extension, its JSON part's length in ``Inference-Header-Content-Length``). The decoded tensors
become a :class:`moegrad.MoeInitRoutingV2GradCall`, the validation every protocol uses.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Response

from moegrad import DTYPES, MAX_RANK, MalformedRequest, MoeInitRoutingV2GradCall, PayloadTooLarge, brief
from moegrad_service.api.intake import byte_count
from moegrad_service.api.outputs import PartsResponse

__all__ = [
    "BINARY_ONLY",
    "DATATYPES",
    "GRAD_DATATYPES",
    "HEADER_LENGTH",
    "INLINE_ENCODE_ELEMENTS",
    "MODEL_NAME",
    "MODEL_VERSION",
    "OUTPUT",
    "InferRequest",
    "binary_lead",
    "decode_infer_request",
    "encode_infer_response",
]

MODEL_NAME = "moe_init_routing_v2_grad"
MODEL_VERSION = "1"
#: The request header that gives the JSON part's length when binary tensor data follows it.
HEADER_LENGTH = "Inference-Header-Content-Length"
INPUTS = ("grad_expanded_x", "expanded_row_idx")
OUTPUT = "grad_x"
#: Request parameters that become the call's attributes (MoeInitRoutingV2GradCall's fields).
ATTRIBUTES = ("top_k", "drop_pad_mode", "active_num", "order", "allow_duplicate_indices")
#: Further request parameters: binary_data_output (outputs as binary data), timeout (microseconds,
#: may only shorten the server's deadline), priority (accepted, has no effect: one queue).
CONTROLS = ("binary_data_output", "timeout", "priority")
_REQUEST_KEYS = frozenset({"id", "parameters", "inputs", "outputs"})
_INPUT_KEYS = frozenset({"name", "shape", "datatype", "parameters", "data"})
_OUTPUT_KEYS = frozenset({"name", "parameters"})
#: grad_x larger than this many elements is encoded on a worker thread, not on the event loop.
INLINE_ENCODE_ELEMENTS = 1 << 16

#: The protocol's fixed-size datatypes and their little-endian NumPy dtypes. The four moegrad uses
#: are the wire table's own (moegrad.DTYPES); the others are decoded only so that the call's
#: validation names them (161002, e.g. INT64 indices) like any other wrong dtype.
DATATYPES: Mapping[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"),
    "INT32": DTYPES["int32"],
    "INT64": np.dtype("<i8"),
    "FP16": DTYPES["float16"],
    "BF16": DTYPES["bfloat16"],
    "FP32": DTYPES["float32"],
    "FP64": np.dtype("<f8"),
}
_DATATYPE_NAMES: Mapping[np.dtype, str] = {dtype: name for name, dtype in DATATYPES.items()}
#: Datatypes that have no JSON form: they travel as binary tensor data only.
BINARY_ONLY = frozenset({"BF16"})
#: JSON element types each kind of dtype accepts (bool is not an int here, and no number is a bool).
_JSON_TYPES: Mapping[str, tuple[frozenset[type], str]] = {
    "b": (frozenset({bool}), "true/false"),
    "i": (frozenset({int}), "integers"),
    "u": (frozenset({int}), "integers"),
    "f": (frozenset({int, float}), "numbers"),
}
#: grad_expanded_x's accepted datatypes, for the model metadata.
GRAD_DATATYPES = ("FP16", "BF16", "FP32")


# --- decoding ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class InferRequest:
    """One decoded inference request.

    Attributes:
        call: the validated operator call.
        id: the request's ``id``, echoed in the reply, or None.
        binary_output: send grad_x as binary tensor data (else as a JSON list).
        timeout_s: the ``timeout`` parameter in seconds, or None when not given.
    """

    call: MoeInitRoutingV2GradCall
    id: str | None
    binary_output: bool
    timeout_s: float | None


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise MalformedRequest(f"{where} must be a JSON object, got {type(value).__name__}", field=where)
    return value


def _keys(document: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(document) - allowed)
    if unknown:
        raise MalformedRequest(
            f"{where} has an unknown field {unknown[0]!r}; the fields are {sorted(allowed)}", field=where
        )


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise MalformedRequest(f"{where}={value!r} must be true or false", field=where)
    return value


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedRequest(f"{where}={value!r} must be a non-negative integer", field=where)
    return value


def binary_lead(header_length: str | None) -> int:
    """Bytes to put before the body so that its binary part, after the JSON header, starts 16-byte
    aligned (``api.intake.Intake.read``'s ``lead``); 0 without a well-formed header, which _split then rejects."""
    size = None if header_length is None else byte_count(header_length)
    return 0 if size is None else -size % 16


def _split(body: bytearray | memoryview, header_length: str | None) -> tuple[bytes | bytearray, memoryview]:
    """The JSON part and the binary part of a body (the binary part is empty without the header)."""
    if header_length is None:  # a JSON-only body (json.loads takes bytes, not a memoryview)
        return (bytes(body) if isinstance(body, memoryview) else body), memoryview(b"")
    size = byte_count(header_length)
    if size is None:
        raise MalformedRequest(f"{HEADER_LENGTH} {brief(header_length)} is not a byte count", field=HEADER_LENGTH)
    if size > len(body):
        raise MalformedRequest(
            f"{HEADER_LENGTH} {brief(header_length)} is larger than the {len(body)}-byte body", field=HEADER_LENGTH
        )
    return bytes(memoryview(body)[:size]), memoryview(body)[size:]


def _finite_number(text: str) -> float:
    """A JSON number as a float; one beyond float64's range is refused rather than read as infinity."""
    value = float(text)
    if math.isinf(value):
        raise MalformedRequest(f"the JSON number {text[:64]} is beyond the range of a float")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members; a key given twice is refused (JSON leaves its meaning open)."""
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise MalformedRequest(f"a JSON object has the key {brief(key)} twice; give each key once", field=key)
        document[key] = value
    return document


def _parse_json(text: bytes | bytearray) -> dict[str, Any]:
    try:
        document = json.loads(text, parse_float=_finite_number, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if isinstance(exc, MalformedRequest):
            raise
        raise MalformedRequest(f"the inference request is not valid JSON ({type(exc).__name__}: {exc})") from None
    return _object(document, "the inference request")


def _flatten(data: Any, where: str, count: int) -> list[Any]:
    """A tensor's JSON data, row-major and flat (the protocol allows nested arrays too), in one pass
    over its items; refused as soon as it holds more than ``count`` elements."""
    if not isinstance(data, list):
        raise MalformedRequest(f"{where} must be a JSON array, got {type(data).__name__}", field=where)
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if type(item) is list:
                stack.append(iter(item))
                break
            flat.append(item)
            if len(flat) > count:
                raise MalformedRequest(f"{where} has more than the {count} elements its shape needs", field=where)
        else:
            stack.pop()
    return flat


def _from_json(data: Any, name: str, datatype: str, shape: list[int]) -> np.ndarray:
    """Convert JSON data; element types and ranges are checked, a wrong one is a 400 naming it."""
    where = f"{name}.data"
    if datatype in BINARY_ONLY:
        raise MalformedRequest(
            f"{name} is {datatype}, which has no JSON form: send it as binary tensor data "
            f"(parameters.binary_data_size and {HEADER_LENGTH})",
            field=name,
        )
    count = math.prod(shape)
    flat = _flatten(data, where, count)
    if len(flat) != count:
        raise MalformedRequest(f"{where} has {len(flat)} elements but shape {shape} needs {count}", field=name)
    dtype = DATATYPES[datatype]
    allowed, described = _JSON_TYPES[dtype.kind]
    if not set(map(type, flat)) <= allowed:
        at = next(i for i, value in enumerate(flat) if type(value) not in allowed)
        raise MalformedRequest(f"{where}[{at}]={flat[at]!r} is not valid {datatype} data; send {described}", field=name)
    try:
        if dtype.kind != "f":
            return _shaped(np.array(flat, dtype=dtype), shape, name)
        wide = np.array(flat, dtype=np.float64)
    except OverflowError as exc:  # an integer the datatype cannot hold
        raise MalformedRequest(f"{where} holds a value out of {datatype} range ({exc})", field=name) from None
    with np.errstate(over="ignore"):
        array = wide.astype(dtype)
    overflow = np.isinf(array) & np.isfinite(wide)
    if overflow.any():
        at = int(np.flatnonzero(overflow)[0])
        raise MalformedRequest(f"{where}[{at}]={flat[at]!r} is out of {datatype} range", field=name)
    return _shaped(array, shape, name)


def _shaped(array: np.ndarray, shape: list[int], name: str) -> np.ndarray:
    """``array.reshape(shape)``; a shape NumPy cannot represent (an empty one with a huge dimension) is 400."""
    try:
        return array.reshape(shape)
    except ValueError:
        raise MalformedRequest(f"{name}.shape={shape} is too large for an array", field=name) from None


def _decode_inputs(inputs: Any, binary: memoryview, max_elements: int) -> dict[str, np.ndarray]:
    if not isinstance(inputs, list):
        raise MalformedRequest(f"inputs must be a JSON array, got {type(inputs).__name__}", field="inputs")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for position, raw in enumerate(inputs):
        tensor = _object(raw, f"inputs[{position}]")
        _keys(tensor, _INPUT_KEYS, f"inputs[{position}]")
        name = tensor.get("name")
        if name not in INPUTS:
            raise MalformedRequest(
                f"inputs[{position}].name={name!r} is not an input of {MODEL_NAME}; the inputs are {', '.join(INPUTS)}",
                field="inputs",
            )
        if name in tensors:
            raise MalformedRequest(f"input {name} is given twice", field=name)
        shape, datatype = tensor.get("shape"), tensor.get("datatype")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(type(d) is int and d >= 0 for d in shape):
            raise MalformedRequest(
                f"{name}.shape={shape!r} must be a list of at most {MAX_RANK} non-negative integers", field=name
            )
        if not isinstance(datatype, str) or datatype not in DATATYPES:
            raise MalformedRequest(
                f"{name}.datatype={brief(datatype)} is not supported; "
                f"{name} is {'FP16, BF16 or FP32' if name == INPUTS[0] else 'INT32'}",
                field=name,
            )
        count = math.prod(shape)
        if count > max_elements:
            raise PayloadTooLarge(
                f"{name}.shape={shape} has {count} elements, over the limit of {max_elements}", field=name
            )
        parameters = _object(tensor.get("parameters", {}), f"{name}.parameters")
        _keys(parameters, frozenset({"binary_data_size"}), f"{name}.parameters")
        if "binary_data_size" not in parameters:
            if "data" not in tensor:
                raise MalformedRequest(f"{name} has neither data nor parameters.binary_data_size", field=name)
            tensors[name] = _from_json(tensor["data"], name, datatype, shape)
            continue
        if "data" in tensor:
            raise MalformedRequest(f"{name} has both data and parameters.binary_data_size", field=name)
        size = _count(parameters["binary_data_size"], f"{name}.parameters.binary_data_size")
        dtype = DATATYPES[datatype]
        if size != count * dtype.itemsize:
            raise MalformedRequest(
                f"{name}.parameters.binary_data_size={size} but shape {shape} of {datatype} "
                f"needs {count * dtype.itemsize} bytes",
                field=name,
            )
        if offset + size > len(binary):
            missing = f"no {HEADER_LENGTH} header" if not binary else f"the binary data has {len(binary)} bytes"
            raise MalformedRequest(f"{name} needs binary bytes [{offset}, {offset + size}) but {missing}", field=name)
        array = _shaped(np.frombuffer(binary[offset : offset + size], dtype=dtype), shape, name)
        tensors[name] = np.require(array, requirements="A")  # copied only when its offset is misaligned
        offset += size
    if offset != len(binary):
        raise MalformedRequest(
            f"{len(binary) - offset} bytes of binary data follow the inputs' binary_data_size total of {offset}",
            field=HEADER_LENGTH,
        )
    return tensors


def _binary_output(outputs: Any, default: bool) -> bool:
    """Whether grad_x goes as binary data: its own ``binary_data``, else ``binary_data_output``."""
    if outputs is None:
        return default
    if not isinstance(outputs, list):
        raise MalformedRequest(f"outputs must be a JSON array, got {type(outputs).__name__}", field="outputs")
    binary, seen = default, False
    for position, raw in enumerate(outputs):
        output = _object(raw, f"outputs[{position}]")
        _keys(output, _OUTPUT_KEYS, f"outputs[{position}]")
        if output.get("name") != OUTPUT:
            raise MalformedRequest(
                f"outputs[{position}].name={output.get('name')!r} is not an output of {MODEL_NAME}; "
                f"the output is {OUTPUT}",
                field="outputs",
            )
        if seen:
            raise MalformedRequest(f"output {OUTPUT} is requested twice", field="outputs")
        seen = True
        parameters = _object(output.get("parameters", {}), f"{OUTPUT}.parameters")
        _keys(parameters, frozenset({"binary_data"}), f"{OUTPUT}.parameters")
        if "binary_data" in parameters:
            binary = _flag(parameters["binary_data"], f"{OUTPUT}.parameters.binary_data")
    return binary


def decode_infer_request(
    body: bytearray | memoryview, header_length: str | None, *, max_elements: int, default_order: str
) -> InferRequest:
    """Decode and validate an inference request body (CPU work: callers run big ones on a thread).

    Args:
        body: the whole HTTP body: JSON, or JSON followed by binary tensor data.
        header_length: the ``Inference-Header-Content-Length`` header (the JSON part's bytes), or None.
        max_elements: the largest element count of one tensor.
        default_order: the profile whose rules check a request that names none (which then names none).

    Raises:
        MalformedRequest: not a well-formed v2 request (bad JSON, unknown names, sizes that disagree).
        PayloadTooLarge: a tensor over ``max_elements``.
        InvalidArgument: the operator's constraints (MoeInitRoutingV2GradCall, with the aclnn code).
    """
    header, binary = _split(body, header_length)
    document = _parse_json(header)
    _keys(document, _REQUEST_KEYS, "the inference request")
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise MalformedRequest(f"id={request_id!r} must be a string", field="id")
    parameters = _object(document.get("parameters", {}), "parameters")
    _keys(parameters, frozenset(ATTRIBUTES + CONTROLS), "parameters")
    tensors = _decode_inputs(document.get("inputs", []), binary, max_elements)
    fields: dict[str, Any] = {name: parameters[name] for name in ATTRIBUTES if name in parameters}
    # an order absent or null names no profile: checked on the server's default, as v1's nil
    call = MoeInitRoutingV2GradCall.with_default_order(default_order, **tensors, **fields)
    binary_output = _binary_output(
        document.get("outputs"), _flag(parameters.get("binary_data_output", False), "parameters.binary_data_output")
    )
    if not binary_output and _DATATYPE_NAMES[call.grad_expanded_x.dtype] in BINARY_ONLY:
        raise MalformedRequest(
            f"{OUTPUT} is BF16, which has no JSON form: request it as binary data "
            f"(outputs[].parameters.binary_data or parameters.binary_data_output)",
            field="outputs",
        )
    timeout_s = None
    if "timeout" in parameters:
        micros = parameters["timeout"]
        if isinstance(micros, bool) or not isinstance(micros, int) or micros <= 0:
            raise MalformedRequest(
                f"parameters.timeout={micros!r} must be a positive number of microseconds", field="timeout"
            )
        timeout_s = min(micros, 2**53) / 1e6  # the server caps it at request_timeout_s anyway
    return InferRequest(call=call, id=request_id, binary_output=binary_output, timeout_s=timeout_s)


# --- encoding ---------------------------------------------------------------------------------


def encode_infer_response(grad_x: np.ndarray, request: InferRequest, reply_parameters: dict[str, Any]) -> Response:
    """The inference response: JSON, or JSON followed by grad_x's bytes when binary output was asked."""
    datatype = _DATATYPE_NAMES[grad_x.dtype]
    output: dict[str, Any] = {"name": OUTPUT, "datatype": datatype, "shape": list(grad_x.shape)}
    raw = np.ascontiguousarray(grad_x, dtype=DATATYPES[datatype]).reshape(-1)
    if request.binary_output:
        output["parameters"] = {"binary_data_size": raw.nbytes}
    else:
        output["data"] = (raw.astype(np.float64) if raw.dtype.kind == "f" else raw).tolist()  # exact in binary64
    document: dict[str, Any] = {"model_name": MODEL_NAME, "model_version": MODEL_VERSION}
    if request.id is not None:
        document["id"] = request.id
    document["parameters"] = reply_parameters
    document["outputs"] = [output]
    header = json.dumps(document, separators=(",", ":")).encode()
    if not request.binary_output:
        return Response(header, media_type="application/json")
    # header and grad_x's bytes are sent as they are, not joined (a join copies grad_x once more)
    return PartsResponse(
        [header, raw.view(np.uint8).data], "application/octet-stream", headers={HEADER_LENGTH: str(len(header))}
    )
