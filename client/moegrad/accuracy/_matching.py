"""Exact replays of a block of rows: which known schedule, precision or faulty summand gives the candidate's bits.

A replay reproduces a row when every element's bits equal the candidate's, a NaN matching any NaN
(its payload is not part of the contract, docs/semantics.md section 4). Each function replays only
the rows still unmatched, one schedule after another, and reports the first that reproduces each.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moegrad.accuracy._fingerprint import Block, Fit, Window, take_rows
from moegrad.accuracy._replay import Schedule, replay

__all__ = ["match_fits", "match_schedules", "same_rows"]

_UINT = {2: np.uint16, 4: np.uint32}
_F32 = np.dtype(np.float32)
_CHUNK_ELEMENTS = 1 << 22  # summand elements of one batch of fault replays


_NAN_MASKS = {2: (np.uint16(0x7FFF), np.uint16(0x7C00)), 4: (np.uint32(0x7FFFFFFF), np.uint32(0x7F800000))}


def same_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[n] whether rows of ``a`` and ``b`` ([n, H], one dtype) are bit-identical, NaN matching NaN."""
    words = _UINT[a.dtype.itemsize]
    x, y = a.view(words), b.view(words)
    same = ~(x != y).any(axis=1)
    suspects = np.flatnonzero(~same)
    if suspects.size:  # rows that differ are still the same if every difference is NaN against NaN
        magnitude, infinity = _NAN_MASKS[a.dtype.itemsize]
        if a.dtype.itemsize == 2 and a.dtype != np.float16:  # bfloat16: float32's exponent
            infinity = np.uint16(0x7F80)
        xs = x[suspects]
        with_nan = ((xs & magnitude) > infinity).any(axis=1)
        for position in suspects[with_nan]:
            p, q = a[position].astype(np.float32), b[position].astype(np.float32)
            same[position] = bool(((x[position] == y[position]) | (np.isnan(p) & np.isnan(q))).all())
    return same


def match_schedules(
    block: Block, w: np.ndarray, schedules: Sequence[Schedule], window: Window, accumulator: np.dtype = _F32
) -> list[Schedule | None]:
    """For block rows ``w`` (all in ``window``), the first schedule whose replay of the device's
    summands, accumulated in ``accumulator`` (float32: the kernels'; float16 / bfloat16: a narrower
    type), gives the candidate's bits; None for a row none reproduces. Each schedule replays the
    window first, the whole row only where the window matches."""
    found: list[Schedule | None] = [None] * w.size
    left = np.arange(w.size)
    for schedule in schedules:
        if left.size == 0:
            break
        tried = left[_window_matches(window, window.position[w[left]], schedule, accumulator)]
        if tried.size and not window.whole:
            rows = w[tried]
            with np.errstate(all="ignore"):
                out = replay(block.call, block.rows, block.index[rows], schedule, accumulator=accumulator)
            tried = tried[same_rows(out, block.candidate[rows])]
        for position in tried:
            found[position] = schedule
        left = np.setdiff1d(left, tried)
    return found


def _window_matches(window: Window, at: np.ndarray, schedule: Schedule, accumulator: np.dtype) -> np.ndarray:
    """[at.size] whether the schedule's replay gives the candidate's bits in window rows ``at``."""
    count = at.size * window.values.shape[1]
    every = at.size == window.rows.size and (at == np.arange(at.size)).all()
    values = (window.values if every else window.values[at]).reshape(count, window.width)
    local = np.where(window.skip[at].reshape(-1), count, np.arange(count))
    with np.errstate(all="ignore"):
        out = replay(window.block.call, values, local, schedule, accumulator=accumulator)
    return same_rows(out, window.wanted[at])


def _summands(block: Block, fits: Sequence[Fit]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each fit's K summands as it says the candidate read them: values [P*K, H], an index into
    them (a skipped slot outside [0, P*K)) and, for a duplicated slot, its row ([P] int, -1 else)."""
    top_k = block.index.shape[1]
    at = np.array([fit.w for fit in fits], dtype=np.intp)
    slot = np.array([fit.slot for fit in fits], dtype=np.intp)
    source = np.array([fit.source for fit in fits], dtype=np.intp)
    label = np.array([fit.label for fit in fits])
    skip = block.skip[at].copy()
    read = np.where(skip, 0, block.index[at])
    positions = np.arange(at.size)
    swap = (label == "replaced") | (label == "extra")
    read[positions[swap], slot[swap]] = source[swap]
    skip[positions[swap], slot[swap]] = False
    skip[positions[label == "missing"], slot[label == "missing"]] = True
    values = take_rows(block.rows, read.reshape(-1))
    index = np.where(skip, at.size * top_k, np.arange(at.size * top_k).reshape(at.size, top_k))
    appended = np.where(label == "duplicated", source, -1)
    return values, index.reshape(-1), appended


def match_fits(block: Block, fits: Sequence[Fit], schedules: Sequence[Schedule]) -> list[Schedule | None]:
    """For each fit, the first schedule whose replay with the fit's summands gives the candidate's
    bits (a duplicated slot is added once more after the schedule, before the final rounding), or None."""
    found: list[Schedule | None] = [None] * len(fits)
    per_fit = max(1, block.index.shape[1] * block.rows.shape[1])
    step = max(1, _CHUNK_ELEMENTS // per_fit)
    for start in range(0, len(fits), step):
        part = list(fits[start : start + step])
        values, index, appended = _summands(block, part)
        wanted = block.candidate[[fit.w for fit in part]]
        for left in (np.flatnonzero(appended < 0), np.flatnonzero(appended >= 0)):
            for schedule in schedules:
                if left.size == 0:
                    break
                hit = _replay_fits(block, schedule, values, index, appended[left], wanted[left], left)
                for position in left[hit]:
                    found[start + position] = schedule
                left = left[~hit]
    return found


def _replay_fits(
    block: Block,
    schedule: Schedule,
    values: np.ndarray,
    index: np.ndarray,
    appended: np.ndarray,
    wanted: np.ndarray,
    left: np.ndarray,
) -> np.ndarray:
    """[left.size] whether the replay by ``schedule`` of fits ``left`` (all plain, or all with a
    slot ``appended``) gives the rows ``wanted``."""
    top_k = block.index.shape[1]
    slots = (left[:, None] * top_k + np.arange(top_k)).reshape(-1)
    rows = values[slots]  # fit p's slot k is row p*K + k of `rows`, or skipped
    local = np.where(index[slots] >= values.shape[0], rows.shape[0], np.arange(rows.shape[0]))
    with np.errstate(all="ignore"):
        if (appended < 0).all():
            out = replay(block.call, rows, local, schedule)
        else:
            total = replay(block.call, rows, local, schedule, out_dtype=_F32)
            total += take_rows(block.rows, appended).astype(_F32)
            out = total.astype(block.candidate.dtype)
    return same_rows(out, wanted)
