"""What changes with the CANN release, on the simulated device of each release.

The rules (the profile table, moegrad.operator._profiles, and docs/semantics.md): phase one answers an
attribute or shape failure with 561002 before 9.1 and with 561103 ACLNN_ERR_INNER_NULLPTR from 9.1
(the 9.1 documentation's code; docs/operator.md's return codes list the checks); from 9.1 an empty
output succeeds with no launch and no attribute check, before it is a tiling error (561002); the
Ascend 950 adds one row at a time at 8.5 and in groups of four from 9.0, and from 9.1 gives a +0.0
row for any negative index, for a dropless index >= N*K and for an active-mode index >= A. The
expected sums come from ascend_cases.sum_in_950_order, a loop written from that rule.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from ascend_cases import DTYPE_NAMES, MODES, assert_bitwise, make_call, sum_in_950_order
from fastapi.testclient import TestClient

from moegrad import DeviceFault, InvalidArgument, MoeInitRoutingV2GradCall
from moegrad_service.app import create_app
from moegrad_service.engine.ascend import AscendBackend
from moegrad_service.settings import Settings
from support.docexample import DOC_GRAD, DOC_IDX
from support.servicekit import grad_x_of, post

RELEASES = ("8.5.0", "9.0.0", "9.1.0")
#: The code of an attribute or shape failure, per release (the 9.1 docs changed it).
SHAPE_ERROR = {"8.5.0": 561002, "9.0.0": 561002, "9.1.0": 561103}


@pytest.fixture
def device(sim, release_home, monkeypatch):
    """``open(version, soc)``: a worker of a backend on a simulated device of that release and SoC.

    One release per test: the simulated operator takes its release from the process's environment.
    """
    opened = []

    def open_worker(version: str | None, soc: str = "Ascend910B3"):
        monkeypatch.setenv("MOEGRAD_SIM_SOC_NAME", soc)
        backend = AscendBackend(ascend_home_path=release_home(version))
        worker = backend.open_worker(0)
        opened.append((backend, worker))
        return worker

    yield open_worker
    for backend, worker in opened:
        worker.close()
        backend.close()


def unvalidated(**fields) -> MoeInitRoutingV2GradCall:
    """A call as the worker takes it, without moegrad's validation (which would refuse most of these)."""
    defaults = {"grad_expanded_x": DOC_GRAD, "expanded_row_idx": DOC_IDX, "top_k": 2, "drop_pad_mode": 0,
                "active_num": 0, "order": "ascend910b@9.1"}
    return MoeInitRoutingV2GradCall.model_construct(**{**defaults, **fields})


# --- the API edge: every chip ------------------------------------------------------------------------


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize(("fields", "status"), [
    ({"expanded_row_idx": np.array([2, 0, 1, 4], np.int32)}, 161002),   # index outside [0, N*K)
    ({"expanded_row_idx": None}, 161001),                                # a null tensor
    ({"top_k": 3}, "shape"),                                             # N*K not divisible by K
    ({"top_k": 0}, "shape"),                                             # K <= 0 (9.1: see below)
    ({"drop_pad_mode": 2}, "shape"),                                     # mode not 0 or 1
    ({"drop_pad_mode": 1}, "shape"),                                     # drop/pad needs [E, C, H]
    ({"active_num": 3}, "shape"),                                        # A != grad.shape[0]
    ({"active_num": -1}, "shape"),                                       # A < 0
])
def test_phase_one_rejections_carry_the_releases_code(device, sim, version, fields, status):
    worker = device(version)
    before = sim.counts()
    if version == "9.1.0" and fields == {"top_k": 0}:  # out is then [0, H]: empty, so no attribute check
        assert worker.run(unvalidated(**fields), timeout_s=None).shape == (0, 2)
        assert sim.counts()["launches"] == before["launches"]
        return
    with pytest.raises(InvalidArgument) as caught:  # the caller's error on every release: a 422
        worker.run(unvalidated(**fields), timeout_s=None)
    assert caught.value.aclnn_status == (SHAPE_ERROR[version] if status == "shape" else status)
    assert "[moegrad-sim] aclnnMoeInitRoutingV2GradGetWorkspaceSize" in caught.value.message
    after = sim.counts()
    assert after["phase_one"] - before["phase_one"] == 1 and after["launches"] == before["launches"]
    assert after["tensors"] == after["executors"] == 0
    assert worker.run(unvalidated(), timeout_s=None).shape == (2, 2)


