"""The compiled comparison: golden, scale and the three comparisons' statistics in one pass (numba).

Imported only when numba is (:mod:`moegrad.accuracy._fused`). For each output element the kernel
reads the call's K summands once, widened exactly to float64, and forms

- the golden: their exact sum rounded to float64 (the plain sum where that is not finite), as the
  NumPy path's golden: the Neumaier-compensated sum, and where its compensation term itself rounded
  (summands spread over more binades than float64 holds) Shewchuk's exact sum, as math.fsum;
- the scale: the float64 sum of their magnitudes;

then updates, per row, the sums, counts and maxima that :class:`moegrad.accuracy.Metrics` is made
of, for candidate vs golden, device vs golden and candidate vs device, with the definitions of
:func:`moegrad.accuracy.metrics` (docs/accuracy.md, "Metrics"). Elements are widened through the
same bit views as the reference kernel (:mod:`moegrad.numerics._fast_jit`): float32 as float32, float16 as
int16 words, bfloat16 as uint16 words.

The statistics are written so that LLVM turns each row's loop into SIMD code without changing a
value: counts are integers (exact in any order); maxima of non-negative values are taken as the
maxima of their bit patterns (integers, ordered as the values); a ULP is a power of two, so an
error in ULPs is the error times the exact inverse power; only the float sums may be reassociated
(their own function allows it, ``fastmath={"reassoc"}``), which moves their last bits, never a
count, a maximum or an element picked. The golden's compensated sum is compiled apart, strictly.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from moegrad.numerics._fast_jit import _compiled, _widen

# Per-row accumulator slots (the last axis of ``acc``), per comparison.
FINITE, NORMAL, SMALL, SUM_ABS, SUM_SQ, MAX_ABS, MAX_REL, SUM_REL, SMALL_ERR, MAX_SMALL, MAX_ACC = range(11)
DOT_AA, DOT_EE, DOT_AE, EQUAL, MAX_ULP, SUM_ULP, ULP_GT1, WITHIN_2, WITHIN_3, WITHIN_4 = range(11, 21)
NAN_MISMATCH, INF_MISMATCH, MATCHED, UP, DOWN, TOWARD, AWAY, BAD, BAD_COL, BAD_A, BAD_E, BAD_G = range(21, 33)
SLOTS = 33

_INT64_MIN = np.int64(-(2**63))


@intrinsic
def _bits(typingctx, value):
    """The bits of a float64 as an int64. For values >= +0.0 (and +inf) the integers order as the values do."""
    if value != types.float64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@intrinsic
def _float(typingctx, bits):
    """The float64 whose bits are ``bits`` (int64): the inverse of :func:`_bits`."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@njit(inline="always")
def _larger(x, y):
    """max(x, y) of two integers as a select: numba's builtin max is a call that no loop vectorises through."""
    return x if x > y else y


