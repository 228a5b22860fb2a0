"""The fast path of :func:`moegrad.compare`: the three comparisons in one compiled pass, when numba is installed.

The NumPy path computes the float64 golden and the summands' magnitude in two passes over the call
(each a gather of N*K rows), then each comparison with a dozen float64 temporaries of N*H elements.
Here one kernel (:mod:`moegrad.accuracy._fused_jit`) reads each summand once and keeps per-row sums,
counts and maxima; the rows are spread over the reference module's thread pool. The metrics are
those of :func:`moegrad.accuracy.metrics`; sums are added in a different order, so means and RMSE
can differ from the NumPy path's in the last bits; the golden is the NumPy path's, bit for bit (the
exact sum rounded once to float64).
"""

from __future__ import annotations

import math
import threading
from types import ModuleType

import ml_dtypes
import numpy as np

from moegrad._dtypes import dtype_name
from moegrad._errors import DeadlineExceeded
from moegrad.accuracy._results import Metrics, WorstElement
from moegrad.accuracy._standards import DTYPE_LIMITS
from moegrad.numerics._fast import CompiledModule, KernelCache
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["available", "fused_metrics", "warm_up_metrics"]

_VIEWS: dict[np.dtype, np.dtype] = {
    np.dtype(np.float32): np.dtype(np.float32),
    np.dtype(np.float16): np.dtype(np.int16),
    np.dtype(ml_dtypes.bfloat16): np.dtype(np.uint16),
}
# |x| at or above which a finite float64 rounds to inf in the format (half the top ULP above the maximum).
_OVERFLOW_AT = {"float32": 2.0**128 - 2.0**103, "float16": 65520.0, "bfloat16": 2.0**128 - 2.0**119}
_CHUNK_ELEMENTS = 1 << 16  # output elements per task of the pool
_CHUNK_ROWS = 4096  # and at most this many rows (each row costs microseconds, however short): a stop waits one

_KERNELS = CompiledModule("moegrad.accuracy._fused_jit")


def _load() -> ModuleType | None:
    """The compiled comparison, imported on first use; None where numba cannot be imported."""
    return _KERNELS.load()


def available() -> bool:
    """Whether the compiled comparison can run here (numba imports)."""
    return _load() is not None


def compare_cache() -> KernelCache:
    """What numba's on-disk cache gave the compiled comparison in this process so far
    (:class:`moegrad.KernelCache`: loaded from a warm cache, or compiled)."""
    return _KERNELS.cache()


def warm_up_metrics() -> bool:
    """Compile (or load from numba's on-disk cache) the comparison for every dtype and candidate
    dtype; False when numba is missing (:func:`moegrad.accuracy.warm_up_compare` calls it)."""
    if _load() is None:
        return False
    for dtype in _VIEWS:
        for candidate_dtype in {dtype, np.dtype(np.float32)}:
            x = np.ones((2, 1), dtype=dtype)
            call = MoeInitRoutingV2GradCall(grad_expanded_x=x, expanded_row_idx=np.arange(2, dtype=np.int32), top_k=2)
            fused_metrics(call, np.ones((1, 1), dtype=candidate_dtype), np.ones((1, 1), dtype=dtype))
            fused_metrics(call, np.ones((1, 1), dtype=candidate_dtype), np.ones((1, 1), dtype=dtype), np.ones((1, 1)))
    return True


def _params(dtype: str, actual: str) -> np.ndarray:
    limits, actual_limits = DTYPE_LIMITS[dtype], DTYPE_LIMITS[actual]
    # The kernel divides by these floors as products with their inverses, exact only for powers of two.
    for floor in (limits.small_value, limits.accumulative_small_value):
        assert math.frexp(floor)[0] == 0.5, f"{floor} is not a power of two"
    return np.array(
        [
            limits.small_value,
            limits.small_value_atol,
            limits.accumulative_small_value,
            actual_limits.mantissa_bits,
            actual_limits.min_exponent,
            _OVERFLOW_AT[actual],
        ],
        dtype=np.float64,
    )


