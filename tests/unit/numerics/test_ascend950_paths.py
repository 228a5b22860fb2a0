"""Both paths of the Ascend 950 order, the compiled one (numba) and the NumPy one, bit for bit.

Expected values come from the slow per-row loop of tests/support/slow_loops.py (written from
docs/semantics.md section 7.2); NaN is compared by position (see tests/unit/numerics/test_reference_paths.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from moegrad import moe_init_routing_v2_grad
from moegrad.numerics import _fast, _reference

pytest.importorskip("numba", reason="the compiled path needs the 'fast' extra")

from moegrad.numerics import _fast_jit  # noqa: E402  (imports numba)
from support.bits import assert_bitwise_equal
from support.inputs import BF16, F32, GRAD_DTYPES, KS, MODES, random_call, wide_values
from support.kernel_paths import record_stream_flags, streamed_into_offset_buffer
from support.slow_loops import REVISIONS, expected_chunk, slow950


@pytest.fixture(params=["numba", "numpy"])
def path(request, monkeypatch):
    """Runs a test once per path, through the module switch the public function reads."""
    monkeypatch.setattr(_reference, "_KERNEL", request.param)
    return request.param


@pytest.fixture
def compiled_calls(monkeypatch):
    """Counts the 950 kernel's calls (it still runs)."""
    calls = []
    kernel = _fast_jit.run_rows_950

    def counting(*args):
        calls.append(args[-2:])
        return kernel(*args)

    monkeypatch.setattr(_fast_jit, "run_rows_950", counting)
    return calls


@pytest.mark.parametrize("ub", [253952, 600], ids=lambda ub: f"ub{ub}")
@pytest.mark.parametrize("order", sorted(REVISIONS))
@pytest.mark.parametrize("top_k", KS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mode", MODES)
def test_path_matches_slow_loop(path, mode, dtype, top_k, order, ub):
    rng = np.random.default_rng([MODES.index(mode), GRAD_DTYPES.index(dtype), top_k, int(REVISIONS[order]), ub, 17])
    tokens = 3 if top_k >= 127 else 5
    # H = 67: the compiled loops run both their vector body and their scalar tail
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, dtype, tokens, hidden=67)
    out = moe_init_routing_v2_grad(grad, idx, top_k, drop_pad_mode, active_num, order=order, ub_size_bytes=ub)
    chunk = expected_chunk(dtype, top_k, 67, ub)
    assert_bitwise_equal(out, slow950(grad, idx, top_k, drop_pad_mode, active_num, chunk=chunk,
                                      grouped=REVISIONS[order]))


