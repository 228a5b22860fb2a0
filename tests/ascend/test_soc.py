"""Which chip answered: the SoC name the runtime reports, and the order of adds that chip computes.

The simulator reports the SoC named by MOEGRAD_SIM_SOC_NAME. On an Ascend950* SoC its kernel adds in
the 950 order for shapes whose whole K fits in one chunk; the expected values here come from a
per-row loop written from that rule (docs/semantics.md, section 7), not from moegrad's code:
a float32 accumulator from +0.0, groups of four rows added as s += ((x0 + x1) + (x2 + x3)), the
leftover rows as s += x, an invalid slot's row taken as +0.0 and added in its place, one rounding
(to nearest, ties to even) to the output dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
from ascend_cases import DTYPE_NAMES, MODES, assert_bitwise, make_call

import moegrad
from moegrad import MoeInitRoutingV2GradCall
from moegrad_service.engine.ascend import AscendBackend, order_of_soc

#: K values whose 950 order is defined by the one-chunk rule, with the groups-of-four edge cases.
K_950 = (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17)


@pytest.mark.parametrize(("soc", "order"), [
    ("Ascend910B1", "ascend910b"), ("Ascend910B3", "ascend910b"), ("Ascend910B4", "ascend910b"),
    ("Ascend910_9391", "ascend910b"), ("Ascend910_9382", "ascend910b"),
    ("Ascend950PR", "ascend950"), ("Ascend950DT", "ascend950"),
    ("Ascend910A", None), ("Ascend310P3", None), ("", None), (None, None),
])
def test_soc_names_map_to_orders(soc, order):
    assert order_of_soc(soc) == order


@pytest.fixture
def soc_backend(sim, sim_home, monkeypatch, request):
    monkeypatch.setenv("MOEGRAD_SIM_SOC_NAME", request.param)
    backend = AscendBackend(ascend_home_path=sim_home)
    try:
        yield backend
    finally:
        backend.close()


@pytest.mark.parametrize(("soc_backend", "order"), [
    ("Ascend910B3", "ascend910b"), ("Ascend910_9391", "ascend910b"), ("Ascend950PR", "ascend950"),
    ("Ascend950DT", "ascend950"), ("Ascend310P3", None),
], indirect=["soc_backend"])
def test_the_backend_names_its_soc_and_the_order_it_computes(soc_backend, order):
    soc = soc_backend.soc_name
    assert soc_backend.order == order
    assert soc_backend.device == f"{soc} #0"


def sum_in_950_order(call: MoeInitRoutingV2GradCall) -> np.ndarray:
    """grad_x by the 950 rule, one token at a time (float32 arithmetic, one final rounding)."""
    grad = np.asarray(call.grad_expanded_x)
    rows = grad.reshape(-1, grad.shape[-1]).astype(np.float32)  # exact widening of fp16 / bf16
    idx, k = np.asarray(call.expanded_row_idx), call.top_k
    out = np.empty((idx.size // k, rows.shape[1]), np.float32)
    for i in range(out.shape[0]):
        xs = []
        for slot in idx[i * k:(i + 1) * k]:
            invalid = slot < 0 if call.drop_pad_mode == 1 else 0 < call.active_num <= slot
            xs.append(np.zeros(rows.shape[1], np.float32) if invalid else rows[slot])
        s, t = np.zeros(rows.shape[1], np.float32), 0
        while k - t >= 4:
            s = s + ((xs[t] + xs[t + 1]) + (xs[t + 2] + xs[t + 3]))
            t += 4
        while t < k:
            s = s + xs[t]
            t += 1
        out[i] = s
    return out.astype(grad.dtype)


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
