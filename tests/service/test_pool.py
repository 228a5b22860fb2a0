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
