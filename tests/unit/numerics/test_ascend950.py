"""The Ascend 950 order (moegrad.numerics._ascend950) against independent computations (docs/semantics.md section 7).

The expected values never come from moegrad's 950 code: templates come from the public tiling unit
tests of the arch35 kernel (hicann/ops-transformer's
``moe/moe_init_routing_v2_grad/tests/ut/op_host/test_moe_init_routing_v2_grad_tiling.cpp``, as
published in the yjyang62/CANN mirror at commit 001035253680c9423cff9cfb095f689d53ed7556) and from
kUbFactor values worked out by hand below; sums come from a slow per-row loop written from
docs/semantics.md section 7.2 with the IEEE rounding helper (both in tests/support/slow_loops.py,
checked by hand here), and hand-written expressions, checked unique among every add tree.
"""

from __future__ import annotations

import numpy as np
import pytest

import moegrad
from moegrad import InvalidArgument, ascend950_tiling, moe_init_routing_v2_grad
from support.bits import assert_bitwise_equal, bits
from support.inputs import BF16, F16, F32, GRAD_DTYPES, KS, MODES, random_call, wide_values
from support.slow_loops import (
    REVISIONS,
    ascend950_row,
    double_factorial,
    every_add_tree,
    expected_chunk,
    round_from_float32,
    slow950,
    slow_grad_x,
)

# --------------------------------------------------------------------------------------------------
# The slow loop (tests/support/slow_loops.py, from docs/semantics.md section 7.2), checked by hand.
# --------------------------------------------------------------------------------------------------

def test_slow_loop_by_hand():
    v = [np.array([x], dtype=np.float32) for x in (1.0, 2.0**-24, 3 * 2.0**-24, 2.0**-23, 5.0, 7.0, 0.5, 0.25, 3.0)]
    zero = np.float32(0.0)
    assert ascend950_row(v[:3], 1, 3, True)[0] == ((zero + v[0]) + v[1]) + v[2]
    assert ascend950_row(v[:6], 1, 6, True)[0] == (((zero + ((v[0] + v[1]) + (v[2] + v[3]))) + v[4]) + v[5])[0]
    assert ascend950_row(v, 1, 9, True)[0] == \
        (((zero + ((v[0] + v[1]) + (v[2] + v[3]))) + ((v[4] + v[5]) + (v[6] + v[7]))) + v[8])[0]
    # chunks of 3: no group of four fits, so every slot is a leftover: a chain
    assert ascend950_row(v[:6], 1, 3, True)[0] == (((((zero + v[0]) + v[1]) + v[2]) + v[3]) + v[4] + v[5])[0]
    assert not np.signbit(ascend950_row([np.array([-0.0], dtype=np.float32)] * 2, 1, 2, True)[0])


# --------------------------------------------------------------------------------------------------
# The tiling decision against the public tiling unit tests and hand-worked values.
# --------------------------------------------------------------------------------------------------

# (test name, dtype, len(expanded_row_idx), top_k, H, UB, expected template) from the public tiling
# unit tests; all run with compileInfo = {aivNum 40, ubSize 65536} (one with ubSize 4096). Tiling key
# 2000xx is SplitH, 3000xx FullLoad, 4000xx Regbase; the two FullLoad variants by the test's name
# ("h_full" / "partial_h"), the others load whole rows (checked by hand in the comments).
PUBLIC_TILING_CASES = [
    ("regbase_dropless_01", BF16, 640, 64, 512, 65536, "regbase"),
    ("regbase_active_02", BF16, 640, 64, 512, 65536, "regbase"),
    ("regbase_drop_pad_03", BF16, 5120, 64, 512, 65536, "regbase"),
    ("regbase_fp32_full_load_04", F32, 640, 64, 512, 65536, "regbase"),
    ("regbase_large_h_split_ub_05", F16, 640, 64, 8192, 65536, "regbase"),
    ("split_h_dropless_01", BF16, 40, 8, 8192, 65536, "split_h"),
    ("split_h_active_02", BF16, 40, 8, 8192, 65536, "split_h"),
    ("split_h_drop_pad_03", BF16, 128, 8, 32768, 65536, "split_h"),
    ("split_h_fp32_04", F32, 24, 8, 16384, 65536, "split_h"),
    ("split_h_subh_partial_ub_05", BF16, 40, 8, 8192, 4096, "split_h"),
    ("full_load_dropless_01", F32, 480, 6, 8, 65536, "full_load"),  # 13 * 4 * 8 <= 65536
    ("full_load_active_02", BF16, 320, 8, 512, 65536, "full_load"),  # 17 * 2 * 512 <= 65536
    ("full_load_drop_pad_03", BF16, 640, 8, 512, 65536, "full_load"),
    ("full_load_fp16_h_full_04", F16, 16, 2, 5120, 65536, "full_load"),  # 5 * 2 * 5120 = 51200
    ("full_load_partial_h_05", BF16, 640, 8, 2048, 65536, "full_load_split_h"),  # 17 * 2 * 2048 = 69632
]


