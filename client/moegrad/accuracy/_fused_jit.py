"""The compiled comparison: golden, scale and the three comparisons' statistics in one pass (numba).

Imported only when numba is (:mod:`moegrad.accuracy._fused`). For each output element the kernel
reads the call's K summands once, widened exactly to float64, and forms

- the golden: their Neumaier-compensated float64 sum (the plain sum where that is not finite);
- the scale: the float64 sum of their magnitudes;

then updates, per row, the sums, counts and maxima that :class:`moegrad.accuracy.Metrics` is made
of, for candidate vs golden, device vs golden and candidate vs device, with the definitions of
:func:`moegrad.accuracy.metrics` (docs/accuracy.md, "Metrics"). Elements are widened through the
same bit views as the reference kernel (:mod:`moegrad._fast_jit`): float32 as float32, float16 as
int16 words, bfloat16 as uint16 words.
"""

from __future__ import annotations

import math

import numpy as np

from numba import njit

from moegrad._fast_jit import _compiled, _widen

_inline = njit(inline="always", nogil=True)  # helpers: inlined into the kernel, where LLVM keeps their state

# Per-row accumulator slots (the last axis of ``acc``), per comparison.
FINITE, NORMAL, SMALL, SUM_ABS, SUM_SQ, MAX_ABS, MAX_REL, SUM_REL, SMALL_ERR, MAX_SMALL, MAX_ACC = range(11)
DOT_AA, DOT_EE, DOT_AE, EQUAL, MAX_ULP, SUM_ULP, ULP_GT1, WITHIN_2, WITHIN_3, WITHIN_4 = range(11, 21)
NAN_MISMATCH, INF_MISMATCH, MATCHED, UP, DOWN, TOWARD, AWAY, BAD, BAD_COL, BAD_A, BAD_E, BAD_G = range(21, 33)
SLOTS = 33


@_inline
def _cls(x):
    if x != x:
        return 1
    if x == math.inf:
        return 2
    if x == -math.inf:
        return 3
    return 0


@_inline
def _rounded_cls(x, overflow_at):
    """The class of x once rounded to a format whose values at or above ``overflow_at`` round to inf."""
    c = _cls(x)
    if c == 0 and abs(x) >= overflow_at:
        return 2 if x > 0 else 3
    return c


@_inline
def _ulp(exponent, mantissa_bits, min_exponent):
    """One ULP at a value 2^exponent <= |g| < 2^(exponent+1) (exponent None-like below for zero) in a format."""
    return math.ldexp(1.0, max(exponent, min_exponent) - mantissa_bits)


@_inline
def _row_stats(acc, i, k, a, e, g, m, p, ulp):
    """One row of one comparison: actual a [H], expected e [H], golden g [H], scale m [H], ULPs at g [H];
    the sums in registers, written to acc[i, k] once."""
    small_value, small_atol, acc_small, overflow_at = p[0], p[1], p[2], p[5]
    equal = nan_mismatch = inf_mismatch = matched = finite_n = normal_n = small_n = 0.0
    sum_abs = sum_sq = max_abs = sum_rel = max_rel = max_small = small_err = max_acc = 0.0
    dot_aa = dot_ee = dot_ae = max_ulp = sum_ulp = ulp_gt1 = within2 = within3 = within4 = 0.0
    up = down = toward = away = 0.0
    bad, bad_col, bad_a, bad_e, bad_g = acc[i, k, BAD], acc[i, k, BAD_COL], acc[i, k, BAD_A], acc[i, k, BAD_E], acc[i, k, BAD_G]
    for h in range(a.shape[0]):
        x, y, gh, mh = a[h], e[h], g[h], m[h]
        if (x == y and math.copysign(1.0, x) == math.copysign(1.0, y)) or (x != x and y != y):
            equal += 1.0
        ca, ce = _cls(x), _rounded_cls(y, overflow_at)
        if ca != ce:
            if ca == 1 or ce == 1:
                nan_mismatch += 1.0
            else:
                inf_mismatch += 1.0
            b = math.inf
        elif ca != 0 or not (math.isfinite(gh) and math.isfinite(mh)):
            matched += 1.0
            b = -1.0
        else:
            err = x - y
            ae = abs(err)
            b = ae
            finite_n += 1.0
            sum_abs += ae
            sum_sq += err * err
            max_abs = max(max_abs, ae)
            if mh >= small_value:
                rel = ae / mh
                normal_n += 1.0
                sum_rel += rel
                max_rel = max(max_rel, rel)
            else:
                small_n += 1.0
                max_small = max(max_small, ae)
                if ae > small_atol:
                    small_err += 1.0
            max_acc = max(max_acc, ae / max(mh, acc_small))
            dot_aa += x * x
            dot_ee += y * y
            dot_ae += x * y
            u = ae / ulp[h]
            max_ulp = max(max_ulp, u)
            sum_ulp += u
            if u > 1.0:
                ulp_gt1 += 1.0
            scaled = ae / max(mh, small_value)
            if scaled <= 1e-2:
                within2 += 1.0
            if scaled <= 1e-3:
                within3 += 1.0
            if scaled <= 1e-4:
                within4 += 1.0
            if err > 0:
                up += 1.0
            elif err < 0:
                down += 1.0
            if abs(x) < abs(y):
                toward += 1.0
            elif abs(x) > abs(y):
                away += 1.0
        if b > bad:
            bad, bad_col, bad_a, bad_e, bad_g = b, h, x, y, gh
    o = acc[i, k]
    o[FINITE] += finite_n
    o[NORMAL] += normal_n
    o[SMALL] += small_n
    o[SUM_ABS] += sum_abs
    o[SUM_SQ] += sum_sq
    o[MAX_ABS] = max(o[MAX_ABS], max_abs)
    o[MAX_REL] = max(o[MAX_REL], max_rel)
    o[SUM_REL] += sum_rel
    o[SMALL_ERR] += small_err
    o[MAX_SMALL] = max(o[MAX_SMALL], max_small)
    o[MAX_ACC] = max(o[MAX_ACC], max_acc)
    o[DOT_AA] += dot_aa
    o[DOT_EE] += dot_ee
    o[DOT_AE] += dot_ae
    o[EQUAL] += equal
    o[MAX_ULP] = max(o[MAX_ULP], max_ulp)
    o[SUM_ULP] += sum_ulp
    o[ULP_GT1] += ulp_gt1
    o[WITHIN_2] += within2
    o[WITHIN_3] += within3
    o[WITHIN_4] += within4
    o[NAN_MISMATCH] += nan_mismatch
    o[INF_MISMATCH] += inf_mismatch
    o[MATCHED] += matched
    o[UP] += up
    o[DOWN] += down
    o[TOWARD] += toward
    o[AWAY] += away
    o[BAD], o[BAD_COL], o[BAD_A], o[BAD_E], o[BAD_G] = bad, bad_col, bad_a, bad_e, bad_g


