"""AscendBackend over the CANN simulator: bitwise results, threads, caches, every injected fault, no leaks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from ascend_cases import DTYPE_NAMES, K_VALUES, MODES, assert_bitwise, make_call

import moegrad
from moegrad import DeadlineExceeded, DeviceFault, InvalidArgument, MoeInitRoutingV2GradCall
from moegrad_service.engine.ascend import AscendBackend, CannUnavailable
from support.docexample import DOC_GRAD, DOC_IDX

#: Device buffers one call holds: gradExpandedX, expandedRowIdx, out, and the workspace.
BUFFERS_PER_CALL = 4


def doc_call(**overrides) -> MoeInitRoutingV2GradCall:
    fields = {"grad_expanded_x": DOC_GRAD, "expanded_row_idx": DOC_IDX, "top_k": 2, **overrides}
    return MoeInitRoutingV2GradCall(**fields)


class WorkerThread:
    """A worker opened, run and closed on one dedicated thread, as the StreamPool does it."""

    def __init__(self, backend: AscendBackend, index: int = 0) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ascend-test-{index}")
        self.worker = self._thread.submit(backend.open_worker, index).result()

    def run(self, call, timeout_s=None) -> np.ndarray:
        return self._thread.submit(self.worker.run, call, timeout_s=timeout_s).result()

    def close(self) -> None:
        self._thread.submit(self.worker.close).result()
        self._thread.shutdown()


def delta(before: dict[str, int], after: dict[str, int], *names: str) -> dict[str, int]:
    return {name: after[name] - before[name] for name in names}


# --- results -----------------------------------------------------------------------------------------


def test_documentation_example_bits(backend):
    worker = backend.open_worker(0)
    grad_x = worker.run(doc_call(), timeout_s=None)
    # docs/operator.md, the documentation's example: [[0.3, 0.3], [0.7, 0.7]], float32 0.3 and 0.70000005.
    want = np.array([[0.3, 0.3], [0.70000005, 0.70000005]], dtype=np.float32)
    assert (grad_x.view(np.uint32) == want.view(np.uint32)).all()
    worker.close()


def test_grad_x_lands_in_the_callers_buffer_when_it_fits(backend):
    worker = backend.open_worker(0)
    want = np.array([[0.3, 0.3], [0.70000005, 0.70000005]], dtype=np.float32)  # the documentation's example
    out = np.full((2, 2), np.nan, dtype=np.float32)
    assert worker.run(doc_call(), timeout_s=None, out=out) is out
    assert (out.view(np.uint32) == want.view(np.uint32)).all()
    for unfit in (np.zeros((2, 3), np.float32), np.zeros((2, 2), np.float16), np.zeros((2, 4), np.float32)[:, ::2]):
        got = worker.run(doc_call(), timeout_s=None, out=unfit)  # another shape, dtype or layout: a fresh array
        assert got is not unfit and (got.view(np.uint32) == want.view(np.uint32)).all()
    worker.close()


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_bitwise_equal_to_reference_for_every_k(backend, mode, dtype_name):
    worker = backend.open_worker(0)
    for top_k in K_VALUES:
        call = make_call(mode, dtype_name, top_k)
        assert_bitwise(worker.run(call, timeout_s=30.0), moegrad.moe_init_routing_v2_grad(call))
    worker.close()


def test_rounding_to_half_is_nearest_even_and_specials_pass_through(backend):
    worker = backend.open_worker(0)
    f16 = np.float16
    grad = np.array([[1.0, 1.0009765625, 2.0**-24, np.inf, -0.0, 60000.0],
                     [2.0**-11, 2.0**-11, 2.0**-24, 1.0, -0.0, 5520.0]], dtype=f16)
    call = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.array([0, 1], np.int32), top_k=2)
    got = worker.run(call, timeout_s=None)
    # Worked by hand: 1 + 2^-11 is halfway to the next half (1 + 2^-10) and rounds to even, 1.0;
    # (1 + 2^-10) + 2^-11 rounds up to the even 1 + 2^-9; 2^-24 + 2^-24 = 2^-23 (subnormal);
    # inf + 1 = inf; -0 + -0 = -0; 60000 + 5520 = 65520 rounds to inf (past the largest half, 65504).
    want = np.array([[1.0, 1.001953125, 2.0**-23, np.inf, -0.0, np.inf]], dtype=f16)
    assert (got.view(np.uint16) == want.view(np.uint16)).all(), got
    worker.close()


def test_nan_and_bfloat16_ties(backend):
    worker = backend.open_worker(0)
    bf16 = ml_dtypes.bfloat16
    grad = np.array([[1.0, np.nan, -np.inf], [2.0**-8, 1.0, np.inf]], dtype=bf16)
    call = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.array([0, 1], np.int32), top_k=2)
    got = worker.run(call, timeout_s=None).astype(np.float32)
    # 1 + 2^-8 is halfway between bfloat16 1 and 1 + 2^-7: ties to even, 1.0; NaN stays NaN; -inf + inf = NaN.
    assert got[0, 0] == 1.0 and np.isnan(got[0, 1]) and np.isnan(got[0, 2])
    worker.close()


def test_negative_zero_rows_and_fully_skipped_rows(backend):
    worker = backend.open_worker(0)
    # Dropless, all -0.0: the S1 assignment keeps -0.0 (docs/semantics.md section 4).
    minus = np.full((4, 3), -0.0, dtype=np.float32)
    got = worker.run(MoeInitRoutingV2GradCall(grad_expanded_x=minus, expanded_row_idx=np.arange(4, dtype=np.int32),
                                              top_k=2), timeout_s=None)
    assert (got.view(np.uint32) == np.uint32(0x80000000)).all()
    # Drop/pad with every slot of token 1 dropped: +0.0, whatever the rows hold.
    grad = np.full((2, 2, 3), -5.0, dtype=np.float32)
    idx = np.array([0, 3, -1, -1], dtype=np.int32)
    got = worker.run(MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=idx, top_k=2, drop_pad_mode=1),
                     timeout_s=None)
    assert (got[0] == -10.0).all() and (got[1].view(np.uint32) == 0).all()
    worker.close()


def test_non_contiguous_read_only_and_big_endian_inputs(backend):
    worker = backend.open_worker(0)
    call = make_call("dropless", "float32", 4, tokens=5, hidden=6)
    expected = moegrad.moe_init_routing_v2_grad(call)
    wide = np.zeros((call.grad_expanded_x.shape[0], 12), dtype=">f4")
    wide[:, ::2] = call.grad_expanded_x
    strided = wide[:, ::2]
    strided.flags.writeable = False
    idx = np.repeat(call.expanded_row_idx, 2)[::2]
    idx.flags.writeable = False
    assert not strided.flags.c_contiguous and not idx.flags.c_contiguous
    got = worker.run(MoeInitRoutingV2GradCall(grad_expanded_x=strided, expanded_row_idx=idx, top_k=4), timeout_s=None)
    assert_bitwise(got, expected)
    assert got.flags.writeable and got.flags.c_contiguous and got.flags.owndata  # the caller's own array
    worker.close()


def test_duplicate_indices_are_summed_as_the_device_does(backend):
    worker = backend.open_worker(0)
    grad = np.arange(8, dtype=np.float32).reshape(4, 2)
    call = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=np.array([1, 1, 2, 2], np.int32), top_k=2,
                                    allow_duplicate_indices=True)
    assert (worker.run(call, timeout_s=None) == np.array([[4.0, 6.0], [8.0, 10.0]], np.float32)).all()
    worker.close()


# --- threads, caches, devices ------------------------------------------------------------------------


def test_workers_on_several_threads(backend, sim):
    before = sim.counts()
    workers = [WorkerThread(backend, i) for i in range(4)]
    calls = [make_call(MODES[i % 3], DTYPE_NAMES[i % 3], K_VALUES[i % len(K_VALUES)], seed=i) for i in range(24)]
    expected = [moegrad.moe_init_routing_v2_grad(call) for call in calls]

    def drive(w: int) -> list[np.ndarray]:
        return [workers[w].run(call, timeout_s=30.0) for call in calls[w::4]]

    with ThreadPoolExecutor(4) as clients:
        results = list(clients.map(drive, range(4)))
    for w in range(4):
        for got, want in zip(results[w], expected[w::4], strict=True):
            assert_bitwise(got, want)
    assert sim.counts()["streams"] == 4
    for worker in workers:
        worker.close()
    after = sim.counts()
    assert delta(before, after, "context_errors", "violations", "streams_created") == {
        "context_errors": 0, "violations": 0, "streams_created": 4}
    assert after["allocations"] == after["streams"] == after["tensors"] == after["executors"] == 0
    assert after["device_refs"] == 1  # only the backend's own (opened on this thread) remains


def test_buffers_and_workspace_are_cached_per_stream(backend, sim):
    worker = backend.open_worker(0)
    call = make_call("dropless", "float16", 8)
    before = sim.counts()
    for _ in range(10):
        worker.run(call, timeout_s=None)
    after = sim.counts()
    assert after["mallocs"] - before["mallocs"] == BUFFERS_PER_CALL
    assert after["allocations"] == BUFFERS_PER_CALL
    assert after["launches"] - before["launches"] == 10 and after["tensors"] == after["executors"] == 0
    worker.close()
    assert sim.counts()["allocations"] == 0


def test_health_from_threads_that_never_opened_a_worker(backend, sim):
    before = sim.counts()
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: backend.check_health(), range(6)))
    assert sim.counts()["context_errors"] == before["context_errors"]


def test_device_description_and_order(backend):
    assert backend.name == "ascend"
    # the simulator's aclrtGetSocName; the release its home's version.info records (conftest), read
    # through aclsysGetVersionStr since ASCEND_HOME_PATH is the operator's home
    assert backend.device == "Ascend910B3 #0, CANN 9.1.0 (aclsysGetVersionStr)"
    assert backend.order == "ascend910b@9.1"


def test_a_device_that_is_not_visible_is_a_clear_startup_error(sim, sim_home):
    with pytest.raises(CannUnavailable, match="NPU 3 is not visible.*ASCEND_RT_VISIBLE_DEVICES"):
        AscendBackend(device_id=3, ascend_home_path=sim_home)
    counts = sim.counts()
    assert counts["initialized"] == 0 and counts["device_refs"] == 0


# --- what the device rejects -------------------------------------------------------------------------


def test_a_dtype_without_an_acl_type_is_refused_before_the_device(backend, sim):
    worker = backend.open_worker(0)
    call = MoeInitRoutingV2GradCall.model_construct(grad_expanded_x=DOC_GRAD.astype(np.float64),
                                                    expanded_row_idx=DOC_IDX, top_k=2, drop_pad_mode=0, active_num=0,
                                                    order="ascend910b@9.1")
    before = sim.counts()["phase_one"]
    with pytest.raises(InvalidArgument) as caught:
        worker.run(call, timeout_s=None)
    assert caught.value.aclnn_status == 161002 and caught.value.field == "grad_expanded_x"
    assert sim.counts()["phase_one"] == before
    worker.close()


def test_the_sequential_order_is_not_what_the_device_computes(backend):
    worker = backend.open_worker(0)
    with pytest.raises(InvalidArgument) as caught:
        worker.run(doc_call(order="sequential"), timeout_s=None)
    assert caught.value.field == "order"
    worker.close()


# --- injected faults ---------------------------------------------------------------------------------


def test_launch_failure_then_recovery(backend, sim):
    worker = backend.open_worker(0)
    sim.inject("launch")
    with pytest.raises(DeviceFault) as caught:
        worker.run(doc_call(), timeout_s=None)
    assert caught.value.aclnn_status == 361001
    assert "injected kernel launch failure" in caught.value.device_message
    assert "injected kernel launch failure" in str(caught.value)
    assert sim.counts()["executors"] == 0  # phase two consumed it even though it failed
    assert worker.run(doc_call(), timeout_s=None)[1, 0] == np.float32(0.70000005)
    worker.close()


def test_malloc_failure_with_nothing_cached(backend, sim):
    worker = backend.open_worker(0)
    sim.inject("malloc", 2)  # expandedRowIdx's buffer
    with pytest.raises(DeviceFault) as caught:
        worker.run(doc_call(), timeout_s=None)
    assert caught.value.aclnn_status == 207001 and "injected out of device memory" in caught.value.device_message
    counts = sim.counts()
    assert counts["tensors"] == counts["executors"] == 0
    assert worker.run(doc_call(), timeout_s=None).shape == (2, 2)
    worker.close()


def test_workspace_malloc_failure_destroys_the_unlaunched_executor(backend, sim):
    worker = backend.open_worker(0)
    sim.inject("malloc", BUFFERS_PER_CALL)  # the workspace, requested after phase one
    before = sim.counts()
    with pytest.raises(DeviceFault):
        worker.run(doc_call(), timeout_s=None)
    after = sim.counts()
    assert after["phase_one"] - before["phase_one"] == 1 and after["launches"] == before["launches"]
    assert after["executors"] == 0 and after["tensors"] == 0 and after["violations"] == before["violations"]
    assert worker.run(doc_call(), timeout_s=None).shape == (2, 2)
    worker.close()


def test_malloc_failure_is_absorbed_by_dropping_the_cache(backend, sim):
    worker = backend.open_worker(0)
    worker.run(doc_call(), timeout_s=None)  # caches four buffers of the example's sizes
    call = make_call("dropless", "float32", 16)  # other sizes: four new mallocs
    sim.inject("malloc")
    assert_bitwise(worker.run(call, timeout_s=None), moegrad.moe_init_routing_v2_grad(call))
    assert sim.counts()["allocations"] == BUFFERS_PER_CALL  # the old ones were freed to make room
    worker.close()


def test_memcpy_failure_then_recovery(backend, sim):
    worker = backend.open_worker(0)
    sim.inject("memcpy")
    with pytest.raises(DeviceFault, match="injected memcpy failure"):
        worker.run(doc_call(), timeout_s=None)
    assert worker.run(doc_call(), timeout_s=None).shape == (2, 2)
    worker.close()


def test_sync_failure_replaces_the_stream(backend, sim):
    worker = backend.open_worker(0)
    before = sim.counts()
    sim.inject("sync")
    with pytest.raises(DeviceFault) as caught:
        worker.run(doc_call(), timeout_s=None)
    assert caught.value.aclnn_status == 507015 and "injected AI Core exception" in caught.value.device_message
    assert worker.run(doc_call(), timeout_s=None)[0, 0] == np.float32(0.3)
    after = sim.counts()
    assert after["streams"] == 1 and after["streams_created"] - before["streams_created"] == 1
    worker.close()


def test_health_failure(backend, sim):
    sim.inject("health")
    with pytest.raises(DeviceFault, match="injected driver failure"):
        backend.check_health()
    backend.check_health()


def test_hung_kernel_deadline_and_recovery_on_a_fresh_stream(backend, sim):
    worker = backend.open_worker(0)
    worker.run(doc_call(), timeout_s=None)
    sim.inject("hang", 1, -1)  # the next kernel hangs until released
    with pytest.raises(DeadlineExceeded, match="stream was replaced"):
        worker.run(doc_call(), timeout_s=0.05)
    hung = sim.counts()
    assert hung["pending"] == 1 and hung["streams"] == 2  # retired (still running) + its replacement
    # The worker keeps serving on the fresh stream while the hung kernel's buffers stay allocated.
    call = make_call("active", "bfloat16", 9)
    assert_bitwise(worker.run(call, timeout_s=5.0), moegrad.moe_init_routing_v2_grad(call))
    assert sim.counts()["pending"] == 1
    assert sim.release_hung() == 1
    worker.run(doc_call(), timeout_s=None)  # polls the retired stream: finished, so it is released
    done = sim.counts()
    assert done["pending"] == 0 and done["streams"] == 1 and done["violations"] == hung["violations"]
    worker.close()
    assert sim.counts()["allocations"] == 0


def test_a_kernel_still_hung_at_close_is_left_to_the_device_reset(sim, sim_home):
    backend = AscendBackend(ascend_home_path=sim_home, drain_timeout_s=0.02)
    worker = backend.open_worker(0)
    sim.inject("hang", 1, -1)
    with pytest.raises(DeadlineExceeded):
        worker.run(doc_call(), timeout_s=0.02)
    before = sim.counts()
    worker.close()
    backend.close()  # the retired stream never finishes: nothing it uses is freed by us
    after = sim.counts()
    # Its stream is destroyed by force (aclrtDestroyStreamForce does not wait; aclrtDestroyStream and
    # aclrtResetDevice would block on the hung kernel), and aclrtResetDevice releases its four buffers.
    assert delta(before, after, "forced", "reclaimed", "blocked") == {
        "forced": 1, "reclaimed": BUFFERS_PER_CALL, "blocked": 0}
    assert after["violations"] == before["violations"]
    assert after["allocations"] == after["streams"] == after["pending"] == after["initialized"] == 0


def test_too_many_hung_kernels_refuse_new_calls(backend, sim):
    worker = backend.open_worker(0)
    for _ in range(4):
        sim.inject("hang", 1, -1)
        with pytest.raises(DeadlineExceeded):
            worker.run(doc_call(), timeout_s=0.01)
    with pytest.raises(DeviceFault, match="4 kernels that missed their deadline"):
        worker.run(doc_call(), timeout_s=1.0)
    sim.release_hung()
    assert worker.run(doc_call(), timeout_s=1.0).shape == (2, 2)
    worker.close()


# --- the whole story ---------------------------------------------------------------------------------


def test_no_live_resources_after_traffic_faults_and_close(sim, sim_home):
    start = sim.counts()
    # No buffer caching: between calls a worker then holds exactly one device block, its workspace.
    backend = AscendBackend(ascend_home_path=sim_home, cache_bytes_per_stream=0)
    workers = [WorkerThread(backend, i) for i in range(3)]
    calls = [make_call(m, d, k, seed=s) for s, (m, d, k) in
             enumerate((m, d, k) for m in MODES for d in DTYPE_NAMES for k in (1, 3, 8, 17, 130))]
    with ThreadPoolExecutor(3) as clients:
        list(clients.map(lambda w: [workers[w].run(c, timeout_s=30.0) for c in calls[w::3]], range(3)))
    for kind, nth in (("launch", 1), ("memcpy", 2), ("sync", 1)):
        sim.inject(kind, nth)
        with pytest.raises(DeviceFault):
            workers[0].run(make_call("dropless", "float32", 5, seed=99), timeout_s=30.0)
    fresh = WorkerThread(backend, 3)  # nothing cached: a failed malloc cannot be absorbed
    sim.inject("malloc", 3)
    with pytest.raises(DeviceFault):
        fresh.run(doc_call())
    fresh.close()
    sim.inject("hang", 1, -1)
    with pytest.raises(DeadlineExceeded):
        workers[1].run(doc_call(), timeout_s=0.02)
    bad = MoeInitRoutingV2GradCall.model_construct(grad_expanded_x=DOC_GRAD, expanded_row_idx=DOC_IDX, top_k=3,
                                                   drop_pad_mode=0, active_num=0, order="ascend910b@9.1")
    with pytest.raises(InvalidArgument):
        workers[2].run(bad)
    sim.release_hung()
    for worker in workers:
        worker.run(doc_call())  # every worker still serves (and worker 1 releases its retired stream)
    live = sim.counts()
    assert live["tensors"] == live["executors"] == live["pending"] == 0
    assert live["streams"] == 3
    assert live["allocations"] == 3  # the three workspaces: nothing beyond the per-stream caches
    for worker in workers:
        worker.close()
    closed_workers = sim.counts()
    assert closed_workers["allocations"] == closed_workers["streams"] == 0
    backend.close()
    end = sim.counts()
    assert end["allocations"] == end["tensors"] == end["executors"] == end["streams"] == end["pending"] == 0
    assert end["device_refs"] == 0 and end["initialized"] == 0
    assert delta(start, end, "violations", "reclaimed", "context_errors") == {
        "violations": 0, "reclaimed": 0, "context_errors": 0}


def test_close_shuts_down_workers_left_open(sim, sim_home):
    start = sim.counts()
    backend = AscendBackend(ascend_home_path=sim_home)
    worker = WorkerThread(backend, 0)
    worker.run(doc_call())
    backend.close()  # the worker thread never closed its worker
    end = sim.counts()
    assert end["allocations"] == end["streams"] == end["device_refs"] == 0
    assert delta(start, end, "reclaimed", "violations") == {"reclaimed": 0, "violations": 0}
    worker.close()  # a late close is harmless
    with pytest.raises(DeviceFault, match="closed"):
        backend.check_health()


def test_the_backend_closing_waits_for_a_worker_closing_itself(sim, sim_home):
    """The pool gives its worker threads a bounded join, then closes the backend from another
    thread: a worker still closing itself then (waiting out a hung kernel's stream) must finish
    before the device is reset, or its last stream calls meet a thread with no context and its
    aclrtResetDevice one reference too many (what a loaded CI machine once showed)."""
    start = sim.counts()
    backend = AscendBackend(ascend_home_path=sim_home, drain_timeout_s=0.5)
    worker = WorkerThread(backend, 0)
    sim.inject("hang", 1, -1)
    with pytest.raises(DeadlineExceeded):
        worker.run(doc_call(), timeout_s=0.02)
    closing = threading.Thread(target=worker.close)
    closing.start()  # waits up to 0.5 s for the hung kernel's stream, on the worker's own thread
    time.sleep(0.2)
    backend.close()  # from this thread, while the worker is still closing
    closing.join(5)
    end = sim.counts()
    assert delta(start, end, "violations", "context_errors") == {"violations": 0, "context_errors": 0}
    assert end["allocations"] == end["streams"] == end["device_refs"] == end["initialized"] == 0
    sim.release_hung()


def test_the_simulator_catches_a_thread_that_never_set_the_device(backend, sim):
    # The binding sets the device on every thread it uses; this proves the simulator would notice if not.
    api = backend._api
    outcome = {}

    def bare_thread() -> None:
        import ctypes

        pointer = ctypes.c_void_p()
        outcome["has_context"] = sim.has_context()
        outcome["malloc"] = api.aclrtMalloc(ctypes.byref(pointer), 64, 0)
        outcome["message"] = api.recent_error()
        stream = ctypes.c_void_p()
        outcome["stream"] = api.aclrtCreateStream(ctypes.byref(stream))

    before = sim.counts()["context_errors"]
    thread = threading.Thread(target=bare_thread)
    thread.start()
    thread.join()
    assert outcome["has_context"] is False
    assert outcome["malloc"] == 107002 and outcome["stream"] == 107002  # ACL_ERROR_RT_CONTEXT_NULL
    assert "no current context" in outcome["message"]
    assert sim.counts()["context_errors"] == before + 2
    assert sim.has_context()  # this thread made the backend, so it did set the device


# --- what CANN's public runtime and operator sources call for --------------------------------------


def test_a_hung_kernel_past_its_deadline_frees_nothing_it_uses_until_it_ends(backend, sim):
    worker = backend.open_worker(0)
    worker.run(doc_call(), timeout_s=None)
    start = sim.counts()
    sim.inject("hang", 1, -1)
    with pytest.raises(DeadlineExceeded, match="stream was replaced"):
        worker.run(doc_call(), timeout_s=0.05)
    hung = sim.counts()
    assert hung["pending"] == 1 and hung["streams"] == 2  # retired, still running, beside its replacement
    # The worker serves on the replacement stream; every call first polls the retired one (a query,
    # never a 0 ms sync), which stays busy, so none of the four buffers the kernel uses is freed.
    for _ in range(3):
        call = make_call("dropless", "float16", 5)
        assert_bitwise(worker.run(call, timeout_s=5.0), moegrad.moe_init_routing_v2_grad(call))
    busy = sim.counts()
    assert busy["queries"] - hung["queries"] >= 3 and busy["pending"] == 1
    assert busy["allocations"] >= BUFFERS_PER_CALL * 2  # the hung call's four, and the cached ones
    assert sim.release_hung() == 1
    worker.run(doc_call(), timeout_s=None)  # the poll now sees it idle: its stream and buffers are released
    done = sim.counts()
    assert done["pending"] == 0 and done["streams"] == 1
    worker.close()
    end = sim.counts()
    assert end["allocations"] == end["tensors"] == end["executors"] == end["streams"] == 0
    assert delta(start, end, "violations", "blocked", "forced", "context_errors") == {
        "violations": 0, "blocked": 0, "forced": 0, "context_errors": 0}


def test_a_sub_millisecond_budget_waits_1_ms_and_is_never_a_refused_sync(backend, sim):
    # 0.5 ms left when the sync is made. The runtime accepts -1 or a timeout > 0 ms only: a
    # conversion that truncated 0.5 ms to a 0 ms wait would be refused (107000) and the call would
    # fail as a DeviceFault (500) although its kernel had finished; a hung kernel would be a 500
    # instead of a 504.
    worker = backend.open_worker(0)
    got = worker.run(doc_call(), timeout_s=0.0005)
    assert (got.view(np.uint32) == np.array([[0.3, 0.3], [0.70000005, 0.70000005]], np.float32).view(np.uint32)).all()
    sim.inject("hang", 1, -1)
    with pytest.raises(DeadlineExceeded):  # a 504, not a DeviceFault
        worker.run(doc_call(), timeout_s=0.0005)
    sim.release_hung()
    worker.close()


@pytest.mark.parametrize(("fault", "status", "hint"), [
    ("kernel", 561003, "install the operator package"),
])
def test_an_installation_fault_in_phase_one_is_a_device_fault(backend, sim, fault, status, hint):
    worker = backend.open_worker(0)
    sim.inject(fault)
    with pytest.raises(DeviceFault) as caught:
        worker.run(doc_call(), timeout_s=None)
    assert not isinstance(caught.value, InvalidArgument)
    assert caught.value.aclnn_status == status and hint in caught.value.message
    assert "[moegrad-sim]" in caught.value.device_message
    assert sim.counts()["tensors"] == sim.counts()["executors"] == 0
    assert worker.run(doc_call(), timeout_s=None).shape == (2, 2)
    worker.close()


def test_phase_one_without_ascend_opp_path_is_a_device_fault(backend, sim, monkeypatch):
    worker = backend.open_worker(0)
    monkeypatch.delenv("ASCEND_OPP_PATH")  # opbase finds the kernels through it
    with pytest.raises(DeviceFault) as caught:
        worker.run(doc_call(), timeout_s=None)
    assert caught.value.aclnn_status == 561107 and "set_env.sh" in caught.value.message
    worker.close()


def test_startup_needs_ascend_opp_path(sim, sim_home, monkeypatch):
    monkeypatch.delenv("ASCEND_OPP_PATH")
    with pytest.raises(CannUnavailable, match=r"ASCEND_OPP_PATH is not set.*export ASCEND_OPP_PATH=.*set_env\.sh"):
        AscendBackend(ascend_home_path=sim_home)
    monkeypatch.setenv("ASCEND_OPP_PATH", str(sim_home / "no-such-dir"))
    with pytest.raises(CannUnavailable, match="is not a directory"):
        AscendBackend(ascend_home_path=sim_home)
    counts = sim.counts()
    assert counts["initialized"] == counts["device_refs"] == 0


def test_startup_runs_phase_one_of_the_documentation_example(sim, sim_home):
    before = sim.counts()
    backend = AscendBackend(ascend_home_path=sim_home)
    after = sim.counts()
    assert after["phase_one"] - before["phase_one"] == 1 and after["launches"] == before["launches"]
    assert after["tensors"] == after["executors"] == after["allocations"] == 0  # nothing kept
    backend.close()
    sim.inject("kernel")  # a host whose kernel package is missing never starts
    with pytest.raises(CannUnavailable, match=r"561003.*cannot run|cannot run.*561003"):
        AscendBackend(ascend_home_path=sim_home)
    end = sim.counts()
    assert end["allocations"] == end["tensors"] == end["executors"] == end["device_refs"] == end["initialized"] == 0
    assert end["violations"] == before["violations"]


def test_the_workspace_is_the_16_mib_the_tiling_reserves(backend, sim):
    worker = backend.open_worker(0)
    worker.run(doc_call(), timeout_s=None)
    # Three 32-byte-aligned buffers of 32, 16 and 16 bytes, and the workspace.
    assert sim.counts()["allocated_bytes"] == 32 + 32 + 32 + (16 << 20)
    worker.close()
