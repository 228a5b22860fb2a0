"""The runtime contract the binding relies on, and the simulator holding it to that contract.

The facts come from CANN's public runtime (see docs/ascend.md, section "What was checked"):
``aclrtSynchronizeStreamWithTimeout`` takes -1 or a timeout > 0 ms and refuses 0 and < -1 with
107000; ``aclrtStreamQuery`` reports ACL_STREAM_STATUS_COMPLETE (0) or NOT_READY (1); ``aclrtFree``
frees at once without waiting for kernels; ``aclrtDestroyStream`` waits for the stream's kernels;
a repeated ``aclInit`` counts one more reference and ``aclFinalizeReference`` releases one.
"""

from __future__ import annotations

import ctypes

import pytest

from moegrad import DeadlineExceeded, MoeInitRoutingV2GradCall
from moegrad_service.engine.ascend import AscendBackend
from moegrad_service.engine.ascend._abi import ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, load
from moegrad_service.engine.ascend._device import Device, timeout_ms
from support.docexample import DOC_GRAD, DOC_IDX

DOC_CALL = MoeInitRoutingV2GradCall(
    grad_expanded_x=DOC_GRAD, expanded_row_idx=DOC_IDX, top_k=2)
BUFFERS_PER_CALL = 4


@pytest.mark.parametrize(("timeout_s", "milliseconds"), [
    (None, -1),            # no deadline: wait forever
    (0.0, 1),              # a spent budget: the shortest valid wait, never the refused 0
    (0.0004, 1),           # under a millisecond: rounded up, never truncated to 0
    (0.001, 1),
    (0.0011, 2),           # rounded up, so the kernel is never given less than its budget
    (2.5, 2500),
    (1e9, 2**31 - 1),      # the argument is an int32_t
])
def test_remaining_time_is_a_valid_sync_timeout(timeout_s, milliseconds):
    assert timeout_ms(timeout_s) == milliseconds


def test_the_simulator_refuses_a_0_ms_sync_and_answers_a_stream_query(backend, sim):
    api = backend._api
    stream = ctypes.c_void_p()
    assert api.aclrtCreateStream(ctypes.byref(stream)) == 0
    try:
        for refused in (0, -2):
            assert api.aclrtSynchronizeStreamWithTimeout(stream, refused) == 107000  # ACL_ERROR_RT_PARAM_INVALID
            assert "timeout" in api.recent_error()
        assert api.aclrtSynchronizeStreamWithTimeout(stream, -1) == 0
        assert api.aclrtSynchronizeStreamWithTimeout(stream, 1) == 0
        status = ctypes.c_int(-1)
        assert api.aclrtStreamQuery(stream, ctypes.byref(status)) == 0 and status.value == 0  # COMPLETE
    finally:
        assert api.aclrtDestroyStream(stream) == 0


def test_the_old_zero_ms_poll_is_caught_freeing_a_running_kernels_memory(sim, sim_home, monkeypatch):
    """The poll this binding used to make: a 0 ms sync, whose refusal (107000) it took as 'finished'."""
    monkeypatch.setenv("MOEGRAD_SIM_BLOCK_CAP_MS", "50")

    def zero_ms_poll(self: Device, stream: int) -> bool:
        status = self.api.aclrtSynchronizeStreamWithTimeout(stream, 0)
        self.api.recent_error()
        return status != ACL_ERROR_RT_STREAM_SYNC_TIMEOUT

    monkeypatch.setattr(Device, "is_idle", zero_ms_poll)
    backend = AscendBackend(ascend_home_path=sim_home, drain_timeout_s=0.05)
    try:
        worker = backend.open_worker(0)
        sim.inject("hang", 1, -1)
        with pytest.raises(DeadlineExceeded):
            worker.run(DOC_CALL, timeout_s=0.02)
        before = sim.counts()
        worker.run(DOC_CALL, timeout_s=1.0)  # polls the retired stream the old way
        after = sim.counts()
        # Its four buffers were freed under the running kernel, then aclrtDestroyStream blocked on it.
        assert after["violations"] - before["violations"] >= BUFFERS_PER_CALL
        assert after["blocked"] - before["blocked"] == 1
        sim.release_hung()
        worker.close()
    finally:
        backend.close()


def test_acl_stays_initialised_for_another_user_of_the_process(sim, sim_home):
    # Another ACL user (torch_npu, say) initialised first: its reference survives the backend's close.
    api = load(sim_home)
    assert api.aclInit(None) == 0
    try:
        backend = AscendBackend(ascend_home_path=sim_home)
        assert sim.counts()["acl_refs"] == 2  # the repeated aclInit (100002) counts too
        backend.close()
        counts = sim.counts()
        assert counts["initialized"] == 1 and counts["acl_refs"] == 1
    finally:
        assert api.aclFinalizeReference(None) == 0
    assert sim.counts()["initialized"] == 0


def test_without_aclfinalizereference_acl_is_left_initialised(sim, sim_home, monkeypatch):
    backend = AscendBackend(ascend_home_path=sim_home)
    api = backend._api
    release = api.aclFinalizeReference
    monkeypatch.setattr(api, "aclFinalizeReference", None)  # an older runtime
    backend.close()
    assert sim.counts()["initialized"] == 1  # never aclFinalize: it would end every user's ACL
    assert release(None) == 0
    assert sim.counts()["initialized"] == 0
