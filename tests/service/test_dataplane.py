"""The dataplane with no HTTP, on the reference backend (the scenarios are tests/dataplane_cases.py)."""

from __future__ import annotations

import pytest
from dataplane_cases import SCENARIOS

from moegrad_service.engine import ReferenceBackend


@pytest.mark.asyncio
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
async def test_dataplane_on_the_reference_backend(scenario):
    await scenario(ReferenceBackend(warm_up=False))
