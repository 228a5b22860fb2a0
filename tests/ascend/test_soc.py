"""Which chip answered: the SoC name the runtime reports, the chip it is, and that chip's order of adds.

The simulator reports the SoC named by MOEGRAD_SIM_SOC_NAME, and its homes record CANN 9.1.0. On an
Ascend950* SoC its kernel adds in the 950 order for shapes whose whole K fits in one chunk; the
expected values here come from a per-row loop written from that rule (ascend_cases.sum_in_950_order,
docs/semantics.md section 7), not from moegrad's code.
"""

from __future__ import annotations

import numpy as np
import pytest
from ascend_cases import DTYPE_NAMES, MODES, assert_bitwise, make_call, sum_in_950_order

import moegrad
from moegrad import MoeInitRoutingV2GradCall
from moegrad_service.engine.ascend import AscendBackend, chip_of_soc

#: K values whose 950 order is defined by the one-chunk rule, with the groups-of-four edge cases.
K_950 = (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17)


@pytest.mark.parametrize(("soc", "chip"), [
    ("Ascend910B1", "ascend910b"), ("Ascend910B3", "ascend910b"), ("Ascend910B4", "ascend910b"),
    ("Ascend910_9391", "ascend910_93"), ("Ascend910_9382", "ascend910_93"),
    ("Ascend950PR", "ascend950"), ("Ascend950DT", "ascend950"),
    ("Ascend910A", None), ("Ascend310P3", None), ("", None), (None, None),
])
def test_soc_names_map_to_chips(soc, chip):
    assert chip_of_soc(soc) == chip


@pytest.fixture
def soc_backend(sim, sim_home, monkeypatch, request):
    monkeypatch.setenv("MOEGRAD_SIM_SOC_NAME", request.param)
    backend = AscendBackend(ascend_home_path=sim_home)
    try:
        yield backend
    finally:
        backend.close()


@pytest.mark.parametrize(("soc_backend", "order"), [
    ("Ascend910B3", "ascend910b@9.1"), ("Ascend910_9391", "ascend910_93@9.1"), ("Ascend950PR", "ascend950@9.1"),
    ("Ascend950DT", "ascend950@9.1"), ("Ascend310P3", None),
], indirect=["soc_backend"])
def test_the_backend_names_its_soc_and_the_profile_it_computes(soc_backend, order):
    soc = soc_backend.soc_name
    assert soc_backend.order == order
    assert soc_backend.device == f"{soc} #0, CANN 9.1.0 (aclsysGetVersionStr)"


@pytest.mark.parametrize("soc_backend", ["Ascend950PR"], indirect=True)
def test_the_simulated_950_adds_in_the_950_order(soc_backend, sim):
    worker = soc_backend.open_worker(0)
    differs_from_a2_a3 = set()
    for mode in MODES:
        for dtype in DTYPE_NAMES:
            for top_k in K_950:
                call = make_call(mode, dtype, top_k, tokens=4, hidden=7, seed=5)
                got = worker.run(call, timeout_s=30.0)
                assert_bitwise(got, sum_in_950_order(call))
                a2_a3 = moegrad.moe_init_routing_v2_grad(call)
                width = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
                if (got.view(width) != a2_a3.view(width)).any():
                    differs_from_a2_a3.add(top_k)
    assert {3, 5, 6, 7, 9} <= differs_from_a2_a3  # the simulator did switch orders (1, 2, 4, 8 agree)
    worker.close()


@pytest.mark.parametrize("soc_backend", ["Ascend950DT"], indirect=True)
def test_the_950_never_returns_negative_zero(soc_backend):
    worker = soc_backend.open_worker(0)
    minus = np.full((6, 3), -0.0, dtype=np.float32)  # A2/A3 keep -0.0 here; the 950 starts from +0.0
    got = worker.run(MoeInitRoutingV2GradCall(grad_expanded_x=minus, expanded_row_idx=np.arange(6, dtype=np.int32),
                                              top_k=3), timeout_s=None)
    assert (got.view(np.uint32) == 0).all()
    grad = np.full((2, 2, 3), -5.0, dtype=np.float32)  # token 1: every slot dropped, so +0.0 rows only
    got = worker.run(MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.array([0, 3, -1, -1], np.int32),
                                              top_k=2, drop_pad_mode=1), timeout_s=None)
    assert (got[0] == -10.0).all() and (got[1].view(np.uint32) == 0).all()
    worker.close()
