"""Fuzzing protocol v2 over gRPC with a raw channel (hypothesis): no crash, every answer a proper status.

What is shown:

- random bytes sent as the request of every RPC of the service (malformed protobuf, or by chance a
  well-formed message of nonsense) are answered with a status of the client-error kinds, never
  INTERNAL or UNKNOWN (a client's mistake is never a server fault) and never a dropped connection;
- well-formed ModelInfer messages that lie -- shapes that disagree with the raw contents' length
  or with the typed contents' count, negative or huge dimensions, too many dimensions, unknown or
  missing datatypes, raw contents for some inputs only, wrong parameter kinds -- are answered the
  same way; when one happens to be a valid call, its grad_x has the call's shape and dtype;
- after the run the server still answers the documentation's example with its documented bits.

Every hypothesis run is derandomized (a fixed seed) and uses no example database.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from moegrad_service.app import create_app
from moegrad_service.settings import Settings
from support.docexample import DOC_GRAD, DOC_IDX
from support.grpckit import DOC_BITS, MODEL

SERVICE = "inference.GRPCInferenceService"
METHODS = [m.name for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
           if not m.client_streaming]
#: Statuses a fuzzed request may get: OK (by chance valid), the client-error kinds, UNIMPLEMENTED
#: for the RPCs moegrad does not serve.
CLIENT_STATUSES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED}
MAX_ELEMENTS = 1 << 20
MAX_BODY_BYTES = 1 << 22
DATATYPES = ["FP16", "BF16", "FP32", "FP64", "INT32", "INT64", "INT8", "UINT8", "BOOL", "BYTES", "", "fp32"]
ITEMSIZE = {"FP16": 2, "BF16": 2, "FP32": 4, "FP64": 8, "INT32": 4, "INT64": 8, "INT8": 1, "UINT8": 1, "BOOL": 1}
FUZZ = {"deadline": None, "derandomize": True, "database": None, "print_blob": False,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]}


@pytest.fixture(scope="module")
def channel():
    """A raw channel to one in-process server (gRPC on a free port) for the whole module."""
    settings = Settings(backend="reference", grpc_port=0, warm_up=False, max_elements=MAX_ELEMENTS,
                        max_body_bytes=MAX_BODY_BYTES)
    app = create_app(settings)
    with TestClient(app), grpc.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as raw:
        yield raw


def call_raw(channel: grpc.Channel, method: str, body: bytes) -> tuple[grpc.StatusCode, bytes | None]:
    """Send ``body`` as the request bytes of ``method``; the status and the reply's bytes (or None)."""
    rpc = channel.unary_unary(f"/{SERVICE}/{method}")  # no serializers: bytes in, bytes out
    try:
        return grpc.StatusCode.OK, rpc(body, timeout=30)
    except grpc.RpcError as exc:
        return exc.code(), None


def assert_client_status(code: grpc.StatusCode, method: str) -> None:
    assert code in CLIENT_STATUSES, f"{method} answered {code}"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        assert method not in {"ModelInfer", "ModelConfig", "ModelMetadata", "ModelStatistics"}


@settings(max_examples=400, **FUZZ)
@given(method=st.sampled_from(METHODS), body=st.one_of(
    st.binary(max_size=256),
    st.binary(min_size=1, max_size=64).map(lambda b: b"\x0a" + bytes([len(b) + 40]) + b),  # a length that lies
    st.builds(lambda tag, rest: bytes([tag]) + rest, st.integers(0, 255), st.binary(max_size=32)),
))
def test_random_bytes_to_every_rpc(channel, method, body):
    code, _ = call_raw(channel, method, body)
    assert_client_status(code, method)


def _shape():
    dims = st.one_of(st.integers(0, 6), st.integers(-3, -1), st.integers(2**20, 2**62))
    return st.lists(dims, max_size=10)


