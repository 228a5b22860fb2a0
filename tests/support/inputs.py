"""Random inputs for the reference tests: the dtypes and K values they sweep, and calls of every mode.

:func:`random_call` makes (grad, idx, drop_pad_mode, active_num) with token 0's slots all skipped
where the mode skips; :func:`wide_values` fills grad over a wide dynamic range with signed zeros,
infinities and NaN sprinkled in. Nothing here imports moegrad.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

__all__ = ["BF16", "F16", "F32", "GRAD_DTYPES", "KS", "MODES", "ORDERS", "random_call", "wide_values"]

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
GRAD_DTYPES = [F16, BF16, F32]
KS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 127, 128, 129, 130, 256]
MODES = ["dropless", "active", "drop_pad"]
ORDERS = ["ascend910b", "sequential"]


def wide_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, top_k: int) -> np.ndarray:
    """Values over a wide dynamic range, with +0.0, -0.0, +inf, -inf and quiet NaN sprinkled in.

    Infinities and NaN are rare enough (0.06/K per slot each) that about 5 in 6 output elements stay finite.
    A value past the format's range (float16 from 65520, the top binade of the others) is inf.
    """
    size = math.prod(shape)
    # exponents: mostly a 32-binade window; now and then (about twice per output element) the whole
    # range of the format, subnormals included, up to the largest binade.
    narrow, full = {F16: ((-14, 8), (-26, 16)), BF16: ((-20, 12), (-135, 128)), F32: ((-20, 12), (-150, 128))}[dtype]
    exponent = np.where(rng.random(size) < min(0.1, 2 / top_k), rng.integers(*full, size), rng.integers(*narrow, size))
    values = rng.choice([-1.0, 1.0], size) * (1.0 + rng.random(size)) * np.exp2(exponent.astype(np.float64))
    u = rng.random(size)
    p = 0.06 / top_k
    values[u < 0.05] = 0.0
    values[(u >= 0.05) & (u < 0.10)] = -0.0
    values[(u >= 0.10) & (u < 0.10 + p)] = np.inf
    values[(u >= 0.10 + p) & (u < 0.10 + 2 * p)] = -np.inf
    values[(u >= 0.10 + 2 * p) & (u < 0.10 + 3 * p)] = np.nan
    with np.errstate(all="ignore"):  # values past the format's range become inf, by design
        return values.astype(dtype).reshape(shape)


def random_call(rng: np.random.Generator, mode: str, top_k: int, dtype: np.dtype, tokens: int, hidden: int):
    """(grad, idx, drop_pad_mode, active_num) with token 0's slots all skipped where the mode skips."""
    slots = tokens * top_k
    if mode == "dropless":
        idx = rng.permutation(slots)
        grad_rows: tuple[int, ...] = (slots,)
        drop_pad_mode, active_num = 0, 0
    elif mode == "active":  # needs tokens >= 2
        active_num = int(rng.integers(1, slots - top_k + 1))
        never_materialised = rng.choice(np.arange(active_num, slots), size=top_k, replace=False)
        rest = rng.permutation(np.setdiff1d(np.arange(slots), never_materialised))
        idx = np.concatenate([never_materialised, rest])
        grad_rows = (active_num,)
        drop_pad_mode = 0
    else:
        capacity = int(rng.integers(1, 6))
        experts = -(-(slots + 3) // capacity)
        idx = rng.choice(experts * capacity, size=slots, replace=False)
        idx[rng.random(slots) < 0.3] = -1
        idx[:top_k] = -1
        grad_rows = (experts, capacity)
        drop_pad_mode, active_num = 1, 0
    grad = wide_values(rng, (*grad_rows, hidden), dtype, top_k)
    return grad, idx.astype(np.int32), drop_pad_mode, active_num
