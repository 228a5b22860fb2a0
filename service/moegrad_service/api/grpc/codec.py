"""Protocol v2 over gRPC, the codec: ``ModelInferRequest`` in, ``ModelInferResponse`` out. No server here.

The messages are those of the Open Inference Protocol's gRPC service (``inference.GRPCInferenceService``,
Triton's ``grpc_service.proto``; KServe's ``grpc_predict_v2.proto`` is its subset), from the stubs
that the maintained ``tritonclient[grpc]`` package generates and ships (``tritonclient.grpc.service_pb2``).

A request's tensors come either all in ``raw_input_contents`` (one bytes entry per input, in the
order of ``inputs``, little-endian and row-major, what tritonclient sends) or each in its input's
typed ``contents`` (``fp32_contents``, ``int_contents``, ...), converted TYPED_CHUNK values at a
time (the servicer bounds their size before the message is parsed: api/grpc/wire.py). FP16 and
BF16 have no typed contents in the protocol: they travel raw. The reply's grad_x is always in
``raw_output_contents``, appended to the serialized reply (one copy).
The decoded tensors and the request parameters become a :class:`moegrad.MoeInitRoutingV2GradCall`,
the validation every protocol uses, so a call is refused with the same message (field, rule and
aclnn code) as on HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from moegrad import MAX_RANK, MalformedRequest, MoeInitRoutingV2GradCall, PayloadTooLarge
from moegrad_service.api.grpc.wire import append_bytes_field
from moegrad_service.api.v2.codec import ATTRIBUTES, CONTROLS, DATATYPES, INPUTS, MODEL_NAME, MODEL_VERSION, OUTPUT
from moegrad_service.dataplane import GradOutcome

__all__ = ["InferRequest", "decode_infer_request", "encode_infer_response"]

#: Each datatype's typed-contents field of ``InferTensorContents`` (FP16 and BF16 have none).
_CONTENTS_FIELDS: Mapping[str, str] = {
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
_DATATYPE_NAMES: Mapping[np.dtype, str] = {dtype: name for name, dtype in DATATYPES.items()}
_PARAMETERS = frozenset(ATTRIBUTES + CONTROLS)
#: Typed values converted at a time: each chunk holds the GIL while it is converted, the event loop
#: runs between chunks.
TYPED_CHUNK = 1 << 16
_RAW_OUTPUT_CONTENTS = service_pb2.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number


@dataclass(frozen=True)
class InferRequest:
    """One decoded ModelInfer request.

    Attributes:
        call: the validated operator call.
        id: the request's ``id`` (echoed in the reply; "" when not sent).
        timeout_s: the ``timeout`` parameter in seconds, or None when not given.
    """

    call: MoeInitRoutingV2GradCall
    id: str
    timeout_s: float | None


def _parameter(value: service_pb2.InferParameter, where: str) -> Any:
    """An InferParameter's value (bool, int, str or float)."""
    choice = value.WhichOneof("parameter_choice")
    if choice is None:
        raise MalformedRequest(
            f"{where} has no value; set one of bool_param, int64_param, string_param, double_param, uint64_param",
            field=where,
        )
    return getattr(value, choice)


def _parameters(
    parameters: Mapping[str, service_pb2.InferParameter], allowed: frozenset[str], where: str
) -> dict[str, Any]:
    unknown = sorted(set(parameters) - allowed)
    if unknown:
        raise MalformedRequest(
            f"{where} has an unknown field {unknown[0]!r}; the fields are {sorted(allowed)}", field=where
        )
    return {key: _parameter(value, f"{where}.{key}") for key, value in parameters.items()}


