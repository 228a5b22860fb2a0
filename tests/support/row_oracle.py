"""Slow per-element oracles for the compare reports' row errors, the factor analysis and the HTML map.

Written from docs/accuracy.md alone ("Where the error lives", "Which factor makes cases fail", "A page
to look at", "Metrics", "Small values", "Standards", "The any-order bound"), one element at a time
in Python floats, sharing no code with ``moegrad.accuracy``: the golden is ``math.fsum`` of a row's
summands, ULPs come from ``math.frexp``, percentiles are ranks of a sorted list, and the Fisher test
is exact rational arithmetic over binomial coefficients. Nothing of moegrad is imported.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

__all__ = ["LIMITS", "RowFigures", "factor_support", "fisher_exact", "nearest_rank", "row_figures", "scaled_map"]

# docs/accuracy.md: (fraction bits, smallest normal exponent, small_value, threshold T,
# accumulative bound) per dtype ("Small values", "threshold", "accumulative").
LIMITS = {
    "float16": (10, -14, 2.0**-10, 2.0**-10, 2.0**-8),
    "bfloat16": (7, -126, 2.0**-10, 2.0**-7, 2.0**-7),
    "float32": (23, -126, 2.0**-20, 2.0**-13, 2.0**-11),
}
_U = 2.0**-24


def _name(dtype: np.dtype) -> str:
    return "bfloat16" if dtype.name == "bfloat16" else np.dtype(dtype).name


def ulp_of(value: float, dtype: str) -> float:
    """One ULP of ``dtype`` at ``value``: 2^(e - p) for |v| in [2^e, 2^(e+1)); the smallest subnormal at 0."""
    bits, emin = LIMITS[dtype][:2]
    if value == 0:
        return 2.0 ** (emin - bits)
    _, exponent = math.frexp(value)
    return 2.0 ** (max(exponent - 1, emin) - bits)


def nearest_rank(values: list[float], percent: int) -> float:
    """The value of rank ceil(percent * n / 100) (1-based) in ascending order; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(Fraction(percent * len(ordered), 100)))
    return ordered[rank - 1]


def _rounded_class(value: float, dtype: str) -> int:
    """The NaN/Inf class (0 finite, 1 NaN, 2 +inf, 3 -inf) of ``value`` rounded to ``dtype``."""
    if math.isnan(value):
        return 1
    top = {"float16": 65520.0, "bfloat16": 2.0**128 - 2.0**119, "float32": 2.0**128 - 2.0**103}[dtype]
    if value >= top:
        return 2
    if value <= -top:
        return 3
    return 0


def _class(value: float) -> int:
    return 1 if math.isnan(value) else 2 if value == math.inf else 3 if value == -math.inf else 0


class RowFigures:
    """Every figure of a report's row errors, from the slow loops (attributes named as the report's)."""

    def __init__(self) -> None:
        self.differing = self.failing = self.device_failing = self.outside_bound = 0
        self.nonfinite = self.device_nonfinite = 0
        self.relative: list[tuple[int, float]] = []
        self.device_relative: list[tuple[int, float]] = []
        self.ulp: list[tuple[int, float]] = []
        self.device_ulp: list[tuple[int, float]] = []
        self.first_nonfinite: dict | None = None

    @staticmethod
    def spread(pairs: list[tuple[int, float]]) -> dict:
        """The percentiles of (row, figure) pairs, as the report's dict form writes them."""
        values = [v for _, v in pairs]
        if not values:
            return {"rows": 0, "p50": "nan", "p90": "nan", "p99": "nan", "max": "nan", "max_row": None}
        top = max(values)
        return {
            "rows": len(values),
            "p50": nearest_rank(values, 50),
            "p90": nearest_rank(values, 90),
            "p99": nearest_rank(values, 99),
            "max": top,
            "max_row": min(row for row, v in pairs if v == top),
        }


