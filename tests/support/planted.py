"""The planted-fault matrix of ``moegrad.explain``: candidates made wrong on purpose by slow loops.

Nothing here imports moegrad, and nothing shares code with explain: each case routes tokens with
:mod:`support.routing`, computes the device's grad_x one row and one slot at a time in the profile's
documented order (docs/semantics.md sections 3 and 7, written again here with a pluggable add), and
plants one fault in a few rows of the candidate, each from its own per-row loop:

- summand faults: a slot dropped (``missing``), a slot added twice, appended after the schedule
  (``duplicated``), a slot reading its neighbour row (``replaced``), a skipped slot added
  (``extra``): -1 read as the last row (drop/pad), the slot of index A read with ``active_num`` off
  by one and a clamping gather (row A-1, active), a dropped slot read with the capacity off by one
  (row (e+1)*C, drop/pad);
- precision: the chain accumulated in float16 or bfloat16; the device's order with every add
  rounded to the output dtype ("cast before the add", float16/bfloat16 calls);
- pure orders: sequential, reversed, pairwise, Kahan-compensated float32, float64 then one rounding;
- a NaN in an input row: in the call's input, the candidate reading it as 0 (``nan_input``), or
  only in the candidate's copy (``nan_candidate``).

Roundings are IEEE round-half-to-even from the definition (:func:`round_to`), not NumPy's casts.
:func:`matrix` lists every case; :func:`sample` a deterministic few of them; :func:`score` compares
an explanation's dict form with what was planted.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from support import routing
from support.slow_loops import expected_chunk

__all__ = ["DTYPES", "HIDDEN", "KS", "MODES", "PLANTS", "PROFILES", "Case", "Planted", "applies", "build", "matrix",
           "sample", "score"]

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
DTYPES = (F16, BF16, F32)
MODES = ("dropless", "active", "drop_pad")
KS = (1, 2, 3, 4, 8, 16, 130)
HIDDEN = (1, 7, 256)
PROFILES = ("ascend910b@9.1", "ascend950@9.1")
TOKENS = 6
UB_BYTES = 253952
# plant -> (expected label, what kind of plant it is)
PLANTS: dict[str, tuple[str, str]] = {
    "drop": ("missing", "summand"),
    "duplicate": ("duplicated", "summand"),
    "neighbour": ("replaced", "summand"),
    "extra_last": ("extra", "summand"),
    "extra_active": ("extra", "summand"),
    "extra_capacity": ("extra", "summand"),
    "accumulate_f16": ("precision", "precision"),
    "accumulate_bf16": ("precision", "precision"),
    "cast_before_add": ("precision", "precision"),
    "sequential": ("order", "order"),
    "reversed": ("order", "order"),
    "pairwise": ("order", "order"),
    "kahan": ("order", "order"),
    "float64": ("order", "order"),
    "nan_input": ("nonfinite", "nonfinite"),
    "nan_candidate": ("nonfinite", "nonfinite"),
}
_FORMATS = {F16: (10, -14, 65504.0), BF16: (7, -126, (2.0 - 2.0**-7) * 2.0**127), F32: (23, -126, (2.0 - 2.0**-23) * 2.0**127)}


def round_to(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float64 ``values`` rounded to ``dtype`` (float16, bfloat16, float32), half to even, from the
    definition: the nearest multiple of the ULP of the value's binade (not NumPy's casts)."""
    values = np.asarray(values, dtype=np.float64)
    bits, min_exponent, largest = _FORMATS[dtype]
    _, e2 = np.frexp(values)
    unit = np.ldexp(1.0, np.maximum(e2 - 1, min_exponent) - bits)
    with np.errstate(invalid="ignore", over="ignore"):
        rounded = np.rint(values / unit) * unit  # exact division by a power of two; rint ties to even
        rounded = np.where(np.abs(rounded) > largest, np.copysign(np.inf, values), rounded)
    rounded = np.where(rounded == 0.0, np.copysign(0.0, values), rounded)
    return np.where(np.isfinite(values), rounded, values)