def _view(array: np.ndarray) -> np.ndarray | None:
    view = _VIEWS.get(array.dtype)
    if view is None or not array.flags.c_contiguous:
        return None
    return _read_only(array.view(view))


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view: numba types a read-only array apart from a writeable one, so every input
    goes in read-only and one compiled signature (the one :func:`warm_up_compare` compiles) serves
    both an array of the caller's and one viewed in a request's receive buffer."""
    view = array.view()
    view.flags.writeable = False
    return view


def fused_metrics(
    call: MoeInitRoutingV2GradCall,
    candidate: np.ndarray,
    device_result: np.ndarray,
    golden: np.ndarray | None = None,
    stop: threading.Event | None = None,
    parallel: bool = True,
) -> tuple[Metrics, Metrics, Metrics] | None:
    """candidate vs golden, device vs golden, candidate vs device, relative to the summands' magnitude.

    The blocks of rows are spread over the reference module's shared thread pool, or computed on
    the calling thread alone when ``parallel`` is False.

    Returns None when this path cannot take the inputs (numba missing, a byte-swapped or strided
    array, an empty grad_x): the caller runs the NumPy path.

    Raises:
        DeadlineExceeded: ``stop`` was set (checked before each block of rows).
    """
    jit = _load()
    tokens, hidden = call.num_tokens, call.hidden_size
    if jit is None or tokens == 0 or hidden == 0:
        return None
    rows = _view(call.grad_expanded_x.reshape(-1, hidden))
    views = _view(candidate), _view(device_result)
    if rows is None or views[0] is None or views[1] is None or rows.shape[0] == 0:
        return None
    if golden is not None and (golden.dtype != np.float64 or not golden.flags.c_contiguous):
        return None
    index = _read_only(np.ascontiguousarray(call.expanded_row_idx.reshape(-1, call.top_k), dtype=np.int32))
    # what a slot whose index is outside [0, rows) does: 1 skips index < 0 (drop/pad), 2 skips any (active,
    # and dropless where the profile makes such a slot a +0.0 row), 0 none (dropless: validation left none)
    lenient = call.profile.skips_any_negative or call.profile.skips_dropless_overflow
    mode = 1 if call.drop_pad_mode == 1 else 2 if call.active_num > 0 or lenient else 0
    limit = call.active_num if call.active_num > 0 else rows.shape[0]
    dtype, candidate_dtype = call.dtype_name, dtype_name(candidate.dtype)
    assert candidate_dtype is not None, "_view took the candidate, so its dtype is a wire dtype"
    p_cand, p_dev = _params(dtype, candidate_dtype), _params(dtype, dtype)
    acc = np.zeros((tokens, 3, jit.SLOTS), dtype=np.float64)
    acc[:, :, jit.BAD] = -2.0
    has_golden = golden is not None
    golden_in = _read_only(golden if golden is not None else np.zeros((1, 1), dtype=np.float64))

    def run(start: int, end: int) -> None:
        if stop is not None and stop.is_set():
            raise DeadlineExceeded("the comparison was stopped: its caller gave up on it")
        jit.compare_rows(
            rows,
            index,
            mode,
            limit,
            views[0],
            views[1],
            golden_in,
            has_golden,
            start,
            end,
            p_cand,
            p_dev,
            acc,
        )

    from moegrad.numerics import _reference  # the shared pool of the reference kernels

    step = max(1, min(_CHUNK_ROWS, _CHUNK_ELEMENTS // hidden))
    if parallel:
        _reference._map_chunks(run, tokens, step)
    else:
        for start in range(0, tokens, step):
            run(start, min(start + step, tokens))
    totals = acc.sum(axis=0)
    maxima = acc.max(axis=0)
    actual = (candidate_dtype, dtype, candidate_dtype)
    cand_gold, dev_gold, cand_dev = (
        _sums_metrics(jit, acc[:, k], totals[k], maxima[k], dtype, actual[k], tokens * hidden, hidden) for k in range(3)
    )
    return cand_gold, dev_gold, cand_dev


def _sums_metrics(
    jit: ModuleType,
    per_row: np.ndarray,
    total: np.ndarray,
    maximum: np.ndarray,
    dtype: str,
    actual: str,
    count: int,
    hidden: int,
) -> Metrics:
    def share(part: float, whole: float) -> float:
        return part / whole if whole else math.nan

    def largest(slot: int, over: int) -> float:
        return float(maximum[slot]) if total[over] else math.nan

    n, normal, small = (int(total[jit.FINITE]), int(total[jit.NORMAL]), int(total[jit.SMALL]))
    if n == 0:
        cosine = math.nan
    else:
        norm_a, norm_e = math.sqrt(total[jit.DOT_AA]), math.sqrt(total[jit.DOT_EE])
        if norm_a == 0 and norm_e == 0:
            cosine = 1.0
        elif norm_a == 0 or norm_e == 0:
            cosine = 0.0
        else:
            cosine = float(total[jit.DOT_AE]) / norm_a / norm_e
    up, down = int(total[jit.UP]), int(total[jit.DOWN])
    toward, away = int(total[jit.TOWARD]), int(total[jit.AWAY])
    nonzero = up + down
    matched = int(total[jit.MATCHED])
    worst = None
    bad = per_row[:, jit.BAD]
    if bad.max() > 0:
        row = int(np.argmax(bad))  # the first row holding the largest: np.argmax's flat order
        a, e, g = (float(per_row[row, slot]) for slot in (jit.BAD_A, jit.BAD_E, jit.BAD_G))
        worst = WorstElement(
            row=row, column=int(per_row[row, jit.BAD_COL]), actual=a, expected=e, golden=g, abs_error=float(abs(a - e))
        )
    small_errors = int(total[jit.SMALL_ERR])
    return Metrics(
        dtype=dtype,
        actual_dtype=actual,
        relative_to="magnitude",
        count=count,
        finite_count=n,
        normal_count=normal,
        small_count=small,
        max_abs_error=largest(jit.MAX_ABS, jit.FINITE),
        mean_abs_error=share(float(total[jit.SUM_ABS]), n),
        rmse=math.sqrt(share(float(total[jit.SUM_SQ]), n)),
        max_relative_error=largest(jit.MAX_REL, jit.NORMAL),
        mean_relative_error=share(float(total[jit.SUM_REL]), normal),
        small_value_error_count=small_errors,
        small_value_error_rate=share(small_errors, small),
        max_small_value_abs_error=largest(jit.MAX_SMALL, jit.SMALL),
        max_accumulative_error=largest(jit.MAX_ACC, jit.FINITE),
        cosine_similarity=cosine,
        bitwise_equal_count=int(total[jit.EQUAL]),
        bitwise_equal_share=share(int(total[jit.EQUAL]), count),
        max_ulp_error=largest(jit.MAX_ULP, jit.FINITE),
        mean_ulp_error=share(float(total[jit.SUM_ULP]), n),
        ulp_error_above_1_share=share(int(total[jit.ULP_GT1]), n),
        hundredth_share=share(int(total[jit.WITHIN_2]) + matched, count),
        thousandth_share=share(int(total[jit.WITHIN_3]) + matched, count),
        ten_thousandth_share=share(int(total[jit.WITHIN_4]) + matched, count),
        nan_mismatch_count=int(total[jit.NAN_MISMATCH]),
        inf_mismatch_count=int(total[jit.INF_MISMATCH]),
        positive_error_share=share(up, n),
        negative_error_share=share(down, n),
        toward_zero_share=share(toward, n),
        away_from_zero_share=share(away, n),
        nonzero_error_count=nonzero,
        error_imbalance=max(abs(up - down), abs(away - toward)) / nonzero if nonzero else math.nan,
        worst=worst,
    )
