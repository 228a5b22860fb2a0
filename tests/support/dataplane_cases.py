"""The dataplane's behaviour with no HTTP, as scenarios run over each backend.

tests/service/test_dataplane.py runs them on the reference backend, tests/ascend/test_dataplane.py
on the CANN simulator. The expected values are the documentation's example (grad_x
[[0.3, 0.3], [0.7, 0.7]]: float32 0.3 and 0.70000005) and hand-made arrays, never the code under test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

import moegrad
from moegrad_service.dataplane import ClientDisconnected, Comparison, DataPlane
from moegrad_service.engine import Backend, StreamPool
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings

from .docexample import DOC_GRAD, DOC_IDX, DOC_RESULT_BITS


def doc_call(**overrides) -> moegrad.MoeInitRoutingV2GradCall:
    fields = {"grad_expanded_x": DOC_GRAD, "expanded_row_idx": DOC_IDX, "top_k": 2, **overrides}
    return moegrad.MoeInitRoutingV2GradCall(**fields)


@contextlib.asynccontextmanager
async def open_dataplane(backend: Backend, **settings) -> AsyncIterator[DataPlane]:
    """A started pool over ``backend`` and the dataplane over it; the pool (and backend) closed after."""
    configured = Settings(**{"backend": "reference", "streams": 1, **settings})
    pool = StreamPool(backend, streams=configured.streams, max_queue=configured.max_queue,
                      retry_after_s=configured.retry_after_s)
    await pool.start()
    dataplane = DataPlane(configured, pool, Metrics())
    try:
        yield dataplane
    finally:
        await pool.close(grace_s=5)
        await dataplane.close()


async def infer_gives_the_documented_example(backend: Backend) -> None:
    async with open_dataplane(backend) as dataplane:
        outcome = await dataplane.infer(doc_call(), timeout_s=30)
    assert outcome.grad_x.dtype == np.float32 and outcome.grad_x.shape == (2, 2)
    np.testing.assert_array_equal(outcome.grad_x.view(np.uint32), DOC_RESULT_BITS)
    # the reference backend answers in the default profile (Atlas A2 at CANN 9.1); a device in its own,
    # which the device's tests check against the chip and release it reports
    assert (outcome.backend, outcome.order) == (backend.name, backend.order or "ascend910b@9.1")
    assert outcome.device == backend.device
    assert outcome.timings.compute_s >= 0 and outcome.timings.queue_s >= 0


async def an_empty_call_never_reaches_the_backend(backend: Backend) -> None:
    empty = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=np.zeros((0, 3), np.float16),
                                             expanded_row_idx=np.zeros(0, np.int32), top_k=2)
    async with open_dataplane(backend) as dataplane:
        dataplane.pool.stop_admitting()  # a call that reached the pool now would be refused
        outcome = await dataplane.infer(empty, timeout_s=30)
    assert outcome.grad_x.shape == (0, 3) and outcome.grad_x.dtype == np.float16
    assert outcome.timings.queue_s == outcome.timings.compute_s == 0


async def compare_judges_a_candidate(backend: Backend) -> None:
    exact = DOC_RESULT_BITS.view(np.float32)
    wrong = exact.copy()
    wrong[1, 0] = 7.0
    async with open_dataplane(backend) as dataplane:
        good = await dataplane.compare(Comparison.checked(doc_call(), exact, None, False), timeout_s=30)
        bad = await dataplane.compare(Comparison.checked(doc_call(), wrong, None, True), timeout_s=30)
    np.testing.assert_array_equal(good.grad.grad_x.view(np.uint32), DOC_RESULT_BITS)
    assert good.report.passed and not bad.report.passed
    assert good.golden_s >= 0 and good.compare_s >= 0


async def readiness_follows_the_pool(backend: Backend) -> None:
    async with open_dataplane(backend) as dataplane:
        await dataplane.check_ready()
        dataplane.pool.stop_admitting()
        with pytest.raises(moegrad.DeviceBusy):
            await dataplane.check_ready()
        with pytest.raises(moegrad.DeviceBusy):
            await dataplane.infer(doc_call(), timeout_s=30)


async def info_names_the_backend_and_the_limits(backend: Backend) -> None:
    async with open_dataplane(backend, max_queue=7, request_timeout_s=12.5) as dataplane:
        info = dataplane.info()
    assert info["backend"] == backend.name and info["device"] == backend.device
    assert (info["max_queue"], info["request_timeout_s"], info["streams"]) == (7, 12.5, 1)
    assert info["version"] == moegrad.__version__ and info["order"] == (backend.order or "ascend910b@9.1")


async def a_caller_that_is_gone_costs_nothing(backend: Backend, started: asyncio.Event | None = None) -> None:
    """A caller that has gone before its call ran gets ClientDisconnected; the pool is idle after."""
    gone = asyncio.Event()
    gone.set()
    async with open_dataplane(backend) as dataplane:
        with pytest.raises(ClientDisconnected):
            await dataplane.infer(doc_call(), timeout_s=30, disconnected=gone.wait)
        assert dataplane.pool.queue_depth == 0
        outcome = await dataplane.infer(doc_call(), timeout_s=30)  # the pool still serves
    np.testing.assert_array_equal(outcome.grad_x.view(np.uint32), DOC_RESULT_BITS)


SCENARIOS = [infer_gives_the_documented_example, an_empty_call_never_reaches_the_backend,
             compare_judges_a_candidate, readiness_follows_the_pool, info_names_the_backend_and_the_limits,
             a_caller_that_is_gone_costs_nothing]