@pytest.mark.parametrize("case", PUBLIC_TILING_CASES, ids=lambda c: c[0])
def test_tiling_picks_the_template_of_the_public_unit_tests(case):
    _, dtype, slots, top_k, hidden, ub, template = case
    tiling = ascend950_tiling(dtype, slots // top_k, top_k, hidden, ub_size_bytes=ub, vector_core_count=40)
    assert tiling.template == template
    assert (tiling.k_chunk < top_k) == (template == "regbase")  # only Regbase splits these K


# (dtype, N, K, H, UB, cores) -> (template, kUbFactor), worked out by hand from docs/semantics.md 7.1:
# ts = element size, Ha = H padded to 32 bytes, kUbFactor = (UB - (ts + 4) Ha) // (2 ts Ha).
HAND_TILINGS = [
    # the public unit test regbase_dropless_01: bf16 Ha = 512: (65536 - 6 * 512) // (4 * 512) = 30
    ((BF16, 10, 64, 512, 65536, 40), ("regbase", 30)),
    # fp32 Ha = 512: (65536 - 8 * 512) // (8 * 512) = 15
    ((F32, 10, 64, 512, 65536, 40), ("regbase", 15)),
    # regbase_large_h_split_ub_05: (3 * 2 + 4) * 8192 = 81920 > 65536 -> 1
    ((F16, 10, 64, 8192, 65536, 40), ("regbase", 1)),
    # the 950 defaults, bf16 H = 2048, N = 64 = cores (not SplitH): (253952 - 6 * 2048) // (4 * 2048) = 29
    ((BF16, 64, 64, 2048, 253952, 64), ("regbase", 29)),
    # the same with N = 1 < (2048 // 512) // 2 = 2: SplitH, all 64 slots in one pass
    ((BF16, 1, 64, 2048, 253952, 64), ("split_h", None)),
    # ... but with one core, N < cores fails and Regbase takes it: the core count changes the bits
    ((BF16, 1, 64, 2048, 253952, 1), ("regbase", 29)),
    # fp32 Ha = 8, UB 576: FullLoad needs (2K + 1) * 32 <= 576 (K <= 8); K = 17 -> (576 - 64) // 64 = 8
    ((F32, 3, 17, 8, 576, 64), ("regbase", 8)),
    # UB 448: (448 - 64) // 64 = 6
    ((F32, 3, 17, 8, 448, 64), ("regbase", 6)),
    # fp32 H = 72, UB 1024: 16 * 72 = 1152 > 1024 -> kUbFactor 1
    ((F32, 3, 11, 72, 1024, 64), ("regbase", 1)),
    # bf16 H = 128, UB 4096, K = 8: 17 * 2 * 128 = 4352 > 4096 but K <= 10: FullLoad with H split
    ((BF16, 3, 8, 128, 4096, 64), ("full_load_split_h", None)),
    # K = 11 there: Regbase, (10 * 128 <= 4096) (4096 - 6 * 128) // (4 * 128) = 6
    ((BF16, 3, 11, 128, 4096, 64), ("regbase", 6)),
    # H = 7 float16 pads to Ha = 16 elements (32 bytes)
    ((F16, 5, 6, 7, 253952, 64), ("full_load", None)),
    # K = 200000, fp32 Ha = 8: FullLoad needs 400001 * 32 = 12800032 <= UB; with UB = 12800000,
    # kUbFactor = (12800000 - 64) // 64 = 199999, capped at 65535
    ((F32, 1, 200000, 8, 12800032, 64), ("full_load", None)),
    ((F32, 1, 200000, 8, 12800000, 64), ("regbase", 65535)),
]


@pytest.mark.parametrize(("shape", "expected"), HAND_TILINGS, ids=lambda x: str(x))
def test_tiling_matches_hand_worked_values(shape, expected):
    dtype, tokens, top_k, hidden, ub, cores = shape
    tiling = ascend950_tiling(dtype, tokens, top_k, hidden, ub_size_bytes=ub, vector_core_count=cores)
    assert (tiling.template, tiling.k_ub_factor) == expected
    assert tiling.k_chunk == (min(expected[1], top_k) if expected[1] else top_k)


def test_tiling_defaults_are_the_950pr_950dt_platform():
    assert moegrad.numerics._ascend950.UB_SIZE_BYTES == 253952
    assert moegrad.numerics._ascend950.VECTOR_CORE_COUNT == 64
    default = ascend950_tiling("bfloat16", 64, 64, 2048)
    assert (default.template, default.k_ub_factor) == ("regbase", 29)
    assert default.hidden_align == 2048
    assert ascend950_tiling("float16", 5, 6, 7).hidden_align == 16
    assert ascend950_tiling("float32", 5, 6, 7).hidden_align == 8


@pytest.mark.parametrize(("field", "value", "error"), [
    ("ub_size_bytes", 0, ValueError), ("vector_core_count", -1, ValueError), ("top_k", 0, ValueError),
    ("ub_size_bytes", 1.5, TypeError), ("vector_core_count", True, TypeError), ("hidden_size", "8", TypeError)])
def test_tiling_rejects_bad_sizes(field, value, error):
    arguments = {"num_tokens": 2, "top_k": 3, "hidden_size": 8, "ub_size_bytes": 1024, "vector_core_count": 4}
    arguments[field] = value
    with pytest.raises(error, match=field):
        ascend950_tiling("float32", **arguments)


def test_tiling_rejects_an_unknown_dtype():
    with pytest.raises(ValueError, match="float64"):
        ascend950_tiling(np.float64, 2, 3, 8)


# --------------------------------------------------------------------------------------------------
# The accumulation schedule of the 950 orders.
# --------------------------------------------------------------------------------------------------

def run_schedule(schedule, values: list[float | None]) -> np.float32:
    """Executes a schedule on one column of float32 values (None: skipped) with the documented ops."""
    bins: dict[int, np.float32] = {}
    for op, dst, src in schedule:
        if op == "zero":
            bins[dst] = np.float32(0.0)
        elif op == "set":
            bins[dst] = np.float32(0.0 if values[src] is None else values[src])
        elif op == "add":
            if values[src] is not None:
                bins[dst] = bins[dst] + np.float32(values[src])
        else:
            bins[dst] = bins[dst] + bins[src]
    return bins[0]


@pytest.mark.parametrize("order", sorted(REVISIONS))
@pytest.mark.parametrize(("shape", "chunk"), [((F32, 5, 6, 8), 6), ((F32, 3, 17, 8), 6), ((F32, 3, 17, 8), 8),
                                             ((F32, 3, 11, 72), 1), ((F32, 3, 130, 8), 130)])
def test_schedule_is_the_documented_order(order, shape, chunk):
    dtype, tokens, top_k, hidden = shape
    ub = {6: 448, 8: 576, 1: 1024, 130: 253952}[chunk]
    schedule = moegrad.accumulation_schedule(top_k, order, dtype=dtype, num_tokens=tokens, hidden_size=hidden,
                                             ub_size_bytes=ub)
    rng = np.random.default_rng(top_k)
    with np.errstate(all="ignore"):
        for _ in range(20):
            column = [float(x) for x in (rng.standard_normal(top_k) * np.exp2(rng.integers(-20, 20, top_k)))
                      .astype(np.float32)]
            column[int(rng.integers(top_k))] = None
            expected = ascend950_row([None if x is None else np.array([x], np.float32) for x in column], 1, chunk,
                                     REVISIONS[order])
            assert bits(np.array([run_schedule(schedule, column)])).tolist() == bits(expected).tolist()
    assert schedule[0] == ("zero", 0, 0)
    assert {op for op, _, _ in schedule} == {"zero", "set", "merge"}  # skipped slots are set to +0.0, never left out


def test_schedule_needs_the_shape_for_950_orders():
    with pytest.raises(ValueError, match="dtype, num_tokens, hidden_size"):
        moegrad.accumulation_schedule(4, "ascend950")
    with pytest.raises(ValueError, match="hidden_size"):
        moegrad.accumulation_schedule(4, "ascend950", dtype="float32", num_tokens=2)
    with pytest.raises(ValueError, match="top_k=0"):
        moegrad.accumulation_schedule(0, "ascend950", dtype="float32", num_tokens=2, hidden_size=3)
    with pytest.raises(ValueError, match="'ascend960' is not a device profile"):
        moegrad.accumulation_schedule(4, "ascend960")


# --------------------------------------------------------------------------------------------------
# The emulation against the slow loop: modes x dtypes x K x revisions, whole-row and chunked tilings.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ub", [253952, 600], ids=lambda ub: f"ub{ub}")
@pytest.mark.parametrize("order", sorted(REVISIONS))
@pytest.mark.parametrize("top_k", KS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mode", MODES)
def test_ascend950_matches_slow_loop(mode, dtype, top_k, order, ub):
    rng = np.random.default_rng([MODES.index(mode), GRAD_DTYPES.index(dtype), top_k, int(REVISIONS[order]), ub, 950])
    tokens = 3 if top_k >= 127 else 5
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, dtype, tokens, hidden=6)
    out = moe_init_routing_v2_grad(grad, idx, top_k, drop_pad_mode, active_num, order=order, ub_size_bytes=ub)
    chunk = expected_chunk(dtype, top_k, 6, ub)
    assert_bitwise_equal(out, slow950(grad, idx, top_k, drop_pad_mode, active_num, chunk=chunk,
                                      grouped=REVISIONS[order]))
    assert out.flags.c_contiguous
    wide = out.astype(np.float32)
    assert not np.signbit(wide[wide == 0]).any()  # never -0.0


# Shapes that select each template (hand-worked in HAND_TILINGS), checked against the slow loop.
TEMPLATE_SHAPES = [
    # (dtype, tokens, top_k, hidden, ub, cores, template, chunk)
    (BF16, 2, 17, 4096, 253952, 64, "split_h", 17),  # N = 2 < (4096 // 512) // 2 = 4
    (F32, 5, 6, 8, 253952, 64, "full_load", 6),
    (BF16, 3, 8, 128, 4096, 64, "full_load_split_h", 8),
    (BF16, 3, 11, 128, 4096, 64, "regbase", 6),
    (F32, 3, 17, 8, 576, 64, "regbase", 8),
    (F32, 3, 17, 8, 448, 64, "regbase", 6),
    (F32, 3, 11, 72, 1024, 64, "regbase", 1),
    (BF16, 2, 64, 2048, 253952, 1, "regbase", 29),
    (BF16, 2, 64, 4096, 253952, 64, "split_h", 64),
]


@pytest.mark.parametrize("shape", TEMPLATE_SHAPES, ids=lambda s: f"{s[6]}-{s[0].name}-K{s[2]}-chunk{s[7]}")
@pytest.mark.parametrize("mode", MODES)
def test_each_template_matches_slow_loop(mode, shape):
    dtype, tokens, top_k, hidden, ub, cores, template, chunk = shape
    tiling = ascend950_tiling(dtype, tokens, top_k, hidden, ub_size_bytes=ub, vector_core_count=cores)
    assert (tiling.template, tiling.k_chunk) == (template, chunk)
    rng = np.random.default_rng([MODES.index(mode), top_k, hidden, ub, cores])
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, dtype, tokens, hidden)
    out = moe_init_routing_v2_grad(grad, idx, top_k, drop_pad_mode, active_num, order="ascend950",
                                   ub_size_bytes=ub, vector_core_count=cores)
    assert_bitwise_equal(out, slow950(grad, idx, top_k, drop_pad_mode, active_num, chunk=chunk))