def _typed(tensor: service_pb2.ModelInferRequest.InferInputTensor, datatype: str, count: int) -> np.ndarray:
    """A tensor from its typed contents, checked against its element count and datatype's range."""
    name = tensor.name
    field = _CONTENTS_FIELDS.get(datatype)
    if field is None:
        raise MalformedRequest(
            f"{name} is {datatype}, which has no typed contents in the protocol: send it in raw_input_contents",
            field=name,
        )
    used = [f.name for f, _ in tensor.contents.ListFields()]
    others = sorted(set(used) - {field})
    if others:
        raise MalformedRequest(
            f"{name} is {datatype} but its contents are in {others[0]}; {datatype} goes in {field}", field=name
        )
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise MalformedRequest(
            f"{name}.contents.{field} has {len(values)} elements but shape "
            f"{list(tensor.shape)} needs {count}; send one value per element",
            field=name,
        )
    dtype = DATATYPES[datatype]
    if dtype.kind in "iu":
        wide = _values(values, count, np.dtype(np.int64 if dtype.kind == "i" else np.uint64))
        info = np.iinfo(dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise MalformedRequest(
                f"{name}.contents.{field} holds a value out of {datatype} range; send values that fit {datatype}",
                field=name,
            )
        return wide.astype(dtype)
    return _values(values, count, dtype)


def _values(values: Any, count: int, dtype: np.dtype) -> np.ndarray:
    """A repeated field's values as an array of ``dtype``, converted TYPED_CHUNK at a time: each value
    becomes a Python object on its way, and between chunks another thread (the event loop) may run."""
    array = np.empty(count, dtype=dtype)
    for start in range(0, count, TYPED_CHUNK):
        array[start : start + TYPED_CHUNK] = values[start : start + TYPED_CHUNK]
    return array


def _raw(
    tensor: service_pb2.ModelInferRequest.InferInputTensor, datatype: str, count: int, raw: bytes, position: int
) -> np.ndarray:
    name, dtype = tensor.name, DATATYPES[datatype]
    if tensor.HasField("contents"):
        raise MalformedRequest(f"{name} has both contents and raw_input_contents[{position}]; send one", field=name)
    if len(raw) != count * dtype.itemsize:
        raise MalformedRequest(
            f"raw_input_contents[{position}] has {len(raw)} bytes but {name}'s shape "
            f"{list(tensor.shape)} of {datatype} needs {count * dtype.itemsize}; send prod(shape) "
            f"elements, little-endian, row-major",
            field=name,
        )
    return np.require(np.frombuffer(raw, dtype=dtype), requirements="A")  # copied only when misaligned


def _decode_inputs(request: service_pb2.ModelInferRequest, max_elements: int) -> dict[str, np.ndarray]:
    raw = list(request.raw_input_contents)  # each read of a bytes field copies it: read each once
    if raw and len(raw) != len(request.inputs):
        raise MalformedRequest(
            f"raw_input_contents has {len(raw)} entries but there are {len(request.inputs)} "
            f"inputs; give one per input, in the order of inputs, or none",
            field="raw_input_contents",
        )
    tensors: dict[str, np.ndarray] = {}
    for position, tensor in enumerate(request.inputs):
        name = tensor.name
        if name not in INPUTS:
            raise MalformedRequest(
                f"inputs[{position}].name={name!r} is not an input of {MODEL_NAME}; the inputs are {', '.join(INPUTS)}",
                field="inputs",
            )
        if name in tensors:
            raise MalformedRequest(f"input {name} is given twice", field=name)
        shape = list(tensor.shape)
        if len(shape) > MAX_RANK or not all(d >= 0 for d in shape):
            raise MalformedRequest(
                f"{name}.shape={shape!r} must be a list of at most {MAX_RANK} non-negative integers", field=name
            )
        datatype = tensor.datatype
        if datatype not in DATATYPES:
            raise MalformedRequest(
                f"{name}.datatype={datatype!r} is not supported; "
                f"{name} is {'FP16, BF16 or FP32' if name == INPUTS[0] else 'INT32'}",
                field=name,
            )
        count = math.prod(shape)
        if count > max_elements:
            raise PayloadTooLarge(
                f"{name}.shape={shape} has {count} elements, over the limit of {max_elements}", field=name
            )
        _parameters(tensor.parameters, frozenset(), f"{name}.parameters")
        flat = _raw(tensor, datatype, count, raw[position], position) if raw else _typed(tensor, datatype, count)
        try:
            tensors[name] = flat.reshape(shape)
        except ValueError:  # an empty shape with a dimension NumPy cannot represent
            raise MalformedRequest(f"{name}.shape={shape} is too large for an array", field=name) from None
    return tensors


def _check_outputs(request: service_pb2.ModelInferRequest) -> None:
    seen = False
    for position, output in enumerate(request.outputs):
        if output.name != OUTPUT:
            raise MalformedRequest(
                f"outputs[{position}].name={output.name!r} is not an output of {MODEL_NAME}; the output is {OUTPUT}",
                field="outputs",
            )
        if seen:
            raise MalformedRequest(f"output {OUTPUT} is requested twice", field="outputs")
        seen = True
        _parameters(output.parameters, frozenset({"binary_data"}), f"{OUTPUT}.parameters")


def decode_infer_request(
    request: service_pb2.ModelInferRequest, *, max_elements: int, default_order: str
) -> InferRequest:
    """Decode and validate a ModelInfer request (CPU work: callers run big ones on a thread). The
    model name and version are the servicer's to check.

    Args:
        request: the parsed request message.
        max_elements: the largest element count of one tensor.
        default_order: the profile whose rules check a request that names none (which then names none).

    Raises:
        MalformedRequest: not a well-formed request (unknown names or parameters, sizes that disagree
            with the shapes, contents in the wrong field).
        PayloadTooLarge: a tensor over ``max_elements``.
        InvalidArgument: the operator's constraints (MoeInitRoutingV2GradCall, with the aclnn code).
    """
    parameters = _parameters(request.parameters, _PARAMETERS, "parameters")
    tensors = _decode_inputs(request, max_elements)
    fields: dict[str, Any] = {name: parameters[name] for name in ATTRIBUTES if name in parameters}
    call = MoeInitRoutingV2GradCall.with_default_order(default_order, **tensors, **fields)
    _check_outputs(request)
    timeout_s = None
    if "timeout" in parameters:
        micros = parameters["timeout"]
        if isinstance(micros, bool) or not isinstance(micros, int) or micros <= 0:
            raise MalformedRequest(
                f"parameters.timeout={micros!r} must be a positive number of microseconds", field="timeout"
            )
        timeout_s = min(micros, 2**53) / 1e6  # the server caps it at request_timeout_s anyway
    return InferRequest(call=call, id=request.id, timeout_s=timeout_s)


def encode_infer_response(outcome: GradOutcome, request_id: str) -> bytes:
    """The reply, serialized: grad_x [N, H] (the call's datatype) in ``raw_output_contents``, and the
    backend, order, ``queue_ms`` and ``compute_ms`` (and the device, when there is one) as parameters.
    grad_x's bytes are copied once, into the reply (wire.append_bytes_field)."""
    grad_x = outcome.grad_x
    response = service_pb2.ModelInferResponse(model_name=MODEL_NAME, model_version=MODEL_VERSION, id=request_id)
    response.outputs.add(name=OUTPUT, datatype=_DATATYPE_NAMES[grad_x.dtype], shape=grad_x.shape)
    parameters = response.parameters
    parameters["backend"].string_param = outcome.backend
    parameters["order"].string_param = outcome.order
    parameters["queue_ms"].double_param = outcome.timings.queue_s * 1e3
    parameters["compute_ms"].double_param = outcome.timings.compute_s * 1e3
    if outcome.device is not None:
        parameters["device"].string_param = outcome.device
    data = memoryview(np.ascontiguousarray(grad_x).reshape(-1).view(np.uint8).data)
    return append_bytes_field(response.SerializeToString(), _RAW_OUTPUT_CONTENTS, data)
