"""Each device profile's bits against the independent slow loop of its kernel source.

Oracle: tests/support/slow_loops.py's ``slow_profile``, written from the kernels' order (A2/A3: the
bins of docs/semantics.md section 3.1; 950 at 8.5: a chain from +0.0; 950 from 9.0: groups of four
per K chunk, section 7.2) and its own table of which slot indices each source makes a +0.0 row;
the 950's K chunks are worked out by hand below from the tiling rules of section 7.1 (and checked
against ``ascend950_tiling``). Every mode, dtype and K in {1..10, 16, 64, 65, 130}, on both kernel
paths, with -0.0, infinities and NaN among the values (tests/support/inputs.py's ``wide_values``),
and on ascend950@9.1 with the slots of +0.0 rows that only it accepts.
"""

from __future__ import annotations

import numpy as np
import pytest

import moegrad
from moegrad import ascend950_tiling, moe_init_routing_v2_grad
from support.bits import assert_bitwise_equal, bits
from support.inputs import BF16, F32, GRAD_DTYPES, MODES, random_call
from support.slow_loops import SLOW_PROFILES, expected_chunk, slow_profile

KS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 64, 65, 130]
PROFILES = list(SLOW_PROFILES)


@pytest.fixture(params=["numba", "numpy"])
def path(request, monkeypatch):
    if request.param == "numba":
        pytest.importorskip("numba", reason="the compiled path needs the 'fast' extra")
    monkeypatch.setattr(moegrad.numerics._reference, "_KERNEL", request.param)
    return request.param


def with_zero_rows(rng: np.random.Generator, idx: np.ndarray, drop_pad_mode: int, rows: int) -> np.ndarray:
    """``idx`` with about a fifth of its slots set to indices only ascend950@9.1 accepts (+0.0 rows)."""
    idx = idx.copy()
    chosen = rng.random(idx.size) < 0.2
    values = [-1, -2, -(2**31)] if drop_pad_mode == 1 else [-1, -7, -(2**31), rows, rows + 3, 2**31 - 1]
    idx[chosen] = rng.choice(values, int(chosen.sum()))
    return idx


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mode", MODES)
def test_each_profile_matches_its_slow_loop(path, mode, dtype, profile):
    # the 950 profiles also with a UB that makes K > 10 run in Regbase chunks (section 7.1)
    ubs = [253952, 600] if profile.startswith("ascend950") else [253952]
    for ub in ubs:
        for top_k in KS:
            rng = np.random.default_rng([MODES.index(mode), GRAD_DTYPES.index(dtype), top_k, ub, PROFILES.index(profile)])
            tokens = 3 if top_k >= 64 else 5
            grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, dtype, tokens, hidden=6)
            if SLOW_PROFILES[profile][1]:
                rows = grad.size // 6
                idx = with_zero_rows(rng, idx, drop_pad_mode, active_num if active_num else rows)
            got = moe_init_routing_v2_grad(grad, idx, top_k, drop_pad_mode, active_num, order=profile,
                                           ub_size_bytes=ub)
            chunk = expected_chunk(dtype, top_k, 6, ub) if profile.startswith("ascend950") else None
            want = slow_profile(grad, idx, top_k, drop_pad_mode, active_num, profile=profile, chunk=chunk)
            assert_bitwise_equal(got, want)


# Both sides of each 950 template and K-chunk boundary (docs/semantics.md 7.1), worked by hand:
# ts the element size, Ha = H rounded up to 32 bytes, kUbFactor = (UB - (ts + 4) Ha) // (2 ts Ha).
BOUNDARY_SHAPES = [
    # (dtype, N, K, H, UB, cores, template, chunk)
    # FullLoad while (2K + 1) ts Ha <= UB: f32, H = 8: 17 * 32 = 544 <= 576; K = 9: 608 > 576 but K <= 10
    (F32, 3, 8, 8, 576, 64, "full_load", 8),
    (F32, 3, 9, 8, 576, 64, "full_load_split_h", 9),
    # FullLoad with H split up to K = 10, Regbase from K = 11: (576 - 64) // 64 = 8
    (F32, 3, 10, 8, 576, 64, "full_load_split_h", 10),
    (F32, 3, 11, 8, 576, 64, "regbase", 8),
    # the chunk on both sides of a multiple of four: UB 575 -> (575 - 64) // 64 = 7; K = 16: 8 + 8, 7 + 7 + 2
    (F32, 3, 16, 8, 576, 64, "regbase", 8),
    (F32, 3, 16, 8, 575, 64, "regbase", 7),
    # K = chunk and chunk + 1 in Regbase: UB 448 -> 6; K = 12: 6 + 6; K = 13: 6 + 6 + 1
    (F32, 3, 12, 8, 448, 64, "regbase", 6),
    (F32, 3, 13, 8, 448, 64, "regbase", 6),
    # SplitH while N < cores and N < (H // 512) // ts: bf16 H = 4096: (4096 // 512) // 2 = 4, so N = 3
    # is SplitH (one pass) and N = 4 Regbase: (253952 - 6 * 4096) // (4 * 4096) = 14, K = 17: 14 + 3
    (BF16, 3, 17, 4096, 253952, 64, "split_h", 17),
    (BF16, 4, 17, 4096, 253952, 64, "regbase", 14),
    # SplitH needs K <= 64: K = 64 one pass; K = 65 Regbase (bf16 H = 4096, N = 2: 14 per chunk)
    (BF16, 2, 64, 4096, 253952, 64, "split_h", 64),
    (BF16, 2, 65, 4096, 253952, 64, "regbase", 14),
]