@pytest.mark.parametrize(("ub", "chunk"), [(576, 8), (448, 6), (1024, 1)])
def test_only_a_chunk_that_is_not_a_multiple_of_four_changes_the_bits(ub, chunk):
    # fp32 H = 8 (K = 17) and H = 72 for the chunk of 1: see HAND_TILINGS
    hidden = 72 if chunk == 1 else 8
    rng = np.random.default_rng(chunk)
    grad = rng.standard_normal((64 * 17, hidden)).astype(np.float32)
    idx = rng.permutation(64 * 17).astype(np.int32)
    out = moe_init_routing_v2_grad(grad, idx, 17, order="ascend950", ub_size_bytes=ub)
    assert ascend950_tiling(F32, 64, 17, hidden, ub_size_bytes=ub).k_chunk == chunk
    one_pass = slow950(grad, idx, 17)
    assert_bitwise_equal(out, slow950(grad, idx, 17, chunk=chunk))
    assert (bits(out) == bits(one_pass)).all() == (chunk % 4 == 0)


def test_the_core_count_changes_the_bits():
    # fp32 K = 64, H = 4096, N = 1: SplitH ((4096 // 512) // 4 = 2 > N) with 64 cores: one pass;
    # with 1 core Regbase: (253952 - 8 * 4096) // (8 * 4096) = 6, chunks of 6
    rng = np.random.default_rng(64)
    grad = rng.standard_normal((64, 4096)).astype(np.float32)
    idx = rng.permutation(64).astype(np.int32)
    assert ascend950_tiling(F32, 1, 64, 4096, vector_core_count=1).k_chunk == 6
    many = moe_init_routing_v2_grad(grad, idx, 64, order="ascend950")
    one = moe_init_routing_v2_grad(grad, idx, 64, order="ascend950", vector_core_count=1)
    assert_bitwise_equal(many, slow950(grad, idx, 64, chunk=64))
    assert_bitwise_equal(one, slow950(grad, idx, 64, chunk=6))
    assert (bits(many) != bits(one)).any()


