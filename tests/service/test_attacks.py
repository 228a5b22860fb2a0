"""Attacks in-process: what each costs the service now, measured in this process.

The same attacks run against a real server, watched by probes, in tests/e2e/test_attacks_e2e.py;
here they are quick and measured directly: the answer, the time it takes and the memory the
service allocates for it (``tracemalloc``, which NumPy reports to as well).

- a msgpack body of empty maps (16 MiB) is 400 at once and allocates nothing like its size;
- ragged nesting in v2 JSON ``data`` (0.86 MiB) is 400 within a second;
- duplicate keys anywhere in v2 JSON are 400 naming the key;
- the in-flight budget keeps its last eighth for small calls, so large bodies cannot keep one out;
- a pool whose every worker cannot run calls is not ready (503) and refuses calls with 503 +
  Retry-After; it is ready again once one can; an abandoned worker is lost capacity until its
  replacement opens;
- an unauthenticated request learns nothing about the routes (401 for a missing route, a wrong
  method and a trailing slash alike);
- an int64 index or a float64 grad on v1 is 422 with aclnn 161002.
"""

from __future__ import annotations

import threading
import time
import tracemalloc

import msgpack
import numpy as np
import pytest

import moegrad
from moegrad_service.engine import ReferenceBackend
from moegrad_service.engine import pool as pool_module
from moegrad_service.memory import MemoryBudget
from support.docexample import example_document
from support.servicekit import post

MIB = 1 << 20
INFER = "/v2/models/moe_init_routing_v2_grad/infer"


def measured(action):
    """(result, seconds, peak bytes allocated while it ran)."""
    tracemalloc.start()
    try:
        started = time.perf_counter()
        result = action()
        return result, time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_body_of_empty_maps_is_400_at_once_and_costs_no_more_than_its_bytes(client):
    n = 16 * MIB - 5
    body = b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n  # a msgpack array of 16 Mi empty maps
    reply, seconds, peak = measured(lambda: post(client, body))
    assert reply.status_code == 400 and "max_array_len" in reply.json()["detail"], reply.text
    # Before: +2.35 GiB and 14.5 s. Now: the body's own copies (client, transport, server buffer).
    assert seconds < 2.0 and peak < 4 * len(body), (seconds, peak)


def test_ragged_nesting_in_v2_json_data_is_400_within_a_second(client):
    depth = 220_000  # [1,[1,[1,...]]]: 0.86 MiB, every level a number beside a list
    data = "[1," * depth + "1" + "]" * depth
    document = ('{"inputs":[{"name":"grad_expanded_x","shape":[4,2],"datatype":"FP32","data":' + data +
                '},{"name":"expanded_row_idx","shape":[4],"datatype":"INT32","data":[2,0,1,3]}],'
                '"parameters":{"top_k":2}}')
    assert 0.8 * MIB < len(document) < 0.9 * MIB
    reply, seconds, _ = measured(lambda: client.post(INFER, content=document,
                                                     headers={"content-type": "application/json"}))
    assert reply.status_code == 400, reply.text
    assert seconds < 1.0, seconds  # before: 35 s with the event loop blocked


