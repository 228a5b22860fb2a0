"""The dataplane's inference statistics (Triton's schema), with no protocol: what each kind of call adds."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import moegrad
from moegrad_service.engine import ReferenceBackend
from support.dataplane_cases import doc_call, open_dataplane


@pytest.mark.asyncio
async def test_successes_failures_and_empty_calls_are_counted():
    async with open_dataplane(ReferenceBackend(), max_queue=1) as dataplane:
        stats = dataplane.statistics
        assert (stats.success.count, stats.fail.count, stats.inference_count, stats.last_inference_ms) == (0, 0, 0, 0)

        arrived = time.perf_counter() - 0.05  # the request arrived 50 ms ago (reading and decoding it)
        before_ms = time.time_ns() // 1_000_000
        await dataplane.infer(doc_call(), timeout_s=30, received_s=arrived)
        assert stats.success.count == stats.queue.count == stats.compute_infer.count == 1
        assert stats.compute_input.count == stats.compute_output.count == 1
        assert stats.compute_input.ns >= 50_000_000  # arrival to the dataplane
        assert stats.success.ns >= stats.compute_input.ns + stats.compute_infer.ns
        assert before_ms <= stats.last_inference_ms <= time.time_ns() // 1_000_000

        empty = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=np.zeros((0, 4), np.float32),
                                                 expanded_row_idx=np.zeros(0, np.int32), top_k=2)
        await dataplane.infer(empty, timeout_s=30)  # answered without a worker: still an inference
        assert stats.success.count == stats.inference_count == stats.execution_count == 2
        assert stats.fail.count == 0

        dataplane.pool.stop_admitting()  # busy: a failure of the model, counted with its duration
        with pytest.raises(moegrad.DeviceBusy):
            await dataplane.infer(doc_call(), timeout_s=30)
        assert stats.fail.count == 1 and stats.success.count == 2


@pytest.mark.asyncio
async def test_a_cancelled_call_is_a_failure():
    def hook(call, timeout_s):
        time.sleep(0.3)

    async with open_dataplane(ReferenceBackend(fault_hook=hook)) as dataplane:
        task = asyncio.create_task(dataplane.infer(doc_call(), timeout_s=30))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert dataplane.statistics.fail.count == 1 and dataplane.statistics.success.count == 0