# --------------------------------------------------------------------------------------------------
# Hand-written orders, unique among every add tree.
# --------------------------------------------------------------------------------------------------

HAND_ORDERS_950 = {
    3: lambda v: ((np.float32(0.0) + v[0]) + v[1]) + v[2],
    6: lambda v: ((np.float32(0.0) + ((v[0] + v[1]) + (v[2] + v[3]))) + v[4]) + v[5],
    7: lambda v: (((np.float32(0.0) + ((v[0] + v[1]) + (v[2] + v[3]))) + v[4]) + v[5]) + v[6],
}


@pytest.mark.parametrize("top_k", sorted(HAND_ORDERS_950))
def test_hand_written_order_is_the_only_order_that_fits(top_k):
    rng = np.random.default_rng(950)
    exponent = rng.integers(-26, 1, (top_k, 32))
    values = (rng.choice([-1.0, 1.0], (top_k, 32)) * (1 + rng.random((top_k, 32))) * np.exp2(exponent)).astype(np.float32)
    out = moe_init_routing_v2_grad(values, np.arange(top_k, dtype=np.int32), top_k, order="ascend950")
    np.testing.assert_array_equal(bits(out[0]), bits(HAND_ORDERS_950[top_k](values)))
    every = every_add_tree(values)  # +0.0 + x is x for these nonzero values: the leading zero adds nothing
    assert every.shape[0] == double_factorial(2 * top_k - 3)
    matches = (bits(every) == bits(out[0])[None, :]).all(axis=1)
    assert matches.sum() == 1