@pytest.mark.parametrize("document, key", [
    ('{"inputs":[],"inputs":[]}', "inputs"),
    ('{"inputs":[{"name":"grad_expanded_x","name":"expanded_row_idx","shape":[4],"datatype":"INT32",'
     '"data":[2,0,1,3]}]}', "name"),
    ('{"parameters":{"top_k":2,"top_k":1},"inputs":[]}', "top_k"),
])
def test_duplicate_keys_in_v2_json_are_400_naming_the_key(client, document, key):
    reply = client.post(INFER, content=document, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and f"'{key}' twice" in reply.json()["error"], reply.text


def test_the_budget_keeps_its_last_eighth_for_small_calls():
    budget = MemoryBudget(64 * MIB)
    assert budget.reserve_body(28 * MIB) == 56 * MIB  # seven eighths: a large body and its answer
    with pytest.raises(moegrad.DeviceBusy, match="in-flight bytes"):
        budget.reserve_body(MIB + 1)  # a large body no longer fits...
    for _ in range(4):
        budget.reserve_body(MIB)  # ...but 4 small calls (1 MiB, holding 2) still do
    with pytest.raises(moegrad.DeviceBusy):
        budget.reserve_body(1)
    assert budget.held_bytes == 64 * MIB


def test_a_body_that_could_never_fit_is_413_not_503():
    budget = MemoryBudget(64 * MIB)
    # 28 MiB + 1 byte holds just over seven eighths (56 MiB), the most a large call may take: retrying cannot help
    with pytest.raises(moegrad.PayloadTooLarge, match="max_inflight_bytes"):
        budget.reserve_body(28 * MIB + 1)
    with pytest.raises(moegrad.PayloadTooLarge, match="max_inflight_bytes"):
        budget.reserve(56 * MIB + 1)
    assert budget.held_bytes == 0
    assert budget.reserve_body(MIB) == 2 * MIB  # a small one may use the whole budget


def test_a_chunked_body_is_as_large_a_call_as_a_declared_one_of_its_size():
    """Chunks of at most 1 MiB are each a small call's size, but the limits apply to the body so far:
    chunked uploads cannot take the eighth kept for small calls, nor pass the 413 size of one call."""
    budget = MemoryBudget(64 * MIB)
    so_far = 0
    while so_far < 28 * MIB:  # 28 MiB in 1 MiB chunks: seven eighths, as a declared 28 MiB body
        budget.reserve_body(MIB, so_far=so_far)
        so_far += MIB
    with pytest.raises(moegrad.PayloadTooLarge, match="a body of 30408704 bytes holds 60817408"):
        budget.reserve_body(MIB, so_far=28 * MIB)  # the 29th MiB: over what one call may take
    budget.reserve_body(MIB, so_far=0)  # a second chunked upload's first MiB: a small call's size
    with pytest.raises(moegrad.DeviceBusy, match="in-flight bytes"):
        budget.reserve_body(MIB, so_far=MIB)  # its second: a large call's, over seven eighths now
    for _ in range(3):
        budget.reserve_body(MIB)  # small calls still fit in the last eighth
    assert budget.held_bytes == 64 * MIB


class Crippled(ReferenceBackend):
    """A reference backend whose workers say they cannot run calls while ``broken`` is set."""

    def __init__(self) -> None:
        super().__init__(warm_up=False)
        self.broken = threading.Event()

    def open_worker(self, index: int):
        worker = super().open_worker(index)
        worker.accepts_calls = lambda: not self.broken.is_set()
        return worker


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "not reached in time"
        time.sleep(0.02)


def test_no_worker_that_can_run_calls_is_not_ready_and_503(serve, monkeypatch):
    monkeypatch.setattr(pool_module, "CAPACITY_POLL_S", 0.02)
    backend = Crippled()
    with serve(backend=backend, streams=2, express_max_adds=0) as client:
        assert post(client, example_document()).status_code == 200
        backend.broken.set()
        # Each worker asks before its next call: one call each finds them out (or the poll does).
        for _ in range(2):
            post(client, example_document())
        wait_for(lambda: client.get("/health/ready").status_code == 503)
        ready = client.get("/health/ready")
        assert "none of the 2 backend workers can run calls" in ready.json()["detail"]
        refused = post(client, example_document())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        backend.broken.clear()
        wait_for(lambda: client.get("/health/ready").status_code == 200)
        assert post(client, example_document()).status_code == 200


def test_an_abandoned_worker_is_lost_capacity_until_its_replacement_opens(serve, monkeypatch):
    monkeypatch.setattr(pool_module, "ABANDON_GRACE_S", 0.05)
    hang, reopen = threading.Event(), threading.Event()

    class Stuck(ReferenceBackend):
        opened = 0

        def open_worker(self, index):
            Stuck.opened += 1
            if Stuck.opened > 1:
                reopen.wait(10)  # the replacement takes its time to open
            return super().open_worker(index)

    backend = Stuck(warm_up=False, fault_hook=lambda call, timeout_s: hang.wait(10))
    try:
        with serve(backend=backend, streams=1, express_max_adds=0) as client:
            reply = post(client, example_document(), headers={"x-request-timeout": "0.1"})
            assert reply.status_code == 504, reply.text
            wait_for(lambda: client.get("/health/ready").status_code == 503)
            assert "none of the 1 backend workers" in client.get("/health/ready").json()["detail"]
            hang.set()
            reopen.set()
            wait_for(lambda: client.get("/health/ready").status_code == 200)
            assert post(client, example_document()).status_code == 200
    finally:
        hang.set()
        reopen.set()


@pytest.mark.parametrize("method, path", [("GET", "/nope"), ("GET", "/v1/moe_init_routing_v2_grad"),
                                          ("POST", "/v1/moe_init_routing_v2_grad/"), ("DELETE", "/v2")])
def test_an_unauthenticated_request_learns_nothing_about_the_routes(serve, method, path):
    with serve(auth_tokens="s3cret") as client:
        reply = client.request(method, path, follow_redirects=False)
        assert reply.status_code == 401 and "location" not in reply.headers, (reply.status_code, reply.text)


@pytest.mark.parametrize("grad_dtype, idx_dtype", [("float32", "int64"), ("float64", "int32")])
def test_unsupported_dtypes_on_v1_are_422_161002(client, grad_dtype, idx_dtype):
    grad, idx = np.zeros((4, 2), grad_dtype), np.array([2, 0, 1, 3], idx_dtype)
    document = example_document(
        grad_expanded_x={"dtype": grad_dtype, "shape": [4, 2], "data": grad.tobytes()},
        expanded_row_idx={"dtype": idx_dtype, "shape": [4], "data": idx.tobytes()})
    reply = post(client, msgpack.packb(document, use_bin_type=True))
    assert reply.status_code == 422 and reply.json()["aclnn_status"] == 161002, reply.text

