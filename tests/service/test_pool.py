"""The stream pool holds nothing of a finished call: an idle worker keeps no tensors or result alive."""

from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np
import pytest

import moegrad
from moegrad_service.engine import ReferenceBackend, StreamPool


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


class _FailingTogether:
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