@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_whole_row_passes_agree_with_the_a2_a3_order_for_k_1_2_4_8(top_k, dtype):
    # K = 1, 2, 4, 8 in one pass are the A2/A3 tree too, but for the sign of an all -0.0 sum
    rng = np.random.default_rng([top_k, 9])
    grad = wide_values(rng, (64 * top_k, 32), dtype, top_k)
    idx = rng.permutation(64 * top_k).astype(np.int32)
    a2 = moe_init_routing_v2_grad(grad, idx, top_k)
    a950 = moe_init_routing_v2_grad(grad, idx, top_k, order="ascend950")
    a2 = np.where(a2 == 0, np.zeros_like(a2), a2)  # +0.0 where A2/A3 keeps -0.0
    assert_bitwise_equal(a950, a2)


@pytest.mark.parametrize("top_k", [3, 5, 6, 7, 9, 16, 130])
def test_other_k_differ_from_the_a2_a3_order(top_k):
    rng = np.random.default_rng(top_k)
    grad = rng.standard_normal((256 * top_k, 64)).astype(np.float32)
    idx = rng.permutation(256 * top_k).astype(np.int32)
    a2 = moe_init_routing_v2_grad(grad, idx, top_k)
    a950 = moe_init_routing_v2_grad(grad, idx, top_k, order="ascend950")
    assert (bits(a2) != bits(a950)).any()