def _rounded(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return round_to(values, dtype)


Add = Callable[[np.ndarray, np.ndarray], np.ndarray]


def add32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One float32 add per element (IEEE: the exact sum of two float32 values, rounded once)."""
    return _rounded(a + b, F32)  # float64 holds the exact sum of two float32 values of close binades


def narrow_add(dtype: np.dtype) -> Add:
    """An add that rounds to float32, then to ``dtype`` (what a float16 / bfloat16 add does on a CPU)."""
    return lambda a, b: _rounded(_rounded(a + b, F32), dtype)


# --------------------------------------------------------------------------------------------------
# Orders of adds over one row's slots; a slot is an [H] float64 array of float32 values, None skipped.
# --------------------------------------------------------------------------------------------------

def bins_row(values: list, add: Add, hidden: int) -> np.ndarray:
    """The Atlas A2/A3 bins (docs/semantics.md 3.1): S1 set (+0.0 if skipped), S2 even, S3 odd, S4 tree."""
    k = len(values)
    nbins = 64 if k >= 128 else 2 ** max(k.bit_length() - 2, 0)
    bins = [np.zeros(hidden) if values[2 * b] is None else values[2 * b].copy() for b in range(nbins)]
    for t in [*range(2 * nbins, k, 2), *range(1, k, 2)]:
        target = (t // 2) % nbins if t % 2 == 0 else ((t - 1) // 2) % nbins
        if values[t] is not None:
            bins[target] = add(bins[target], values[t])
    stride = 1
    while stride < nbins:
        for j in range(stride, nbins, 2 * stride):
            bins[j - stride] = add(bins[j - stride], bins[j])
        stride *= 2
    return bins[0]


def chain_row(values: list, add: Add, hidden: int) -> np.ndarray:
    """From +0.0, slot 0 to K-1; a skipped slot adds nothing."""
    total = np.zeros(hidden)
    for value in values:
        if value is not None:
            total = add(total, value)
    return total


def groups_row(values: list, add: Add, hidden: int, chunk: int) -> np.ndarray:
    """The Ascend 950 (docs/semantics.md 7.2): from +0.0, per chunk of slots, groups of four then leftovers;
    a skipped slot is a +0.0 row added in its place."""
    rows = [np.zeros(hidden) if v is None else v for v in values]
    total = np.zeros(hidden)
    for first in range(0, len(rows), chunk):
        block = rows[first:first + chunk]
        j = 0
        while len(block) - j >= 4:
            total = add(total, add(add(block[j], block[j + 1]), add(block[j + 2], block[j + 3])))
            j += 4
        for value in block[j:]:
            total = add(total, value)
    return total


def pairwise_row(values: list, add: Add, hidden: int) -> np.ndarray:
    """Adjacent slots in pairs, then pairs of pairs, a leftover passed up; a skipped slot is +0.0."""
    level = [np.zeros(hidden) if v is None else v for v in values]
    while len(level) > 1:
        level = [add(level[j], level[j + 1]) if j + 1 < len(level) else level[j] for j in range(0, len(level), 2)]
    return level[0]


def kahan_row(values: list, hidden: int) -> np.ndarray:
    """Kahan-compensated float32 sum, slot 0 to K-1."""
    total, comp = np.zeros(hidden), np.zeros(hidden)
    for value in values:
        if value is None:
            continue
        y = _rounded(value - comp, F32)
        t = add32(total, y)
        comp = _rounded(_rounded(t - total, F32) - y, F32)
        total = t
    return total


def float64_row(values: list, hidden: int) -> np.ndarray:
    """The exact sum of the slots (math.fsum), not yet rounded."""
    present = [v for v in values if v is not None]
    return np.array([math.fsum(float(v[h]) for v in present) for h in range(hidden)])


# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Planted:
    """What was planted in one row: the expected label, and the slot and row of a summand fault."""

    label: str
    slot: int | None = None
    source: int | None = None


@dataclass
class Case:
    """One call with its planted candidate: the arrays and attributes, and the planted rows."""

    name: str
    plant: str
    mode: str
    dtype: np.dtype
    top_k: int
    hidden: int
    profile: str
    grad: np.ndarray
    index: np.ndarray
    drop_pad_mode: int
    active_num: int
    device: np.ndarray
    candidate: np.ndarray
    planted: dict[int, Planted] = field(default_factory=dict)

    def kwargs(self) -> dict:
        """The call's fields, for ``MoeInitRoutingV2GradCall(**case.kwargs())``."""
        return {"grad_expanded_x": self.grad, "expanded_row_idx": self.index, "top_k": self.top_k,
                "drop_pad_mode": self.drop_pad_mode, "active_num": self.active_num, "order": self.profile}


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Signed values over 12 binades (so that orders of adds round differently), each exactly a
    ``dtype`` value: (1 + m / 2^p) * 2^e with p the format's fraction bits."""
    bits = _FORMATS[dtype][0]
    fraction = rng.integers(0, 2**bits, size=shape) / 2.0**bits
    raw = rng.choice([-1.0, 1.0], size=shape) * (1.0 + fraction) * np.exp2(rng.integers(-6, 6, size=shape))
    return raw.astype(dtype)  # exact: every value is representable


class _Device:
    """A profile's order for one call: ``total(values, add)`` the row before its final rounding."""

    def __init__(self, profile: str, dtype: np.dtype, top_k: int, hidden: int) -> None:
        self.kind = "groups" if profile.startswith("ascend950") else "bins"
        self.chunk = expected_chunk(dtype, top_k, hidden, UB_BYTES)
        self.hidden = hidden

    def total(self, values: list, add: Add = add32) -> np.ndarray:
        if self.kind == "bins":
            return bins_row(values, add, self.hidden)
        return groups_row(values, add, self.hidden, self.chunk)


def _route(rng: np.random.Generator, mode: str, top_k: int) -> tuple[routing.Routing, int, int]:
    """The routing, the number of experts and the capacity (drop/pad) of a case."""
    experts = top_k + 4
    slots = TOKENS * top_k
    if mode == "drop_pad":
        capacity = max(1, slots // (2 * experts) + 1)
        return routing.route(rng, TOKENS, top_k, experts, "drop_pad", capacity=capacity), experts, capacity
    if mode == "active":
        return routing.route(rng, TOKENS, top_k, experts, "active", active_num=max(1, slots // 2)), experts, 0
    return routing.route(rng, TOKENS, top_k, experts, "dropless"), experts, 0


def _ranks(expert_ids: np.ndarray, experts: int) -> np.ndarray:
    """Each slot's rank among its expert's slots, in the forward's stable order."""
    flat = expert_ids.reshape(-1).astype(np.int64)
    position = routing.dropless_index(expert_ids).astype(np.int64)
    first = np.searchsorted(np.sort(flat), np.arange(experts))
    return position - first[flat]


def build(mode: str, dtype: np.dtype, top_k: int, hidden: int, plant: str, profile: str = PROFILES[0]) -> Case | None:
    """One case of the matrix, or None when the plant has no place in it (no skipped slot, ...)."""
    if not applies(plant, mode, dtype):
        return None
    name = f"{plant}/{mode}/{np.dtype(dtype).name if dtype != BF16 else 'bfloat16'}/K{top_k}/H{hidden}/{profile}"
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    routed, experts, capacity = _route(rng, mode, top_k)
    grad = _values(rng, (*routed.rows, hidden), dtype)
    index = routed.expanded_row_idx.astype(np.int64)
    flat = grad.reshape(-1, hidden)
    rows = flat.shape[0]
    skipped = (index < 0) | (index >= rows)
    sites = _sites(plant, rng, index.reshape(TOKENS, top_k), skipped.reshape(TOKENS, top_k), rows,
                   routed, experts, capacity)
    if sites is None:
        return None
    if plant == "nan_input":
        flat = flat.copy()
        for i, (t, _) in sites.items():
            flat[index[i * top_k + t], hidden // 2] = np.nan
        grad = flat.reshape(grad.shape)
    device_order = _Device(profile, np.dtype(dtype), top_k, hidden)
    widened = flat.astype(np.float64)
    device = np.empty((TOKENS, hidden), dtype=dtype)
    candidate = np.empty((TOKENS, hidden), dtype=dtype)
    planted = {}
    with np.errstate(all="ignore"):
        for i in range(TOKENS):
            values = [None if skipped[i * top_k + t] else widened[index[i * top_k + t]] for t in range(top_k)]
            device[i] = _rounded(device_order.total(values), dtype)
            candidate[i] = device[i]
            if i in sites:
                candidate[i], planted[i] = _plant(plant, sites[i], values, widened, device_order, dtype, index, i, top_k)
    return Case(name, plant, mode, np.dtype(dtype), top_k, hidden, profile, grad, index.astype(np.int32),
                routed.drop_pad_mode, routed.active_num, device, candidate, planted)


def _sites(plant, rng, index, skipped, rows, routed, experts, capacity) -> dict[int, tuple[int, int]] | None:
    """Planted row -> (slot, the row that slot reads in the fault); None when the plant does not apply."""
    top_k = index.shape[1]
    if plant == "extra_last":
        if routed.drop_pad_mode != 1:
            return None
        chosen = {i: (int(np.flatnonzero(skipped[i])[0]), rows - 1) for i in range(TOKENS) if skipped[i].any()}
    elif plant == "extra_active":
        a = routed.active_num
        hits = np.argwhere(index == a) if routed.drop_pad_mode == 0 and a > 0 else np.empty((0, 2))
        chosen = {int(i): (int(t), a - 1) for i, t in hits}
    elif plant == "extra_capacity":
        if routed.drop_pad_mode != 1:
            return None
        ranks = _ranks(routed.expert_ids, experts).reshape(TOKENS, top_k)
        experts_of = routed.expert_ids.astype(np.int64)
        chosen = {}
        for i, t in np.argwhere((ranks == capacity) & (experts_of < experts - 1)):
            chosen.setdefault(int(i), (int(t), int(experts_of[i, t] + 1) * capacity))
    elif PLANTS[plant][1] in ("summand", "nonfinite"):
        chosen = {}
        for i in range(TOKENS):
            present = np.flatnonzero(~skipped[i])
            if present.size:
                t = int(rng.choice(present))
                chosen[i] = (t, (int(index[i, t]) + 1) % rows if plant == "neighbour" else int(index[i, t]))
        if plant == "neighbour" and rows < 2:
            return None
    else:
        chosen = {i: (0, -1) for i in range(TOKENS)}
    if not chosen:
        return None
    keep = sorted(chosen)[:3]
    return {i: chosen[i] for i in keep}


def _plant(plant, site, values, widened, device_order, dtype, index, i, top_k) -> tuple[np.ndarray, Planted]:
    """The planted row (rounded to ``dtype``) and what explain should say of it."""
    slot, source = site
    hidden = device_order.hidden
    label = PLANTS[plant][0]
    if plant == "drop":
        changed = list(values)
        changed[slot] = None
        return _rounded(device_order.total(changed), dtype), Planted(label, slot, source)
    if plant == "duplicate":
        total = add32(device_order.total(values), values[slot])
        return _rounded(total, dtype), Planted(label, slot, source)
    if plant in ("neighbour", "extra_last", "extra_active", "extra_capacity"):
        changed = list(values)
        changed[slot] = widened[source]
        return _rounded(device_order.total(changed), dtype), Planted(label, slot, source)
    if plant in ("accumulate_f16", "accumulate_bf16"):
        narrow = F16 if plant == "accumulate_f16" else BF16
        cast = [None if v is None else _rounded(v, narrow) for v in values]
        return _rounded(chain_row(cast, narrow_add(narrow), hidden), dtype), Planted(label)
    if plant == "cast_before_add":
        return _rounded(device_order.total(values, narrow_add(dtype)), dtype), Planted(label)
    if plant in ("nan_input", "nan_candidate"):
        changed = [None if v is None else v.copy() for v in values]
        at = changed[slot]
        at[hidden // 2] = 0.0 if plant == "nan_input" else np.nan
        planted = Planted(label, slot, source) if plant == "nan_input" else Planted(label)
        return _rounded(device_order.total(changed), dtype), planted
    total = {
        "sequential": lambda: chain_row(values, add32, hidden),
        "reversed": lambda: chain_row(values[::-1], add32, hidden),
        "pairwise": lambda: pairwise_row(values, add32, hidden),
        "kahan": lambda: kahan_row(values, hidden),
        "float64": lambda: float64_row(values, hidden),
    }[plant]()
    return _rounded(total, dtype), Planted(label)


def applies(plant: str, mode: str, dtype: np.dtype) -> bool:
    """Whether a plant has a place in a mode and dtype (a case may still have no site for it)."""
    if plant in ("extra_last", "extra_capacity"):
        return mode == "drop_pad"
    if plant == "extra_active":
        return mode == "active"
    if plant == "cast_before_add":
        return np.dtype(dtype) != F32  # in float32 the output dtype is the accumulator's
    return True


def matrix() -> Iterator[tuple[str, np.dtype, int, int, str, str]]:
    """Every (mode, dtype, K, H, plant, profile) of the matrix where the plant applies."""
    return (entry for entry in itertools.product(MODES, DTYPES, KS, HIDDEN, PLANTS, PROFILES)
            if applies(entry[4], entry[0], entry[1]))


def sample(count: int, seed: int = 37) -> list[tuple[str, np.dtype, int, int, str, str]]:
    """At least ``count`` entries of the matrix with a site for their plant, deterministic: every
    plant at every H and on every profile first, then others; K = 130 with H = 256 (the slowest
    loops) left out."""
    entries = [entry for entry in matrix() if not (entry[2] == 130 and entry[3] == 256)]
    np.random.default_rng(seed).shuffle(entries)  # in place, deterministic for the seed
    chosen: list = []
    wanted = [(plant, hidden, profile) for plant in PLANTS for hidden in HIDDEN for profile in PROFILES]
    for plant, hidden, profile in wanted:
        for entry in entries:
            if entry[4:] == (plant, profile) and entry[3] == hidden and entry not in chosen and build(*entry):
                chosen.append(entry)
                break
    for entry in entries:
        if len(chosen) >= count:
            break
        if entry not in chosen and build(*entry) is not None:
            chosen.append(entry)
    return chosen


def score(case: Case, rows: list[dict]) -> dict[int, str]:
    """For each planted row, the label explain gave ("agrees" when the row is not listed: the fault
    changed no bit); ``rows`` is ``explanation.to_dict()["rows"]``."""
    given = {row["row"]: row["label"] for row in rows}
    return {i: given.get(i, "agrees") for i in case.planted}