def _row_stats_for(checked):
    """The statistics of one row of one comparison, compiled with or without the NaN/Inf
    classification (``checked``, a constant numba folds).

    Longer than 80 lines on purpose, as :func:`row_stats` inside it is: a numba kernel body whose one
    loop over H LLVM vectorises whole, every statistic accumulated in registers in the same pass;
    split into functions, the loop would need each statistic's partial sums in memory between the
    pieces, or several passes over the row (the compare section of bench/RESULTS.md measures it)."""

    @_compiled(fastmath={"reassoc"}, error_model="numpy")
    def row_stats(o, a, e, g, m, p, inv_ulp, key):
        """One row of one comparison into ``o`` [SLOTS]: actual a [H], expected e [H], golden g [H],
        scale m [H], the inverse of one ULP at g [H] (an exact power of two); ``key`` [H] int64 receives
        each element's badness as :func:`_bits` (inf: a NaN/Inf mismatch; the error; -1.0: not judged).

        With ``checked`` False the caller vouches that every value of the row is finite and under
        the format's overflow (:func:`_unexceptional`), and the classification is left out; the
        figures are those ``checked`` gives for such a row. Branch-free (selects only). Only the
        float sums may be reassociated (this function's ``reassoc``); the NaN/Inf tests keep their
        meaning (no ``nnan``/``ninf``), and no product is fused into a sum (no ``contract``). NumPy's
        error model: a division checked for a zero divisor (Python's) is a branch out of the loop,
        which no loop vectorises; every divisor here is > 0.
        """
        small_value, small_atol, acc_small, overflow_at = p[0], p[1], p[2], p[5]
        inv_small_value, inv_acc_small = 1.0 / small_value, 1.0 / acc_small  # exact: both are powers of two
        inf = math.inf
        equal = nan_mismatch = inf_mismatch = matched = finite_n = normal_n = small_n = 0
        small_err = ulp_gt1 = within2 = within3 = within4 = up = down = toward = away = 0
        sum_abs = sum_sq = sum_rel = dot_aa = dot_ee = dot_ae = sum_ulp = 0.0
        max_abs = max_rel = max_small = max_acc = max_ulp = np.int64(0)
        worst = _INT64_MIN
        for h in range(a.shape[0]):
            x, y, gh, mh = a[h], e[h], g[h], m[h]
            same = (x == y) & (math.copysign(1.0, x) == math.copysign(1.0, y))
            if checked:
                x_nan, y_nan = x != x, y != y
                equal += 1 if same | (x_nan & y_nan) else 0
                # classes: 0 finite, 1 NaN, 2 +inf, 3 -inf; y as rounded to the actual's format
                ca = 1 if x_nan else (2 if x == inf else (3 if x == -inf else 0))
                cy = 1 if y_nan else (2 if y >= overflow_at else (3 if y <= -overflow_at else 0))
                mismatch = ca != cy
                nan_mismatch += 1 if mismatch & ((ca == 1) | (cy == 1)) else 0
                inf_mismatch += 1 if mismatch & (ca != 1) & (cy != 1) else 0
                fin = (not mismatch) & (ca == 0) & (abs(gh) < inf) & (mh < inf)
                matched += 1 if (not mismatch) & (not fin) else 0
            else:  # the caller found every value finite and under the format's overflow
                equal += 1 if same else 0
                mismatch, fin = False, True
            err = (x - y) if fin else 0.0
            ae = abs(err)
            k = _bits(inf if mismatch else (ae if fin else -1.0))
            key[h] = k
            worst = k if k > worst else worst
            finite_n += 1 if fin else 0
            sum_abs += ae
            sum_sq += err * err
            max_abs = _larger(max_abs, _bits(ae))
            normal = fin & (mh >= small_value)
            small = fin & (mh < small_value)
            # One division serves the three ratios: each divides by mh above its floor, and by the floor
            # (a power of two: times its exact inverse) below it.
            q = ae / mh
            rel = q if normal else 0.0
            normal_n += 1 if normal else 0
            sum_rel += rel
            max_rel = _larger(max_rel, _bits(rel))
            small_abs = ae if small else 0.0
            small_n += 1 if small else 0
            max_small = _larger(max_small, _bits(small_abs))
            small_err += 1 if small_abs > small_atol else 0
            accumulated = (q if mh > acc_small else ae * inv_acc_small) if fin else 0.0
            max_acc = _larger(max_acc, _bits(accumulated))
            xf, yf = (x if fin else 0.0), (y if fin else 0.0)
            dot_aa += xf * xf
            dot_ee += yf * yf
            dot_ae += xf * yf
            u = ae * inv_ulp[h]  # exactly ae / ULP: the ULP is a power of two
            max_ulp = _larger(max_ulp, _bits(u))
            sum_ulp += u
            ulp_gt1 += 1 if u > 1.0 else 0
            scaled = (q if mh > small_value else ae * inv_small_value) if fin else inf
            within2 += 1 if scaled <= 1e-2 else 0
            within3 += 1 if scaled <= 1e-3 else 0
            within4 += 1 if scaled <= 1e-4 else 0
            up += 1 if err > 0.0 else 0
            down += 1 if err < 0.0 else 0
            toward += 1 if fin & (abs(xf) < abs(yf)) else 0
            away += 1 if fin & (abs(xf) > abs(yf)) else 0
        o[FINITE] += finite_n
        o[NORMAL] += normal_n
        o[SMALL] += small_n
        o[SUM_ABS] += sum_abs
        o[SUM_SQ] += sum_sq
        o[MAX_ABS] = max(o[MAX_ABS], _float(max_abs))
        o[MAX_REL] = max(o[MAX_REL], _float(max_rel))
        o[SUM_REL] += sum_rel
        o[SMALL_ERR] += small_err
        o[MAX_SMALL] = max(o[MAX_SMALL], _float(max_small))
        o[MAX_ACC] = max(o[MAX_ACC], _float(max_acc))
        o[DOT_AA] += dot_aa
        o[DOT_EE] += dot_ee
        o[DOT_AE] += dot_ae
        o[EQUAL] += equal
        o[MAX_ULP] = max(o[MAX_ULP], _float(max_ulp))
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
        if _float(worst) > o[BAD]:  # the first element with the largest badness (np.argmax's order)
            for h in range(a.shape[0]):
                if key[h] == worst:
                    o[BAD], o[BAD_COL], o[BAD_A], o[BAD_E], o[BAD_G] = _float(worst), h, a[h], e[h], g[h]
                    break

    return row_stats


