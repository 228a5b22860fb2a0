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

_inline = njit(inline="always", nogil=True)  # the per-row statistics: inlined into the kernel

# Per-row accumulator slots (the last axis of ``acc``), per comparison.
FINITE, NORMAL, SMALL, SUM_ABS, SUM_SQ, MAX_ABS, MAX_REL, SUM_REL, SMALL_ERR, MAX_SMALL, MAX_ACC = range(11)
DOT_AA, DOT_EE, DOT_AE, EQUAL, MAX_ULP, SUM_ULP, ULP_GT1, WITHIN_2, WITHIN_3, WITHIN_4 = range(11, 21)
NAN_MISMATCH, INF_MISMATCH, MATCHED, UP, DOWN, TOWARD, AWAY, BAD, BAD_COL, BAD_A, BAD_E, BAD_G = range(21, 33)
SLOTS = 33


@_inline
def _row_stats(acc, i, k, a, e, g, m, p, ulp, bad):
    """One row of one comparison: actual a [H], expected e [H], golden g [H], scale m [H], ULPs at g [H].

    Branch-free (selects only); the sums stay in registers and are added to acc[i, k] once. Compiled
    without fast-math: reassociation would cancel the golden's compensation in the same kernel, and
    the NaN/Inf tests must keep their meaning. ``bad`` [H] receives each element's badness (the worst element's key).
    """
    small_value, small_atol, acc_small, overflow_at = p[0], p[1], p[2], p[5]
    inf = math.inf
    equal = nan_mismatch = inf_mismatch = matched = finite_n = normal_n = small_n = 0.0
    sum_abs = sum_sq = max_abs = sum_rel = max_rel = max_small = small_err = max_acc = 0.0
    dot_aa = dot_ee = dot_ae = max_ulp = sum_ulp = ulp_gt1 = within2 = within3 = within4 = 0.0
    up = down = toward = away = 0.0
    for h in range(a.shape[0]):
        x, y, gh, mh = a[h], e[h], g[h], m[h]
        x_nan, y_nan = x != x, y != y
        same = (x == y) & (math.copysign(1.0, x) == math.copysign(1.0, y))
        equal += 1.0 if same | (x_nan & y_nan) else 0.0
        # classes: 0 finite, 1 NaN, 2 +inf, 3 -inf; y as rounded to the actual's format
        ca = 1 if x_nan else (2 if x == inf else (3 if x == -inf else 0))
        cy = 1 if y_nan else (2 if y >= overflow_at else (3 if y <= -overflow_at else 0))
        mismatch = ca != cy
        nan_mismatch += 1.0 if mismatch & ((ca == 1) | (cy == 1)) else 0.0
        inf_mismatch += 1.0 if mismatch & (ca != 1) & (cy != 1) else 0.0
        fin = (not mismatch) & (ca == 0) & (abs(gh) < inf) & (mh < inf)
        matched += 1.0 if (not mismatch) & (not fin) else 0.0
        err = (x - y) if fin else 0.0
        ae = abs(err)
        bad[h] = inf if mismatch else (ae if fin else -1.0)
        finite_n += 1.0 if fin else 0.0
        sum_abs += ae
        sum_sq += err * err
        max_abs = ae if ae > max_abs else max_abs
        normal = fin & (mh >= small_value)
        small = fin & (mh < small_value)
        rel = ae / mh if normal else 0.0
        normal_n += 1.0 if normal else 0.0
        sum_rel += rel
        max_rel = rel if rel > max_rel else max_rel
        small_abs = ae if small else 0.0
        small_n += 1.0 if small else 0.0
        max_small = small_abs if small_abs > max_small else max_small
        small_err += 1.0 if small_abs > small_atol else 0.0
        accumulated = ae / (mh if mh > acc_small else acc_small) if fin else 0.0
        max_acc = accumulated if accumulated > max_acc else max_acc
        xf, yf = (x if fin else 0.0), (y if fin else 0.0)
        dot_aa += xf * xf
        dot_ee += yf * yf
        dot_ae += xf * yf
        u = ae / ulp[h] if fin else 0.0
        max_ulp = u if u > max_ulp else max_ulp
        sum_ulp += u
        ulp_gt1 += 1.0 if u > 1.0 else 0.0
        scaled = ae / (mh if mh > small_value else small_value) if fin else inf
        within2 += 1.0 if scaled <= 1e-2 else 0.0
        within3 += 1.0 if scaled <= 1e-3 else 0.0
        within4 += 1.0 if scaled <= 1e-4 else 0.0
        up += 1.0 if err > 0.0 else 0.0
        down += 1.0 if err < 0.0 else 0.0
        toward += 1.0 if fin & (abs(xf) < abs(yf)) else 0.0
        away += 1.0 if fin & (abs(xf) > abs(yf)) else 0.0
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
    worst = o[BAD]
    for h in range(a.shape[0]):  # the first element with the largest badness (np.argmax's order)
        if bad[h] > worst:
            worst = bad[h]
            o[BAD], o[BAD_COL], o[BAD_A], o[BAD_E], o[BAD_G] = bad[h], h, a[h], e[h], g[h]


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
    total = np.empty(hidden)
    comp = np.empty(hidden)
    g = np.empty(hidden)
    m = np.empty(hidden)
    a = np.empty(hidden)
    d = np.empty(hidden)
    bad = np.empty(hidden)
    ulp_c = np.empty(hidden)
    ulp_d = np.empty(hidden)
    g_bits, ulp_c_bits, ulp_d_bits = g.view(np.uint64), ulp_c.view(np.uint64), ulp_d.view(np.uint64)
    p_c, e_c, p_d, e_d = int(p_cand[3]), int(p_cand[4]), int(p_dev[3]), int(p_dev[4])
    for i in range(start, stop):
        total[:] = 0.0
        comp[:] = 0.0
        m[:] = 0.0
        for t in range(top_k):
            j = index[i, t]
            if (mode == 1 and j < 0) or (mode == 2 and j >= limit):
                continue  # a skipped slot adds nothing
            for h in range(hidden):
                v = np.float64(_widen(rows[j, h]))
                s = total[h]
                new = s + v
                comp[h] += ((s - new) + v) if abs(s) >= abs(v) else ((v - new) + s)
                total[h] = new
                m[h] += abs(v)
        for h in range(hidden):
            if has_golden:
                g[h] = golden[i, h]
            else:
                s = total[h]
                g[h] = s + comp[h] if abs(s) < math.inf else s
            a[h] = np.float64(_widen(candidate[i, h]))
            d[h] = np.float64(_widen(device[i, h]))
        for h in range(hidden):
            # one ULP at g: 2^(max(e, emin) - p) with e the exponent of g (zero and subnormals: emin)
            exponent = np.int64((g_bits[h] >> np.uint64(52)) & np.uint64(0x7FF)) - 1023
            ulp_c_bits[h] = np.uint64(max(exponent, e_c) - p_c + 1023) << np.uint64(52)
            ulp_d_bits[h] = np.uint64(max(exponent, e_d) - p_d + 1023) << np.uint64(52)
        _row_stats(acc, i, 0, a, g, g, m, p_cand, ulp_c, bad)
        _row_stats(acc, i, 1, d, g, g, m, p_dev, ulp_d, bad)
        _row_stats(acc, i, 2, a, d, g, m, p_cand, ulp_c, bad)
