"""Both paths of the reference numerics, the compiled one (numba) and the NumPy one, bit for bit.

Every expected value comes from an independent computation: the slow per-row loop and the IEEE
rounding of tests/support/slow_loops.py (written from docs/semantics.md section 3), NumPy's and ml_dtypes'
own casts for the compiled conversions, and hand-worked roundings.

NaN: results are compared NaN position for NaN position, and bit for bit everywhere else. Which
payload and sign a NaN + NaN keeps is not part of the contract: NumPy's own float32 add keeps the
first operand's in its vector loop and the second's in its scalar tail (so the NumPy path already
depends on where an element falls), the compiled path lets LLVM order the two operands, and the
device is not known to follow x86 either.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from moegrad import MoeInitRoutingV2GradCall, accumulation_schedule, moe_init_routing_v2_grad
from moegrad.numerics import _fast, _reference

pytest.importorskip("numba", reason="the compiled path needs the 'fast' extra")

from moegrad.numerics import _fast_jit  # noqa: E402  (imports numba)
from support.bits import assert_bitwise_equal
from support.inputs import BF16, F16, F32, GRAD_DTYPES, KS, MODES, ORDERS, random_call
from support.kernel_paths import record_stream_flags, streamed_into_offset_buffer
from support.slow_loops import expected_chunk, slow_grad_x, slow_profile

PATHS = ["numba", "numpy"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Runs a test once per path, through the module switch the public function reads."""
    monkeypatch.setattr(_reference, "_KERNEL", request.param)
    return request.param


@pytest.fixture
def compiled_calls(monkeypatch):
    """Counts the compiled kernel's calls (it still runs)."""
    calls = []
    kernel = _fast_jit.run_rows

    def counting(*args):
        calls.append(args[-2:])
        return kernel(*args)

    monkeypatch.setattr(_fast_jit, "run_rows", counting)
    return calls


def run(grad, idx, top_k, drop_pad_mode=0, active_num=0, *, kernel, order="ascend910b"):
    """moe_init_routing_v2_grad through the internal entry that takes the path as a keyword."""
    call = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=idx, top_k=top_k,
                                    drop_pad_mode=drop_pad_mode, active_num=active_num, order=order)
    out = np.empty((call.num_tokens, call.hidden_size), dtype=grad.dtype.newbyteorder("="))
    return _reference.accumulate(call, accumulation_schedule(top_k, order), out, kernel=kernel)


# --------------------------------------------------------------------------------------------------
# The compiled conversions against NumPy's and ml_dtypes' casts.
# --------------------------------------------------------------------------------------------------

def all_words() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def float32_patterns() -> np.ndarray:
    """Every upper half of a float32, each with lower halves at and around the rounding boundaries.

    float16 drops 13 bits of a float32 and bfloat16 16: the lower halves sit below, at and above the
    half-ulp of both, and include all-zeros and all-ones (the smallest and largest NaN payloads).
    """
    low = np.array([0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FFF, 0x8000,
                    0x8001, 0x9000, 0xC000, 0xE000, 0xEFFF, 0xF000, 0xF001, 0xFFFF], dtype=np.uint32)
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    return (high[:, None] | low[None, :]).reshape(-1).view(np.float32)


def test_widen_float16_portable_is_numpys_cast_for_every_word():
    words = all_words()
    out = np.empty(words.size, dtype=np.float32)
    _fast_jit.widen_f16_portable(words.view(np.int16), out)
    np.testing.assert_array_equal(out.view(np.uint32), words.view(np.float16).astype(np.float32).view(np.uint32))


def test_widen_float16_is_numpys_cast_for_every_word_but_quiets_signalling_nans():
    words = all_words()
    out = np.empty(words.size, dtype=np.float32)
    _fast_jit.widen_f16(words.view(np.int16), out)
    expected = words.view(np.float16).astype(np.float32).view(np.uint32)
    signalling = ((words & 0x7C00) == 0x7C00) & ((words & 0x3FF) != 0) & ((words & 0x200) == 0)
    assert int(signalling.sum()) == 2 * 511
    if _fast_jit.HARDWARE_HALF:  # the CPU's conversion sets the quiet bit; sign and payload stay
        expected = np.where(signalling, expected | np.uint32(0x00400000), expected)
    np.testing.assert_array_equal(out.view(np.uint32), expected)