@st.composite
def infer_requests(draw) -> service_pb2.ModelInferRequest:
    """A ModelInfer message whose parts each may lie: shapes, datatypes, contents, parameters."""
    request = service_pb2.ModelInferRequest(model_name=draw(st.sampled_from([MODEL, MODEL, MODEL, "other"])),
                                            model_version=draw(st.sampled_from(["", "1", "2"])))
    for name, kind in draw(st.lists(st.tuples(st.sampled_from(["top_k", "drop_pad_mode", "active_num", "order",
                                                                  "allow_duplicate_indices", "timeout", "bogus"]),
                                               st.sampled_from(["int", "bool", "str", "double", "uint", "none"])),
                                     max_size=5)):
        parameter = request.parameters[name]
        if kind == "int":
            parameter.int64_param = draw(st.integers(-(2**63), 2**63 - 1))
        elif kind == "bool":
            parameter.bool_param = draw(st.booleans())
        elif kind == "str":
            parameter.string_param = draw(st.text(max_size=12))
        elif kind == "double":
            parameter.double_param = draw(st.floats(allow_nan=True))
        elif kind == "uint":
            parameter.uint64_param = draw(st.integers(0, 2**64 - 1))
    if "top_k" not in request.parameters and draw(st.booleans()):
        request.parameters["top_k"].int64_param = 2
    raw_contents = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["grad_expanded_x", "expanded_row_idx", "expanded_row_idx", "grad_expanded_x",
                                     "x"]))
        datatype = draw(st.sampled_from(DATATYPES))
        shape = draw(st.one_of(_shape(), st.just([4, 2] if name == "grad_expanded_x" else [4])))
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        count = int(np.prod(shape, dtype=object)) if shape else 1
        if raw_contents:
            honest = ITEMSIZE.get(datatype, 4) * count if 0 <= count <= 4096 else 0
            size = draw(st.one_of(st.just(honest), st.integers(0, 64), st.just(max(honest - 1, 0)),
                                  st.just(honest + 2)))
            if draw(st.integers(0, 9)) > 0:  # sometimes raw contents for some inputs only
                request.raw_input_contents.append(draw(st.binary(min_size=size, max_size=size)))
        else:
            values = draw(st.lists(st.floats(width=32, allow_nan=True), max_size=12))
            which = draw(st.sampled_from(["fp32", "int", "int64", "bool", "uint", "fp64"]))
            if which == "fp32":
                tensor.contents.fp32_contents.extend(values)
            elif which == "fp64":
                tensor.contents.fp64_contents.extend(values)
            elif which == "bool":
                tensor.contents.bool_contents.extend([v > 0 for v in values if not math.isnan(v)])
            else:
                ints = draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12))
                values_of = [abs(i) for i in ints] if which == "uint" else ints
                getattr(tensor.contents, f"{which}_contents").extend(values_of)
    if draw(st.booleans()):
        request.outputs.add(name=draw(st.sampled_from(["grad_x", "grad_x", "y"])))
    return request


@settings(max_examples=400, **FUZZ)
@given(request=infer_requests())
def test_lying_infer_requests(channel, request):
    code, reply = call_raw(channel, "ModelInfer", request.SerializeToString())
    assert_client_status(code, "ModelInfer")
    assert code != grpc.StatusCode.UNIMPLEMENTED
    if code == grpc.StatusCode.OK:  # a valid call by chance: grad_x [N, H] of grad's dtype
        response = service_pb2.ModelInferResponse.FromString(reply)
        (output,) = response.outputs
        grad = next(t for t in request.inputs if t.name == "grad_expanded_x")
        assert output.datatype == grad.datatype and output.shape[-1] == grad.shape[-1]
        assert len(response.raw_output_contents[0]) == np.prod(output.shape) * ITEMSIZE[output.datatype]


@pytest.mark.parametrize("lie", ["short", "long", "shape", "count"])
def test_contents_that_disagree_with_the_shape(channel, lie):
    """The classes the fuzz draws from, each once by hand, with the message naming the input."""
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.parameters["top_k"].int64_param = 2
    grad = request.inputs.add(name="grad_expanded_x", datatype="FP32", shape=[4, 2])
    request.inputs.add(name="expanded_row_idx", datatype="INT32", shape=[4])
    raw = [DOC_GRAD.tobytes(), DOC_IDX.tobytes()]
    if lie == "short":
        raw[0] = raw[0][:-1]
    elif lie == "long":
        raw[1] += b"\0"
    elif lie == "shape":
        grad.shape[:] = [2**40, 2**40]
    if lie == "count":
        grad.contents.fp32_contents.extend([0.5] * 7)
        request.inputs[1].contents.int_contents.extend(DOC_IDX.tolist())
    else:
        request.raw_input_contents.extend(raw)
    with pytest.raises(grpc.RpcError) as raised:
        rpc = channel.unary_unary(f"/{SERVICE}/ModelInfer",
                                  request_serializer=service_pb2.ModelInferRequest.SerializeToString)
        rpc(request, timeout=30)
    want = {"short": (grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents[0] has 31 bytes"),
            "long": (grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents[1] has 17 bytes"),
            "shape": (grpc.StatusCode.RESOURCE_EXHAUSTED, f"over the limit of {MAX_ELEMENTS}"),
            "count": (grpc.StatusCode.INVALID_ARGUMENT, "fp32_contents has 7 elements but shape [4, 2] needs 8")}[lie]
    assert raised.value.code() == want[0] and want[1] in raised.value.details()


def test_the_server_still_answers_after_the_fuzz(channel):
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.parameters["top_k"].int64_param = 2
    request.inputs.add(name="grad_expanded_x", datatype="FP32", shape=[4, 2])
    request.inputs.add(name="expanded_row_idx", datatype="INT32", shape=[4])
    request.raw_input_contents.extend([DOC_GRAD.tobytes(), DOC_IDX.tobytes()])
    code, reply = call_raw(channel, "ModelInfer", request.SerializeToString())
    assert code == grpc.StatusCode.OK
    response = service_pb2.ModelInferResponse.FromString(reply)
    assert np.frombuffer(response.raw_output_contents[0], np.uint32).reshape(2, 2).tolist() == DOC_BITS