@pytest.mark.parametrize("version", RELEASES)
def test_an_injected_tiling_failure_carries_the_releases_code(device, sim, version):
    worker = device(version)
    sim.inject("tiling")
    with pytest.raises(InvalidArgument) as caught:
        worker.run(unvalidated(), timeout_s=None)
    assert caught.value.aclnn_status == SHAPE_ERROR[version] and "injected tiling failure" in caught.value.message


def test_on_an_unknown_release_561103_is_not_claimed_as_the_callers(device, sim):
    worker = device("10.0.0")  # newer than every profile: the simulator answers as 9.1 does
    sim.inject("tiling")
    with pytest.raises(DeviceFault) as caught:  # 561103 is also an internal fault: a 500, with the hint
        worker.run(unvalidated(), timeout_s=None)
    assert caught.value.aclnn_status == 561103 and "from CANN 9.1" in str(caught.value)


@pytest.mark.parametrize("version", RELEASES)
def test_an_empty_output(device, sim, version):
    worker = device(version)
    empty = np.zeros((4, 0), np.float32)
    for call in (unvalidated(grad_expanded_x=empty), unvalidated(grad_expanded_x=empty, active_num=-1)):
        before = sim.counts()
        if version == "9.1.0":  # success, no launch, and no attribute check (active_num=-1 passes)
            got = worker.run(call, timeout_s=None)
            assert got.shape == (2, 0) and got.dtype == np.float32
        else:  # the tiling requires every dimension to be positive
            with pytest.raises(InvalidArgument) as caught:
                worker.run(call, timeout_s=None)
            assert caught.value.aclnn_status == 561002
        after = sim.counts()
        assert after["launches"] == before["launches"] and after["executors"] == after["tensors"] == 0


# --- the Ascend 950 kernel ---------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "release", "other"), [("8.5.0", "8.5", "9.0"), ("9.0.0", "9.0", "8.5")])
def test_the_950_adds_one_row_at_a_time_at_8_5_and_in_groups_of_four_from_9_0(device, version, release, other):
    worker = device(version, "Ascend950PR")
    differ = set()
    for mode in MODES:
        for dtype in DTYPE_NAMES:
            for top_k in (1, 3, 4, 5, 8, 9, 16, 17):
                call = make_call(mode, dtype, top_k, tokens=4, hidden=7, seed=7)
                got = worker.run(call, timeout_s=30.0)
                assert_bitwise(got, sum_in_950_order(call, release))
                elsewhere = sum_in_950_order(call, other)
                if (got.view(f"u{got.itemsize}") != elsewhere.view(f"u{got.itemsize}")).any():
                    differ.add(top_k)
    assert differ >= {4, 5, 8}  # the orders differ once a group of four forms (K < 4: the same chain)


def invalid_slot_calls(order: str) -> dict[str, MoeInitRoutingV2GradCall]:
    """One call per mode whose slots hold the indices only 950@9.1 defines: N = 3, K = 4 (N*K = 12)."""
    rng = np.random.default_rng(29)
    grad = rng.standard_normal((12, 5)).astype(np.float32)
    dropless = np.array([0, -1, 1, 12, 2, 3, -5, 4, 5, 6, 7, 40], np.int32)  # -1, -5, N*K, > N*K
    active = np.array([0, -1, 1, 2, 8, 12, 3, 4, 30, 5, -7, 6], np.int32)    # A = 8: 8, 12 and 30 skipped
    drop_pad = np.array([0, -1, 1, -5, 2, 3, 4, -2, 5, 6, 7, 8], np.int32)   # E*C = 12
    return {
        "dropless": unvalidated(grad_expanded_x=grad, expanded_row_idx=dropless, top_k=4, order=order),
        "active": unvalidated(grad_expanded_x=grad[:8], expanded_row_idx=active, top_k=4, active_num=8, order=order),
        "drop_pad": unvalidated(grad_expanded_x=grad.reshape(3, 4, 5), expanded_row_idx=drop_pad, top_k=4,
                                drop_pad_mode=1, order=order),
    }


