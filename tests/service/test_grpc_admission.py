"""gRPC admission before a message is read (api/grpc/admission.py), the wire checks before a message is
parsed (api/grpc/wire.py), the reply written with one copy of grad_x, and typed contents converted a
chunk at a time (api/grpc/codec.py).

Oracles: the reservation rule and limits as docs/protocol.md states them (4 times the largest
message before the read, 4 times the message after, its call's peak once decoded; 4 MiB of typed
contents; 4,096 fields a level; a sixteenth of seven eighths of the budget by default), protobuf's own serializer for the sizes of
typed contents and for the reply's bytes, and Python lists for the values of typed contents.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from tritonclient.grpc import service_pb2

from moegrad import DeviceBusy, MalformedRequest, PayloadTooLarge
from moegrad_service.api.errors import RequestTimeout
from moegrad_service.api.grpc.admission import MessageGate, max_message_bytes
from moegrad_service.api.grpc.codec import TYPED_CHUNK, decode_infer_request, encode_infer_response
from moegrad_service.api.grpc.wire import check_typed_contents
from moegrad_service.app import create_app
from moegrad_service.dataplane import GradOutcome
from moegrad_service.engine import Timings
from moegrad_service.memory import MemoryBudget, Peak
from moegrad_service.settings import Settings
from support.grpckit import MODEL

MIB = 1 << 20
SERVICE = "inference.GRPCInferenceService"


# --- the limit and the reservation ---------------------------------------------------------------

def test_the_message_limit_is_a_sixteenth_of_what_one_call_may_take_by_default():
    budget = MemoryBudget(1 << 30)  # seven eighths: 896 MiB; a sixteenth of it: 56 MiB
    assert max_message_bytes(Settings(max_inflight_bytes=1 << 30), budget) == 56 * MIB
    assert max_message_bytes(Settings(max_inflight_bytes=1 << 30, max_body_bytes=8 * MIB), budget) == 8 * MIB
    assert max_message_bytes(Settings(max_inflight_bytes=1 << 30, grpc_max_message_bytes=200 * MIB),
                             budget) == 200 * MIB
    with pytest.raises(ValueError, match="lower grpc_max_message_bytes to 234881024 or less"):
        max_message_bytes(Settings(max_inflight_bytes=1 << 30, grpc_max_message_bytes=225 * MIB), budget)


def test_a_limit_no_message_could_fit_stops_startup():
    app = create_app(Settings(backend="reference", grpc_port=0, warm_up=False, max_inflight_bytes=64 * MIB,
                              grpc_max_message_bytes=15 * MIB))
    with pytest.raises(ValueError, match="grpc_max_message_bytes"), TestClient(app):
        pass


class FakeContext:
    """A servicer context whose ``read`` reports what the budget held when it was called."""

    def __init__(self, budget: MemoryBudget, message: object, delay_s: float = 0.0) -> None:
        self.budget, self.message, self.delay_s = budget, message, delay_s
        self.held_at_read: int | None = None

    async def read(self) -> object:
        self.held_at_read = self.budget.held_bytes
        await asyncio.sleep(self.delay_s)
        return self.message


def gate_for(budget: MemoryBudget, max_message: int = MIB, timeout_s: float = 1.0) -> MessageGate:
    return MessageGate(budget, max_message_bytes=max_message, timeout_s=timeout_s, retry_after_s=3.0)


@pytest.mark.asyncio
async def test_the_largest_message_is_reserved_before_the_read_and_the_message_after_it():
    budget = MemoryBudget(64 * MIB)
    gate = gate_for(budget)
    context = FakeContext(budget, b"x" * 1000)
    raw, reservation = await gate.receive(context, time.perf_counter())
    assert raw == b"x" * 1000
    assert context.held_at_read == 4 * MIB  # 4 times the largest message, before a byte is read
    assert budget.held_bytes == reservation.nbytes == 4 * 1000  # then 4 times the message
    reservation.release()
    reservation.release()  # idempotent
    assert budget.held_bytes == 0
    no_message = FakeContext(budget, grpc.aio.EOF)
    raw, reservation = await gate.receive(no_message, time.perf_counter())
    assert raw == b"" and budget.held_bytes == 0


@pytest.mark.asyncio
async def test_once_decoded_the_reservation_becomes_the_calls_peak():
    budget = MemoryBudget(64 * MIB)  # one request may take 56 MiB
    gate = gate_for(budget)
    _, reservation = await gate.receive(FakeContext(budget, b"x" * 1000), time.perf_counter())
    reservation.cover(Peak(body=1000, result=300))  # less than the read's 4 x 1000: the rest given back
    assert budget.held_bytes == reservation.nbytes == 1300
    reservation.cover(Peak(body=1000, result=20 * MIB, reply=20 * MIB))  # more: reserved
    assert budget.held_bytes == reservation.nbytes == 1000 + 40 * MIB
    with pytest.raises(PayloadTooLarge, match=r"holds 60818408 bytes .*result 30408704, reply 30408704, body 1000"):
        reservation.cover(Peak(body=1000, result=29 * MIB, reply=29 * MIB))  # over 56 MiB: never fits
    budget.reserve(10 * MIB)  # what others hold now
    with pytest.raises(DeviceBusy):
        reservation.cover(Peak(body=1000, result=24 * MIB, reply=24 * MIB))  # 48 MiB beside 10: not now
    assert reservation.nbytes == 1000 + 40 * MIB  # a refusal changes nothing held
    reservation.release()
    budget.release(10 * MIB)
    assert budget.held_bytes == 0


@pytest.mark.asyncio
async def test_reads_wait_in_arrival_order_for_room():
    budget = MemoryBudget(16 * MIB)  # seven eighths: 14 MiB, room for three reads of a 1 MiB limit
    gate = gate_for(budget, timeout_s=5.0)
    held = [await gate.receive(FakeContext(budget, b"x" * MIB), time.perf_counter()) for _ in range(3)]
    assert budget.held_bytes == 12 * MIB
    order: list[int] = []

    async def waiter(number: int) -> None:
        _, reservation = await gate.receive(FakeContext(budget, b"y"), time.perf_counter())
        order.append(number)
        reservation.release()

    tasks = [asyncio.create_task(waiter(n)) for n in range(3)]
    await asyncio.sleep(0.1)
    assert order == []  # 4 MiB more do not fit beside the 12 held
    held[0][1].release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    for _, reservation in held[1:]:
        reservation.release()
    assert budget.held_bytes == 0


@pytest.mark.asyncio
async def test_no_room_in_time_is_unavailable_and_a_slow_message_is_a_timeout():
    budget = MemoryBudget(16 * MIB)
    gate = gate_for(budget, timeout_s=0.3)
    budget.reserve(12 * MIB)
    with pytest.raises(DeviceBusy, match="a message being read reserves 4194304") as raised:
        await gate.receive(FakeContext(budget, b"x"), time.perf_counter())
    assert raised.value.retry_after_s == 3.0
    budget.release(12 * MIB)
    with pytest.raises(RequestTimeout, match=r"did not arrive within 0.3 s \(body_timeout_s\)"):
        await gate.receive(FakeContext(budget, b"x", delay_s=5.0), time.perf_counter())
    assert budget.held_bytes == 0  # given back on every error path


# --- the wire checks before parsing --------------------------------------------------------------

def _request(*, typed: int = 0, raw: bool = True, parameters: int = 0) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL, id="r")
    request.parameters["top_k"].int64_param = 1
    for number in range(parameters):
        request.parameters[f"p{number}"].bool_param = True
    grad = request.inputs.add(name="grad_expanded_x", datatype="FP32", shape=[max(1, typed), 1])
    index = request.inputs.add(name="expanded_row_idx", datatype="INT32", shape=[max(1, typed)])
    if raw:
        request.raw_input_contents.extend([bytes(4 * max(1, typed)), bytes(4 * max(1, typed))])
    else:
        grad.contents.fp32_contents.extend([0.5] * typed)
        index.contents.int_contents.extend(range(typed))
    return request


def _typed_bytes(request: service_pb2.ModelInferRequest) -> int:
    """The typed contents' bytes on the wire, by protobuf's own serializer."""
    return sum(len(tensor.contents.SerializeToString()) for tensor in request.inputs if tensor.HasField("contents"))


def test_typed_contents_up_to_the_limit_pass_and_over_it_are_refused_naming_the_field():
    check_typed_contents(_request(typed=1 << 20).SerializeToString())  # 4 MiB of raw contents: no limit
    under = _request(typed=500_000, raw=False)
    assert _typed_bytes(under) <= 4 * MIB
    check_typed_contents(under.SerializeToString())
    over = _request(typed=1 << 20, raw=False)
    assert _typed_bytes(over) > 4 * MIB
    with pytest.raises(PayloadTooLarge) as raised:
        check_typed_contents(over.SerializeToString())
    message = str(raised.value)
    assert raised.value.field in ("grad_expanded_x", "expanded_row_idx")
    assert f"over the limit of {4 * MIB} bytes" in message and "send large tensors in raw_input_contents" in message
    assert f"{raised.value.field}.contents." in message


def test_fields_beyond_the_limit_and_bytes_that_are_no_message_are_refused_before_parsing():
    check_typed_contents(_request(parameters=4000).SerializeToString())
    with pytest.raises(MalformedRequest, match="more than 4096 fields at its top level"):
        check_typed_contents(_request(parameters=4100).SerializeToString())
    whole = _request().SerializeToString()
    for broken in (whole[:-1], whole + b"\x0f", whole + b"\x80" * 11, b"\x00\x00"):
        with pytest.raises(MalformedRequest, match=r"is not a valid inference\.ModelInferRequest message"):
            check_typed_contents(broken)


def test_an_unknown_group_is_skipped_and_what_follows_it_is_still_counted():
    over = _request(typed=1 << 20, raw=False).SerializeToString()
    group = b"\xa3\x06" + b"\x08\x01" + b"\xa4\x06"  # field 100 as a group holding a varint, then its end
    assert service_pb2.ModelInferRequest.FromString(group + over).model_name == MODEL  # protobuf skips it too
    with pytest.raises(PayloadTooLarge):
        check_typed_contents(group + over)


# --- the reply, and typed values ------------------------------------------------------------------

def test_the_reply_is_the_message_protobuf_would_write():
    grad_x = np.arange(12, dtype=np.float32).reshape(3, 4)
    outcome = GradOutcome(grad_x=grad_x, backend="reference", order="ascend910b@9.1",
                          timings=Timings(queue_s=0.001, compute_s=0.002), device="Ascend910B3 #0")
    data = encode_infer_response(outcome, "id-1")
    want = service_pb2.ModelInferResponse(model_name=MODEL, model_version="1", id="id-1")
    want.outputs.add(name="grad_x", datatype="FP32", shape=[3, 4])
    want.raw_output_contents.append(grad_x.tobytes())
    for key, value in (("backend", "reference"), ("order", "ascend910b@9.1"), ("device", "Ascend910B3 #0")):
        want.parameters[key].string_param = value
    want.parameters["queue_ms"].double_param = 1.0
    want.parameters["compute_ms"].double_param = 2.0
    assert service_pb2.ModelInferResponse.FromString(data) == want
    assert len(data) == want.ByteSize()  # the same bytes, in another order of the parameters at most


def test_typed_values_across_chunks_are_those_sent():
    count = 2 * TYPED_CHUNK + 7
    values = [(-1) ** i * (i % 1000) * 0.25 for i in range(count)]
    indices = list(range(count))[::-1]
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.parameters["top_k"].int64_param = 1
    request.inputs.add(name="grad_expanded_x", datatype="FP32", shape=[count, 1]).contents.fp32_contents.extend(values)
    request.inputs.add(name="expanded_row_idx", datatype="INT32", shape=[count]).contents.int_contents.extend(indices)
    decoded = decode_infer_request(request, max_elements=1 << 31, default_order="ascend910b@9.1")
    assert decoded.call.grad_expanded_x.ravel().tolist() == values
    assert decoded.call.expanded_row_idx.tolist() == indices
    request.inputs[1].datatype = "INT8"  # the range check sees a value in the second chunk
    request.inputs[1].contents.int_contents[TYPED_CHUNK + 1] = 300
    with pytest.raises(MalformedRequest, match=r"expanded_row_idx\.contents\.int_contents holds a value out of INT8"):
        decode_infer_request(request, max_elements=1 << 31, default_order="ascend910b@9.1")


# --- in process, over the wire ---------------------------------------------------------------------

@contextlib.contextmanager
def grpc_app(**settings):
    settings = {"backend": "reference", "grpc_port": 0, "warm_up": False, **settings}
    app = create_app(Settings(**settings))
    with TestClient(app, raise_server_exceptions=False) as http, \
            grpc.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as channel:
        yield http, channel


def test_over_the_wire_typed_contents_over_the_limit_are_resource_exhausted():
    with grpc_app() as (_, channel):
        rpc = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        with pytest.raises(grpc.RpcError) as raised:
            rpc(_request(typed=1 << 20, raw=False).SerializeToString(), timeout=30)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "send large tensors in raw_input_contents" in raised.value.details()


def test_rpcs_whose_request_has_no_fields_never_read_it():
    with grpc_app() as (_, channel):
        reply = channel.unary_unary(f"/{SERVICE}/ServerLive")(b"\xff not a message", timeout=30)
        assert service_pb2.ServerLiveResponse.FromString(reply).live


def _held_bytes(http: TestClient) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("moegrad_inflight_bytes "):
            return float(line.split()[1])
    raise AssertionError("no moegrad_inflight_bytes")


def test_a_message_that_never_comes_is_deadline_exceeded_and_gives_its_room_to_the_next():
    # 12 MiB messages in a 64 MiB budget: a read reserves 48 of the 56 MiB a call may take, one at a time
    with grpc_app(body_timeout_s=2.0, max_inflight_bytes=64 * MIB, grpc_max_message_bytes=12 * MIB) as (http, channel):
        stop = threading.Event()

        def never():
            stop.wait(30)
            yield b""

        silent = channel.stream_unary(f"/{SERVICE}/ModelInfer").future(never(), timeout=30)
        time.sleep(1.0)  # it holds the room now; the next call waits for it
        assert _held_bytes(http) == 48 * MIB
        request = _request()
        reply = channel.unary_unary(f"/{SERVICE}/ModelInfer")(request.SerializeToString(), timeout=30)
        assert service_pb2.ModelInferResponse.FromString(reply).raw_output_contents[0] == bytes(4)
        with pytest.raises(grpc.RpcError) as raised:
            silent.result()
        stop.set()
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "did not arrive within 2 s (body_timeout_s)" in raised.value.details()
        assert _held_bytes(http) == 0
