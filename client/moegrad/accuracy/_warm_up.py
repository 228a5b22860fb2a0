"""Compile ahead what a comparison and its report's row errors run: :func:`warm_up_compare`."""

from __future__ import annotations

import numpy as np

from moegrad.accuracy._fused import _VIEWS, warm_up_metrics
from moegrad.accuracy._where import row_errors
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["warm_up_compare"]


def warm_up_compare() -> bool:
    """Compile (or load from numba's on-disk cache) the comparison for every dtype and candidate dtype,
    and the kernels of a report's row errors (:func:`moegrad.accuracy.row_errors`).

    The first :func:`moegrad.compare` of each combination otherwise pays for it (seconds), and the
    first row errors (a report of ``moegrad compare``) about 2 s. A service can call this at startup.
    Returns False when numba is missing (the NumPy path serves).
    """
    if not warm_up_metrics():
        return False
    for dtype in _VIEWS:
        call = MoeInitRoutingV2GradCall(
            grad_expanded_x=np.ones((2, 1), dtype=dtype), expanded_row_idx=np.arange(2, dtype=np.int32), top_k=2
        )
        row_errors(call, np.full((1, 1), 2.0, dtype), device_result=np.ones((1, 1), dtype))
    return True
