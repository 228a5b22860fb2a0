"""The stream pool holds nothing of a finished call: an idle worker keeps no tensors or result alive."""

from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np
import pytest

import moegrad
from moegrad_service.engine import BackendWorker, ReferenceBackend, StreamPool


@pytest.mark.asyncio
async def test_the_pool_holds_no_reference_to_a_finished_call():
    pool = StreamPool(ReferenceBackend(warm_up=False), streams=2, max_queue=4)
    await pool.start()
    try:
        grad = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
        call = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.arange(64, dtype=np.int32),
                                                top_k=4)
        result, _ = await pool.run(call, timeout_s=30)
        np.testing.assert_array_equal(result, grad.reshape(16, 4, 8).sum(axis=1, dtype=np.float32))
        inputs, output = weakref.ref(call.grad_expanded_x), weakref.ref(result)
        del call, grad, result
        for _ in range(100):  # the worker drops its locals just after it hands the result over
            gc.collect()
            if inputs() is None and output() is None:
                break
            await asyncio.sleep(0.01)
        assert inputs() is None, "the pool still holds the finished call's grad_expanded_x"
        assert output() is None, "the pool still holds the finished call's grad_x"
    finally:
        await pool.close(grace_s=5)


class _FailingTogether(BackendWorker):
    """A reference slot whose run_many raises (or declines): the pool must run each call alone."""

    def __init__(self, worker, declines: bool) -> None:
        self._worker, self._declines, self.together = worker, declines, 0

    def run(self, call, *, timeout_s):
        return self._worker.run(call, timeout_s=timeout_s)

    def run_many(self, calls, *, timeout_s):
        self.together += 1
        if self._declines:
            return None
        raise RuntimeError("run_many broke")

    def close(self) -> None:
        self._worker.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("declines", [False, True], ids=["raises", "declines"])
async def test_a_batch_runs_one_by_one_when_run_many_fails_or_declines(declines):
    workers = []

    class Backend(ReferenceBackend):
        def open_worker(self, index):
            workers.append(_FailingTogether(super().open_worker(index), declines))
            return workers[-1]

    pool = StreamPool(Backend(warm_up=False), streams=1, max_queue=4)
    await pool.start()
    try:
        calls = [
            moegrad.MoeInitRoutingV2GradCall(
                grad_expanded_x=np.full((4, 2), float(n), np.float32),
                expanded_row_idx=np.arange(4, dtype=np.int32),
                top_k=2,
            )
            for n in (1, 3)
        ]
        outcomes, _ = await pool.run_many(calls, timeout_s=30)
        assert workers[0].together == 1
        assert [(grad_x.tolist(), error) for grad_x, error in outcomes] == [
            ([[2.0, 2.0]] * 2, None),
            ([[6.0, 6.0]] * 2, None),
        ]
    finally:
        await pool.close(grace_s=5)


# --- what a refused or timed-out batch call leaves behind ------------------------------------------
# A caught exception kept as an answer, in a list its own traceback's frames reach, is a reference
# cycle: it would hold the whole batch's tensors until the garbage collector next runs, which an idle
# server may not do for a long time (each such batch of 160 MiB kept about 360 MiB). These tests run
# with the collector off, so only reference counts can free anything.

def test_a_refused_batch_item_holds_no_tensor_of_its_neighbours(collector_off):
    from types import SimpleNamespace

    from moegrad_service.api.v1.codec import decode_batch_items
    from support.docexample import example_document

    dataplane = SimpleNamespace(default_order="ascend910b", check_order=lambda order: None)
    decoded = decode_batch_items([example_document(), example_document(top_k=0)], dataplane, max_elements=1 << 20)
    assert isinstance(decoded[1], moegrad.InvalidArgument) and decoded[1].field == "top_k"
    neighbour = weakref.ref(decoded[0].grad_expanded_x)
    del decoded
    assert neighbour() is None, "the refused item's answer keeps its neighbour's tensor alive"


