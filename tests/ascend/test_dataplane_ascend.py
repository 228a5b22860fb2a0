"""The dataplane with no HTTP, on the ascend backend over the CANN simulator (scenarios: tests/dataplane_cases.py)."""

from __future__ import annotations

import pytest

from support.dataplane_cases import SCENARIOS

LIVE = ("allocations", "tensors", "executors", "streams", "pending")


@pytest.mark.asyncio
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
async def test_dataplane_on_the_simulator(scenario, sim, sim_home):
    from moegrad_service.engine.ascend import AscendBackend

    before = sim.counts()
    await scenario(AscendBackend(device_id=0, ascend_home_path=sim_home))  # the pool closes the backend
    after = sim.counts()
    assert {name: after[name] for name in LIVE} == dict.fromkeys(LIVE, 0)
    assert after["violations"] == before["violations"]