def test_widen_bfloat16_is_ml_dtypes_cast_for_every_word():
    words = all_words()
    out = np.empty(words.size, dtype=np.float32)
    _fast_jit.widen_bf16(words, out)
    np.testing.assert_array_equal(out.view(np.uint32), words.view(BF16).astype(np.float32).view(np.uint32))


def test_narrow_float16_portable_is_numpys_cast():
    values = float32_patterns()
    out = np.empty(values.size, dtype=np.int16)
    _fast_jit.narrow_f16_portable(values, out)
    with np.errstate(all="ignore"):
        expected = values.astype(np.float16)
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))  # NaN bits too


def test_narrow_float16_is_numpys_cast_but_for_nan_payloads():
    values = float32_patterns()
    out = np.empty(values.size, dtype=np.int16)
    _fast_jit.narrow_f16(values, out)
    with np.errstate(all="ignore"):
        expected = values.astype(np.float16).view(np.uint16)
    bits = values.view(np.uint32)
    nan = np.isnan(values)
    if _fast_jit.HARDWARE_HALF:  # the CPU's conversion: sign, quiet bit, the top 9 payload bits
        hardware = ((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x1FF)
        expected = np.where(nan, hardware.astype(np.uint16), expected)
    np.testing.assert_array_equal(out.view(np.uint16), expected)


def test_narrow_bfloat16_is_ml_dtypes_cast():
    values = float32_patterns()
    out = np.empty(values.size, dtype=np.uint16)
    _fast_jit.narrow_bf16(values, out)
    with np.errstate(all="ignore"):
        expected = values.astype(BF16)
    np.testing.assert_array_equal(out, expected.view(np.uint16))  # NaN bits too


@pytest.mark.parametrize(("value", "dtype", "expected"), [
    (1 + 2.0**-11, F16, 0x3C00),  # a tie: to the even 1.0
    (1 + 3 * 2.0**-11, F16, 0x3C02),  # a tie: to the even 1 + 2**-9
    (65519.0, F16, 0x7BFF),
    (65520.0, F16, 0x7C00),  # the tie above 65504 (odd mantissa) goes to inf
    (2.0**-25, F16, 0x0000),  # the tie between +0 and the smallest subnormal
    (3 * 2.0**-26, F16, 0x0001),
    (-(2.0**-24), F16, 0x8001),
    (2.0**-14 - 2.0**-25, F16, 0x0400),  # the largest subnormal's upper tie: the smallest normal
    (-0.0, F16, 0x8000),
    (1 + 2.0**-8, BF16, 0x3F80),
    (1 + 3 * 2.0**-8, BF16, 0x3F82),
    (3.4028234663852886e38, BF16, 0x7F80),  # float32's max is past bfloat16's largest tie
    (-(2.0**-140), BF16, 0x8000),  # far below half of bfloat16's smallest subnormal (2**-133)
])
def test_narrow_known_values(value, dtype, expected):
    values = np.array([value], dtype=np.float32)
    out = np.empty(1, dtype=np.int16 if dtype == F16 else np.uint16)
    (_fast_jit.narrow_f16 if dtype == F16 else _fast_jit.narrow_bf16)(values, out)
    assert int(out.view(np.uint16)[0]) == expected


# --------------------------------------------------------------------------------------------------
# Both paths against the slow loop: modes x dtypes x K x orders, with NaN, inf, +-0 and a wide range.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("top_k", KS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mode", MODES)
def test_path_matches_slow_loop(path, mode, dtype, top_k, order):
    rng = np.random.default_rng([MODES.index(mode), GRAD_DTYPES.index(dtype), top_k, ORDERS.index(order), 17])
    tokens = 3 if top_k >= 127 else 5
    # H = 67: the compiled loops run both their vector body and their scalar tail
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, dtype, tokens, hidden=67)
    out = moe_init_routing_v2_grad(grad, idx, top_k, drop_pad_mode, active_num, order=order)
    assert_bitwise_equal(out, slow_grad_x(grad, idx, top_k, drop_pad_mode, active_num, order))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_numba_path_runs_the_compiled_kernel(compiled_calls, mode, dtype):
    rng = np.random.default_rng(5)
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, 4, dtype, tokens=3, hidden=8)
    out = run(grad, idx, 4, drop_pad_mode, active_num, kernel="numba")
    assert compiled_calls == [(0, 3)]
    assert_bitwise_equal(out, slow_grad_x(grad, idx, 4, drop_pad_mode, active_num))