def _slots(index_row: list[int], rows: int, capacity: int | None) -> dict:
    skipped = [v < 0 or v >= rows for v in index_row]
    read = [None if s else v for v, s in zip(index_row, skipped, strict=True)]
    return {
        "t": list(range(len(index_row))),
        "index": list(index_row),
        "row": read,
        "skipped": skipped,
        "expert": [None if capacity is None or r is None else r // capacity for r in read],
        "capacity_row": [None if capacity is None or r is None else r % capacity for r in read],
    }


def _side(values: list[float], golden: list[float], magnitude: list[float], dtype: str, call_dtype: str,
          zero_row: bool) -> tuple[float | None, float | None, bool, bool, list[bool]]:
    """One row of one side: largest relative error, largest ULP error, failing, NaN/Inf, finite mask."""
    _, _, small, threshold, bound = LIMITS[call_dtype]
    rel = ulps = None
    failing = nonfinite = False
    finite_mask = []
    for v, g, m in zip(values, golden, magnitude, strict=True):
        cv, cg = _class(v), _rounded_class(g, dtype)
        finite = cv == 0 and cg == 0 and math.isfinite(g) and math.isfinite(m)
        finite_mask.append(finite)
        nonfinite |= cv != 0
        failing |= cv != cg
        if zero_row and not (v == 0 and math.copysign(1.0, v) > 0):
            failing = True
        if not finite:
            continue
        error = abs(v - g)
        u = error / ulp_of(g, dtype)
        ulps = u if ulps is None else max(ulps, u)
        if m >= small:
            r = error / m
            rel = r if rel is None else max(rel, r)
            failing |= r >= 10 * threshold
        failing |= error / max(m, 1.0) > bound
    return rel, ulps, failing, nonfinite, finite_mask


def _bound(magnitude: float, added: int, value: float, dtype: str) -> float:
    """docs/accuracy.md, "The any-order bound": gamma_(n-1) * sum |x_t| + the cast's half ULP + slack."""
    steps = max(added - 1, 0)
    gamma = steps * _U / (1 - steps * _U)
    cast = 0.0 if dtype == "float32" else 0.5 * ulp_of(abs(value), dtype)
    return gamma * magnitude + cast + 2.0**-50 * (magnitude + abs(value))


def row_figures(grad: np.ndarray, index: np.ndarray, top_k: int, drop_pad_mode: int, candidate: np.ndarray,
                device: np.ndarray) -> RowFigures:
    """Every row-error figure of ``candidate`` and ``device`` ([N, H]) for a call on a profile whose
    skipped slots are the indices past the rows or negative (every profile for valid calls)."""
    hidden = grad.shape[-1]
    flat = grad.reshape(-1, hidden).astype(np.float64)
    rows = flat.shape[0]
    capacity = grad.shape[1] if drop_pad_mode == 1 else None
    cand_dtype, call_dtype = _name(candidate.dtype), _name(grad.dtype)
    index2 = [[int(v) for v in index[i * top_k:(i + 1) * top_k]] for i in range(candidate.shape[0])]
    out = RowFigures()
    for i, slots in enumerate(index2):
        read = [v for v in slots if 0 <= v < rows]
        golden = [math.fsum(float(flat[r, h]) for r in read) if all(math.isfinite(flat[r, h]) for r in read)
                  else float(sum(flat[r, h] for r in read)) for h in range(hidden)]
        magnitude = [math.fsum(abs(float(flat[r, h])) for r in read) if all(math.isfinite(flat[r, h]) for r in read)
                     else float(sum(abs(flat[r, h]) for r in read)) for h in range(hidden)]
        zero_row = not read
        c = [float(v) for v in candidate[i].astype(np.float64)]
        d = [float(v) for v in device[i].astype(np.float64)]
        rel, ulps, failing, nonfinite, finite = _side(c, golden, magnitude, cand_dtype, call_dtype, zero_row)
        drel, dulps, dfailing, dnonfinite, _ = _side(d, golden, magnitude, call_dtype, call_dtype, zero_row)
        out.failing += failing
        out.device_failing += dfailing
        out.nonfinite += nonfinite
        out.device_nonfinite += dnonfinite
        for pairs, value in ((out.relative, rel), (out.device_relative, drel), (out.ulp, ulps), (out.device_ulp, dulps)):
            if value is not None:
                pairs.append((i, value))
        same = all((a == b and math.copysign(1, a) == math.copysign(1, b)) or (math.isnan(a) and math.isnan(b))
                   for a, b in zip(c, d, strict=True))
        out.differing += not same
        out.outside_bound += any(f and abs(v - g) > _bound(m, len(read), v, cand_dtype)
                                 for f, v, g, m in zip(finite, c, golden, magnitude, strict=True))
        if nonfinite and out.first_nonfinite is None:
            columns = [h for h, v in enumerate(c) if not math.isfinite(v)]
            table = _slots(slots, rows, capacity)
            out.first_nonfinite = {
                "row": i,
                "count": len(columns),
                "columns": columns[:8],
                "device_count": sum(not math.isfinite(v) for v in d),
                "golden_count": sum(not math.isfinite(g) for g in golden),
                "slots": table,
                "carriers": [t for t, r in enumerate(table["row"])
                             if r is not None and any(not math.isfinite(flat[r, h]) for h in columns)],
            }
    return out


def expected_dict(figures: RowFigures, n: int) -> dict:
    """The row errors' dict form (``report.row_errors.to_dict()``) the figures give."""
    return {
        "rows": n,
        "differing": figures.differing,
        "failing": figures.failing,
        "device_failing": figures.device_failing,
        "outside_bound": figures.outside_bound,
        "nonfinite": figures.nonfinite,
        "device_nonfinite": figures.device_nonfinite,
        "relative_error": RowFigures.spread(figures.relative),
        "device_relative_error": RowFigures.spread(figures.device_relative),
        "ulp_error": RowFigures.spread(figures.ulp),
        "device_ulp_error": RowFigures.spread(figures.device_ulp),
        "first_nonfinite": figures.first_nonfinite,
    }


def scaled_map(grad: np.ndarray, index: np.ndarray, top_k: int, drop_pad_mode: int, candidate: np.ndarray,
               blocks: int = 32) -> tuple[list[int], list[int], list[list[float]]]:
    """The HTML page's error map from its definition: each element's |candidate - golden| /
    max(magnitude, small_value) (inf for a NaN/Inf unlike the golden's), the largest per block;
    blocks split N (or E) and H (or C) at floor(b * count / blocks). Drop/pad: experts x capacity
    rows, each place the largest row error of a token reading it (NaN: none does)."""
    hidden = grad.shape[-1]
    flat = grad.reshape(-1, hidden).astype(np.float64)
    rows = flat.shape[0]
    n = candidate.shape[0]
    small = LIMITS[_name(grad.dtype)][2]
    dtype = _name(candidate.dtype)
    errors = []
    for i in range(n):
        read = [int(v) for v in index[i * top_k:(i + 1) * top_k] if 0 <= v < rows]
        line = []
        for h in range(hidden):
            g = math.fsum(float(flat[r, h]) for r in read)
            m = math.fsum(abs(float(flat[r, h])) for r in read)
            v = float(candidate[i, h])
            if _class(v) != _rounded_class(g, dtype):
                line.append(math.inf)
            elif _class(v) != 0:
                line.append(0.0)
            else:
                line.append(abs(v - g) / max(m, small))
        errors.append(line)

    def edges(count: int) -> list[int]:
        b = max(1, min(count, blocks))
        return [(k * count) // b for k in range(b + 1)]

    if drop_pad_mode == 1:
        experts, capacity = grad.shape[0], grad.shape[1]
        re, ce = edges(experts), edges(capacity)
        cells = [[math.nan] * (len(ce) - 1) for _ in range(len(re) - 1)]
        for i in range(n):
            worst = max(errors[i]) if errors[i] else 0.0
            for v in index[i * top_k:(i + 1) * top_k]:
                if 0 <= v < rows:
                    e, c = int(v) // capacity, int(v) % capacity
                    a = max(k for k in range(len(re) - 1) if re[k] <= e)
                    b = max(k for k in range(len(ce) - 1) if ce[k] <= c)
                    cells[a][b] = worst if math.isnan(cells[a][b]) else max(cells[a][b], worst)
        return re, ce, cells
    re, ce = edges(n), edges(hidden)
    cells = [[max(errors[i][h] for i in range(re[a], re[a + 1]) for h in range(ce[b], ce[b + 1]))
              for b in range(len(ce) - 1)] for a in range(len(re) - 1)]
    return re, ce, cells


def fisher_exact(failing_with: int, failing: int, with_condition: int, total: int) -> Fraction:
    """P(X >= failing_with), X hypergeometric, as an exact fraction of binomial coefficients."""
    tail = sum(math.comb(failing, x) * math.comb(total - failing, with_condition - x)
               for x in range(failing_with, min(failing, with_condition) + 1))
    return Fraction(tail, math.comb(total, with_condition))


def factor_support(cases: list[dict], condition) -> tuple[int, int, int, int]:
    """(failing with, failing without, passing with, passing without) of ``condition`` (a
    predicate over a case's dict) over cases whose ``status`` is fail, pass or warning."""
    counts = [0, 0, 0, 0]
    for case in cases:
        if case["status"] not in ("fail", "pass", "warning"):
            continue
        failing = case["status"] == "fail"
        holds = bool(condition(case))
        counts[(0 if failing else 2) + (0 if holds else 1)] += 1
    return counts[0], counts[1], counts[2], counts[3]