@pytest.mark.asyncio
async def test_a_timed_out_batch_holds_no_tensor_once_answered(collector_off):
    from support.dataplane_cases import open_dataplane

    async with open_dataplane(ReferenceBackend(warm_up=False), streams=2) as dataplane:
        grads = [np.full((64, 8), float(n), np.float32) for n in range(8)]
        calls = [moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.arange(64, dtype=np.int32),
                                                  top_k=4) for grad in grads]
        answers = await dataplane.infer_batch(calls, timeout_s=1e-6)
        assert all(isinstance(answer, moegrad.DeadlineExceeded) for answer in answers)
        tensors = [weakref.ref(grad) for grad in grads]
        del grads, calls, answers
        for _ in range(200):  # a chunk that had started finishes on its worker just after
            if dataplane.pool.queue_depth == 0 and dataplane.pool.in_flight == 0 and all(t() is None for t in tensors):
                break
            await asyncio.sleep(0.01)
        assert [t() is None for t in tensors] == [True] * 8, "a timed-out call's tensors are still referenced"


@pytest.mark.parametrize("broken", ["top_k", "truncated", "dtype"])
def test_a_refused_large_request_frees_its_body_without_the_collector(collector_off, broken):
    """Bodies over INLINE_DECODE_BYTES are decoded and validated on a worker thread; the refusal
    coming back from there must not keep the body (here 4 MiB) in a reference cycle."""
    import tracemalloc

    from fastapi.testclient import TestClient

    from moegrad_service.api.inputs import INLINE_DECODE_BYTES
    from moegrad_service.app import create_app
    from moegrad_service.settings import Settings
    from support.docexample import example_document
    from support.servicekit import MSGPACK_HEADERS, pack

    grad = np.zeros((4096, 256), np.float32)
    assert grad.nbytes > INLINE_DECODE_BYTES
    document = example_document(grad_expanded_x={"dtype": "float32", "shape": [4096, 256], "data": grad.tobytes()},
                                expanded_row_idx={"dtype": "int32", "shape": [4096],
                                                  "data": np.arange(4096, dtype=np.int32).tobytes()})
    if broken == "top_k":
        document["top_k"] = 0
    elif broken == "dtype":
        document["grad_expanded_x"]["dtype"] = "float64"
    body = pack(document)[:-1] if broken == "truncated" else pack(document)
    with TestClient(create_app(Settings(max_body_bytes=8 << 20))) as client:
        for _ in range(2):  # warm: kept receive buffers, lazily built state
            assert client.post("/v1/moe_init_routing_v2_grad", content=body, headers=MSGPACK_HEADERS).status_code in (400, 422)
        tracemalloc.start()
        try:
            assert client.post("/v1/moe_init_routing_v2_grad", content=body, headers=MSGPACK_HEADERS).status_code in (400, 422)
            held = tracemalloc.get_traced_memory()[0]
            gc.collect()
            only_by_the_collector = held - tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    assert only_by_the_collector < 1 << 20, f"{only_by_the_collector >> 20} MiB were held by a reference cycle"


@pytest.mark.asyncio
async def test_a_timed_out_call_holds_no_tensor_once_answered(collector_off):
    from support.dataplane_cases import open_dataplane

    async with open_dataplane(ReferenceBackend(warm_up=False), streams=1) as dataplane:
        grad = np.ones((4096, 64), np.float32)
        call = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.arange(4096, dtype=np.int32),
                                                top_k=4)
        with pytest.raises(moegrad.DeadlineExceeded):
            await dataplane.infer(call, timeout_s=1e-6)
        tensor = weakref.ref(grad)
        del grad, call
        for _ in range(200):  # a call that had started finishes on its worker just after
            if dataplane.pool.queue_depth == 0 and dataplane.pool.in_flight == 0 and tensor() is None:
                break
            await asyncio.sleep(0.01)
        assert tensor() is None, "a timed-out call's tensors are still referenced"
