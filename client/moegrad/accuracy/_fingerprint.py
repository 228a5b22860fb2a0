"""The fingerprint of a wrong summand, and the search for the summand that leaves it.

Every row of grad_x is H independent sums over the same K slots, so a wrong summand moves every
column of the row by the same vector: with ``residual = candidate - golden`` (the golden being the
exact sum of the device's summands),

    missing slot s      residual = -x_s          +- the any-order bound of the other summands
    duplicated slot s   residual = +x_s          +- the bound of the K + 1 summands
    replaced: s read r  residual = x_r - x_s     +- the bound of the summands with x_r for x_s
    extra: skipped u    residual = +x_r          +- the bound with x_r added

(``x`` a row of grad_expanded_x, widened exactly). A *fit* is a hypothesis whose residual lies
within the bound in every column where both results are finite. The row's own slots are tried
first (:func:`own_slot_fits`): one probe column per row sorts out almost every slot, the few left
are checked on every column. Replaced and extra summands read some other row: the target vector is
looked up in a few sorted key columns of grad_expanded_x (:class:`RowIndex`, binary search), and the
rows found are checked on every column (:func:`row_search_fits`). A hypothesis that changes no
value (a row of zeros added, a slot replaced by an identical row) is no fit: it cannot be told
from no fault at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from moegrad.accuracy._bound import sum_bound
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["WINDOW", "Block", "Fit", "RowIndex", "Window", "own_slot_fits", "row_search_fits", "take_rows"]

_F64 = np.dtype(np.float64)
_CHUNK_ELEMENTS = 1 << 18  # float64 elements per array of a check: a few MiB
_KEY_COLUMNS = 8
WINDOW = 16  # columns a hypothesis or a schedule is tried on before the whole row
_WINDOW_ROWS = 1 << 12  # a target whose narrowest window is wider is not searched (docs/accuracy.md)
_PAIRS = 1 << 16  # (target, row) pairs looked at in one batch
_TINY = np.finfo(np.float64).tiny


_WORDS = {2: np.uint16, 4: np.uint32}


def take_rows(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``array[index]`` (rows of a 2-D array), gathered through an unsigned-integer view: NumPy's
    fancy indexing of an ``ml_dtypes`` dtype copies element by element, several times slower."""
    words = _WORDS.get(array.dtype.itemsize)
    if words is None:
        return array[index]
    return array.view(words)[index].view(array.dtype)


