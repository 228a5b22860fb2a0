"""NumPy numerics of aclnnMoeInitRoutingV2Grad: the device's order, Huawei's golden, a float64 golden.

``grad_x[i] = sum over t < K of grad_expanded_x[expanded_row_idx[i*K + t]]`` with the skip rules of
docs/semantics.md section 2: a slot whose index names no row of grad_expanded_x is skipped (-1 in
drop/pad mode, an index >= active_num in active mode, and on ``ascend950@9.1`` any negative index
and a dropless index >= N*K, which validation accepts there alone). Rows are widened exactly to
float32, every add is float32 round-to-nearest-even, and the result is rounded once to the input
dtype. What differs between profiles is only the schedule of adds (:mod:`moegrad.numerics._schedules` writes each
one out; many small calls run as one in :mod:`moegrad.numerics._reference_many`).

Nothing materialises an [N, K, H] intermediate: rows are processed in chunks whose float32 bins fit
in a few MiB, the chunks spread over the machine's cores (NumPy releases the GIL while it copies
and adds). Where numba is installed (the ``fast`` extra), the float32 accumulation runs compiled
instead (:mod:`moegrad.numerics._fast`), with the same bits; ``_KERNEL`` or ``accumulate(kernel=...)``
picks the path ("auto", "numba", "numpy"). The shared pool has ``MOEGRAD_REFERENCE_THREADS``
threads, default the CPUs this process may use (at most 8); concurrent calls share it.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from moegrad._errors import AclnnStatus, InvalidArgument
from moegrad.numerics import _fast
from moegrad.numerics._ascend950 import (
    ASCEND950,
    UB_SIZE_BYTES,
    VECTOR_CORE_COUNT,
    ascend950_schedule,
    ascend950_tiling,
)
from moegrad.numerics._schedules import schedule_steps
from moegrad.operator._call import GRAD_DTYPES, MoeInitRoutingV2GradCall
from moegrad.operator._profiles import CHAIN, DEFAULT_PROFILE, GROUPS_OF_FOUR

__all__ = ["accumulate", "kernel_threads", "moe_init_routing_v2_grad", "moe_init_routing_v2_grad_golden", "warm_up"]

_CHUNK_BYTES = 2 << 20  # float32 bins of one chunk: small enough to stay in cache
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)

_KERNEL = "auto"  # the float32 path: "auto" (numba when it imports), "numba" (required) or "numpy"
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def kernel_threads() -> int:
    """The threads of the shared pool the kernels run on: ``MOEGRAD_REFERENCE_THREADS``, default the
    CPUs this process may use (at most 8).

    Raises:
        ValueError: ``MOEGRAD_REFERENCE_THREADS`` is not a positive integer.
    """
    return _workers_for(os.environ.get("MOEGRAD_REFERENCE_THREADS", ""))


@functools.lru_cache(maxsize=8)
def _workers_for(configured: str) -> int:  # cached: a small call would otherwise pay a syscall for it
    configured = configured.strip()
    if configured:
        if not configured.isdigit() or int(configured) < 1:
            raise ValueError(f"MOEGRAD_REFERENCE_THREADS={configured!r} must be a positive integer")
        return int(configured)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(usable or 1, 8))


def _map_chunks(fn: Callable[[int, int], None], rows: int, chunk: int) -> None:
    """Run ``fn(start, stop)`` over row chunks, spread over a shared thread pool."""
    spans = [(s, min(s + chunk, rows)) for s in range(0, rows, chunk)]
    if len(spans) <= 1 or kernel_threads() == 1:
        for span in spans:
            fn(*span)
        return
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(kernel_threads(), thread_name_prefix="moegrad-reference")
    if threading.current_thread().name.startswith("moegrad-reference"):  # already inside the pool
        for span in spans:
            fn(*span)
        return
    for future in [_executor.submit(fn, *span) for span in spans]:
        future.result()


def _prepare(
    call: MoeInitRoutingV2GradCall,
) -> tuple[np.ndarray, np.ndarray, Callable[[np.ndarray], np.ndarray | None]]:
    """C-contiguous [R, H] rows, the flat [N*K] index into them, and the per-mode skip-mask function.

    A C-contiguous grad_expanded_x is viewed as [rows, H] as it is. Any other layout (a strided or
    overlapping view, a transposed array) is not copied whole: only the rows the index references
    are gathered, in increasing order, into a C-contiguous [R, H] array, and the index is renumbered
    into it, its skipped slots kept skipped (-1 in drop/pad mode, A in active mode, N*K in dropless
    mode on 950@9.1: each outside [0, R) and caught by the mask). The adds then
    read the same values in the same order, so the bits are those of a contiguous copy.
    """
    grad = call.grad_expanded_x
    hidden = call.hidden_size
    index = call.expanded_row_idx.reshape(-1)
    profile = call.profile
    if call.drop_pad_mode == 1:  # -1 (any negative on 950@9.1); validation leaves no index >= E*C
        skip_value = -1

        def skipped(column: np.ndarray) -> np.ndarray | None:
            mask = column < 0
            return mask if mask.any() else None
    elif call.active_num > 0 or profile.skips_any_negative or profile.skips_dropless_overflow:
        # active: >= A (and on 950@9.1 any negative); dropless on 950@9.1: negative or >= N*K
        limit = skip_value = call.active_num if call.active_num > 0 else index.shape[0]
        negative = profile.skips_any_negative

        def skipped(column: np.ndarray) -> np.ndarray | None:
            mask = (column >= limit) | (column < 0) if negative else column >= limit
            return mask if mask.any() else None
    else:  # dropless: validation leaves every index in [0, N*K)
        skip_value = 0

        def skipped(column: np.ndarray) -> np.ndarray | None:
            return None

    if grad.flags.c_contiguous:
        return grad.reshape(-1, hidden), index, skipped
    mask = skipped(index)
    used = index if mask is None else index[~mask]
    referenced, renumbered = np.unique(used, return_inverse=True)
    if referenced.size == 0:
        return np.empty((0, hidden), dtype=grad.dtype), np.full(index.shape, skip_value, dtype=np.int32), skipped
    positions = np.unravel_index(referenced.astype(np.intp), grad.shape[:-1])
    rows = np.ascontiguousarray(grad[positions].reshape(-1, hidden))
    compact = np.full(index.shape, skip_value, dtype=np.int32)
    if mask is None:
        compact[:] = renumbered.reshape(-1)
    else:
        compact[~mask] = renumbered.reshape(-1)
    return rows, compact, skipped


def accumulate(
    call: MoeInitRoutingV2GradCall,
    schedule: Sequence[tuple[str, int, int]],
    out: np.ndarray,
    *,
    kernel: str | None = None,
    chunking: tuple[int, bool] | None = None,
    accumulator: np.dtype = _F32,
) -> np.ndarray:
    """grad_x of a validated ``call`` into ``out`` with the device's arithmetic: float32 adds in the
    order of ``schedule`` (:func:`~moegrad.accumulation_schedule`'s steps), one rounding to ``out``'s dtype.

    Args:
        call: a validated call.
        schedule: the steps of one output row; ``chunking = (k_chunk, grouped)`` marks an Ascend 950
            schedule, which the compiled path runs by its own loop.
        out: [N, H] of the call's dtype, C-contiguous, written whole.
        kernel: ``"auto"`` (numba when it imports), ``"numba"`` or ``"numpy"``; None: the module's default.
        accumulator: the dtype every add rounds to: float32 (the device's), or float16 / bfloat16
            (the arithmetic of a port that accumulates in a narrower type, which
            :func:`moegrad.explain` replays; each summand is rounded to it first; NumPy only).

    Raises:
        ValueError: another ``kernel``. RuntimeError: ``kernel="numba"`` where numba does not import.
    """
    kernel = _KERNEL if kernel is None else kernel
    if kernel not in ("auto", "numba", "numpy"):
        raise ValueError(f"kernel={kernel!r} is not one of 'auto', 'numba', 'numpy'")
    if kernel == "numba" and not _fast.available():
        raise RuntimeError("kernel='numba' needs numba: pip install 'moegrad[fast]'")
    prepared = _rows_of(call, out)
    if prepared is None:
        return out
    rows, flat_index, skipped = prepared
    accumulator = np.dtype(accumulator)
    if kernel != "numpy" and accumulator == _F32:
        if chunking is not None:
            taken = _fast.accumulate_950(rows, flat_index, call.top_k, *chunking, out, _map_chunks, kernel_threads())
        else:
            taken = _fast.accumulate(rows, flat_index, call.top_k, schedule, out, _map_chunks, kernel_threads())
        if taken:
            return out  # same bits as below; byte-swapped inputs fall through to NumPy
    index = flat_index.reshape(-1, call.top_k)
    nbins = 1 + max(step[1] for step in schedule)
    chunk = max(1, _CHUNK_BYTES // (nbins * out.shape[1] * accumulator.itemsize))

    def run(start: int, stop: int) -> None:
        slots = _Slots(rows, index[start:stop], skipped, accumulator)
        bins = np.empty((nbins, stop - start, out.shape[1]), dtype=accumulator)
        value = np.empty((stop - start, out.shape[1]), dtype=accumulator)
        for op, dst, src in schedule:
            target = bins[dst]
            if op == "set":
                mask = slots.load(src, target)
                if mask is not None:
                    target[mask] = 0.0
            elif op == "zero":
                target.fill(0.0)
            elif op == "merge":
                np.add(target, bins[src], out=target)
            else:
                mask = slots.load(src, value)
                np.add(target, value, out=target, where=True if mask is None else ~mask[:, None])
        np.copyto(out[start:stop], bins[0], casting="unsafe")  # one round-half-even cast

    _map_chunks(_quietly(run), out.shape[0], chunk)
    return out


def _golden(call: MoeInitRoutingV2GradCall, out: np.ndarray) -> np.ndarray:
    """Each row's exact sum into the float64 ``out``: Neumaier's compensated adds over the slots,
    then :func:`math.fsum` for the few elements whose compensation term itself rounded."""
    prepared = _rows_of(call, out)
    if prepared is None:
        return out
    rows, flat_index, skipped = prepared
    index = flat_index.reshape(-1, call.top_k)
    chunk = max(1, _CHUNK_BYTES // (out.shape[1] * _F64.itemsize))

    def run(start: int, stop: int) -> None:
        block = index[start:stop]
        slots = _Slots(rows, block, skipped, _F64)
        total = np.zeros((stop - start, out.shape[1]), dtype=_F64)
        value, comp = np.empty_like(total), np.zeros_like(total)
        inexact = np.zeros(total.shape, dtype=np.bool_)
        for t in range(call.top_k):
            mask = slots.load(t, value)
            _neumaier_add(total, value, comp, None if mask is None else ~mask[:, None], inexact)
        summed = total + comp
        total = np.where(np.isfinite(total), summed, total)
        # Where comp itself rounded, total + comp is not the exact sum: sum those few elements exactly.
        for r, h in zip(*np.nonzero(inexact & np.isfinite(total)), strict=True):
            mask = skipped(block[r])
            used = block[r] if mask is None else block[r][~mask]
            total[r, h] = math.fsum(float(x) for x in rows[used, h])
        out[start:stop] = total

    _map_chunks(_quietly(run), out.shape[0], chunk)
    return out


def _rows_of(
    call: MoeInitRoutingV2GradCall, out: np.ndarray
) -> tuple[np.ndarray, np.ndarray, Callable[[np.ndarray], np.ndarray | None]] | None:
    """:func:`_prepare`'s rows, index and skip mask; None when ``out`` is already the answer (filled
    here with +0.0 when every slot is skipped)."""
    tokens, hidden = out.shape
    if tokens == 0 or hidden == 0:  # before _prepare: reshape(-1, 0) cannot infer the row count
        return None
    rows, flat_index, skipped = _prepare(call)
    if rows.shape[0] == 0:  # drop/pad with E*C = 0: validation left only -1, every slot is skipped
        out.fill(0.0)
        return None
    return rows, flat_index, skipped


class _Slots:
    """The rows one chunk of output rows gathers, slot by slot, widened exactly to ``dtype``."""

    def __init__(
        self, rows: np.ndarray, block: np.ndarray, skipped: Callable[[np.ndarray], np.ndarray | None], dtype: np.dtype
    ) -> None:
        self.rows, self.block, self.skipped = rows, block, skipped
        self.gathered = np.empty((block.shape[0], rows.shape[1]), dtype=rows.dtype) if rows.dtype != dtype else None

    def load(self, t: int, into: np.ndarray) -> np.ndarray | None:
        """Slot ``t`` of every row into ``into`` (a skipped slot reads row 0); the skip mask, or None."""
        column = self.block[:, t]
        mask = self.skipped(column)
        if mask is not None:
            column = np.where(mask, 0, column)
        if self.gathered is None:
            np.take(self.rows, column, axis=0, out=into)
        else:
            np.take(self.rows, column, axis=0, out=self.gathered)
            np.copyto(into, self.gathered, casting="unsafe")  # exact when widened; else rounds to nearest even
        return mask


def _quietly(run: Callable[[int, int], None]) -> Callable[[int, int], None]:
    """``run`` with NumPy's floating-point warnings off: inf - inf, overflow to inf and overflowing
    casts are the kernel's results, not errors (errstate is per thread: set in the thread that runs)."""

    def quiet(start: int, stop: int) -> None:
        with np.errstate(all="ignore"):
            run(start, stop)

    return quiet


def _neumaier_add(
    total: np.ndarray, value: np.ndarray, comp: np.ndarray, keep: np.ndarray | None, inexact: np.ndarray
) -> None:
    """total += value with Neumaier's compensation term accumulated in comp (elementwise, where keep).

    ``lost`` is the exact rounding error of each add (Fast2Sum). While every ``comp += lost`` is exact
    too, total + comp equals the exact sum and its float64 rounding is the correctly rounded sum; an
    element whose comp add rounded is marked in ``inexact`` (it happens only for values spread over
    more binades than float64 holds, e.g. 2**100, 2**40, 2**-60, -2**100, -2**40).
    """
    where = True if keep is None else keep
    new = np.add(total, value, where=where, out=np.array(total))
    big = np.abs(total) >= np.abs(value)
    lost = np.where(big, (total - new) + value, (value - new) + total)
    take = where & np.isfinite(lost)
    summed = np.add(comp, lost, where=take, out=np.array(comp))
    error = np.where(np.abs(comp) >= np.abs(lost), (comp - summed) + lost, (lost - summed) + comp)
    inexact |= take & (error != 0)
    comp[...] = summed
    total[...] = new


def _validated(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order, allow_duplicate_indices):
    if isinstance(grad_expanded_x, MoeInitRoutingV2GradCall):
        return grad_expanded_x
    return MoeInitRoutingV2GradCall(
        grad_expanded_x=grad_expanded_x,
        expanded_row_idx=expanded_row_idx,
        top_k=top_k,
        drop_pad_mode=drop_pad_mode,
        active_num=active_num,
        order=order,
        allow_duplicate_indices=allow_duplicate_indices,
    )


def moe_init_routing_v2_grad(
    grad_expanded_x: np.ndarray | MoeInitRoutingV2GradCall,
    expanded_row_idx: np.ndarray | None = None,
    top_k: int | None = None,
    drop_pad_mode: int = 0,
    active_num: int = 0,
    *,
    order: str = DEFAULT_PROFILE,
    allow_duplicate_indices: bool = False,
    ub_size_bytes: int = UB_SIZE_BYTES,
    vector_core_count: int = VECTOR_CORE_COUNT,
    out: np.ndarray | None = None,
    kernel: str | None = None,
) -> np.ndarray:
    """gradX of aclnnMoeInitRoutingV2Grad, computed on the CPU in the order the device uses.

    Args:
        grad_expanded_x: [N*K, H] (dropless), [A, H] (active) or [E, C, H] (drop/pad); float16,
            bfloat16 or float32. Or an already validated :class:`MoeInitRoutingV2GradCall`, in which
            case the other arguments are ignored.
        expanded_row_idx: [N*K] int32.
        top_k: K > 0.
        drop_pad_mode: 0 dropless/active, 1 drop/pad.
        active_num: A; 0 dropless, > 0 active.
        order: the device profile whose bits and rules apply, any name of :data:`~moegrad.ORDERS`:
            ``"<chip>@<release>"`` with chip ``ascend910b`` / ``ascend910_93`` (Atlas A2/A3: the
            bins), ``ascend950`` (Ascend 950PR/950DT: groups of four from 9.0, a chain at 8.5) and
            release 8.5, 9.0 or 9.1; a bare chip (its newest release); ``"sequential"`` (Huawei's
            golden); default ``"ascend910b@9.1"``. docs/semantics.md sections 2, 3, 7.
        allow_duplicate_indices: accept repeated indices (the documentation forbids them).
        ub_size_bytes: the 950 platform's unified-buffer size in bytes (default 253952, Ascend
            950PR/950DT); only the 950 profiles read it, since it decides the tiling and so the schedule.
        vector_core_count: the 950 platform's vector (AIV) core count (default 64); as above.
        out: where to write grad_x, as the operator writes into the gradX its caller allocated: a
            writeable C-contiguous [N, H] array of grad_expanded_x's dtype in native byte order,
            sharing no memory with the inputs. Default: a new array. Every element is written; the
            bits are the same either way.
        kernel: the float32 accumulation's path, ``"auto"`` (the compiled kernel where numba imports),
            ``"numba"`` or ``"numpy"`` (no numba import, nothing compiled: cheaper for a few small
            calls in a fresh process); None: ``"auto"``. The bits are the same on every path.

    Returns:
        grad_x, [N, H] C-contiguous, the dtype of grad_expanded_x (``out`` itself when given). A
        row whose slots are all skipped is +0.0; empty inputs give an empty [N, H] array.

    Raises:
        InvalidArgument: the call breaks a documented constraint on its profile (aclnn 161001 /
            161002 / 561002, 561103 from CANN 9.1; see :class:`MoeInitRoutingV2GradCall`); or
            ``out`` has another dtype (161002, field ``grad_x``) or another shape than [N, H] (the
            profile's attribute status, 561002 or 561103, field ``grad_x``).
        TypeError: ``out`` is not a numpy.ndarray.
        ValueError: ``out`` is not C-contiguous, is read-only or overlaps an input; or
            ``ub_size_bytes`` / ``vector_core_count`` is not a positive integer (TypeError when
            it is not an integer at all); or ``kernel`` is none of the three.
        RuntimeError: ``kernel="numba"`` where numba does not import.
    """
    call = _validated(
        grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order, allow_duplicate_indices
    )
    out = _result_buffer(call, out)
    profile = call.profile
    if profile.chip != ASCEND950:
        return accumulate(call, schedule_steps(call.top_k, profile.schedule), out, kernel=kernel)
    # checked even when the result is empty, so a bad setting never passes unnoticed (an empty
    # grad_x of another dtype, which 9.1 lets through, has no tiling: only the settings are checked)
    tiling = ascend950_tiling(
        call.dtype_name if call.dtype_name in GRAD_DTYPES else "float32",
        max(call.num_tokens, 1),
        call.top_k,
        max(call.hidden_size, 1),
        ub_size_bytes=ub_size_bytes,
        vector_core_count=vector_core_count,
    )
    if profile.schedule == CHAIN:  # CANN 8.5: a chain from +0.0, whatever the chunks
        return accumulate(call, schedule_steps(call.top_k, CHAIN), out, kernel=kernel)
    assert profile.schedule == GROUPS_OF_FOUR
    chunking = (tiling.k_chunk, True)
    return accumulate(call, ascend950_schedule(call.top_k, tiling.k_chunk), out, kernel=kernel, chunking=chunking)


def _result_buffer(call: MoeInitRoutingV2GradCall, out: np.ndarray | None) -> np.ndarray:
    """``out`` checked against the call (see :func:`moe_init_routing_v2_grad`), or a new [N, H] array."""
    shape = (call.num_tokens, call.hidden_size)
    dtype = call.grad_expanded_x.dtype.newbyteorder("=")
    if out is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if out.dtype != dtype:
        raise InvalidArgument(
            f"out.dtype={out.dtype} must be grad_expanded_x's dtype in native byte order ({dtype})",
            aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID,
            field="grad_x",
        )
    if out.shape != shape:
        raise InvalidArgument(
            f"out.shape={out.shape} must be [N, H] = {list(shape)} (N = len(expanded_row_idx) // "
            "top_k, H = grad_expanded_x.shape[-1])",
            aclnn_status=call.profile.attribute_status,
            field="grad_x",
        )
    if not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous (strides {out.strides} for shape {out.shape})")
    if not out.flags.writeable:
        raise ValueError("out must be writeable")
    if np.may_share_memory(out, call.grad_expanded_x) or np.may_share_memory(out, call.expanded_row_idx):
        raise ValueError("out must not share memory with grad_expanded_x or expanded_row_idx")
    return out


def moe_init_routing_v2_grad_golden(
    grad_expanded_x: np.ndarray | MoeInitRoutingV2GradCall,
    expanded_row_idx: np.ndarray | None = None,
    top_k: int | None = None,
    drop_pad_mode: int = 0,
    active_num: int = 0,
    *,
    order: str = DEFAULT_PROFILE,
    allow_duplicate_indices: bool = False,
) -> np.ndarray:
    """The float64 golden of gradX: each row's exact sum, correctly rounded to float64.

    The inputs are widened exactly to float64 and summed t = 0..K-1 with Neumaier's compensation
    term; the few elements whose compensation term itself rounded (values spread over more binades
    than float64 holds) are summed again with :func:`math.fsum`. So the result is the exact sum
    rounded to nearest float64, whatever the order of the slots (an infinity or NaN among the slots
    gives the IEEE result instead). Same arguments, skip rules and errors as
    :func:`moe_init_routing_v2_grad`: ``order`` names the profile whose validation applies (which
    index values are accepted, and which of them are +0.0 slots left out of the sum); the sum itself
    does not depend on it.

    Returns:
        [N, H] float64.
    """
    call = _validated(
        grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order, allow_duplicate_indices
    )
    out = np.empty((call.num_tokens, call.hidden_size), dtype=_F64)
    return _golden(call, out)


def warm_up() -> bool:
    """Compile (or load from numba's on-disk cache) the compiled kernel for every dtype, now.

    Without it the first call of each dtype pays for the compilation. The service calls it
    before it reports ready. Set ``NUMBA_CACHE_DIR`` to a writable folder where the package's own
    folder is read-only (a container), so later processes load instead of compiling.

    Returns:
        True when the compiled path is ready; False when numba is missing (the NumPy path serves).
    """
    return _fast.warm_up()
