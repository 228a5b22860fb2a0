"""The dataplane with no HTTP, on the reference backend (the scenarios are tests/dataplane_cases.py)."""

from __future__ import annotations

import pytest

from moegrad_service.engine import ReferenceBackend
from support.dataplane_cases import SCENARIOS


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