_row_stats = _row_stats_for(True)
_row_stats_finite = _row_stats_for(False)


@_compiled
def _unexceptional(a, d, g, m, overflow_at):
    """Whether every a, d, m [H] is finite and every |g| [H] under ``overflow_at``: nothing to classify."""
    ok = True
    for h in range(a.shape[0]):
        ok &= (abs(a[h]) < math.inf) & (abs(d[h]) < math.inf) & (abs(g[h]) < overflow_at) & (m[h] < math.inf)
    return ok


@_compiled
def _golden_row(rows, index, i, mode, limit, total, comp, m, g, rounded, partials):
    """Row i's golden g [H] (its summands' exact sum rounded to float64, the plain sum where that
    is not finite) and scale m [H] (the sum of their magnitudes). Strict IEEE order: compiled
    apart from the statistics, so no reassociation reaches the compensation.

    The Neumaier-compensated sum is that rounding while every add to the compensation term is
    exact; an element where one rounded (marked in ``rounded`` [H], as moegrad's golden marks it)
    is summed again exactly (:func:`_exact_sum`, into ``partials``) when its sum is finite."""
    hidden = g.shape[0]
    total[:] = 0.0
    comp[:] = 0.0
    m[:] = 0.0
    rounded[:] = False
    inexact = False
    for t in range(index.shape[1]):
        j = index[i, t]
        if (mode == 1 and j < 0) or (mode == 2 and (j < 0 or j >= limit)):
            continue  # a skipped slot adds nothing
        for h in range(hidden):
            v = np.float64(_widen(rows[j, h]))
            s = total[h]
            new = s + v
            lost = ((s - new) + v) if abs(s) >= abs(v) else ((v - new) + s)
            c = comp[h]
            summed = c + lost
            error = ((c - summed) + lost) if abs(c) >= abs(lost) else ((lost - summed) + c)
            lost_bits = error != 0.0  # NaN too (an infinite summand): that element's total is not finite
            rounded[h] |= lost_bits
            inexact |= lost_bits
            comp[h] = summed
            total[h] = new
            m[h] += abs(v)
    for h in range(hidden):
        s = total[h]
        g[h] = s + comp[h] if abs(s) < math.inf else s
    if inexact:
        for h in range(hidden):
            if rounded[h] and abs(total[h]) < math.inf:
                g[h] = _exact_sum(rows, index, i, mode, limit, h, partials)


@_compiled
def _golden_rows(rows, index, chosen, mode, limit, total, comp, m, g, rounded, partials):
    """:func:`_golden_row` of rows ``chosen`` [count] in turn: row chosen[k]'s golden into g[k] and
    scale into m[k] ([count, H] each). One call for a block of rows instead of one a row."""
    for k in range(chosen.shape[0]):
        _golden_row(rows, index, chosen[k], mode, limit, total, comp, m[k], g[k], rounded, partials)


