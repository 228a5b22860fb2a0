"""The schedules of adds: which float32 add of aclnnMoeInitRoutingV2Grad comes when (docs/semantics.md).

Every order sums the same widened float32 values with float32 round-to-nearest-even adds; only the
order of the adds differs, and with it the bits. A device profile (:mod:`moegrad.operator._profiles`) names
one of three kernels' schedules (``Profile.schedule``):

``"bins"`` reproduces the Atlas A2/A3 kernel (ascend910b, ascend910_93, every release) bit for bit:
B = 64 bins when K >= 128, else 2**max(floor(log2 K) - 1, 0);
S1 ``bin[b] = v[2b]`` for b < B (a skipped slot sets +0.0);
S2 ``bin[(t/2) % B] += v[t]`` for even t >= 2B, increasing;
S3 ``bin[((t-1)/2) % B] += v[t]`` for odd t, increasing (a skipped slot in S2/S3 adds nothing);
S4 a pairwise tree ``bin[j-s] += bin[j]`` for s = 1, 2, 4, ... < B and j = s, 3s, 5s, ... < B.
``"chain"`` is float32 from +0.0, t = 0..K-1: Huawei's public test golden (``"sequential"``) and the
Ascend 950 kernel at CANN 8.5.
``"groups_of_four"`` reproduces the Ascend 950PR/950DT kernel from CANN 9.0 (:mod:`moegrad.numerics._ascend950`):
one float32 accumulator from +0.0, groups of four slots added as ``s += ((v0 + v1) + (v2 + v3))``,
leftovers one by one, the groups restarting at each chunk of slots the tiling picks (which depends
on N, K, H, the dtype, the UB size and the vector core count); a skipped slot adds +0.0.

:func:`accumulation_schedule` writes a schedule out as data (steps of one output row), which both
kernel paths of :mod:`moegrad.numerics._reference` run.
"""

from __future__ import annotations

import functools

from moegrad.numerics._ascend950 import (
    ASCEND950,
    UB_SIZE_BYTES,
    VECTOR_CORE_COUNT,
    ascend950_schedule,
    ascend950_tiling,
)
from moegrad.operator._profiles import BINS, CHAIN, DEFAULT_PROFILE, GROUPS_OF_FOUR, resolve_profile

__all__ = ["accumulation_schedule", "bin_count", "schedule_steps"]


def bin_count(top_k: int) -> int:
    """B, the number of float32 accumulators the A2/A3 kernel uses for ``top_k`` slots (docs/semantics.md)."""
    if top_k >= 128:
        return 64
    return 2 ** max(top_k.bit_length() - 2, 0)


def accumulation_schedule(
    top_k: int,
    order: str = DEFAULT_PROFILE,
    *,
    dtype: object = None,
    num_tokens: int | None = None,
    hidden_size: int | None = None,
    ub_size_bytes: int = UB_SIZE_BYTES,
    vector_core_count: int = VECTOR_CORE_COUNT,
) -> tuple[tuple[str, int, int], ...]:
    """The adds of one output row, in the order the kernel performs them.

    Args:
        top_k: K >= 1.
        order: the device profile, any name of :data:`~moegrad.ORDERS` (as a call's ``order``); its
            schedule (``Profile.schedule``) decides.
        dtype, num_tokens, hidden_size: grad_expanded_x's dtype, N and H; required for the
            Ascend 950 profiles, whose tiling (and so whose schedule) depends on them; ignored otherwise.
        ub_size_bytes, vector_core_count: the 950 platform's UB size in bytes and vector core
            count (defaults: Ascend 950PR/950DT, docs/semantics.md section 7.4).

    Returns:
        A tuple of steps ``(op, dst, src)``: ``("zero", b, 0)`` bin b = +0.0, ``("set", b, t)`` bin
        b = slot t (+0.0 when skipped), ``("add", b, t)`` bin b += slot t (nothing when skipped),
        ``("merge", b, c)`` bin b += bin c. The row's result is bin 0.

    Raises:
        ValueError: an unknown profile, ``top_k < 1``, or a 950 profile without dtype, num_tokens
            and hidden_size.
    """
    profile = resolve_profile(order)
    if profile.chip == ASCEND950:
        missing = [
            name
            for name, value in (("dtype", dtype), ("num_tokens", num_tokens), ("hidden_size", hidden_size))
            if value is None
        ]
        if missing:
            raise ValueError(
                f"order={order!r} ({profile.name}) needs {', '.join(missing)}: the 950's tiling, and so its order, "
                "depends on the dtype, N and H"
            )
        if top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1")
        assert num_tokens is not None and hidden_size is not None  # checked just above: missing is empty
        tiling = ascend950_tiling(
            dtype, num_tokens, top_k, hidden_size, ub_size_bytes=ub_size_bytes, vector_core_count=vector_core_count
        )
        return ascend950_schedule(top_k, tiling.k_chunk, profile.schedule == GROUPS_OF_FOUR)
    return schedule_steps(top_k, profile.schedule)


@functools.lru_cache(maxsize=512)
def schedule_steps(top_k: int, schedule: str) -> tuple[tuple[str, int, int], ...]:
    """The steps of one output row in the kernel's schedule ``schedule``, ``"bins"`` or ``"chain"`` (the
    950's ``"groups_of_four"`` depends on its tiling: :func:`moegrad.numerics._ascend950.ascend950_schedule`).

    Raises:
        ValueError: ``top_k < 1`` or another ``schedule``.
    """
    if top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if schedule == CHAIN:
        return (("zero", 0, 0), *(("add", 0, t) for t in range(top_k)))
    if schedule != BINS:
        raise ValueError(f"schedule={schedule!r} is not {BINS!r} or {CHAIN!r}")
    bins = bin_count(top_k)
    steps = [("set", b, 2 * b) for b in range(bins)]
    steps += [("add", (t // 2) % bins, t) for t in range(2 * bins, top_k, 2)]
    steps += [("add", ((t - 1) // 2) % bins, t) for t in range(1, top_k, 2)]
    stride = 1
    while stride < bins:
        steps += [("merge", j - stride, j) for j in range(stride, bins, 2 * stride)]
        stride *= 2
    return tuple(steps)