def test_numpy_path_never_runs_the_compiled_kernel(compiled_calls):
    rng = np.random.default_rng(6)
    grad, idx, drop_pad_mode, active_num = random_call(rng, "dropless", 4, F32, tokens=3, hidden=8)
    run(grad, idx, 4, kernel="numpy")
    assert compiled_calls == []


@pytest.mark.parametrize("top_k", [3, 8, 130])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_compiled_path_over_several_tiles_of_h(monkeypatch, dtype, top_k):
    # 256 bytes of bins: tiles of 64 elements, so H = 150 is two full tiles and a tail of 22
    monkeypatch.setattr(_fast, "_BIN_BYTES", 256)
    rng = np.random.default_rng([top_k, GRAD_DTYPES.index(dtype)])
    grad, idx, drop_pad_mode, active_num = random_call(rng, "drop_pad", top_k, dtype, tokens=4, hidden=150)
    out = run(grad, idx, top_k, drop_pad_mode, active_num, kernel="numba")
    assert_bitwise_equal(out, slow_grad_x(grad, idx, top_k, drop_pad_mode, active_num))


@pytest.fixture
def stream_flags(monkeypatch):
    """The ``stream`` argument of each compiled kernel call (the kernel still runs)."""
    return record_stream_flags(monkeypatch, "run_rows")


@pytest.mark.parametrize("offset", [0, 1, 13], ids=lambda o: f"offset{o}")
@pytest.mark.parametrize("hidden", [1, 33, 150])
@pytest.mark.parametrize("top_k", [2, 3, 8, 130])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_streamed_grad_x_is_the_slow_loops_and_stays_in_its_rows(monkeypatch, stream_flags, dtype, top_k, hidden,
                                                                  offset):
    # grad_x past the caches (non-temporal stores of whole 64-byte lines, ordinary ones at either
    # end of a row) for every size here; 256 bytes of bins make H = 150 several tiles
    monkeypatch.setattr(_fast, "_STREAM_BYTES", 0)
    monkeypatch.setattr(_fast, "_BIN_BYTES", 256)
    rng = np.random.default_rng([top_k, hidden, offset, GRAD_DTYPES.index(dtype)])
    tokens = 3 if top_k >= 127 else 9
    grad, idx, drop_pad_mode, active_num = random_call(rng, "drop_pad", top_k, dtype, tokens, hidden)
    kwargs = dict(grad_expanded_x=grad, expanded_row_idx=idx, top_k=top_k, drop_pad_mode=drop_pad_mode,
                  active_num=active_num)
    out, outside = streamed_into_offset_buffer(kwargs, tokens, hidden, dtype, offset)
    assert stream_flags and all(stream_flags)
    assert_bitwise_equal(out, slow_grad_x(grad, idx, top_k, drop_pad_mode, active_num))
    assert np.all(outside == 0x5A5A5A5A & np.iinfo(outside.dtype).max)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_a_grad_x_at_an_odd_byte_offset_takes_ordinary_stores(monkeypatch, stream_flags, dtype):
    # its elements start no 64-byte line: a line store there would fault (the process would die)
    monkeypatch.setattr(_fast, "_STREAM_BYTES", 0)
    rng = np.random.default_rng([GRAD_DTYPES.index(dtype), 61])
    grad, idx, drop_pad_mode, active_num = random_call(rng, "dropless", 2, dtype, tokens=40, hidden=100)
    buffer = np.zeros(40 * 100 * dtype.itemsize + 1, dtype=np.uint8)
    out = buffer[1:].view(dtype).reshape(40, 100)
    assert not out.flags.aligned
    moe_init_routing_v2_grad(grad, idx, 2, drop_pad_mode, active_num, out=out)
    assert stream_flags and not any(stream_flags)
    assert_bitwise_equal(out, slow_grad_x(grad, idx, 2, drop_pad_mode, active_num))