@pytest.mark.parametrize("top_k", KS)
@pytest.mark.parametrize("mode", MODES)
def test_2025_12_revision_is_the_sequential_order(mode, top_k):
    # A chain from +0.0 is the sequential golden: adding +0.0 for a skipped slot changes no bit,
    # since the accumulator is never -0.0; so the revision equals order="sequential" bit for bit.
    rng = np.random.default_rng([MODES.index(mode), top_k, 2025])
    tokens = 3 if top_k >= 127 else 5
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, F32, tokens, hidden=6)
    out = moe_init_routing_v2_grad(grad, idx, top_k, drop_pad_mode, active_num, order="ascend950@2025-12",
                                   ub_size_bytes=600)
    assert_bitwise_equal(out, slow_grad_x(grad, idx, top_k, drop_pad_mode, active_num, "sequential"))


# --------------------------------------------------------------------------------------------------
# Invalid rows, signed zeros, infinities, NaN, rounding ties.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", sorted(REVISIONS))
@pytest.mark.parametrize("top_k", [1, 2, 3, 8, 17, 128, 130])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_all_skipped_row_is_positive_zero(dtype, top_k, order):
    rng = np.random.default_rng(top_k)
    grad = wide_values(rng, (4, 3, 5), dtype, top_k)
    idx = np.full(2 * top_k, -1, dtype=np.int32)
    idx[top_k] = 0  # token 1 reads row 0 once
    out = moe_init_routing_v2_grad(grad, idx, top_k, 1, order=order, ub_size_bytes=1024)
    assert bits(out[0]).tolist() == [0] * 5
    grad_x = moe_init_routing_v2_grad(np.zeros((0, 4, 5), dtype), idx[:top_k], top_k, 1, order=order)
    assert bits(grad_x).tolist() == [[0] * 5]  # E*C = 0: every slot is skipped


@pytest.mark.parametrize("order", sorted(REVISIONS))
@pytest.mark.parametrize("top_k", [1, 2, 3, 6, 8, 127, 128, 130, 256])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
def test_negative_zero_rows_give_positive_zero(dtype, top_k, order):
    # The accumulator starts at +0.0 and +0.0 + -0.0 = +0.0: the 950 never returns -0.0 (A2/A3 does).
    grad = np.full((3 * top_k, 4), -0.0, dtype=dtype)
    idx = np.arange(3 * top_k, dtype=np.int32)
    out = moe_init_routing_v2_grad(grad, idx, top_k, order=order)
    assert bits(out).tolist() == [[0] * 4] * 3
    assert np.signbit(moe_init_routing_v2_grad(grad, idx, top_k).astype(np.float32)).all()  # A2/A3: -0.0