@pytest.mark.parametrize("profile", ["ascend950@8.5", "ascend950@9.0", "ascend950@9.1"])
@pytest.mark.parametrize("shape", BOUNDARY_SHAPES, ids=lambda s: f"{s[6]}-{s[0].name}-N{s[1]}-K{s[2]}-H{s[3]}-ub{s[4]}")
@pytest.mark.parametrize("mode", MODES)
def test_both_sides_of_each_950_template_and_chunk_boundary(path, mode, shape, profile):
    dtype, tokens, top_k, hidden, ub, cores, template, chunk = shape
    tiling = ascend950_tiling(dtype, tokens, top_k, hidden, ub_size_bytes=ub, vector_core_count=cores)
    assert (tiling.template, tiling.k_chunk) == (template, chunk)
    rng = np.random.default_rng([MODES.index(mode), tokens, top_k, hidden, ub])
    grad, idx, drop_pad_mode, active_num = random_call(rng, mode, top_k, dtype, tokens, hidden)
    if profile == "ascend950@9.1":
        idx = with_zero_rows(rng, idx, drop_pad_mode, active_num if active_num else grad.size // hidden)
    got = moe_init_routing_v2_grad(grad, idx, top_k, drop_pad_mode, active_num, order=profile, ub_size_bytes=ub,
                                   vector_core_count=cores)
    assert_bitwise_equal(got, slow_profile(grad, idx, top_k, drop_pad_mode, active_num, profile=profile,
                                           chunk=chunk))


def test_the_9_0_and_9_1_kernels_add_alike_and_8_5_is_the_golden():
    # the same order of adds from 9.0 (only the invalid slots changed in 9.1); 8.5's chain is the
    # sequential golden's bits; all three differ from the A2/A3 bins for K = 6
    rng = np.random.default_rng(91)
    grad = rng.standard_normal((64 * 6, 32)).astype(np.float32)
    idx = rng.permutation(64 * 6).astype(np.int32)
    run = {name: moe_init_routing_v2_grad(grad, idx, 6, order=name) for name in
           ("ascend950@9.0", "ascend950@9.1", "ascend950@8.5", "sequential", "ascend910b@9.1", "ascend910_93@8.5")}
    assert_bitwise_equal(run["ascend950@9.1"], run["ascend950@9.0"])
    assert_bitwise_equal(run["ascend950@8.5"], run["sequential"])
    assert_bitwise_equal(run["ascend910b@9.1"], run["ascend910_93@8.5"])
    assert (bits(run["ascend950@9.0"]) != bits(run["ascend950@8.5"])).any()
    assert (bits(run["ascend950@9.0"]) != bits(run["ascend910b@9.1"])).any()


@pytest.mark.parametrize("profile", PROFILES)
def test_negative_zero_infinities_and_nan(profile):
    inf, nan = np.inf, np.nan
    grad = np.array([[-0.0, inf, 1.0, nan], [-0.0, -inf, 2.0, 1.0], [-0.0, 1.0, 3.4e38, 1.0],
                     [-0.0, 1.0, 3.4e38, 1.0]], dtype=np.float32)
    idx = np.arange(4, dtype=np.int32)
    got = moe_init_routing_v2_grad(grad, idx, 4, order=profile)
    assert_bitwise_equal(got, slow_profile(grad, idx, 4, profile=profile))
    assert np.isnan(got[0, 1]) and np.isnan(got[0, 3])  # inf + -inf, and NaN, on every profile
    # -0.0 survives only the A2/A3 bins (S1 copies it); every chain or 950 sum starts from +0.0
    assert bool(np.signbit(got[0, 0])) == (SLOW_PROFILES[profile][0] == "bins")
