"""The dtypes a tensor may have on the wire and in the operator: one table, with no codec attached.

The operator takes float16, bfloat16 and float32 for ``grad_expanded_x`` and int32 for
``expanded_row_idx`` (aclnnMoeInitRoutingV2Grad's documentation); each travels under its NumPy
name, bfloat16 as ``ml_dtypes.bfloat16``. The profiles, the numerics, the accuracy checks and the
codec (:mod:`moegrad.wire`) all name a dtype through this table.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["DTYPES", "brief", "dtype_name"]

#: The wire dtype names and their little-endian NumPy dtypes: the one table every path uses.
DTYPES: Mapping[str, np.dtype] = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype("<f4"),
    "int32": np.dtype("<i4"),
}
_NAMES: Mapping[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: np.dtype | type) -> str | None:
    """The wire name of ``dtype`` (either byte order), or None when the wire has no such dtype."""
    name = _NAMES.get(dtype) if isinstance(dtype, np.dtype) else None  # the common case, without np.dtype()
    if name is not None:
        return name
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    return _NAMES.get(dtype)


_BRIEF = reprlib.Repr()
_BRIEF.maxlist, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlevel = 12, 64, 64, 2


def brief(value: Any) -> str:
    """A bounded repr for error messages: a client's million-entry shape is not echoed back whole."""
    return _BRIEF.repr(value)