@pytest.mark.parametrize("order", sorted(REVISIONS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_numba_and_numpy_paths_agree(mode, dtype, order, monkeypatch):
    rng = np.random.default_rng([MODES.index(mode), GRAD_DTYPES.index(dtype), 33])
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, 33, dtype, tokens=40, hidden=130)
    results = {}
    for kernel in ("numba", "numpy"):
        monkeypatch.setattr(_reference, "_KERNEL", kernel)
        results[kernel] = moe_init_routing_v2_grad(grad, idx, 33, drop_pad_mode, active_num, order=order,
                                                   ub_size_bytes=4096)
    assert_bitwise_equal(results["numba"], results["numpy"])


def test_numba_path_runs_the_compiled_kernel(compiled_calls, monkeypatch):
    monkeypatch.setattr(_reference, "_KERNEL", "numba")
    rng = np.random.default_rng(5)
    grad, idx, drop_pad_mode, active_num = random_call(rng, "drop_pad", 9, F32, tokens=3, hidden=8)
    out = moe_init_routing_v2_grad(grad, idx, 9, drop_pad_mode, active_num, order="ascend950")
    assert compiled_calls == [(0, 3)]
    assert_bitwise_equal(out, slow950(grad, idx, 9, drop_pad_mode, active_num))


def test_numpy_path_never_runs_the_compiled_kernel(compiled_calls, monkeypatch):
    monkeypatch.setattr(_reference, "_KERNEL", "numpy")
    rng = np.random.default_rng(6)
    grad, idx, _, _ = random_call(rng, "dropless", 9, F32, tokens=3, hidden=8)
    moe_init_routing_v2_grad(grad, idx, 9, order="ascend950")
    assert compiled_calls == []


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_compiled_path_over_several_tiles_of_h(monkeypatch, dtype):
    monkeypatch.setattr(_reference, "_KERNEL", "numba")
    monkeypatch.setattr(_fast, "_TILE_950", 64)
    rng = np.random.default_rng(8)
    grad, idx, drop_pad_mode, active_num = random_call(rng, "active", 17, dtype, tokens=3, hidden=200)
    out = moe_init_routing_v2_grad(grad, idx, 17, drop_pad_mode, active_num, order="ascend950", ub_size_bytes=600)
    assert_bitwise_equal(out, slow950(grad, idx, 17, drop_pad_mode, active_num, chunk=expected_chunk(dtype, 17, 200, 600)))


@pytest.mark.parametrize("offset", [0, 1, 13], ids=lambda o: f"offset{o}")
@pytest.mark.parametrize("hidden", [1, 33, 67])
@pytest.mark.parametrize("top_k", [2, 9])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_streamed_grad_x_is_the_slow_loops_and_stays_in_its_rows(monkeypatch, compiled_stream_flags, dtype, top_k,
                                                                  hidden, offset):
    # as in tests/unit/numerics/test_reference_paths.py: every grad_x streamed; tiles of 64 elements (H = 67: two)
    monkeypatch.setattr(_reference, "_KERNEL", "numba")
    monkeypatch.setattr(_fast, "_STREAM_BYTES", 0)
    monkeypatch.setattr(_fast, "_TILE_950", 64)
    rng = np.random.default_rng([top_k, hidden, offset, GRAD_DTYPES.index(dtype), 950])
    grad, idx, drop_pad_mode, active_num = random_call(rng, "active", top_k, dtype, tokens=5, hidden=hidden)
    kwargs = dict(grad_expanded_x=grad, expanded_row_idx=idx, top_k=top_k, drop_pad_mode=drop_pad_mode,
                  active_num=active_num, order="ascend950")
    out, outside = streamed_into_offset_buffer(kwargs, 5, hidden, dtype, offset)
    assert compiled_stream_flags and all(compiled_stream_flags)
    assert_bitwise_equal(out, slow950(grad, idx, top_k, drop_pad_mode, active_num,
                                      chunk=expected_chunk(dtype, top_k, hidden, 253952)))
    assert np.all(outside == 0x5A5A5A5A & np.iinfo(outside.dtype).max)


@pytest.fixture
def compiled_stream_flags(monkeypatch):
    """The ``stream`` argument of each 950 kernel call (the kernel still runs)."""
    return record_stream_flags(monkeypatch, "run_rows_950")


def test_compiled_path_over_many_chunks_on_the_pool(monkeypatch, compiled_calls):
    monkeypatch.setattr(_reference, "_KERNEL", "numba")
    monkeypatch.setattr(_fast, "_CHUNK_INPUT_BYTES", 256)
    monkeypatch.setenv("MOEGRAD_REFERENCE_THREADS", "2")
    rng = np.random.default_rng(9)
    grad = wide_values(rng, (64 * 6, 8), F32, 6)
    idx = rng.permutation(64 * 6).astype(np.int32)
    out = moe_init_routing_v2_grad(grad, idx, 6, order="ascend950")
    assert len(compiled_calls) > 1 and sorted(compiled_calls)[0][0] == 0
    assert_bitwise_equal(out, slow950(grad, idx, 6))


def test_byte_swapped_inputs_fall_back_to_numpy(compiled_calls, monkeypatch):
    monkeypatch.setattr(_reference, "_KERNEL", "numba")
    rng = np.random.default_rng(10)
    grad = wide_values(rng, (30, 14), F32, 6)
    idx = rng.permutation(30).astype(np.int32)
    sample = grad[:, :7].astype(">f4")
    out = moe_init_routing_v2_grad(sample, idx, 6, order="ascend950")
    assert_bitwise_equal(out, slow950(np.ascontiguousarray(sample, dtype=np.float32), idx, 6))
    assert compiled_calls == []


def test_strided_inputs_take_the_compiled_path_on_their_gathered_rows(compiled_calls, monkeypatch):
    monkeypatch.setattr(_reference, "_KERNEL", "numba")
    rng = np.random.default_rng(10)
    grad = wide_values(rng, (30, 14), F32, 6)
    idx = rng.permutation(30).astype(np.int32)
    sample = grad[:, ::2]
    out = moe_init_routing_v2_grad(sample, idx, 6, order="ascend950")
    assert_bitwise_equal(out, slow950(np.ascontiguousarray(sample), idx, 6))
    assert compiled_calls


def test_warm_up_compiles_the_950_kernel_too():
    assert _fast.warm_up()
    assert len(_fast_jit.run_rows_950.signatures) >= 3


def test_without_numba_auto_uses_numpy(without_numba):
    rng = np.random.default_rng(12)
    grad, idx, drop_pad_mode, active_num = random_call(rng, "drop_pad", 17, BF16, tokens=5, hidden=33)
    assert not _fast.available()
    out = moe_init_routing_v2_grad(grad, idx, 17, drop_pad_mode, active_num, order="ascend950", ub_size_bytes=600)
    assert_bitwise_equal(out, slow950(grad, idx, 17, drop_pad_mode, active_num,
                                      chunk=expected_chunk(BF16, 17, 33, 600)))


def test_without_numba_forcing_it_is_an_error(without_numba, monkeypatch):
    monkeypatch.setattr(_reference, "_KERNEL", "numba")
    with pytest.raises(RuntimeError, match="moegrad\\[fast\\]"):
        moe_init_routing_v2_grad(np.ones((4, 3), np.float32), np.arange(4, dtype=np.int32), 2, order="ascend950")
