"""The Ascend 950PR/950DT kernel of aclnnMoeInitRoutingV2Grad: its tiling decision and its schedule of adds.

The 950 runs the ``arch35`` ("regbase") kernels of hicann/ops-transformer
(``moe/moe_init_routing_v2_grad/op_kernel/arch35/``), with the tiling of
``op_host/moe_init_routing_v2_grad_*tiling_arch35.cpp``; docs/semantics.md section 7 cites the files
and commits. Three templates exist; the tiling tries them in priority order and takes the first
that accepts the shape:

1. ``split_h`` (priority 20000): accepts when ``K <= 64``, ``N < cores`` and ``N < (H // 512) // ts``;
2. ``full_load`` (30000): always accepts; ``(2K + 1) * ts * Ha <= UB`` loads whole rows
   (``"full_load"``), else it splits H (``"full_load_split_h"``) when ``K <= 10``, else refuses;
3. ``regbase`` (40000): always accepts; it sums the K slots in chunks of
   ``kUbFactor = min((UB - (ts + 4) * Ha) // (2 * ts * Ha), 65535)`` when ``(3 ts + 4) * Ha <= UB``,
   else of 1.

``ts`` is the element size in bytes, ``Ha`` is H rounded up so that ``Ha * ts`` is a multiple of 32
bytes, ``UB`` the unified-buffer size and ``cores`` the vector core count the platform reports.

Every template sums a token's K rows with the same routine: a float32 accumulator starting at +0.0,
to which each group of four slots is added as ``s += ((x0 + x1) + (x2 + x3))`` and each leftover
slot (fewer than four at the end) as ``s += x``. ``split_h`` and both ``full_load`` variants pass all
K slots to it at once; ``regbase`` passes them one chunk at a time, keeping ``s`` in float32 between
chunks, so the groups of four restart at each chunk. The result is rounded once to the output dtype.
A slot whose index is invalid (skipped) is a row of +0.0 added in its place. So only ``regbase``
with ``kUbFactor < K`` gives bits that differ from one pass over all K slots, and which template
runs depends on N, K, H, the dtype, the UB size and the core count.

The summing routine changed between CANN releases (the profiles of :mod:`moegrad.operator._profiles`):

- from 9.0 (``ascend950@9.0``, ``ascend950@9.1``; ``Profile.schedule == "groups_of_four"``): the
  groups of four above;
- 8.5 (``ascend950@8.5``; ``"chain"``): a plain chain ``s += x`` slot after slot (the chunking
  then changes nothing, and the bits are those of the ``"sequential"`` golden).

9.1 also made every negative index, and a dropless index >= N*K, a slot of +0.0 (9.0 and 8.5 test
``== -1`` in drop/pad mode and ``>= A`` in active mode only): moegrad's validation accepts those
indices on ``ascend950@9.1`` alone, and the emulation adds a +0.0 row for every index outside
[0, rows), so the same code serves every release.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from moegrad._dtypes import dtype_name

__all__ = [
    "ASCEND950",
    "TEMPLATES",
    "UB_SIZE_BYTES",
    "VECTOR_CORE_COUNT",
    "Ascend950Tiling",
    "ascend950_schedule",
    "ascend950_tiling",
]

#: The UB size of Ascend 950PR/950DT in bytes (``ub_size`` of the CANN platform files): the default.
UB_SIZE_BYTES = 253952
#: The vector (AIV) core count of Ascend 950PR/950DT (``vector_core_cnt``): the default.
VECTOR_CORE_COUNT = 64
#: The templates by name, in the tiling's priority order.
TEMPLATES: tuple[str, ...] = ("split_h", "full_load", "full_load_split_h", "regbase")
#: The chip name of Ascend 950PR/950DT in the device profiles (``Profile.chip``).
ASCEND950 = "ascend950"

_BLOCK_BYTES = 32  # UB block: rows are padded to a multiple of it
_SPLIT_H_MAX_TOP_K = 64
_SPLIT_H_CACHE_LINE = 512
_FULL_LOAD_SPLIT_H_MAX_TOP_K = 10
_UINT16_MAX = 65535
_ITEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Ascend950Tiling:
    """The template the 950's tiling picks for one shape, and how it chunks the K slots.

    Attributes:
        template: one of :data:`TEMPLATES`.
        k_chunk: slots summed per pass of the summing routine (the groups of four restart at
            each pass): ``min(kUbFactor, K)`` for ``regbase``, K for the other templates.
        k_ub_factor: ``regbase``'s kUbFactor as the tiling computes it (None for the others).
        hidden_align: H rounded up to a whole number of 32-byte blocks, in elements.
    """

    template: str
    k_chunk: int
    k_ub_factor: int | None
    hidden_align: int


def _positive(name: str, value: Any) -> int:
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be an integer") from None
    if number < 1:
        raise ValueError(f"{name}={number} must be >= 1")
    return number


@functools.lru_cache(maxsize=1024)
def _tiling(item: int, tokens: int, top_k: int, hidden: int, ub: int, cores: int) -> Ascend950Tiling:
    align = -(-hidden * item // _BLOCK_BYTES) * _BLOCK_BYTES // item
    if top_k <= _SPLIT_H_MAX_TOP_K and tokens < cores and tokens < hidden // _SPLIT_H_CACHE_LINE // item:
        return Ascend950Tiling("split_h", top_k, None, align)
    if (2 * top_k + 1) * item * align <= ub:
        return Ascend950Tiling("full_load", top_k, None, align)
    if top_k <= _FULL_LOAD_SPLIT_H_MAX_TOP_K:
        return Ascend950Tiling("full_load_split_h", top_k, None, align)
    if (3 * item + 4) * align <= ub:
        factor = min((ub - (item + 4) * align) // (2 * item * align), _UINT16_MAX)
    else:
        factor = 1
    return Ascend950Tiling("regbase", min(factor, top_k), factor, align)


def ascend950_tiling(
    dtype: object,
    num_tokens: int,
    top_k: int,
    hidden_size: int,
    *,
    ub_size_bytes: int = UB_SIZE_BYTES,
    vector_core_count: int = VECTOR_CORE_COUNT,
) -> Ascend950Tiling:
    """The template the Ascend 950 tiling picks for a call's shape (docs/semantics.md section 7.1).

    Args:
        dtype: grad_expanded_x's dtype (float16, bfloat16 or float32; a NumPy dtype or its name).
        num_tokens: N, ``len(expanded_row_idx) // top_k``; >= 1.
        top_k: K >= 1.
        hidden_size: H >= 1.
        ub_size_bytes: the unified buffer the tiling may fill, in bytes (the platform's ``ub_size``).
        vector_core_count: the vector (AIV) cores the platform reports.

    Returns:
        An :class:`Ascend950Tiling`.

    Raises:
        ValueError: an unknown dtype, or a size below 1.
        TypeError: a size that is not an integer.
    """
    if isinstance(dtype, str):
        name = dtype
    else:  # anything else goes to np.dtype as given, which raises TypeError for what is not dtype-like
        as_dtype = np.dtype(cast(npt.DTypeLike, dtype))
        name = dtype_name(as_dtype) or str(as_dtype)
    if name not in _ITEM_BYTES:
        raise ValueError(f"dtype={name!r} is not one of {', '.join(_ITEM_BYTES)}")
    sizes = [
        _positive(field, value)
        for field, value in (
            ("num_tokens", num_tokens),
            ("top_k", top_k),
            ("hidden_size", hidden_size),
            ("ub_size_bytes", ub_size_bytes),
            ("vector_core_count", vector_core_count),
        )
    ]
    return _tiling(_ITEM_BYTES[name], *sizes)


@functools.lru_cache(maxsize=512)
def ascend950_schedule(top_k: int, k_chunk: int, grouped: bool = True) -> tuple[tuple[str, int, int], ...]:
    """The steps of one output row on the 950, in the vocabulary of ``accumulation_schedule``.

    Bin 0 is the float32 accumulator (``("zero", 0, 0)``: +0.0). Each slot is loaded into a bin
    with ``("set", b, t)``, which gives +0.0 for a skipped slot, as the kernel's zero row does. A
    group of four is ``set 1, set 2, merge 1+=2, set 2, set 3, merge 2+=3, merge 1+=2, merge 0+=1``;
    a leftover slot ``set 1, merge 0+=1``. Groups restart every ``k_chunk`` slots; with
    ``grouped=False`` (CANN 8.5's chain) every slot is a leftover.

    Raises:
        ValueError: ``top_k < 1`` or ``k_chunk < 1``.
    """
    if top_k < 1 or k_chunk < 1:
        raise ValueError(f"top_k={top_k} and k_chunk={k_chunk} must be >= 1")
    steps: list[tuple[str, int, int]] = [("zero", 0, 0)]
    for first in range(0, top_k, k_chunk):
        last = min(first + k_chunk, top_k)
        t = first
        while grouped and t + 4 <= last:
            steps += [
                ("set", 1, t),
                ("set", 2, t + 1),
                ("merge", 1, 2),
                ("set", 2, t + 2),
                ("set", 3, t + 3),
                ("merge", 2, 3),
                ("merge", 1, 2),
                ("merge", 0, 1),
            ]
            t += 4
        for leftover in range(t, last):
            steps += [("set", 1, leftover), ("merge", 0, 1)]
    return tuple(steps)
