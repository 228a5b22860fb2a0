"""The order probe: which tree of adds a candidate uses for K slots (FPRev).

Method (FPRev: P. Xie, Y. Gao, Y. Wang, J. Xue, "Revealing Floating-Point Accumulation Orders in
Software/Hardware Implementations", USENIX ATC 2025; the tool's source in microsoft/RepDL
``tools/FPRev/fprev/basic.py`` @ 5d5e890c865e3f32e7f08f07cc1961a74311fa77 and peichenxie/FPRev):
for a pair of slots (i, j) put +M at slot i, -M at slot j and a unit u at every other slot. A unit
added to +M or -M is absorbed (M is so large that M + (K - 2) u and -M + (K - 2) u round back to
±M in float32: the sum of the units stays below half an ULP of the binade *below* M), the
pair cancels exactly where the two meet, and every unit added after that survives. So the result
counts, in units, the slots *outside* the smallest subtree holding i and j: K minus that subtree's
size. The sizes of all pairs determine the tree (:func:`moegrad.accuracy._trees.rebuild`).

Each probe cell (one token, one column) carries one pair, so one call of N tokens x H columns
carries N*H pairs; the K(K-1)/2 pairs of K slots take ``ceil(K(K-1)/2 / (N*H))`` calls, and spare
cells measure pairs again (every measurement of a pair must agree). Two more calls on random
inputs check the result: the two must give the same bits (else the order changes from run to run),
and the rebuilt tree, replayed with float32 adds, must give the candidate's bits (else the order
depends on the values or on expanded_row_idx, or the adds are not float32 adds).

Magnitudes per input dtype (the accumulator is float32 for every dtype; ``c`` is the bit length of
K - 2, so 2**c > K - 2):

- float32 and bfloat16: M = 2**(25 + c), u = 1: counts up to K - 2 come back as integers; bfloat16
  holds every integer up to 256 exactly, so bfloat16 probes reach K = 258;
- float16: M = 2**15 (the largest power of two it holds), u = 2**(-10 - c); counts come back as
  multiples of u below 2**-10, exact in float16 while u >= 2**-21 (K <= 2049). From K = 18, u is
  a float16 subnormal: a candidate that flushes float16 subnormals to zero gives no signal.

FPRev's own probes use M = 2**127 (float32) with units of 1; the smallest M that still absorbs is
used here so that a float64 accumulator, which would absorb units only next to a far larger M,
shows as what it is: an exact sum.

A float64 (or exact) accumulator absorbs nothing at these magnitudes: every pair then counts all
K - 2 units, which no tree of two-operand adds gives, and the probe says so
(:class:`MultiTermOrder`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moegrad._dtypes import DTYPES, dtype_name
from moegrad._errors import MoegradError
from moegrad.accuracy._candidate import Candidate, candidate_in_use
from moegrad.accuracy._trees import Tree, expression, profile_sizes, rebuild, replay
from moegrad.numerics._ascend950 import UB_SIZE_BYTES, VECTOR_CORE_COUNT
from moegrad.operator._call import GRAD_DTYPES, MoeInitRoutingV2GradCall

__all__ = [
    "PROBE_LIMITS",
    "InconsistentOrder",
    "MultiTermOrder",
    "OrderProbe",
    "OrderProbeError",
    "probe_order",
    "probe_scale",
]

#: The largest K each input dtype's probe reveals (module docstring: the counts must come back exact).
PROBE_LIMITS: Mapping[str, int] = {"float32": 512, "bfloat16": 258, "float16": 512}
_DEFAULT_HIDDEN = 64
_MAX_ELEMENTS = 1 << 24  # grad_expanded_x elements per probe call when the harness picks N


class OrderProbeError(MoegradError):
    """The candidate's answers to the probes name no tree of two-operand float32 adds.

    Attributes:
        top_k, dtype: what was probed.
        calls: the candidate calls made.
    """

    def __init__(self, message: str, *, top_k: int, dtype: str, calls: int) -> None:
        super().__init__(message)
        self.message, self.top_k, self.dtype, self.calls = message, top_k, dtype, calls


class InconsistentOrder(OrderProbeError):
    """No single order fits: it changes between runs, rows or columns, or depends on the values or on
    expanded_row_idx, or the candidate does not sum its slots with float32 adds."""


class MultiTermOrder(OrderProbeError):
    """The answers fit only a tree with adds of more than two operands at once (an exact or wider
    than float32 accumulation, a fused multi-operand adder, or an order sorted by value).

    Attributes:
        expression: the tree the pair probes show, multi-term adds written ``(v0+v1+v2)``. Pair
            probes cannot tell every arrangement of multi-term adds apart, so it is one tree that
            fits, not a proof of the order.
    """

    def __init__(self, message: str, *, expression: str, top_k: int, dtype: str, calls: int) -> None:
        super().__init__(message, top_k=top_k, dtype=dtype, calls=calls)
        self.expression = expression


@dataclass(frozen=True)
class OrderProbe:
    """The candidate's tree of adds for K slots, at one call shape.

    Attributes:
        top_k, dtype: K and the input dtype probed.
        num_tokens, hidden_size: N and H of every probe call (the 950's order depends on them).
        tree: the canonical tree: a slot number, or a tuple of two subtrees (each node's operands
            sorted by their smallest slot; adds commute).
        expression: the tree written out, ``((v0+v1)+(v2+v3))``.
        profiles: the device profiles (and ``"sequential"``) whose order at this shape is this tree.
        distances: for every profile, the number of slot pairs that meet in a subtree of another
            size than in this tree (0: the same tree).
        closest: the profiles at the smallest distance.
        calls: candidate calls made (probes and the two checks).
        pairs: slot pairs measured, K(K-1)/2.
    """

    top_k: int
    dtype: str
    num_tokens: int
    hidden_size: int
    tree: Tree
    expression: str
    profiles: tuple[str, ...]
    distances: Mapping[str, int] = field(repr=False)
    closest: tuple[str, ...]
    calls: int
    pairs: int

    def __str__(self) -> str:
        named = ", ".join(self.profiles) if self.profiles else "no profile"
        near = f" (closest: {', '.join(self.closest)})" if not self.profiles else ""
        return (
            f"K={self.top_k} {self.dtype} [N={self.num_tokens}, H={self.hidden_size}]: {self.expression} "
            f"= {named}{near}; {self.calls} candidate calls"
        )


def probe_scale(top_k: int, dtype: str) -> tuple[float, float]:
    """``(M, u)``, the probe's big value and unit for K slots in ``dtype`` (module docstring)."""
    bits = max(top_k - 2, 0).bit_length()
    if dtype == "float16":
        return 2.0**15, 2.0 ** (-10 - bits)
    return 2.0 ** (25 + bits), 1.0


def _check_arguments(top_k: Any, dtype: Any) -> tuple[int, str]:
    name = dtype if isinstance(dtype, str) else dtype_name(np.dtype(dtype))
    if name not in GRAD_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(GRAD_DTYPES)}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise ValueError(f"top_k={top_k!r} must be an integer >= 1")
    if top_k > PROBE_LIMITS[name]:
        raise ValueError(
            f"top_k={top_k}: a {name} probe reveals K <= {PROBE_LIMITS[name]} (the counts it reads must be "
            "exact in the output dtype, and the probes grow as K**3); probe a wider dtype, e.g. float32"
        )
    return int(top_k), name


