"""The independent slow oracles of the reference numerics: per-row loops written from the documented order.

Nothing here imports moegrad. Each loop computes gradX one token and one slot at a time, in the
order docs/semantics.md documents, and rounds each float32 sum to the output dtype with an IEEE
round-half-to-even written from the definition (not NumPy's cast):

- :func:`slow_grad_x`: the A2/A3 (``ascend910b``) kernel's order, section 3 (bins, S1-S4, skip
  rules), or Huawei's sequential golden (``order="sequential"``), section 2;
- :func:`slow950`: the Ascend 950's order, section 7.2 (chunks of K, groups of four), with
  :func:`expected_chunk` the K chunk of section 7.1 for the small shapes the sweeps use;
- :func:`slow_profile`: any device profile (a chip at one CANN release), from :data:`SLOW_PROFILES`,
  this module's own table of what each kernel source does (its order of adds and which slot
  indices it turns into +0.0 rows), written from the sources, not from moegrad's table;
- :func:`every_add_tree`: every binary tree of float32 adds over K slots, to prove a hand-written
  order the only one that fits.

tests/unit/numerics/test_reference.py and tests/unit/numerics/test_ascend950.py check these loops by hand before the
other tests trust them.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

__all__ = ["REVISIONS", "SLOW_ALIASES", "SLOW_PROFILES", "ascend950_row", "device_order_row", "double_factorial",
           "every_add_tree", "expected_chunk", "floor_log2", "round_from_float32", "sequential_row", "slot_skipped",
           "slow950", "slow_grad_x", "slow_profile"]

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
REVISIONS = {"ascend950": True, "ascend950@2025-12": False}  # docs 7.5: groups of four, or a plain chain

# Every device profile, from the kernels' public sources (docs/semantics.md's profile table):
# (the order of adds, whether every negative index and a dropless index >= N*K is a +0.0 row).
# - A2/A3 (op_kernel/*.h, the same in every release): bins; drop/pad skips -1, active skips >= A.
# - 950 at 8.5 (arch35 @ a5d6f9dc): a chain from +0.0; at 9.0 (@ 8c1f71ff): groups of four per K
#   chunk; both test == -1 (drop/pad) and >= A (active) only.
# - 950 at 9.1 (@ 49e0de82): groups of four; any negative index, an active index >= A and a
#   dropless index >= N*K are rows of +0.0.
SLOW_PROFILES = {
    **{f"{chip}@{release}": ("bins", False) for chip in ("ascend910b", "ascend910_93") for release in ("8.5", "9.0", "9.1")},
    "ascend950@8.5": ("chain950", False),
    "ascend950@9.0": ("groups", False),
    "ascend950@9.1": ("groups", True),
    "sequential": ("chain", False),
}
#: The other names a profile goes by: a bare chip is its newest release; moegrad's older order names.
SLOW_ALIASES = {"ascend910b": "ascend910b@9.1", "ascend910_93": "ascend910_93@9.1", "ascend950": "ascend950@9.1",
                "ascend950@2025-12": "ascend950@8.5"}


# --------------------------------------------------------------------------------------------------
# IEEE rounding and the A2/A3 order (docs/semantics.md sections 2-3).
# --------------------------------------------------------------------------------------------------

# (mantissa bits, smallest normal exponent, largest finite value) of the narrow formats.
_FORMATS = {
    F16: (10, -14, 65504.0),
    BF16: (7, -126, (2.0 - 2.0**-7) * 2.0**127),
}


def round_from_float32(value: np.float32, dtype: np.dtype):
    """float32 -> dtype with IEEE round-half-to-even, from the definition (not NumPy's cast)."""
    if dtype == F32:
        return np.float32(value)
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v == 0.0:
        return dtype.type(v)
    mantissa_bits, min_exponent, max_finite = _FORMATS[dtype]
    _, e2 = math.frexp(v)  # v = m * 2**e2 with 0.5 <= |m| < 1, so floor(log2 |v|) = e2 - 1
    ulp = 2.0 ** (max(e2 - 1, min_exponent) - mantissa_bits)
    rounded = round(v / ulp) * ulp  # v / ulp is exact; Python's round() breaks ties to even
    if abs(rounded) > max_finite:
        rounded = math.copysign(math.inf, v)
    if rounded == 0.0:
        rounded = math.copysign(0.0, v)
    return dtype.type(rounded)  # exact: rounded is representable


def floor_log2(k: int) -> int:
    e = 0
    while (2 << e) <= k:
        e += 1
    return e


def device_order_row(values: list[np.ndarray | None], hidden: int) -> np.ndarray:
    """One row in the A2/A3 kernel's order (docs/semantics.md section 3.1); None is a skipped slot."""
    k = len(values)
    nbins = 64 if k >= 128 else 2 ** max(floor_log2(k) - 1, 0)
    zero = np.zeros(hidden, dtype=np.float32)  # +0.0
    bins = [zero.copy() if values[2 * b] is None else values[2 * b].copy() for b in range(nbins)]  # S1
    for t in range(2 * nbins, k, 2):  # S2: even slots after the first 2B, increasing
        if values[t] is not None:
            bins[(t // 2) % nbins] = bins[(t // 2) % nbins] + values[t]
    for t in range(1, k, 2):  # S3: odd slots, increasing
        if values[t] is not None:
            bins[((t - 1) // 2) % nbins] = bins[((t - 1) // 2) % nbins] + values[t]
    stride = 1
    while stride < nbins:  # S4: pairwise tree
        for j in range(stride, nbins, 2 * stride):
            bins[j - stride] = bins[j - stride] + bins[j]
        stride *= 2
    return bins[0]


def sequential_row(values: list[np.ndarray | None], hidden: int) -> np.ndarray:
    """Huawei's golden: float32 from +0.0, slot 0 to K-1."""
    total = np.zeros(hidden, dtype=np.float32)
    for value in values:
        if value is not None:
            total = total + value
    return total


def slow_grad_x(grad, idx, top_k, drop_pad_mode=0, active_num=0, order="ascend910b") -> np.ndarray:
    """gradX, one token and one slot at a time, from docs/semantics.md section 2."""
    hidden = grad.shape[-1]
    flat = grad.reshape(-1, hidden)
    tokens = idx.shape[0] // top_k
    out = np.empty((tokens, hidden), dtype=grad.dtype.newbyteorder("="))
    row_of = device_order_row if order == "ascend910b" else sequential_row
    with np.errstate(all="ignore"):
        for i in range(tokens):
            values: list[np.ndarray | None] = []
            for t in range(top_k):
                j = int(idx[i * top_k + t])
                if drop_pad_mode == 1:
                    skipped = j == -1
                else:
                    skipped = active_num > 0 and j >= active_num
                values.append(None if skipped else flat[j].astype(np.float32))
            total = row_of(values, hidden)
            for h in range(hidden):
                out[i, h] = round_from_float32(total[h], out.dtype)
    return out


# --------------------------------------------------------------------------------------------------
# The Ascend 950 order (docs/semantics.md section 7).
# --------------------------------------------------------------------------------------------------

def ascend950_row(values: list[np.ndarray | None], hidden: int, chunk: int, grouped: bool) -> np.ndarray:
    """One row in the 950's order; None (a skipped slot) is a row of +0.0, added in its place."""
    rows = [np.zeros(hidden, dtype=np.float32) if v is None else v for v in values]
    total = np.zeros(hidden, dtype=np.float32)  # the accumulator starts at +0.0
    for first in range(0, len(rows), chunk):  # one pass per chunk of slots
        block = rows[first:first + chunk]
        j = 0
        while grouped and len(block) - j >= 4:  # a group of four: s += ((x0 + x1) + (x2 + x3))
            total = total + ((block[j] + block[j + 1]) + (block[j + 2] + block[j + 3]))
            j += 4
        for value in block[j:]:  # the leftovers, one by one
            total = total + value
    return total


def slow950(grad, idx, top_k, drop_pad_mode=0, active_num=0, *, chunk=None, grouped=True) -> np.ndarray:
    """gradX one token and one slot at a time in the 950's order (chunk None: all K slots at once),
    skipping the slots every release skips (-1 in drop/pad mode, >= A in active mode)."""
    return _slow_rows(
        grad, idx, top_k, lambda j: slot_skipped(j, drop_pad_mode, active_num, idx.shape[0], False),
        lambda values, hidden: ascend950_row(values, hidden, chunk or top_k, grouped),
    )


def _slow_rows(grad, idx, top_k, skipped, row_sum) -> np.ndarray:
    """gradX one token at a time: ``skipped(j)`` says whether slot index j reads no row, and
    ``row_sum(values, hidden)`` sums one token's rows (None for a skipped slot) in float32."""
    hidden = grad.shape[-1]
    flat = grad.reshape(-1, hidden)
    tokens = idx.shape[0] // top_k
    out = np.empty((tokens, hidden), dtype=grad.dtype.newbyteorder("="))
    with np.errstate(all="ignore"):
        for i in range(tokens):
            values = [None if skipped(j) else flat[j].astype(np.float32)
                      for j in (int(v) for v in idx[i * top_k:(i + 1) * top_k])]
            total = row_sum(values, hidden)
            for h in range(hidden):
                out[i, h] = round_from_float32(total[h], out.dtype)
    return out


def slot_skipped(j: int, drop_pad_mode: int, active_num: int, slots: int, lenient: bool) -> bool:
    """Whether slot index ``j`` reads no row (a skipped slot, or the 950's +0.0 row); ``slots`` = N*K,
    ``lenient``: the 950 at 9.1 (every negative index, and every index past the rows)."""
    if lenient:
        if j < 0:
            return True
        return False if drop_pad_mode == 1 else j >= (active_num if active_num > 0 else slots)
    if drop_pad_mode == 1:
        return j == -1
    return active_num > 0 and j >= active_num


def slow_profile(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=0, active_num=0, *, profile: str,
                 chunk=None) -> np.ndarray:
    """gradX one token and one slot at a time as the device profile ``profile`` (a name of
    :data:`SLOW_PROFILES` or :data:`SLOW_ALIASES`) computes it; ``chunk``: the 950's K chunk
    (None: all K slots at once)."""
    kind, lenient = SLOW_PROFILES[SLOW_ALIASES.get(profile, profile)]

    def row_sum(values, hidden):
        if kind == "bins":
            return device_order_row(values, hidden)
        if kind == "chain":
            return sequential_row(values, hidden)
        return ascend950_row(values, hidden, chunk or top_k, kind == "groups")

    return _slow_rows(
        grad_expanded_x, expanded_row_idx, top_k,
        lambda j: slot_skipped(j, drop_pad_mode, active_num, expanded_row_idx.shape[0], lenient), row_sum,
    )


def expected_chunk(dtype: np.dtype, top_k: int, hidden: int, ub: int) -> int:
    """The K chunk for the sweep's shapes (N <= 5, H <= 67, so never SplitH), by docs/semantics.md 7.1."""
    item = dtype.itemsize
    align = -(-hidden * item // 32) * 32 // item
    if (2 * top_k + 1) * item * align <= ub or top_k <= 10:
        return top_k
    factor = (ub - (item + 4) * align) // (2 * item * align) if (3 * item + 4) * align <= ub else 1
    return min(factor, top_k)


# --------------------------------------------------------------------------------------------------
# Every order of adds.
# --------------------------------------------------------------------------------------------------

def every_add_tree(values: np.ndarray) -> np.ndarray:
    """values [K, H] float32 -> [T, H]: the result of every binary tree of float32 adds over the K
    slots (each slot used once; a + b == b + a in IEEE, so unordered trees: T = (2K-3)!!)."""
    k = values.shape[0]
    memo: dict[int, np.ndarray] = {}

    def trees(mask: int) -> np.ndarray:
        if mask in memo:
            return memo[mask]
        members = [i for i in range(k) if mask >> i & 1]
        if len(members) == 1:
            result = values[members[0]][None, :]
        else:
            lowest = 1 << members[0]
            rest = mask ^ lowest
            parts = []
            subset = rest
            while True:  # every split {lowest + subset, rest - subset} with a non-empty right side
                if rest ^ subset:
                    left, right = trees(lowest | subset), trees(rest ^ subset)
                    parts.append((left[:, None, :] + right[None, :, :]).reshape(-1, values.shape[1]))
                if subset == 0:
                    break
                subset = (subset - 1) & rest
            result = np.concatenate(parts)
        memo[mask] = result
        return result

    with np.errstate(all="ignore"):
        return trees((1 << k) - 1)


def double_factorial(n: int) -> int:
    return math.prod(range(n, 0, -2))
