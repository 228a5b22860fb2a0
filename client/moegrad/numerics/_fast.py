"""The compiled path of the reference numerics: one pass over the gathered rows, when numba is installed.

:func:`moegrad.numerics._reference.moe_init_routing_v2_grad` hands its float32 accumulation here first; when
this path cannot take a call (numba missing, or an input layout it does not handle) it returns False
and the NumPy path runs instead. Both give the same bits (a NaN's payload aside: NaN where the other
has NaN): the adds are the ones :func:`~moegrad.numerics._reference.accumulation_schedule` lists, in its
order, on exactly widened float32 values, rounded once, half to even (see :mod:`moegrad.numerics._fast_jit`
for how the compiled code keeps that).

Why it is faster than the NumPy path: NumPy gathers each slot's rows into a buffer, widens them into
another and adds that into a bin, so every value crosses the cache hierarchy several times. Here each
gathered row is read once and widened in registers; the bins' chains of adds (docs/semantics.md:
S1-S3 touch one bin at a time) run four bins and two elements each per pass, so a pass reads eight
rows side by side (a core keeps more loads in flight). For K = 1-3 and 8-15 (B = 1 or 4) the whole
sum, S4 and the narrowing of grad_x happen in passes that end in grad_x directly, K = 8 in a single
pass with no float32 bin in memory at all. Other K keep float32 bins for the group results, in
cache-sized tiles of H; a pass whose every chain element is a pad (a -0.0 add) is left out. The
first bytes of the rows of the tokens a few ahead are prefetched, so that at small H with random
routing the misses of several tokens overlap instead of one token's two rows waiting at a time.
A grad_x of ``_STREAM_BYTES`` or more, far beyond the caches, is written past them: each tile is
finished in a staging row and stored with non-temporal stores, so the memory does not first read
every line of grad_x that it is about to overwrite (a third stream beside the rows read and grad_x
written). Nothing is allocated beyond those bins and the staging row, one set per running lane (at
most ``_BIN_BYTES`` and a tile).

Threads: rows are cut into spans of about 4 MiB of input each. One task per thread of the reference
module's shared pool (a "lane") takes spans one after the other until none is left, calling the
kernel (which releases the GIL) on each: the load balances itself, and a span costs one kernel call
rather than one pool task. Calls made at the same time, such as a service with two streams, queue
their lanes on the same pool, so the machine never runs more compute threads than the pool has
(``MOEGRAD_REFERENCE_THREADS``, default: the CPUs this process may use, at most 8). numba's own
parallel layer (prange over the same spans) is not used: it is no faster than these lanes
(bench/RESULTS.md, "Notes kept from earlier runs"), each calling thread starts its own team of
threads, so two streams would run twice as many threads as cores, and numba's default (workqueue)
layer aborts when two threads launch at once.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "PRIVATE_MEMBERS",
    "CompiledModule",
    "KernelCache",
    "accumulate",
    "accumulate_950",
    "available",
    "kernel_cache",
    "warm_up",
]

_CHUNK_INPUT_BYTES = 4 << 20  # gathered input per chunk: enough to hide the call, small enough to balance
_BIN_BYTES = 128 << 10  # float32 bins of one tile: they stay in the core's L2
_STREAM_BYTES = 16 << 20  # grad_x from which the kernel writes it with non-temporal stores
_TILE_950 = 4096  # elements of H per pass of the 950 loop: its one float32 accumulator row stays in L1
_BIT_VIEWS: dict[np.dtype[Any], np.dtype[Any]] = {  # the dtype the kernel sees: it names the format too (see _fast_jit)
    np.dtype(np.float32): np.dtype(np.float32),
    np.dtype(np.float16): np.dtype(np.int16),
    np.dtype(ml_dtypes.bfloat16): np.dtype(np.uint16),
}


#: numba's members beyond its documented API that :meth:`CompiledModule.cache` reads (owner, name):
#: each dispatcher's cache counters. pyproject.toml bounds numba to the releases
#: tests/contract/test_numba_members.py passed on.
PRIVATE_MEMBERS: tuple[tuple[str, str], ...] = (("numba.core.dispatcher.Dispatcher", "stats"),)


@dataclasses.dataclass(frozen=True)
class KernelCache:
    """What numba's on-disk cache gave a module of compiled kernels in this process so far.

    Counted per kernel and signature (one per dtype a kernel was called with), from each numba
    dispatcher's cache counters (``Dispatcher.stats``: a lookup that found the compiled code on disk
    is a hit, one that had to compile is a miss).

    Attributes:
        loaded: signatures loaded from the cache (a warm cache: well under a second each).
        compiled: signatures compiled in this process, then saved to the cache (a cold cache:
            seconds each).
        folder: where numba keeps the module's cache (beside the module, or under
            ``NUMBA_CACHE_DIR``); None before the module is imported or without numba.
    """

    loaded: int = 0
    compiled: int = 0
    folder: str | None = None

    def since(self, before: KernelCache) -> KernelCache:
        """The signatures loaded and compiled after ``before`` was taken."""
        return KernelCache(self.loaded - before.loaded, self.compiled - before.compiled, self.folder)


class CompiledModule:
    """A module of numba kernels, imported on its first use (importing it imports numba, and
    numba's on-disk cache checks only a kernel's own file, so the kernels live in modules of their
    own: :mod:`moegrad.numerics._fast_jit`, :mod:`moegrad.accuracy._fused_jit`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.module: ModuleType | None = None
        self.missing = False  # numba could not be imported: the NumPy path serves

    def load(self) -> ModuleType | None:
        """The module; None where numba cannot be imported (asked once)."""
        if self.module is None and not self.missing:
            try:
                self.module = importlib.import_module(self.name)
            except ImportError:
                self.missing = True
        return self.module

    def cache(self) -> KernelCache:
        """What numba's cache gave this module's kernels so far (all 0 before it is imported)."""
        if self.module is None:
            return KernelCache()
        from numba.extending import is_jitted  # numba imports: the module did

        loaded = compiled = 0
        folder = None
        for kernel in vars(self.module).values():
            if is_jitted(kernel) and getattr(kernel, "__module__", None) == self.name:
                stats = kernel.stats  # numba's undocumented Dispatcher.stats (tests/contract)
                loaded += sum(stats.cache_hits.values())
                compiled += sum(stats.cache_misses.values())
                folder = folder or stats.cache_path
        return KernelCache(loaded, compiled, folder)


_KERNELS = CompiledModule("moegrad.numerics._fast_jit")


def _load_jit() -> ModuleType | None:
    """The compiled module, imported on first use; None where numba cannot be imported."""
    return _KERNELS.load()


def available() -> bool:
    """Whether the compiled path can run here (numba imports)."""
    return _load_jit() is not None


def kernel_cache() -> KernelCache:
    """What numba's on-disk cache gave the reference kernel in this process so far (:class:`KernelCache`)."""
    return _KERNELS.cache()


def warm_up() -> bool:
    """Compile (or load from numba's cache) the kernel for all three dtypes; False without numba.

    The first call of each dtype otherwise pays for the compilation, unless numba's cache has the
    kernel (beside the module, or in NUMBA_CACHE_DIR): a cached kernel loads instead of compiling
    (bench/RESULTS.md, "Notes kept from earlier runs"). A server can
    call this at startup, before it reports ready.
    """
    jit = _load_jit()
    if jit is None:
        return False
    for view in _BIT_VIEWS.values():
        rows = np.zeros((2, 1), dtype=view)
        plan = _plan((("set", 0, 0), ("add", 0, 1)))
        assert plan is not None  # a two-slot chain always has the kernel's shape
        chains, group = plan
        jit.run_rows(
            _read_only(rows),
            _aux(view, 1),
            _read_only(np.arange(2, dtype=np.int32)),
            2,
            chains,
            group,
            1,
            False,
            np.empty((1, 1), dtype=view),
            0,
            1,
        )
        jit.run_rows_950(
            _read_only(rows),
            _aux(view, 1),
            _read_only(np.arange(2, dtype=np.int32)),
            2,
            2,
            True,
            1,
            False,
            np.empty((1, 1), dtype=view),
            0,
            1,
        )
    return True


@functools.lru_cache(maxsize=512)
def _plan(schedule: tuple[tuple[str, int, int], ...]) -> tuple[np.ndarray, int] | None:
    """The schedule as per-bin chains for the kernel, or None when it does not have the kernel's shape.

    Returns ``(chains, group)``: chains [B, L, 2] int32, bin b's adds in order as (slot, aux row),
    where slot -1 reads the aux row, and a skipped slot too: +0.0 (row 0) for a set or a zero,
    -0.0 (row 1) for an add; chains are padded with (-1, 1) to the same even length L. ``group``
    is how many bins the kernel runs side by side: 4, or 1 when B < 4. The kernel starts each bin
    at -0.0 and adds, so a set of v gives v and a skipped set +0.0, and an add of -0.0 changes no
    bit: the same adds, in the same order, as the schedule. The shape it needs: each bin's first
    step a set or zero, all merges after the last set/add, and the merges the pairwise tree of
    docs/semantics.md (step S4) over B bins (both orders have it).
    """
    merges = [step for step in schedule if step[0] == "merge"]
    head = list(schedule[: len(schedule) - len(merges)])
    if any(step[0] == "merge" for step in head):
        return None
    nbins = 1 + max(step[1] for step in schedule)
    tree, stride = [], 1
    while stride < nbins:
        tree += [("merge", j - stride, j) for j in range(stride, nbins, 2 * stride)]
        stride *= 2
    if nbins & (nbins - 1) or merges != tree:
        return None
    chains: list[list[tuple[int, int]]] = [[] for _ in range(nbins)]
    for op, dst, src in head:
        if (op in ("set", "zero")) != (not chains[dst]):
            return None  # a bin must open with its one set (or zero)
        chains[dst].append((src, 0) if op == "set" else (-1, 0) if op == "zero" else (src, 1))
    if any(not chain for chain in chains):
        return None
    layers = max(len(chain) for chain in chains)
    layers += layers % 2  # the kernel takes two elements of a chain per pass
    table = np.array([chain + [(-1, 1)] * (layers - len(chain)) for chain in chains], dtype=np.int32)
    table.flags.writeable = False
    return table, 4 if nbins >= 4 else 1


@functools.lru_cache(maxsize=8)
def _aux(view: np.dtype, hidden: int) -> np.ndarray:
    """[2, H] in the kernel's bit view: row 0 all +0.0, row 1 all -0.0 (only the sign bit set)."""
    aux = np.zeros((2, hidden), dtype=view)
    words = aux.view(np.uint32 if view.itemsize == 4 else np.uint16)
    words[1] = 1 << (8 * view.itemsize - 1)
    aux.flags.writeable = False
    return aux


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view (the array itself when it is one already): numba compiles one specialisation
    per writability, and the service's inputs (views of the request body) are read-only, so every
    caller passes inputs this way."""
    if not array.flags.writeable:
        return array
    view = array.view()
    view.flags.writeable = False
    return view


def accumulate(
    rows: np.ndarray,
    index: np.ndarray,
    top_k: int,
    schedule: Sequence[tuple[str, int, int]],
    out: np.ndarray,
    map_chunks: Callable[[Callable[[int, int], None], int, int], None],
    lanes: int,
) -> bool:
    """grad_x into ``out`` with the compiled kernel; False (``out`` untouched) when it cannot take the call.

    Args:
        rows: [R, H] grad_expanded_x (drop/pad: [E*C, H]); float32, float16 or bfloat16.
        index: [N*K] int32 expanded_row_idx; a slot outside [0, R) is skipped (docs/semantics.md
            section 2: validation leaves there only the profile's skipped slots).
        top_k: K.
        schedule: :func:`~moegrad.numerics._schedules.accumulation_schedule` of K (a tuple).
        out: [N, H] C-contiguous, the dtype of ``rows``; N >= 1, H >= 1.
        map_chunks: runs ``fn(start, stop)`` over row chunks (the reference module's thread pool).
        lanes: how many of the pool's threads this call may use.
    """
    view = _BIT_VIEWS.get(rows.dtype)
    if view is None or out.dtype != rows.dtype or not rows.flags.c_contiguous or not out.flags.c_contiguous:
        return False  # byte-swapped, strided or mixed: the NumPy path handles those
    jit = _load_jit()
    if jit is None:
        return False
    plan = _plan(tuple(schedule))
    if plan is None:
        return False
    chains, group = plan
    hidden = out.shape[1]
    groups = chains.shape[0] // group
    kept = group + (groups if groups > 1 else 0)  # float32 bins per element of a tile: working + group results
    tile = min(hidden, max(64, _BIN_BYTES // (4 * kept) // 64 * 64))
    schedule_args = (chains, group, tile, _streams(out))
    _run_spans(jit.run_rows, view, rows, _aux(view, hidden), index, top_k, schedule_args, out, map_chunks, lanes)
    return True


def accumulate_950(
    rows: np.ndarray,
    index: np.ndarray,
    top_k: int,
    k_chunk: int,
    grouped: bool,
    out: np.ndarray,
    map_chunks: Callable[[Callable[[int, int], None], int, int], None],
    lanes: int,
) -> bool:
    """grad_x into ``out`` in the Ascend 950 order; False (``out`` untouched) when it cannot take the call.

    Same bits as the NumPy path running :func:`moegrad.numerics._ascend950.ascend950_schedule` (one float32
    accumulator from +0.0; groups of four restarting every ``k_chunk`` slots, or a plain chain when
    ``grouped`` is False; a skipped slot adds +0.0; one rounding at the end).

    Args:
        rows: [R, H] grad_expanded_x (drop/pad: [E*C, H]); float32, float16 or bfloat16.
        index: [N*K] int32 expanded_row_idx; a slot outside [0, R) is skipped.
        top_k: K.
        k_chunk: the slots per pass, 1 <= k_chunk <= K.
        grouped: groups of four (the 950 from CANN 9.0) or a plain chain (CANN 8.5).
        out: [N, H] C-contiguous, the dtype of ``rows``; N >= 1, H >= 1.
        map_chunks: runs ``fn(start, stop)`` over row chunks (the reference module's thread pool).
        lanes: how many of the pool's threads this call may use.
    """
    view = _BIT_VIEWS.get(rows.dtype)
    if view is None or out.dtype != rows.dtype or not rows.flags.c_contiguous or not out.flags.c_contiguous:
        return False
    jit = _load_jit()
    if jit is None:
        return False
    hidden = out.shape[1]
    zero = _aux(view, hidden)[:1]  # row 0 of the aux rows: all +0.0
    tile = min(hidden, _TILE_950)
    schedule_args = (k_chunk, grouped, tile, _streams(out))
    _run_spans(jit.run_rows_950, view, rows, zero, index, top_k, schedule_args, out, map_chunks, lanes)
    return True


def _streams(out: np.ndarray) -> bool:
    """Whether the kernel writes ``out`` past the caches: when it is _STREAM_BYTES or more and its
    elements are aligned to their size (the streaming stores need whole 64-byte lines; a view of a
    buffer at an odd byte offset has none, and takes ordinary stores)."""
    return out.nbytes >= _STREAM_BYTES and out.flags.aligned


def _run_spans(
    kernel: Callable[..., None],
    view: np.dtype[Any],
    rows: np.ndarray,
    aux: np.ndarray,
    index: np.ndarray,
    top_k: int,
    schedule_args: tuple,
    out: np.ndarray,
    map_chunks: Callable[[Callable[[int, int], None], int, int], None],
    lanes: int,
) -> None:
    """``kernel(rows, aux, index, top_k, *schedule_args, out, start, stop)`` in the kernel's bit
    ``view``, over the rows [0, N) of ``out`` in spans of about _CHUNK_INPUT_BYTES of input.

    One span runs here, on the calling thread (a small call pays no hand-off to the pool); more go
    to at most ``lanes`` of the pool's threads, each taking spans until none is left.
    """
    tokens, hidden = out.shape
    args = (
        _read_only(rows.view(view)),
        aux,
        _read_only(np.ascontiguousarray(index.reshape(-1), dtype=np.int32)),
        top_k,
        *schedule_args,
        out.view(view),
    )
    chunk = max(1, _CHUNK_INPUT_BYTES // max(1, top_k * hidden * rows.itemsize))
    if tokens <= chunk:
        kernel(*args, 0, tokens)
        return
    spans = [(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]
    taken = itertools.count()  # next() on it is atomic under the GIL: each span is taken once

    def lane(_first: int, _last: int) -> None:  # one per thread
        while (number := next(taken)) < len(spans):
            kernel(*args, *spans[number])

    map_chunks(lane, min(lanes, len(spans)), 1)
