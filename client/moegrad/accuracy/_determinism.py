"""Does the candidate give the same bits twice? Run it several times on one call and count the variants.

Atomic accumulation (``index_add_`` on CUDA, a scatter with atomic adds) adds a token's slots in
whatever order the threads arrive, so a row with several slots can come out differently from run to
run, while every variant is still a correct float32 sum. Such variants stay within the error bound
of *some* order of adds (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section
4.2: a recursive sum of n values errs by at most ``gamma_(n-1) * sum |x_t|``, ``gamma_n = n u / (1 -
n u)``, u = 2**-24 for float32 adds), plus half an ULP of the output dtype for the final cast
(:func:`moegrad.accuracy.any_order_bound`, the bound :func:`moegrad.explain` uses too). A variant
beyond that bound is not rounding: a race that loses or repeats an add.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moegrad.accuracy._bound import any_order_bound
from moegrad.accuracy._candidate import candidate_in_use
from moegrad.numerics._reference import moe_init_routing_v2_grad_golden
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["DeterminismCheck", "check_determinism"]

_KEEP_ROWS = 16


@dataclass(frozen=True)
class DeterminismCheck:
    """Several runs of one candidate on one call.

    Attributes:
        runs: how many times the candidate ran.
        distinct_per_row: [N] int64, the distinct results of each row over the runs (1: steady);
            rows compare by bits, every NaN alike.
        varying_rows: the rows with more than one distinct result, ascending.
        within_bound: whether every result of every run lies within
            :func:`~moegrad.accuracy.any_order_bound` of the float64 golden (NaN and infinities
            where the golden has them).
        outside_rows: the rows where some run lies outside that bound, ascending.
        variants: for up to 16 varying rows (the first ones found), their distinct results
            ([k, H], the call's dtype or float32), in the order they appeared.
    """

    runs: int
    distinct_per_row: np.ndarray = field(repr=False)
    varying_rows: np.ndarray
    within_bound: bool
    outside_rows: np.ndarray = field(repr=False)
    variants: Mapping[int, np.ndarray] = field(repr=False)

    @property
    def deterministic(self) -> bool:
        """No row varied."""
        return self.varying_rows.size == 0

    def __str__(self) -> str:
        rows = self.distinct_per_row.size
        if self.deterministic:
            head = f"the same bits in all {self.runs} runs ({rows} rows)"
        else:
            head = (
                f"{self.varying_rows.size} of {rows} rows vary over {self.runs} runs "
                f"(up to {int(self.distinct_per_row.max())} distinct results per row)"
            )
        if self.within_bound:
            tail = "every result within the any-order bound"
            if not self.deterministic:
                tail += ": rounding from an order that changes between runs (atomic accumulation), not a lost add"
        else:
            tail = f"{self.outside_rows.size} rows outside the any-order bound: a fault, not rounding"
        return f"{head}; {tail}"


def _row_hashes(result: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Two 64-bit hashes per row of ``result``'s bits (every NaN alike): [2, N] uint64."""
    bits = result.view(np.dtype(f"u{result.itemsize}")).astype(np.uint64)
    nan = np.isnan(result)
    if nan.any():
        bits[nan] = 0x7FC00000
    return np.stack([bits @ keys[0], bits @ keys[1]])  # uint64 products wrap: a polynomial hash mod 2**64


def _outside(result: np.ndarray, golden: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """[N] bool: rows with an element farther than ``bound`` from ``golden`` (or of another class)."""
    value = result.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        far = ~(np.abs(value - golden) <= bound)
    finite = np.isfinite(golden)
    same_class = (np.isnan(value) & np.isnan(golden)) | (value == golden)
    far = np.where(finite, far, ~same_class)
    return far.any(axis=1)


def _distinct(hashes: np.ndarray) -> np.ndarray:
    """[N] distinct results per row from [runs, 2, N] row hashes."""
    first, second = hashes[:, 0, :], hashes[:, 1, :]
    order = np.lexsort((second, first), axis=0)
    first, second = np.take_along_axis(first, order, 0), np.take_along_axis(second, order, 0)
    changes = (first[1:] != first[:-1]) | (second[1:] != second[:-1])
    return 1 + changes.sum(axis=0)


def _keep_variants(
    kept: dict[int, dict[tuple[int, int], np.ndarray]], row_hashes: np.ndarray, first: np.ndarray, result: np.ndarray
) -> None:
    """Add ``result``'s rows that differ from the first run's to ``kept`` (at most 16 rows in all)."""
    differ = np.flatnonzero((row_hashes != first).any(axis=0))
    fresh = differ[~np.isin(differ, list(kept))][: _KEEP_ROWS - len(kept)]
    for row in [*(row for row in differ if int(row) in kept), *fresh]:
        key = (int(row_hashes[0, row]), int(row_hashes[1, row]))
        kept.setdefault(int(row), {}).setdefault(key, result[row].copy())


def check_determinism(
    candidate: Any, call: MoeInitRoutingV2GradCall, runs: int = 10, *, golden: np.ndarray | None = None
) -> DeterminismCheck:
    """Run ``candidate`` ``runs`` times on ``call``; which rows vary, and is every variant rounding?

    Args:
        candidate: a :class:`~moegrad.accuracy.Candidate`, a callable, a v2 URL or
            ``"package.module:function"``.
        call: the call to repeat (rows with one slot, or all slots skipped, cannot vary in order).
        runs: at least 2; atomic accumulation shows within a few runs on rows with several slots,
            the MoE fixes that found it counted distinct results over 40-100 runs.
        golden: ``moe_init_routing_v2_grad_golden(call)`` when already computed.

    Returns:
        A :class:`DeterminismCheck`. Memory beyond one result: two hashes per row per run, and the
        variants of at most 16 rows.

    Raises:
        ValueError: ``runs < 2``.
        CandidateError: the candidate failed or returned something other than grad_x.
    """
    if isinstance(runs, bool) or not isinstance(runs, (int, np.integer)) or runs < 2:
        raise ValueError(f"runs={runs!r} must be an integer >= 2")
    golden = moe_init_routing_v2_grad_golden(call) if golden is None else golden
    bound = any_order_bound(call, golden)
    keys = np.random.default_rng(0).integers(1, 2**63, (2, call.hidden_size), dtype=np.uint64) | np.uint64(1)
    with candidate_in_use(candidate) as fn:
        first = fn(call)
        hashes, outside = [_row_hashes(first, keys)], _outside(first, golden, bound)
        kept: dict[int, dict[tuple[int, int], np.ndarray]] = {}
        for _ in range(runs - 1):
            result = fn(call)
            row_hashes = _row_hashes(result, keys)
            outside |= _outside(result, golden, bound)
            _keep_variants(kept, row_hashes, hashes[0], result)
            hashes.append(row_hashes)
    distinct = _distinct(np.stack(hashes))
    variants = {row: np.stack([first[row], *found.values()]) for row, found in sorted(kept.items())}
    return DeterminismCheck(
        runs=int(runs),
        distinct_per_row=distinct,
        varying_rows=np.flatnonzero(distinct > 1),
        within_bound=not bool(outside.any()),
        outside_rows=np.flatnonzero(outside),
        variants=variants,
    )