def _shape(pairs: int, top_k: int, num_tokens: int | None, hidden_size: int | None) -> tuple[int, int]:
    for label, value in (("num_tokens", num_tokens), ("hidden_size", hidden_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{label}={value!r} must be an integer >= 1")
    if num_tokens is not None and hidden_size is not None:
        return int(num_tokens), int(hidden_size)
    if hidden_size is None and num_tokens is not None:
        hidden = max(1, math.ceil(max(pairs, 1) / num_tokens))
        return int(num_tokens), min(hidden, max(1, _MAX_ELEMENTS // (top_k * num_tokens)))
    hidden = int(hidden_size or _DEFAULT_HIDDEN)
    tokens = max(1, math.ceil(max(pairs, 1) / hidden))
    return min(tokens, max(1, _MAX_ELEMENTS // (top_k * hidden))), hidden


def _probe_call(
    slots: tuple[np.ndarray, np.ndarray],
    first: int,
    top_k: int,
    shape: tuple[int, int],
    dtype: str,
    scale: tuple[float, float],
) -> tuple[MoeInitRoutingV2GradCall, np.ndarray]:
    """One probe call and the pair each of its N*H cells carries (pairs ``first``, ``first + 1``, ...
    cyclically)."""
    tokens, hidden = shape
    big, unit = scale
    cells = np.arange(tokens * hidden)
    pair = (first + cells) % max(len(slots[0]), 1)
    values = np.full((tokens, top_k, hidden), unit, np.float32)
    if len(slots[0]):
        values[cells // hidden, slots[0][pair], cells % hidden] = big
        values[cells // hidden, slots[1][pair], cells % hidden] = -big
    grad = values.reshape(tokens * top_k, hidden).astype(DTYPES[dtype])
    index = np.arange(tokens * top_k, dtype=np.int32)
    return MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=index, top_k=top_k), pair


def _random_call(top_k: int, shape: tuple[int, int], dtype: str, seed: int) -> MoeInitRoutingV2GradCall:
    """Random values over many binades (so that orders differ) and a random dropless index."""
    tokens, hidden = shape
    rng = np.random.default_rng(seed)
    low, high = (-12, 4) if dtype == "float16" else (-30, 30)
    size = (tokens * top_k, hidden)
    mantissa = rng.random(size, dtype=np.float32) + np.float32(1.0)  # [1, 2), random signs below
    grad = np.ldexp(mantissa, rng.integers(low, high, size, dtype=np.int32))
    np.negative(grad, out=grad, where=rng.random(size, dtype=np.float32) < 0.5)
    grad = grad.astype(DTYPES[dtype])
    index = rng.permutation(tokens * top_k).astype(np.int32)
    return MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=index, top_k=top_k)


def _bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


@dataclass
class _Probing:
    """One probe run: the candidate, what is probed, and the measured subtree size of every pair."""

    candidate: Candidate
    top_k: int
    dtype: str
    shape: tuple[int, int]
    scale: tuple[float, float]
    first_calls: int

    @property
    def calls(self) -> int:
        return self.candidate.calls - self.first_calls

    def inconsistent(self, message: str) -> InconsistentOrder:
        return InconsistentOrder(
            f"candidate {self.candidate.name}, K={self.top_k} {self.dtype}: {message}",
            top_k=self.top_k,
            dtype=self.dtype,
            calls=self.calls,
        )

    def measure(self, slots: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """The [K, K] subtree sizes of every pair, from ``ceil(pairs / (N*H))`` probe calls.

        Raises:
            InconsistentOrder: an answer that is not a count of units, or a pair whose measurements
                disagree between cells.
        """
        pairs, cells = len(slots[0]), self.shape[0] * self.shape[1]
        low = np.full(pairs, self.top_k + 1, np.int64)
        high = np.zeros(pairs, np.int64)
        for first in range(0, pairs, cells):
            call, pair = _probe_call(slots, first, self.top_k, self.shape, self.dtype, self.scale)
            counts = self.candidate(call).astype(np.float64).ravel() / self.scale[1]
            with np.errstate(invalid="ignore"):
                size = self.top_k - counts
                bad = ~(np.isfinite(size) & (size == np.round(size)) & (size >= 2) & (size <= self.top_k))
            if bad.any():
                raise self._not_a_count(slots, pair, counts, int(np.argmax(bad)))
            np.minimum.at(low, pair, size.astype(np.int64))
            np.maximum.at(high, pair, size.astype(np.int64))
        if (low != high).any():
            p = int(np.argmax(low != high))
            raise self.inconsistent(
                f"slots {slots[0][p]} and {slots[1][p]} meet in a subtree of {low[p]} slots in one cell and of "
                f"{high[p]} in another of the same probe: the order changes from row to row or column to "
                "column (atomic adds?); moegrad.check_determinism shows which rows vary"
            )
        sizes = np.ones((self.top_k, self.top_k), np.int64)
        sizes[slots[0], slots[1]] = low
        sizes[slots[1], slots[0]] = low
        return sizes

    def _not_a_count(
        self, slots: tuple[np.ndarray, np.ndarray], pair: np.ndarray, counts: np.ndarray, cell: int
    ) -> InconsistentOrder:
        i, j = slots[0][pair[cell]], slots[1][pair[cell]]
        return self.inconsistent(
            f"the probe with +M at slot {i}, -M at slot {j} and units elsewhere (M = {self.scale[0]:g}, unit "
            f"{self.scale[1]:g}) gave {float(counts[cell] * self.scale[1])!r}, not a count of 0 to "
            f"K-2 = {self.top_k - 2} units: the candidate does not add these K slots in any single order of "
            "float32 adds (a slot missing or counted twice, a float16 accumulator, ...); run it on "
            "moegrad.order_free_inputs first"
        )

    def check_steady(self, check: MoeInitRoutingV2GradCall, results: list[np.ndarray]) -> None:
        """Raises InconsistentOrder when two runs of the same random call differ in any bit."""
        differ = _bits(results[0]) != _bits(results[1])
        if differ.any():
            rows = np.flatnonzero(differ.any(axis=1))
            raise self.inconsistent(
                f"two runs on the same random inputs [N={check.num_tokens}, H={check.hidden_size}] differ in "
                f"{rows.size} rows (first: row {rows[0]}): its order changes from run to run (atomic adds?); "
                "moegrad.check_determinism counts the variants"
            )

    def tree(self, sizes: np.ndarray) -> Tree:
        """The binary tree of the measured sizes.

        Raises:
            MultiTermOrder: sizes that only a tree with multi-term adds gives (every unit kept
                everywhere: an exact sum; or a node with three or more operands).
            InconsistentOrder: sizes no tree gives.
        """
        top_k = self.top_k
        if top_k >= 3 and (sizes[np.triu_indices(top_k, 1)] == 2).all():
            flat = "(" + "+".join(f"v{t}" for t in range(top_k)) + ")"
            raise self._multi_term(
                flat,
                "every unit survived every cancellation, so no add ever rounded: the candidate sums exactly at "
                "these magnitudes (a float64 or wider accumulator, compensated or exact summation), which is one "
                "add of all K operands as far as float32 can tell",
            )
        tree = rebuild(sizes)
        if tree is None:
            raise self.inconsistent(
                "the probes fit no tree of adds (some pairs meet in subtrees that cannot nest): the order depends "
                "on the values, or the candidate adds several operands at once with a wider accumulator"
            )
        wide = _widest(tree)
        if wide is not None:
            raise self._multi_term(
                expression(tree),
                f"the node {expression(wide)} adds {len(wide)} operands at once (a fused multi-operand add, "
                "or an order that depends on the values, e.g. sorted by magnitude)",
            )
        return tree

    def _multi_term(self, text: str, why: str) -> MultiTermOrder:
        return MultiTermOrder(
            f"candidate {self.candidate.name}, K={self.top_k} {self.dtype}: {why}: {text}. Every device profile "
            "adds two operands at a time in float32, so this candidate matches none of them bit for bit",
            expression=text,
            top_k=self.top_k,
            dtype=self.dtype,
            calls=self.calls,
        )

    def check_replay(self, tree: Tree, check: MoeInitRoutingV2GradCall, result: np.ndarray) -> None:
        """Raises InconsistentOrder when ``tree``'s float32 adds do not give ``result``'s bits; then one
        more call, the same values read through the identity index, tells an order that follows
        expanded_row_idx from one that follows the values."""
        differ = self._replay_differs(tree, check, result)
        if not differ.any():
            return
        row, column = (int(axis[0]) for axis in np.nonzero(differ))
        where = f"{int(differ.sum())} elements differ, first row {row}, column {column}"
        rows = check.grad_expanded_x[check.expanded_row_idx]  # slot s now reads row s
        identity = MoeInitRoutingV2GradCall(
            grad_expanded_x=rows, expanded_row_idx=np.arange(rows.shape[0], dtype=np.int32), top_k=self.top_k
        )
        if not self._replay_differs(tree, identity, self.candidate(identity)).any():
            raise self.inconsistent(
                f"the tree {expression(tree)} rebuilt from the probes gives the candidate's bits when slot s reads "
                f"row s, but not through a random expanded_row_idx ({where}): its order follows the rows of "
                "grad_expanded_x (a scatter over the rows, e.g. index_add_), not the slots, so it changes with "
                "the routing"
            )
        raise self.inconsistent(
            f"the tree {expression(tree)} rebuilt from the probes does not reproduce the candidate on random "
            f"inputs ({where}: candidate {result[row, column]}, tree replay differs): its order depends on the "
            "values, or it does not accumulate in float32 (e.g. a float16 accumulator)"
        )

    def _replay_differs(self, tree: Tree, call: MoeInitRoutingV2GradCall, result: np.ndarray) -> np.ndarray:
        values = call.grad_expanded_x[call.expanded_row_idx.reshape(-1, self.top_k)].astype(np.float32)  # [N, K, H]
        expected = replay(tree, np.moveaxis(values, 1, 0)).astype(result.dtype)
        return _bits(expected) != _bits(result)


def _widest(tree: Tree) -> tuple[Tree, ...] | None:
    """The first node with more than two operands, or None."""
    if isinstance(tree, int):
        return None
    if len(tree) > 2:
        return tree
    for operand in tree:
        found = _widest(operand)
        if found is not None:
            return found
    return None


def probe_order(
    candidate: Any,
    top_k: int,
    dtype: Any = "float32",
    *,
    num_tokens: int | None = None,
    hidden_size: int | None = None,
    ub_size_bytes: int = UB_SIZE_BYTES,
    vector_core_count: int = VECTOR_CORE_COUNT,
    seed: int = 0,
) -> OrderProbe:
    """The candidate's tree of adds for ``top_k`` slots, revealed by FPRev probes (module docstring).

    Args:
        candidate: a :class:`~moegrad.accuracy.Candidate`, a callable, a v2 URL or
            ``"package.module:function"`` (:func:`~moegrad.accuracy.as_candidate`).
        top_k: K, 1 to :data:`PROBE_LIMITS` [dtype] (512 for float32 and float16, 258 for bfloat16).
        dtype: grad_expanded_x's dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        num_tokens, hidden_size: N and H of every probe call. The order of the Ascend 950 (and of any
            candidate that tiles by shape) depends on them; give the shape of the calls that matter.
            Default: H = 64 and N just large enough for every pair in one call; given one of the
            two, the other is sized so (either way at most 2**24 elements of grad_expanded_x per
            call, the rest in further calls).
        ub_size_bytes, vector_core_count: the 950 platform whose tiling names the 950 profiles.
        seed: the random check inputs' seed.

    Returns:
        An :class:`OrderProbe`: ``.expression``, ``.tree``, ``.profiles`` (with ``.distances`` and
        ``.closest``), ``.calls``.

    Raises:
        ValueError: a dtype or K out of range (the limits and why are in the message).
        InconsistentOrder: answers no single order gives (changing between runs, rows or columns,
            depending on the values or the index, or not float32 adds).
        MultiTermOrder: answers only adds of more than two operands at once give.
        CandidateError: the candidate failed or returned something other than grad_x.
    """
    top_k, name = _check_arguments(top_k, dtype)
    slots = np.triu_indices(top_k, 1)
    shape = _shape(len(slots[0]), top_k, num_tokens, hidden_size)
    with candidate_in_use(candidate) as fn:
        run = _Probing(fn, top_k, name, shape, probe_scale(top_k, name), fn.calls)
        sizes = run.measure(slots)
        check = _random_call(top_k, shape, name, seed)
        results = [fn(check), fn(check)]
        run.check_steady(check, results)
        tree = run.tree(sizes) if top_k > 1 else 0
        run.check_replay(tree, check, results[0])
    others = profile_sizes(top_k, name, shape[0], shape[1], ub_size_bytes, vector_core_count)
    upper = np.triu_indices(top_k, 1)
    distances = {profile: int(np.count_nonzero(other[upper] != sizes[upper])) for profile, other in others.items()}
    nearest = min(distances.values())
    return OrderProbe(
        top_k=top_k,
        dtype=name,
        num_tokens=shape[0],
        hidden_size=shape[1],
        tree=tree,
        expression=expression(tree),
        profiles=tuple(profile for profile, distance in distances.items() if distance == 0),
        distances=distances,
        closest=tuple(profile for profile, distance in distances.items() if distance == nearest),
        calls=run.calls,
        pairs=len(slots[0]),
    )