def test_a_grad_x_of_16_mib_is_streamed_and_a_smaller_one_is_not(stream_flags):
    rng = np.random.default_rng(12)
    for tokens, expected in ((1023, False), (1024, True)):  # H = 4096 float32: 16 KiB a row
        grad = rng.standard_normal((tokens, 4096), dtype=np.float32)
        idx = rng.permutation(tokens).astype(np.int32)
        stream_flags.clear()
        out = moe_init_routing_v2_grad(grad, idx, 1)
        assert stream_flags and all(flag is expected for flag in stream_flags)
        assert_bitwise_equal(out, grad[idx])  # K = 1: each token's row is its one slot's row


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_compiled_path_over_many_chunks_on_the_pool(monkeypatch, compiled_calls, dtype):
    # 1 KiB of input per chunk: 4 tokens of 256 bytes each, 75 chunks spread over the shared pool
    monkeypatch.setattr(_fast, "_CHUNK_INPUT_BYTES", 1024)
    rng = np.random.default_rng(8)
    grad, idx, drop_pad_mode, active_num = random_call(rng, "active", 2, dtype, tokens=300, hidden=128 // dtype.itemsize)
    out = run(grad, idx, 2, drop_pad_mode, active_num, kernel="numba")
    assert sorted(compiled_calls) == [(s, s + 4) for s in range(0, 300, 4)]
    assert_bitwise_equal(out, slow_grad_x(grad, idx, 2, drop_pad_mode, active_num))


def test_concurrent_calls_share_the_pool_and_stay_exact(monkeypatch):
    # two service streams at once: each call's chunks go to the same pool; both results stay exact
    monkeypatch.setattr(_fast, "_CHUNK_INPUT_BYTES", 4096)
    rng = np.random.default_rng(9)
    calls = [random_call(rng, mode, 8, BF16, tokens=64, hidden=40) for mode in ("dropless", "drop_pad")]
    results: dict[int, np.ndarray] = {}
    start = threading.Barrier(2)

    def stream(i: int) -> None:
        start.wait()
        grad, idx, drop_pad_mode, active_num = calls[i]
        results[i] = run(grad, idx, 8, drop_pad_mode, active_num, kernel="numba")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, (grad, idx, drop_pad_mode, active_num) in enumerate(calls):
        assert_bitwise_equal(results[i], slow_grad_x(grad, idx, 8, drop_pad_mode, active_num))


def test_duplicate_indices_on_the_compiled_path():
    grad = np.array([[1.0, -0.0], [2.0**-24, 3.0]], dtype=np.float32)
    idx = np.array([0, 0, 1, 0, 1, 1], dtype=np.int32)  # K = 3: (v0 + v2) + v1; 1 + 2**-24 is a tie -> 1
    call = MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=idx, top_k=3, active_num=2,
                                    allow_duplicate_indices=True)
    out = np.empty((2, 2), dtype=np.float32)
    _reference.accumulate(call, accumulation_schedule(3), out, kernel="numba")
    expected = np.array([[2.0, 3.0], [1.0, 6.0]], dtype=np.float32)
    assert_bitwise_equal(out, expected)


def test_byte_swapped_inputs_fall_back_to_numpy(compiled_calls):
    rng = np.random.default_rng(10)
    grad, idx, _, _ = random_call(rng, "dropless", 6, F32, tokens=5, hidden=14)
    swapped = grad.astype(grad.dtype.newbyteorder(">"))
    out = run(swapped, idx, 6, kernel="numba")
    assert_bitwise_equal(out, slow_grad_x(swapped, idx, 6))
    assert compiled_calls == []


@pytest.mark.parametrize("mode", MODES)
def test_strided_inputs_take_the_compiled_path_on_their_gathered_rows(compiled_calls, mode):
    rng = np.random.default_rng(10)
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, 6, F32, tokens=5, hidden=14)
    strided = grad[..., ::2]
    out = run(strided, idx, 6, drop_pad_mode, active_num, kernel="numba")
    assert_bitwise_equal(out, slow_grad_x(strided, idx, 6, drop_pad_mode, active_num))
    assert compiled_calls


# --------------------------------------------------------------------------------------------------
# Without numba, and the switches.
# --------------------------------------------------------------------------------------------------

def test_byte_swapped_or_strided_index_still_takes_the_compiled_path(compiled_calls):
    rng = np.random.default_rng(11)
    grad, idx, drop_pad_mode, active_num = random_call(rng, "drop_pad", 4, BF16, tokens=5, hidden=20)
    expected = slow_grad_x(grad, idx, 4, drop_pad_mode, active_num)
    swapped = idx.astype(idx.dtype.newbyteorder(">"))
    strided = np.repeat(idx, 2)[::2]
    for sample in (swapped, strided):
        out = run(grad, sample, 4, drop_pad_mode, active_num, kernel="numba")
        assert_bitwise_equal(out, expected)
    assert len(compiled_calls) == 2


