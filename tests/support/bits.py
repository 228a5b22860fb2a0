"""Bit-for-bit comparison: arrays viewed as unsigned integers of their item size.

Equal floats can differ in bits (+0.0 and -0.0) and NaN equals nothing, so results are compared as
the integers that hold their bits. NaN is the one exception :func:`assert_bitwise_equal` makes:
which payload and sign a NaN + NaN keeps is not part of the contract (docs/semantics.md), so NaNs
are compared by position only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["UINT", "assert_bitwise_equal", "bits", "same_bits"]

#: item size in bytes -> the unsigned integer type of that size.
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(array: np.ndarray) -> np.ndarray:
    """``array``'s bits: a C-contiguous view (a copy when it is not contiguous) as unsigned integers."""
    return np.ascontiguousarray(array).view(UINT[array.dtype.itemsize])


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal dtype, shape and bits (viewed as unsigned integers of the item size)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    return bool(np.array_equal(bits(got), bits(want)))


def assert_bitwise_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same dtype and shape; NaN at the same places; every other element the same bit pattern."""
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    nan_actual = np.isnan(actual.astype(np.float32))
    nan_expected = np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(nan_actual, nan_expected)
    mismatch = bits(actual)[~nan_actual] != bits(expected)[~nan_expected]
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} of {mismatch.size} elements differ; first: "
        f"{actual[~nan_actual][mismatch][:4]} != {expected[~nan_expected][mismatch][:4]}"
    )