@_compiled
def row_figures(values, golden, magnitude, zero_rows, limits, gammas, relative, ulps, failing, beyond):
    """Each row's figures of :func:`moegrad.accuracy._where.row_errors` for a block whose every value,
    golden and magnitude is finite, in one pass, with the NumPy path's operations in its order (so
    the same bits): ``|v - g|``; the relative error ``|v - g| / m`` where ``m`` reaches the small
    value (the row's largest into ``relative``, NaN for a row with none); the ULP distance
    ``ldexp(|v - g|, p - e)``, e the golden's binade (at least ``emin``; zero has ``emin``), as a
    product with that exact power of two (correctly rounded, as ``ldexp``), the row's largest into
    ``ulps``; ``failing`` where a relative error reaches its limit, an
    accumulative error ``|v - g| / max(m, floor)`` passes its bound, or a row whose every slot is
    skipped (``zero_rows``) is not +0.0; with ``gammas`` [rows] not empty, ``beyond`` where
    ``|v - g|`` passes the any-order bound ``gamma * m + 2^-50 * (m + |v|)`` plus half an ULP of
    the value's format at ``v`` (none for float32).

    ``values``, ``golden``, ``magnitude``: [rows, H] float64; ``limits``: small value, floor,
    relative limit, accumulative bound, p, emin, the format's overflow threshold, and 1.0 where the
    cast adds half an ULP. Returns False, leaving the outputs unfinished, at the first value or
    magnitude that is not finite or golden at or past the threshold: that block goes the NumPy way.
    """
    small, floor, max_relative, bound = limits[0], limits[1], limits[2], limits[3]
    mantissa, lowest, top, cast = np.int64(limits[4]), np.int64(limits[5]), limits[6], limits[7] != 0.0
    slack = 2.0**-50
    with_bound = gammas.shape[0] > 0
    for r in range(values.shape[0]):
        any_normal = False
        largest_relative = 0.0
        largest_ulps = 0.0
        fails = False
        outside = False
        positive_zero = True
        for h in range(values.shape[1]):
            v, g, m = values[r, h], golden[r, h], magnitude[r, h]
            if not (abs(v) < math.inf and abs(m) < math.inf and abs(g) < top):
                return False
            error = abs(v - g)
            if m >= small:
                any_normal = True
                rel = error / m
                fails |= rel >= max_relative
                largest_relative = max(largest_relative, rel)
            binade = max(((_bits(g) >> 52) & 0x7FF) - 1023, lowest)  # zero and subnormal: -1023
            largest_ulps = max(largest_ulps, error * _float((1023 + mantissa - binade) << 52))
            fails |= error / max(m, floor) > bound
            positive_zero &= v == 0.0 and math.copysign(1.0, v) > 0.0
            if with_bound:
                limit = gammas[r] * m
                limit += slack * (m + abs(v))
                if cast:  # half an ULP at v: 2^(e - p - 1), e v's binade (at least emin)
                    own = max(((_bits(v) >> 52) & 0x7FF) - 1023, lowest)
                    limit += _float((1023 - 1 + own - mantissa) << 52)
                outside |= error > limit
        relative[r] = largest_relative if any_normal else math.nan
        ulps[r] = largest_ulps
        failing[r] = fails or (zero_rows[r] and not positive_zero)
        if with_bound:
            beyond[r] = outside
    return True


@_compiled
def _exact_sum(rows, index, i, mode, limit, h, partials):
    """The exact sum of row i's summands in column h, rounded to nearest float64: math.fsum's
    algorithm (Shewchuk's non-overlapping partials, then the half-way correction), for finite
    summands whose partial sums stay finite (widened float32 values: at most 2**128 * K).
    ``partials`` [64]: scratch (widened float32 values span 277 binades: at most 7 partials)."""
    n = 0
    for t in range(index.shape[1]):
        j = index[i, t]
        if (mode == 1 and j < 0) or (mode == 2 and (j < 0 or j >= limit)):
            continue
        x = np.float64(_widen(rows[j, h]))
        k = 0
        for p in range(n):
            y = partials[p]
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo != 0.0:
                partials[k] = lo
                k += 1
            x = hi
        partials[k] = x
        n = k + 1
    hi = 0.0
    if n > 0:
        n -= 1
        hi = partials[n]
        lo = 0.0
        while n > 0:
            x = hi
            n -= 1
            y = partials[n]
            hi = x + y
            lo = y - (hi - x)
            if lo != 0.0:
                break
        # half-way case: the partials below tip it (math.fsum's correction)
        if n > 0 and ((lo < 0.0 and partials[n - 1] < 0.0) or (lo > 0.0 and partials[n - 1] > 0.0)):
            y = lo * 2.0
            x = hi + y
            if y == x - hi:
                hi = x
    return hi


