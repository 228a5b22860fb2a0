"""The dataplane with no HTTP, on the reference backend (the scenarios are tests/support/dataplane_cases.py)."""

from __future__ import annotations

import numpy as np
import pytest

from moegrad import MoeInitRoutingV2GradCall
from moegrad_service.dataplane import DataPlane
from moegrad_service.engine import ReferenceBackend, StreamPool
from moegrad_service.metrics import Metrics
from moegrad_service.settings import Settings
from support.dataplane_cases import SCENARIOS
from support.docexample import DOC_GRAD, DOC_IDX, DOC_RESULT_BITS, DOC_TOP_K


@pytest.mark.asyncio
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
async def test_dataplane_on_the_reference_backend(scenario):
    await scenario(ReferenceBackend(warm_up=False))


@pytest.mark.parametrize("warm_up", [True, False])
def test_the_service_compiles_the_comparison_in_the_background_at_startup(serve, monkeypatch, warm_up):
    import threading

    import moegrad_service.app

    compiled = threading.Event()
    monkeypatch.setattr(moegrad_service.app, "warm_up_compare", compiled.set)
    with serve(warm_up=warm_up) as client:
        assert client.get("/health/ready").status_code == 200
        assert compiled.wait(5 if warm_up else 0.5) is warm_up


class _Lender:
    """A ResultLender that is not an admission: it lends one array and records what it is told."""

    def __init__(self) -> None:
        self.asked: list[tuple[tuple[int, ...], np.dtype]] = []
        self.written = 0
        self.lent: np.ndarray | None = None

    def result_buffer(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self.asked.append((shape, dtype))
        self.lent = np.full(shape, np.nan, dtype)
        return self.lent

    def result_written(self) -> None:
        self.written += 1


@pytest.mark.asyncio
async def test_grad_x_is_written_into_the_buffer_its_lender_lends_and_the_lender_is_told_once():
    """DataPlane.infer is handed a lender of result buffers (dataplane.records.ResultLender), not
    the request's admission: it asks for [N, H] of the call's dtype, the worker writes grad_x
    there (the documentation example's bits), and the lender is told once the worker is done."""
    settings = Settings(backend="reference", streams=1, max_queue=4)
    pool = StreamPool(ReferenceBackend(warm_up=False), streams=1, max_queue=4)
    await pool.start()
    try:
        dataplane = DataPlane(settings, pool, Metrics())
        call = MoeInitRoutingV2GradCall(grad_expanded_x=DOC_GRAD, expanded_row_idx=DOC_IDX, top_k=DOC_TOP_K)
        lender = _Lender()
        outcome = await dataplane.infer(call, timeout_s=30, lender=lender)
    finally:
        await pool.close(grace_s=5)
    assert lender.asked == [((2, 2), np.dtype(np.float32))] and lender.written == 1
    assert np.shares_memory(outcome.grad_x, lender.lent)
    assert np.array_equal(outcome.grad_x.view(np.uint32), DOC_RESULT_BITS)