def test_without_numba_auto_uses_numpy(without_numba):
    rng = np.random.default_rng(12)
    grad, idx, drop_pad_mode, active_num = random_call(rng, "drop_pad", 8, BF16, tokens=5, hidden=33)
    assert not _fast.available()
    out = moe_init_routing_v2_grad(grad, idx, 8, drop_pad_mode, active_num)
    assert_bitwise_equal(out, slow_grad_x(grad, idx, 8, drop_pad_mode, active_num))


def test_without_numba_forcing_it_is_an_error(without_numba):
    grad = np.ones((4, 3), dtype=np.float32)
    idx = np.arange(4, dtype=np.int32)
    with pytest.raises(RuntimeError, match="moegrad\\[fast\\]"):
        run(grad, idx, 2, kernel="numba")


def test_warm_up_compiles_every_dtype():
    assert _fast.warm_up()
    assert len(_fast_jit.run_rows.signatures) >= 3  # float32, int16 (float16 bits), uint16 (bfloat16 bits)


def test_warm_up_without_numba_says_so(without_numba):
    assert not _fast.warm_up()


def test_kernel_compiles_without_a_writable_cache(monkeypatch):
    # numba raises "cannot cache function ..." at decoration when it finds no writable cache folder
    njit = _fast_jit.njit

    def refuse(**options):
        if options.get("cache"):
            def decorate(function):
                raise RuntimeError(f"cannot cache function {function.__name__!r}: no locator available")
            return decorate
        return njit(**options)

    monkeypatch.setattr(_fast_jit, "njit", refuse)
    kernel = _fast_jit._compiled(lambda words: words.sum())
    assert type(kernel._cache).__name__ == "NullCache"  # compiled in this process, not cached
    assert kernel(np.arange(4, dtype=np.int64)) == 6


def test_unknown_kernel_is_an_error():
    with pytest.raises(ValueError, match="kernel='cuda'"):
        run(np.ones((2, 3), dtype=np.float32), np.arange(2, dtype=np.int32), 2, kernel="cuda")
    with pytest.raises(ValueError, match="kernel='cuda'"):  # the public keyword, even on an empty call
        moe_init_routing_v2_grad(np.ones((0, 3), dtype=np.float32), np.arange(0, dtype=np.int32), 2, kernel="cuda")


@pytest.mark.parametrize("order", ["ascend910b@9.1", "ascend950@8.5", "ascend950@9.1"])
@pytest.mark.parametrize("kernel", ["numpy", "numba"])
def test_the_public_kernel_keyword_picks_the_path_with_the_slow_loop_s_bits(compiled_calls, kernel, order):
    rng = np.random.default_rng(9)
    grad, idx, _, _ = random_call(rng, "dropless", 12, F32, tokens=4, hidden=40)
    out = moe_init_routing_v2_grad(grad, idx, 12, order=order, kernel=kernel)
    chunk = expected_chunk(F32, 12, 40, 253952)  # the default UB size: all 12 slots in one chunk
    assert_bitwise_equal(out, slow_profile(grad, idx, 12, profile=order, chunk=chunk))
    assert (compiled_calls != []) is (kernel == "numba" and not order.startswith("ascend950@9"))  # 950's own loop


@pytest.mark.parametrize(("value", "threads"), [("1", 1), ("3", 3), (" 2 ", 2)])
def test_thread_count_from_the_environment(monkeypatch, value, threads):
    monkeypatch.setenv("MOEGRAD_REFERENCE_THREADS", value)
    assert _reference.kernel_threads() == threads


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_thread_count_is_an_error(monkeypatch, value):
    monkeypatch.setenv("MOEGRAD_REFERENCE_THREADS", value)
    with pytest.raises(ValueError, match="MOEGRAD_REFERENCE_THREADS"):
        _reference.kernel_threads()


def test_one_thread_runs_every_chunk_in_the_caller(monkeypatch, compiled_calls):
    monkeypatch.setenv("MOEGRAD_REFERENCE_THREADS", "1")
    monkeypatch.setattr(_fast, "_CHUNK_INPUT_BYTES", 256)
    seen = set()
    kernel = _fast_jit.run_rows

    def where(*args):
        seen.add(threading.current_thread().name)
        return kernel(*args)

    monkeypatch.setattr(_fast_jit, "run_rows", where)
    rng = np.random.default_rng(13)
    grad, idx, _, _ = random_call(rng, "dropless", 2, F32, tokens=40, hidden=16)
    out = run(grad, idx, 2, kernel="numba")
    assert seen == {threading.current_thread().name}
    assert_bitwise_equal(out, slow_grad_x(grad, idx, 2))