@_compiled
def compare_rows(rows, index, mode, limit, candidate, device, golden, has_golden, start, stop, p_cand, p_dev, acc):
    """Rows [start, stop) of grad_x: acc[i, 0..2] for candidate vs golden, device vs golden, candidate vs device.

    ``rows`` [R, H] and ``device`` [N, H] are bit views of the call's dtype, ``candidate`` [N, H] of its
    own; ``index`` [N, K] int32; ``mode`` 0 dropless, 1 drop/pad (index < 0 skipped), 2 active
    (index >= ``limit`` skipped); ``golden`` [N, H] float64 is used when ``has_golden``.
    ``p_cand`` / ``p_dev``: small_value, small_value_atol, accumulative_small_value, mantissa bits
    and min exponent of the actual's dtype, and the overflow threshold of that dtype.
    """
    hidden = candidate.shape[1]
    top_k = index.shape[1]
    g = np.empty(hidden)
    m = np.empty(hidden)
    a = np.empty(hidden)
    d = np.empty(hidden)
    ulp_c = np.empty(hidden)
    ulp_d = np.empty(hidden)
    same_format = p_dev[3] == p_cand[3] and p_dev[4] == p_cand[4]
    for i in range(start, stop):
        for h in range(hidden):
            if has_golden:
                gh = golden[i, h]
                mh = 0.0
                for t in range(top_k):
                    j = index[i, t]
                    if (mode == 1 and j < 0) or (mode == 2 and j >= limit):
                        continue
                    mh += abs(np.float64(_widen(rows[j, h])))
            else:
                s = 0.0
                c = 0.0
                mh = 0.0
                for t in range(top_k):
                    j = index[i, t]
                    if (mode == 1 and j < 0) or (mode == 2 and j >= limit):
                        continue
                    v = np.float64(_widen(rows[j, h]))
                    total = s + v
                    if abs(s) >= abs(v):
                        c += (s - total) + v
                    else:
                        c += (v - total) + s
                    s = total
                    mh += abs(v)
                gh = s + c if math.isfinite(s) else s
            g[h] = gh
            m[h] = mh
            a[h] = np.float64(_widen(candidate[i, h]))
            d[h] = np.float64(_widen(device[i, h]))
            exponent = -100000 if gh == 0.0 or not math.isfinite(gh) else math.frexp(gh)[1] - 1
            ulp_c[h] = _ulp(exponent, int(p_cand[3]), int(p_cand[4]))
            ulp_d[h] = ulp_c[h] if same_format else _ulp(exponent, int(p_dev[3]), int(p_dev[4]))
        _row_stats(acc, i, 0, a, g, g, m, p_cand, ulp_c)
        _row_stats(acc, i, 1, d, g, g, m, p_dev, ulp_d)
        _row_stats(acc, i, 2, a, d, g, m, p_cand, ulp_c)