def test_cancellation_gives_positive_zero_and_a_skipped_slot_is_a_zero_row():
    grad = np.array([[1.5], [-1.5], [-0.0], [2.0]], dtype=np.float32).reshape(4, 1, 1)  # drop/pad [E, C, H]
    out = moe_init_routing_v2_grad(grad, np.array([0, 1, -1, 2], dtype=np.int32), 4, 1, order="ascend950")
    assert bits(out).tolist() == [[0]]  # +0.0 + ((1.5 + -1.5) + (+0.0 + -0.0)): a zero row for the -1
    a2 = moe_init_routing_v2_grad(grad, np.array([2, -1], dtype=np.int32), 2, 1)
    assert bits(a2).tolist() == [[0x80000000]]  # A2/A3: bin 0 = -0.0, the skipped add adds nothing
    assert bits(moe_init_routing_v2_grad(grad, np.array([2, -1], dtype=np.int32), 2, 1, order="ascend950")).tolist() \
        == [[0]]


def test_infinities_and_nan():
    inf, nan = np.inf, np.nan
    grad = np.array([[inf, inf, 1.0, nan], [1.0, -inf, 2.0, 1.0], [3.0, 1.0, 3.4e38, 1.0], [4.0, 1.0, 3.4e38, 1.0]],
                    dtype=np.float32)
    out = moe_init_routing_v2_grad(grad, np.arange(4, dtype=np.int32), 4, order="ascend950")
    assert out[0, 0] == inf and np.isnan(out[0, 1]) and np.isnan(out[0, 3])
    # ((1 + 2) + (3.4e38 + 3.4e38)) overflows float32 inside the group: +inf
    assert out[0, 2] == inf
    assert_bitwise_equal(out, slow950(grad, np.arange(4, dtype=np.int32), 4))


def test_bfloat16_rounding_ties_to_even():
    # bfloat16 ulp(1) = 2**-7: 1 + 2**-8 is a tie (-> 1.0), 1 + 3 * 2**-8 a tie (-> 1 + 2**-6).
    # The sums are exact in float32, so only the final rounding decides.
    a, b = 2.0**-9, 3 * 2.0**-9
    grad = np.array([[1.0, 1.0], [a, b], [a, b], [0.0, 0.0]], dtype=np.float32).astype(BF16)
    out = moe_init_routing_v2_grad(grad, np.arange(4, dtype=np.int32), 4, order="ascend950")
    assert out.astype(np.float32).tolist() == [[1.0, 1.0 + 2.0**-6]]
    assert bits(out).tolist() == [[0x3F80, 0x3F82]]
    assert round_from_float32(np.float32(1 + 2**-8), BF16) == 1.0


def test_settings_are_checked_even_for_an_empty_result():
    grad = np.zeros((0, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="ub_size_bytes=0"):
        moe_init_routing_v2_grad(grad, np.zeros(0, dtype=np.int32), 2, order="ascend950", ub_size_bytes=0)
    assert moe_init_routing_v2_grad(grad, np.zeros(0, dtype=np.int32), 2, order="ascend950").shape == (0, 4)


def test_a_2a3_order_ignores_the_950_settings():
    grad = np.ones((4, 3), dtype=np.float32)
    out = moe_init_routing_v2_grad(grad, np.arange(4, dtype=np.int32), 2, ub_size_bytes=0)
    assert out.tolist() == [[2.0] * 3] * 2


def test_unknown_order_is_invalid_argument_161002():
    with pytest.raises(InvalidArgument) as error:
        moe_init_routing_v2_grad(np.ones((2, 3), np.float32), np.arange(2, dtype=np.int32), 2, order="ascend950@2026-13")
    assert error.value.aclnn_status == 161002 and error.value.field == "order"


def test_the_950_names():
    # the 950's profiles, and the older order names as aliases of them (docs/semantics.md section 7.5)
    assert {"ascend950@8.5", "ascend950@9.0", "ascend950@9.1", "ascend950", "ascend950@2025-12"} <= set(moegrad.ORDERS)
    for name, profile in (("ascend950", "ascend950@9.1"), ("ascend950@2025-12", "ascend950@8.5")):
        assert moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=np.ones((2, 3), np.float32),
                                                expanded_row_idx=np.arange(2, dtype=np.int32), top_k=2,
                                                order=name).order == profile
