"""The compiled path of the reference numerics: one pass over the gathered rows, when numba is installed.

:func:`moegrad._reference.moe_init_routing_v2_grad` hands its float32 accumulation here first; when
this path cannot take a call (numba missing, or an input layout it does not handle) it returns False
and the NumPy path runs instead. Both give the same bits: the adds are the ones
:func:`~moegrad._reference.accumulation_schedule` lists, in its order, on exactly widened float32
values, rounded once, half to even (see :mod:`moegrad._fast_jit` for how the compiled code keeps that).

Why it is faster than the NumPy path: NumPy gathers each slot's rows into a buffer, widens them into
another and adds that into a bin, so every value crosses the cache hierarchy several times. Here each
gathered row is read once, widened in registers and added into a bin that stays in the core's cache
(bins are cut into tiles of H so that all of them fit), and each grad_x row is written once, already
narrowed. Nothing is allocated beyond one tile of bins per running chunk (<= 128 KiB).

Threads: rows are cut into chunks of about 4 MiB of input each and run on the reference module's one
shared thread pool (the kernel releases the GIL). Calls made at the same time, such as a service with
two streams, queue their chunks on that same pool, so the machine never runs more compute threads
than the pool has (``MOEGRAD_REFERENCE_THREADS``, default: the CPUs this process may use, at most 8).
numba's own parallel layer is not used: its default (workqueue) layer aborts when two threads launch
parallel kernels at once, which a service with two streams does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import ModuleType

import ml_dtypes
import numpy as np

__all__ = ["accumulate", "available"]

_CHUNK_INPUT_BYTES = 4 << 20  # gathered input per chunk: enough to hide the call, small enough to balance
_BIN_BYTES = 128 << 10  # float32 bins of one tile: they stay in the core's L2
_BIT_VIEWS = {  # the dtype the kernel sees: it names the format too (see _fast_jit)
    np.dtype(np.float32): np.dtype(np.float32),
    np.dtype(np.float16): np.dtype(np.int16),
    np.dtype(ml_dtypes.bfloat16): np.dtype(np.uint16),
}
_OPS = {"set": 0, "add": 1, "merge": 2, "zero": 3}  # _fast_jit.OP_*

_jit: ModuleType | None = None
_jit_missing = False


def _load_jit() -> ModuleType | None:
    """The compiled module, imported on first use; None where numba cannot be imported."""
    global _jit, _jit_missing
    if _jit is None and not _jit_missing:
        try:
            from moegrad import _fast_jit
        except ImportError:
            _jit_missing = True
        else:
            _jit = _fast_jit
    return _jit


def available() -> bool:
    """Whether the compiled path can run here (numba imports)."""
    return _load_jit() is not None


@functools.lru_cache(maxsize=512)
def _schedule_table(schedule: tuple[tuple[str, int, int], ...]) -> np.ndarray:
    table = np.array([(_OPS[op], dst, src) for op, dst, src in schedule], dtype=np.int32).reshape(-1, 3)
    table.flags.writeable = False
    return table


def accumulate(rows: np.ndarray, index: np.ndarray, top_k: int, schedule: Sequence[tuple[str, int, int]],
               out: np.ndarray, map_chunks: Callable[[Callable[[int, int], None], int, int], None]) -> bool:
    """grad_x into ``out`` with the compiled kernel; False (``out`` untouched) when it cannot take the call.

    Args:
        rows: [R, H] grad_expanded_x (drop/pad: [E*C, H]); float32, float16 or bfloat16.
        index: [N*K] int32 expanded_row_idx; a slot outside [0, R) is skipped (DESIGN.md section 3:
            validation leaves there only -1 in drop/pad mode and >= A in active mode).
        top_k: K.
        schedule: :func:`~moegrad._reference.accumulation_schedule` of K (a tuple).
        out: [N, H] C-contiguous, the dtype of ``rows``; N >= 1, H >= 1.
        map_chunks: runs ``fn(start, stop)`` over row chunks (the reference module's thread pool).
    """
    view = _BIT_VIEWS.get(rows.dtype)
    if view is None or out.dtype != rows.dtype or not rows.flags.c_contiguous or not out.flags.c_contiguous:
        return False  # byte-swapped, strided or mixed: the NumPy path handles those
    jit = _load_jit()
    if jit is None:
        return False
    tokens, hidden = out.shape
    table = _schedule_table(tuple(schedule))
    nbins = int(table[:, 1].max()) + 1
    tile = min(hidden, max(64, _BIN_BYTES // (4 * nbins) // 64 * 64))
    rows_bits = rows.view(view)
    out_bits = out.view(view)
    flat_index = np.ascontiguousarray(index.reshape(-1), dtype=np.int32)
    chunk = max(1, _CHUNK_INPUT_BYTES // max(1, top_k * hidden * rows.itemsize))

    def run(start: int, stop: int) -> None:
        jit.run_rows(rows_bits, flat_index, top_k, table, nbins, tile, out_bits, start, stop)

    map_chunks(run, tokens, chunk)
    return True