@_compiled
def _widen_row(source, i, out):
    for h in range(out.shape[0]):
        out[h] = np.float64(_widen(source[i, h]))


@_compiled
def _inverse_ulps(g, p_c, e_c, p_d, e_d, inv_c, inv_d):
    """The inverse of one ULP at each g [H] in the candidate's and the device's format: 2^(p - max(e, emin))
    with e the exponent of g (zero and subnormals: emin); exact powers of two."""
    g_bits = g.view(np.uint64)
    c_bits, d_bits = inv_c.view(np.uint64), inv_d.view(np.uint64)
    for h in range(g.shape[0]):
        exponent = np.int64((g_bits[h] >> np.uint64(52)) & np.uint64(0x7FF)) - 1023
        c_bits[h] = np.uint64(1023 - (_larger(exponent, e_c) - p_c)) << np.uint64(52)
        d_bits[h] = np.uint64(1023 - (_larger(exponent, e_d) - p_d)) << np.uint64(52)


@_compiled
def compare_rows(rows, index, mode, limit, candidate, device, golden, has_golden, start, stop, p_cand, p_dev, acc):
    """Rows [start, stop) of grad_x: acc[i, 0..2] for candidate vs golden, device vs golden, candidate vs device.

    ``rows`` [R, H] and ``device`` [N, H] are bit views of the call's dtype, ``candidate`` [N, H] of its
    own; ``index`` [N, K] int32; ``mode`` 0 dropless (nothing skipped), 1 drop/pad (index < 0
    skipped), 2 skips an index outside [0, ``limit``) (active: limit A; a dropless call on
    ascend950@9.1: N*K); ``golden`` [N, H] float64 is used when ``has_golden``.
    ``p_cand`` / ``p_dev``: small_value, small_value_atol, accumulative_small_value, mantissa bits
    and min exponent of the actual's dtype, and the overflow threshold of that dtype.
    """
    hidden = candidate.shape[1]
    total = np.empty(hidden)
    comp = np.empty(hidden)
    g = np.empty(hidden)
    m = np.empty(hidden)
    a = np.empty(hidden)
    d = np.empty(hidden)
    key = np.empty(hidden, dtype=np.int64)
    rounded = np.empty(hidden, dtype=np.bool_)
    partials = np.empty(64)
    inv_c = np.empty(hidden)
    inv_d = np.empty(hidden)
    p_c, e_c, p_d, e_d = int(p_cand[3]), int(p_cand[4]), int(p_dev[3]), int(p_dev[4])
    overflow_at = min(p_cand[5], p_dev[5])
    for i in range(start, stop):
        _golden_row(rows, index, i, mode, limit, total, comp, m, g, rounded, partials)
        if has_golden:
            g[:] = golden[i]
        _widen_row(candidate, i, a)
        _widen_row(device, i, d)
        _inverse_ulps(g, p_c, e_c, p_d, e_d, inv_c, inv_d)
        if _unexceptional(a, d, g, m, overflow_at):
            _row_stats_finite(acc[i, 0], a, g, g, m, p_cand, inv_c, key)
            _row_stats_finite(acc[i, 1], d, g, g, m, p_dev, inv_d, key)
            _row_stats_finite(acc[i, 2], a, d, g, m, p_cand, inv_c, key)
        else:
            _row_stats(acc[i, 0], a, g, g, m, p_cand, inv_c, key)
            _row_stats(acc[i, 1], d, g, g, m, p_dev, inv_d, key)
            _row_stats(acc[i, 2], a, d, g, m, p_cand, inv_c, key)