def test_the_950_at_9_1_gives_a_zero_row_for_every_invalid_slot(device):
    worker = device("9.1.0", "Ascend950PR")
    for mode, call in invalid_slot_calls("ascend950@9.1").items():
        got = worker.run(call, timeout_s=None)
        assert_bitwise(got, sum_in_950_order(call, "9.1"))
        assert not np.isnan(got).any(), mode
    beyond = invalid_slot_calls("ascend950@9.1")["drop_pad"]  # a drop/pad index >= E*C stays undefined
    beyond.expanded_row_idx[0] = 12
    with pytest.raises(InvalidArgument) as caught:
        worker.run(beyond, timeout_s=None)
    assert caught.value.aclnn_status == 161002


@pytest.mark.parametrize(("version", "soc"), [("9.0.0", "Ascend950PR"), ("8.5.0", "Ascend950PR"),
                                              ("9.1.0", "Ascend910B3"), ("9.1.0", "Ascend910_9391")])
def test_elsewhere_those_slots_are_undefined_and_refused(device, version, soc):
    worker = device(version, soc)
    for mode, call in invalid_slot_calls("ascend950@9.1").items():
        if mode == "active":
            with pytest.raises(InvalidArgument) as caught:  # -1, 12, 30, -7 are outside [0, N*K): undefined
                worker.run(call, timeout_s=None)
            assert caught.value.aclnn_status == 161002
            call.expanded_row_idx[[1, 5, 8, 10]] = (9, 10, 11, 7)
            got = worker.run(call, timeout_s=None)  # indices >= A but < N*K are skipped on every profile
            assert got.shape == (3, 5)
            continue
        with pytest.raises(InvalidArgument) as caught:
            worker.run(call, timeout_s=None)
        assert caught.value.aclnn_status == 161002, mode


@pytest.mark.parametrize(("soc", "served"), [("Ascend950PR", True), ("Ascend910B3", False)])
def test_a_backward_with_unrouted_slots_through_the_service(sim, release_home, monkeypatch, soc, served):
    """Huawei's 950 binding's backward: dropless, -1 where a token's expert was outside the active
    range. Served on the 950 at 9.1 with +0.0 rows; refused on an A2 at 9.1, naming the profile that
    takes it."""
    monkeypatch.setenv("MOEGRAD_SIM_SOC_NAME", soc)
    home = release_home("9.1.0")
    rng = np.random.default_rng(5)
    grad = rng.standard_normal((12, 6)).astype(np.float32)
    idx = np.array([3, -1, 0, 7, -1, -1, 11, 2, 5, 9, -1, 1], np.int32)
    document = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=idx, top_k=4,
                                        order="ascend950@9.1").to_wire()
    del document["order"]  # named none: the device's own profile decides
    with TestClient(create_app(Settings(backend="ascend", ascend_home_path=home, streams=1)),
                    raise_server_exceptions=False) as client:
        response = post(client, document)
        if served:
            assert response.status_code == 200, response.text
            assert msgpack.unpackb(response.content)["order"] == "ascend950@9.1"
            expected = sum_in_950_order(MoeInitRoutingV2GradCall.model_construct(
                grad_expanded_x=grad, expanded_row_idx=idx, top_k=4, drop_pad_mode=0, active_num=0), "9.1")
            assert_bitwise(grad_x_of(response), expected)
        else:
            problem = response.json()
            assert (problem["status"], problem["aclnn_status"]) == (422, 161002)
            assert "ascend950@9.1" in problem["detail"]