@dataclass
class Block:
    """Differing rows of grad_x, their differing elements, and what every test of them reads.

    Attributes:
        call: the call; ``dtype``: its dtype name.
        rows: grad_expanded_x as [R, H], C-contiguous, the call's dtype.
        row: [c] the rows of grad_x.
        index: [c, K] int64 ``expanded_row_idx`` of those rows; ``skip`` [c, K] the skipped slots
            (the index is outside [0, R)); ``count`` [c] the summands the device adds.
        candidate, device: [c, H] the candidate's and the device's rows, the call's dtype.
        golden, magnitude: [c, H] float64, the exact sum (rounded once) and ``sum |x_t|``.
        ew, eh: [E] the differing elements (bits differ, NaN matching NaN), row-major: the block
            row and the column of each.
        ecand, edev, egold, ebound, eratio: [E] float64 at those elements: the candidate, the
            device, the golden, the any-order bound at the candidate's value, and ``|candidate -
            golden| / bound`` (inf where the bound is 0); ``eusable``: both values finite.
        outside: [c] usable differing elements with ratio > 1 (outside the bound); ``worst`` [c]
            the largest such ratio (0 when none).
        top: [c, 8] per row, its differing elements (indices into the E arrays) with the largest
            ratio, largest first, -1 past the row's count.
    """

    call: MoeInitRoutingV2GradCall
    dtype: str
    rows: np.ndarray
    row: np.ndarray
    index: np.ndarray
    skip: np.ndarray
    count: np.ndarray
    candidate: np.ndarray
    device: np.ndarray
    golden: np.ndarray
    magnitude: np.ndarray
    ew: np.ndarray
    eh: np.ndarray
    ecand: np.ndarray
    edev: np.ndarray
    egold: np.ndarray
    ebound: np.ndarray
    eratio: np.ndarray
    eusable: np.ndarray
    outside: np.ndarray
    worst: np.ndarray
    top: np.ndarray

    def dense(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For block rows ``w``: the candidate as float64, ``candidate - golden`` and whether both
        results are finite (the columns a fingerprint is read from), each [len(w), H]."""
        cand = self.candidate[w].astype(_F64)
        with np.errstate(invalid="ignore"):
            residual = cand - self.golden[w]
        usable = np.isfinite(cand) & np.isfinite(self.device[w].astype(_F64))
        return cand, residual, usable


@dataclass(frozen=True)
class Fit:
    """A summand fault whose fingerprint fits block row ``w`` within the bound.

    Attributes:
        w: the row's position in its :class:`Block`.
        label: "missing", "duplicated", "replaced" or "extra".
        slot: t; source: the row of grad_expanded_x (see the module docstring).
        ratio: the largest ``|residual - fingerprint| / bound`` over the usable columns (<= 1).
    """

    w: int
    label: str
    slot: int
    source: int
    ratio: float


def _within(
    block: Block, w: np.ndarray, delta: np.ndarray, magnitude: np.ndarray, count: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For block rows ``w`` [P] and fingerprints ``delta`` [P, H] (summands ``count`` [P] of
    ``magnitude`` [P, H]): whether every usable column fits, and the largest ratio to the bound."""
    cand, residual, usable = block.dense(w)
    bound = sum_bound(magnitude, count[:, None], cand, block.dtype)
    with np.errstate(invalid="ignore"):
        error = np.abs(residual - delta)
        ok = np.asarray(np.where(usable, error <= bound, True).all(axis=1))
        ratio = np.asarray(np.where(usable, error / np.maximum(bound, _TINY), 0.0).max(axis=1, initial=0.0))
    return ok, ratio


def _chunks(total: int, per_item: int) -> Iterator[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(per_item, 1))
    for start in range(0, total, step):
        yield slice(start, min(start + step, total))


class Window:
    """The summands and the candidate of block rows ``w`` in a window of ``min(16, H)`` contiguous
    columns around each row's worst differing column (the one farthest outside the bound): read
    once (a few cache lines per summand), they let a hypothesis or a schedule be tried on the
    window before the whole row.

    Attributes:
        rows: [n] the block rows ``w``; ``position``: [c] each block row's place among them (-1: none).
        columns: [n, width] the columns; ``worst``: [n] the worst column's place among them.
        values: [n, K, width] the summands (the call's dtype; a skipped slot reads row 0, see ``skip``).
        skip: [n, K]; ``wanted``: [n, width] the candidate's values there.
    """

    def __init__(self, block: Block, w: np.ndarray) -> None:
        hidden = block.rows.shape[1]
        width = min(WINDOW, hidden)
        worst = np.where(block.top[w, 0] >= 0, block.eh[np.maximum(block.top[w, 0], 0)], 0)
        first = np.clip(worst - width // 2, 0, hidden - width)
        self.block, self.rows, self.width, self.whole = block, w, width, width == hidden
        self.position = np.full(block.row.size, -1, dtype=np.intp)
        self.position[w] = np.arange(w.size)
        self.columns = first[:, None] + np.arange(width)
        self.worst = worst - first
        self.skip = block.skip[w]
        start = np.where(self.skip, 0, block.index[w]) * hidden + first[:, None]  # [n, K] flat offsets
        flat = block.rows.reshape(-1)
        offsets = start[:, :, None] + np.arange(width)
        self.values = flat.take(offsets) if flat.size else np.zeros(offsets.shape, dtype=block.rows.dtype)
        self.wanted = block.candidate[w[:, None], self.columns]


def own_slot_fits(block: Block, w: np.ndarray, window: Window) -> list[Fit]:
    """Missing and duplicated slots of block rows ``w`` (all in ``window``) that fit (module
    docstring): each slot is tested on the row's worst column, then on the window, then on every column."""
    fits: list[Fit] = []
    if block.rows.shape[0] == 0 or w.size == 0:
        return fits
    at = window.position[w]
    for label, sign in (("missing", -1.0), ("duplicated", 1.0)):
        rows_at, slots = np.nonzero(_at_worst(block, window, w, sign))  # most slots fail there
        places = np.arange(window.width)
        for stage in (places[None, ::4], places[None, :]):
            if rows_at.size == 0:
                break
            ok = _probe(block, window, at[rows_at], slots, sign, stage)
            rows_at, slots = rows_at[ok], slots[ok]
        for piece in _chunks(rows_at.size, block.rows.shape[1]):
            fits += _full_own_check(block, w[rows_at[piece]], slots[piece], label, sign)
    return fits


def _at_worst(block: Block, window: Window, w: np.ndarray, sign: float) -> np.ndarray:
    """[len(w), K] whether each slot missing (sign -1) or added twice (+1) fits in its row's worst column."""
    at = window.position[w]
    place = window.worst[at]
    column = window.columns[at, place]
    x = window.values[at[:, None], np.arange(window.values.shape[1]), place[:, None]].astype(_F64)
    cand = block.candidate[w, column].astype(_F64)[:, None]
    usable = np.isfinite(cand) & np.isfinite(block.device[w, column].astype(_F64))[:, None]
    with np.errstate(invalid="ignore"):
        residual = cand - block.golden[w, column][:, None]
        grown = np.maximum(block.magnitude[w, column][:, None] + sign * np.abs(x), 0.0)
        bound = sum_bound(grown, (block.count[w] + int(sign))[:, None], cand, block.dtype)
        return ((np.abs(residual - sign * x) <= bound) | ~usable) & ~window.skip[at]


def _probe(block: Block, window: Window, at: np.ndarray, t: np.ndarray, sign: float, places: np.ndarray) -> np.ndarray:
    """[P] whether slot ``t`` of window row ``at`` missing (sign -1) or added twice (+1) fits in the
    window's columns ``places`` ([P, c] or [1, c] positions within the window)."""
    ok = np.ones(at.size, dtype=np.bool_)
    for part in _chunks(at.size, places.shape[1]):
        a, here = at[part], np.broadcast_to(places, (at.size, places.shape[1]))[part]
        columns = window.columns[a[:, None], here]
        rows = window.rows[a]
        where = (rows[:, None], columns)
        x = window.values[a[:, None], t[part][:, None], here].astype(_F64)
        cand = block.candidate[where].astype(_F64)
        usable = np.isfinite(cand) & np.isfinite(block.device[where].astype(_F64))
        with np.errstate(invalid="ignore"):
            residual = cand - block.golden[where]
            grown = np.maximum(block.magnitude[where] + sign * np.abs(x), 0.0)
            bound = sum_bound(grown, (block.count[rows] + int(sign))[:, None], cand, block.dtype)
            ok[part] = ((np.abs(residual - sign * x) <= bound) | ~usable).all(axis=1)
    return ok


def _full_own_check(block: Block, at: np.ndarray, t: np.ndarray, label: str, sign: float) -> list[Fit]:
    source = block.index[at, t]
    summand = take_rows(block.rows, source).astype(_F64)
    grown = np.maximum(block.magnitude[at] + sign * np.abs(summand), 0.0)
    ok, ratio = _within(block, at, sign * summand, grown, block.count[at] + int(sign))
    ok &= (summand != 0).any(axis=1)
    return [
        Fit(int(a), label, int(s), int(r), float(q))
        for a, s, r, q in zip(at[ok], t[ok], source[ok], ratio[ok], strict=True)
    ]


class RowIndex:
    """A few columns of grad_expanded_x, each sorted once, to find the rows near a target vector.

    For each target, the narrowest of its windows (the rows whose value in a key column lies within
    the target's tolerance there) is read and filtered by every other key column: a superset of the
    rows within tolerance in every column, which the caller then checks in full. A target whose
    narrowest window holds more than 4096 rows is not searched, and said to be cut (docs/accuracy.md).
    """

    def __init__(self, rows: np.ndarray) -> None:
        hidden = rows.shape[1]
        self.rows = rows
        self.columns = np.unique(np.linspace(0, hidden - 1, num=min(hidden, _KEY_COLUMNS)).round().astype(np.intp))
        self.order: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        for h in self.columns:
            column = rows[:, h].astype(np.float32)  # exact: every input dtype's values are float32 values
            order = np.argsort(column).astype(np.int32)
            self.order.append(order)
            self.values.append(column[order])

    @staticmethod
    def nbytes(rows: int, hidden: int) -> int:
        """The memory an index of ``rows`` x ``hidden`` holds, in bytes (the peak of its build included)."""
        return (min(hidden, _KEY_COLUMNS) * 8 + 16) * rows

    def near(
        self, targets: np.ndarray, tolerance: np.ndarray
    ) -> tuple[np.ndarray, Iterator[tuple[np.ndarray, np.ndarray]]]:
        """(the targets cut, [P] bool; batches of pairs (target number, row) to check, about 2^16
        pairs each), for targets and tolerance [P, H] float64."""
        count = self.rows.shape[0]
        bounds = []
        for j, h in enumerate(self.columns):
            low = np.nextafter((targets[:, h] - tolerance[:, h]).astype(np.float32), np.float32(-np.inf))
            high = np.nextafter((targets[:, h] + tolerance[:, h]).astype(np.float32), np.float32(np.inf))
            first = np.searchsorted(self.values[j], low, side="left")
            width = np.searchsorted(self.values[j], high, side="right") - first
            usable = np.isfinite(low) & np.isfinite(high)
            bounds.append((low, high, first, np.where(usable, width, count + 1)))
        widths = np.stack([bound[3] for bound in bounds], axis=1)
        best = widths.argmin(axis=1)
        narrowest = widths[np.arange(best.size), best]
        cut = (narrowest > _WINDOW_ROWS) & (narrowest <= count)
        searched = np.flatnonzero(narrowest <= _WINDOW_ROWS)
        return cut, self._batches(searched, best, bounds, narrowest)

    def _batches(self, searched, best, bounds, narrowest) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        batch: list[int] = []
        size = 0
        for p in searched:
            batch.append(int(p))
            size += int(narrowest[p])
            if size >= _PAIRS:
                yield self._pairs(batch, best, bounds, narrowest)
                batch, size = [], 0
        if batch:
            yield self._pairs(batch, best, bounds, narrowest)

    def _pairs(
        self, batch: list[int], best: np.ndarray, bounds: list, narrowest: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The pairs of targets ``batch``: each one's narrowest window, kept where every key column
        lies in the target's window."""
        parts = [self.order[best[p]][bounds[best[p]][2][p] : bounds[best[p]][2][p] + narrowest[p]] for p in batch]
        target = np.repeat(np.array(batch, dtype=np.intp), [part.size for part in parts])
        row = np.concatenate(parts).astype(np.intp) if parts else np.empty(0, dtype=np.intp)
        keep = np.ones(target.size, dtype=np.bool_)
        for (low, high, *_), h in zip(bounds, self.columns, strict=True):
            value = self.rows[row, h].astype(np.float32)
            lo, hi = low[target], high[target]
            keep &= ~(np.isfinite(lo) & np.isfinite(hi)) | ((value >= lo) & (value <= hi))
        return target[keep], row[keep]


def _targets(block: Block, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The search targets of block rows ``w``: (row position, slot or -1 for extra, target, tolerance)."""
    owners, slots = [], []
    for position in w:
        if block.skip[position].any():
            owners.append(position)
            slots.append(-1)
        for t in np.flatnonzero(~block.skip[position]):
            owners.append(position)
            slots.append(int(t))
    at = np.array(owners, dtype=np.intp)
    slot = np.array(slots, dtype=np.intp)
    cand, residual, usable = block.dense(at)
    replaced = slot >= 0
    residual[replaced] += take_rows(block.rows, block.index[at[replaced], slot[replaced]]).astype(_F64)
    target = np.where(usable, residual, np.nan)
    count = block.count[at] + np.where(replaced, 0, 1)
    reach = block.magnitude[at] + np.abs(target)
    tolerance = 2.0 * sum_bound(reach, count[:, None], cand, block.dtype)
    return at, slot, target, tolerance


def row_search_fits(
    block: Block, w: np.ndarray, index: RowIndex, checkpoint: Callable[[], None] = lambda: None
) -> tuple[list[Fit], set[int]]:
    """Replaced and extra summands of block rows ``w`` that fit, their rows found in ``index``; and
    the block rows whose search was cut (a target with every key window too wide).

    ``checkpoint()`` is called before each few rows' targets and each batch of pairs checked: it
    raises to stop the search (an explanation whose caller has gone).
    """
    fits: list[Fit] = []
    cut_rows: set[int] = set()
    for part in _chunks(w.size, (block.index.shape[1] + 1) * block.rows.shape[1]):
        checkpoint()
        at, slot, target, tolerance = _targets(block, w[part])
        if at.size == 0:
            continue
        cut, batches = index.near(target, tolerance)
        cut_rows.update(int(a) for a in at[cut])
        for pair_target, pair_row in batches:
            checkpoint()
            for piece in _chunks(pair_target.size, block.rows.shape[1]):
                fits += _check_pairs(block, at[pair_target[piece]], slot[pair_target[piece]], pair_row[piece])
    return fits, cut_rows


def _check_pairs(block: Block, at: np.ndarray, slot: np.ndarray, source: np.ndarray) -> list[Fit]:
    """The pairs (block row, slot or -1, row read) whose fingerprint fits in every usable column."""
    read = take_rows(block.rows, source).astype(_F64)
    replaced = slot >= 0
    own_rows = block.index[at, np.maximum(slot, 0)]
    own = np.where(replaced[:, None], take_rows(block.rows, np.where(replaced, own_rows, 0)).astype(_F64), 0.0)
    delta = read - own
    magnitude = np.maximum(block.magnitude[at] - np.abs(own) + np.abs(read), 0.0)
    count = block.count[at] + np.where(replaced, 0, 1)
    ok, ratio = _within(block, at, delta, magnitude, count)
    ok &= (delta != 0).any(axis=1) & ~(replaced & (source == own_rows))
    fits: list[Fit] = []
    for a, s, r, q in zip(at[ok], slot[ok], source[ok], ratio[ok], strict=True):
        if s >= 0:
            fits.append(Fit(int(a), "replaced", int(s), int(r), float(q)))
        else:  # any skipped slot of the row may be the one that read it
            fits += [Fit(int(a), "extra", int(u), int(r), float(q)) for u in np.flatnonzero(block.skip[a])]
    return fits
