"""moegrad.shrink: the smallest call on which a candidate still fails with the same fault.

The fault is what :func:`moegrad.explain` says of one row of the candidate's grad_x: its label and,
for a summand fault (``missing``, ``duplicated``, ``replaced``, ``extra``), its slot. A smaller call
*keeps the fault* when the candidate's grad_x on it has a row with the same label and, for a summand
fault, at the same slot: the same summand position, followed through every removal of slots (a
removal of slot u < t moves the fault's slot t to t - 1; removing the slot t itself is never
tried). Which token fails, and with what values, is not followed: that is the trigger's business,
and the shrinker keeps whatever keeps the fault. A call on which the candidate fails otherwise
(another label, another slot, no difference at all, an error) is not kept: a shrinker that drifted
to another bug would mislead.

The method is delta debugging (:func:`moegrad.accuracy._ddmin.ddmin`) over one dimension at a
time, each move a valid call of the same mode (:mod:`moegrad.accuracy._reduce`):

1. tokens (N), 2. columns (H), 3. slot positions (K), 4. values, toward small integers: elements set
to 0, then to ±1, then rounded to an integer, 5. drop/pad only: experts (E), then capacity
positions (C).

The five run again, in that order, until one whole round keeps nothing: then no move of any phase
keeps the fault, and shrinking the result again for the same fault changes nothing (for a
deterministic candidate, unless ``max_tests`` ran out first). docs/accuracy.md, "The smallest
failing call", has a worked example.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from moegrad._dtypes import DTYPES
from moegrad._errors import InvalidArgument, MoegradError
from moegrad.accuracy._candidate import Candidate, CandidateError, candidate_in_use
from moegrad.accuracy._ddmin import ddmin
from moegrad.accuracy._explain import explain
from moegrad.accuracy._explanation import SUMMAND_FAULTS, Explanation, RowExplanation
from moegrad.accuracy._reduce import (
    ReductionRefused,
    call_size,
    keep_capacity,
    keep_columns,
    keep_experts,
    keep_slots,
    keep_tokens,
    with_values,
)
from moegrad.accuracy._reproducer import Replay, write_reproducer
from moegrad.operator._call import MoeInitRoutingV2GradCall

__all__ = ["DEFAULT_MAX_TESTS", "NothingToShrink", "ShrinkError", "ShrinkResult", "ShrinkStep", "shrink"]

#: The most candidate calls one shrink makes, unless told otherwise.
DEFAULT_MAX_TESTS = 20000
_UINT = {2: np.uint16, 4: np.uint32}
#: The labels that name what went wrong, chosen first when no label is asked for.
_DEFINITE = (*SUMMAND_FAULTS, "precision", "nonfinite")


class ShrinkError(MoegradError):
    """The shrink could not be done: see the subclasses and the message."""


class NothingToShrink(ShrinkError):
    """The candidate gives the device's bits on the call: there is no fault to shrink."""


@dataclass(frozen=True)
class ShrinkStep:
    """One smaller call kept.

    Attributes:
        phase: ``"tokens"``, ``"columns"``, ``"slots"``, ``"values: zero"``, ``"values: unit"``,
            ``"values: integer"``, ``"experts"`` or ``"capacity"``.
        tests: candidate calls made so far, this one's included.
        size: the call kept (:func:`~moegrad.accuracy._reduce.call_size`).
    """

    phase: str
    tests: int
    size: str


@dataclass(frozen=True)
class ShrinkResult:
    """What :func:`shrink` found.

    Attributes:
        call: the smallest call found on which the candidate still fails with the same fault.
        candidate: the candidate's grad_x on ``call`` ([N, H], the call's dtype).
        label: the fault's label (:data:`~moegrad.accuracy.LABELS`).
        slot: a summand fault's slot in ``call`` (else the slot explain names, or None).
        row: the row of ``call``'s grad_x with the fault.
        explanation: ``explain(call, candidate)``.
        original: the sizes of the call shrunk (e.g. ``N=4096 K=8 H=7168 bfloat16 dropless [32768, 7168]``).
        history: every smaller call kept, in order.
        tests: the candidate calls made (the first and the final check included).
        seconds: wall time.
        exhausted: True when ``max_tests`` ran out before a round kept nothing (shrinking ``call``
            again may then go further).
        replay: how the reproducer calls the candidate again.
    """

    call: MoeInitRoutingV2GradCall = field(repr=False)
    candidate: np.ndarray = field(repr=False)
    label: str
    slot: int | None
    row: int
    explanation: Explanation = field(repr=False)
    original: str
    history: tuple[ShrinkStep, ...] = field(repr=False)
    tests: int
    seconds: float
    exhausted: bool
    replay: Replay = field(repr=False)

    @property
    def size(self) -> str:
        """The sizes of :attr:`call`."""
        return call_size(self.call)

    def save(self, directory: str | os.PathLike[str], name: str = "reproducer") -> tuple[Path, Path]:
        """Write the reproducer: ``<name>.npz`` (a case file, :func:`~moegrad.accuracy.save_case`)
        and ``<name>.py``, a script that replays it bit for bit (docs/accuracy.md, "The reproducer").

        Returns:
            The two paths. The folder is created when missing.

        Raises:
            OSError: a file cannot be written.
        """
        return write_reproducer(
            Path(directory),
            name,
            call=self.call,
            grad_x=self.candidate,
            label=self.label,
            slot=self.slot if self.label in SUMMAND_FAULTS else None,
            replay=self.replay,
            summary=f"{self.label} at row {self.row}" + ("" if self.slot is None else f", slot {self.slot}"),
        )

    def __str__(self) -> str:
        explained = self.explanation.row(self.row)
        evidence = explained.evidence.summary if explained is not None else ""
        slot = "" if self.slot is None else f", slot {self.slot}"
        ran_out = "; max_tests ran out: shrinking again may go further" if self.exhausted else ""
        return (
            f"{self.original}\n  -> {self.size}\n"
            f"the same fault: row {self.row} {self.label}{slot}: {evidence}\n"
            f"{self.tests} candidate calls, {len(self.history)} smaller calls kept, {self.seconds:.2f} s{ran_out}\n"
        )


class _State(NamedTuple):
    """A call on which the candidate fails with the fault: the fault's slot there, the result, the row."""

    call: MoeInitRoutingV2GradCall
    slot: int | None
    grad_x: np.ndarray
    explanation: Explanation
    row: RowExplanation


class _Exhausted(Exception):
    """max_tests reached; ``state`` is the smallest call kept so far."""

    def __init__(self, state: _State) -> None:
        super().__init__("max_tests reached")
        self.state = state


def _in_dtype(grad_x: np.ndarray, call: MoeInitRoutingV2GradCall) -> np.ndarray:
    """A float32 result of a float16/bfloat16 call rounded to the call's dtype (round half to even)."""
    want = np.dtype(DTYPES[call.dtype_name])
    return grad_x if grad_x.dtype == want else grad_x.astype(want)


def _matching(explanation: Explanation, label: str, slot: int | None) -> RowExplanation | None:
    """The first row with the fault: ``label``, and for a summand fault the slot ``slot``."""
    for row in explanation.rows:
        if row.label == label and (label not in SUMMAND_FAULTS or row.slot == slot):
            return row
    return None


class _Search:
    """Runs the candidate on smaller calls and says whether the fault is kept; counts the calls."""

    def __init__(self, candidate: Candidate, label: str, max_tests: int) -> None:
        self.candidate, self.label, self.max_tests = candidate, label, max_tests
        self.tests = 0

    def outcome(self, call: MoeInitRoutingV2GradCall) -> tuple[np.ndarray, Explanation]:
        self.tests += 1
        grad_x = _in_dtype(self.candidate(call), call)
        return grad_x, explain(call, grad_x)

    def run(self, call: MoeInitRoutingV2GradCall, slot: int | None) -> _State | None:
        """The state when the candidate fails on ``call`` with the fault at ``slot``, else None.

        An error of the candidate on a smaller call (it refuses a shape, its server answers 4xx)
        is not the fault: None. :class:`_Exhausted` when ``max_tests`` calls were made.
        """
        if self.tests >= self.max_tests:
            raise _Exhausted(self.best)
        try:
            grad_x, explanation = self.outcome(call)
        except CandidateError:
            return None
        row = _matching(explanation, self.label, slot)
        return None if row is None else _State(call, slot, grad_x, explanation, row)

    best: _State  # the smallest call kept so far (set by shrink, updated by _phase)


Move = Callable[[MoeInitRoutingV2GradCall, list[int], int | None], tuple[MoeInitRoutingV2GradCall, int | None] | None]


def _phase(search: _Search, state: _State, items: list[int], move: Move, *, try_empty: bool = False) -> _State:
    """ddmin over ``items`` with ``move(call, kept, slot) -> (smaller call, its slot) | None``."""

    def fails(kept: list[int]) -> bool:
        try:
            made = move(state.call, kept, state.slot)
        except (InvalidArgument, ReductionRefused):  # the operator's rules refuse it: not a call
            return False
        if made is None:
            return False
        found = search.run(*made)
        if found is None:
            return False
        search.best = found
        return True

    search.best = state
    if len(items) == 0:
        return state
    if try_empty and fails([]):
        return search.best
    kept = ddmin(items, fails)
    return state if len(kept) == len(items) else search.best


def _tokens(search: _Search, state: _State) -> _State:
    return _phase(search, state, list(range(state.call.num_tokens)), lambda c, kept, s: (keep_tokens(c, kept), s))


def _columns(search: _Search, state: _State) -> _State:
    return _phase(search, state, list(range(state.call.hidden_size)), lambda c, kept, s: (keep_columns(c, kept), s))


def _slots(search: _Search, state: _State) -> _State:
    def move(call: MoeInitRoutingV2GradCall, kept: list[int], slot: int | None) -> Any:
        if slot is not None and slot not in kept:
            return None  # the fault's own summand stays
        return keep_slots(call, kept), (None if slot is None else kept.index(slot))

    return _phase(search, state, list(range(state.call.top_k)), move)


def _simpler(values: np.ndarray, step: str) -> np.ndarray:
    """``values`` (float64) one step toward small integers: 0; ±1; the nearest integer (from 1 up)."""
    finite = np.isfinite(values)
    if step == "zero":
        return np.zeros_like(values)
    if step == "unit":
        return np.where(finite & (values != 0), np.copysign(1.0, values), values)
    rounded = np.rint(np.where(finite, values, 0.0))
    return np.where(finite & (np.abs(rounded) >= 1), rounded, values)


def _values(step: str) -> Callable[[_Search, _State], _State]:
    def phase(search: _Search, state: _State) -> _State:
        grad = state.call.grad_expanded_x
        flat = np.ascontiguousarray(grad).reshape(-1)
        target = _simpler(flat.astype(np.float64), step).astype(grad.dtype)
        words = _UINT[grad.dtype.itemsize]
        changed = np.flatnonzero(target.view(words) != flat.view(words))

        def move(call: MoeInitRoutingV2GradCall, kept: list[int], slot: int | None) -> Any:
            values = target.copy()
            unchanged = changed[np.asarray(kept, dtype=np.intp)]
            values[unchanged] = flat[unchanged]
            return with_values(call, values.reshape(grad.shape)), slot

        return _phase(search, state, list(range(changed.size)), move, try_empty=True)

    return phase


def _experts(search: _Search, state: _State) -> _State:
    if state.call.drop_pad_mode != 1:
        return state
    experts = state.call.grad_expanded_x.shape[0]
    return _phase(search, state, list(range(experts)), lambda c, kept, s: (keep_experts(c, kept), s))


def _capacity(search: _Search, state: _State) -> _State:
    if state.call.drop_pad_mode != 1:
        return state
    capacity = state.call.grad_expanded_x.shape[1]
    return _phase(search, state, list(range(capacity)), lambda c, kept, s: (keep_capacity(c, kept), s))


_PHASES: tuple[tuple[str, Callable[[_Search, _State], _State]], ...] = (
    ("tokens", _tokens),
    ("columns", _columns),
    ("slots", _slots),
    ("values: zero", _values("zero")),
    ("values: unit", _values("unit")),
    ("values: integer", _values("integer")),
    ("experts", _experts),
    ("capacity", _capacity),
)


def _target(explanation: Explanation, label: str | None, row: int | None) -> RowExplanation:
    """The row whose fault is shrunk (:func:`shrink`'s ``label`` and ``row``)."""
    if not explanation.rows:
        raise NothingToShrink("the candidate gives the device's bits on this call: there is no fault to shrink")
    found = ", ".join(f"{name} {count}" for name, count in explanation.labels.items() if count)
    if row is not None:
        chosen = explanation.row(row)
        if chosen is None:
            raise ValueError(f"row={row}: that row agrees with the device's bits (the rows that differ: {found})")
        if label is not None and chosen.label != label:
            raise ValueError(f"row={row} is labelled {chosen.label!r}, not {label!r}")
        return chosen
    if label is not None:
        chosen = next((r for r in explanation.rows if r.label == label), None)
        if chosen is None:
            raise ValueError(f"label={label!r}: no row that differs has it (the labels found: {found})")
        return chosen
    for kinds in (_DEFINITE, ("unexplained", "ambiguous")):
        chosen = next((r for r in explanation.rows if r.label in kinds), None)
        if chosen is not None:
            return chosen
    return explanation.rows[0]


def shrink(
    call: MoeInitRoutingV2GradCall,
    candidate: Any,
    *,
    label: str | None = None,
    row: int | None = None,
    max_tests: int = DEFAULT_MAX_TESTS,
) -> ShrinkResult:
    """The smallest call on which ``candidate`` still fails with the same fault (module docstring).

    Args:
        call: a call on which the candidate's grad_x differs from the device's (the call's profile).
        candidate: a :class:`~moegrad.accuracy.Candidate`, a callable, a v2 URL or
            ``"package.module:function"``; it must be deterministic (the same bits on the same call).
        label: the fault to shrink: the first row with this label. Default: the first row labelled
            missing, duplicated, replaced, extra, precision or nonfinite; else the first
            ``unexplained`` or ``ambiguous`` one; else the first row that differs (``order``).
        row: the fault of this row of grad_x instead.
        max_tests: the most candidate calls to make; when they run out, the smallest call kept so
            far is returned with ``exhausted`` set.

    Returns:
        A :class:`ShrinkResult`; ``.save(directory)`` writes the reproducer.

    Raises:
        NothingToShrink: the candidate's grad_x on ``call`` is bit-identical to the device's.
        ShrinkError: the candidate gave other bits when the smallest call was run again (it is not
            deterministic: :func:`~moegrad.accuracy.check_determinism`).
        ValueError: ``row`` agrees with the device, no row has ``label``, or ``max_tests < 1``.
        CandidateError: the candidate failed on ``call`` itself, or on the final check.
        InvalidArgument: as :func:`~moegrad.accuracy.explain` (e.g. the candidate's dtype).
    """
    if isinstance(max_tests, bool) or not isinstance(max_tests, int) or max_tests < 1:
        raise ValueError(f"max_tests={max_tests!r} must be an integer >= 1")
    started = time.perf_counter()
    with candidate_in_use(candidate) as fn:
        search = _Search(fn, "", max_tests)
        grad_x, explanation = search.outcome(call)
        chosen = _target(explanation, label, row)
        search.label = chosen.label
        slot = chosen.slot if chosen.label in SUMMAND_FAULTS else None
        state = _State(call, slot, grad_x, explanation, chosen)
        history: list[ShrinkStep] = []
        state, exhausted = _rounds(search, state, history)
        _confirm(search, state)
        replay = Replay.of(fn)
    return ShrinkResult(
        call=state.call,
        candidate=state.grad_x,
        label=chosen.label,
        slot=state.row.slot,
        row=state.row.row,
        explanation=state.explanation,
        original=call_size(call),
        history=tuple(history),
        tests=search.tests,
        seconds=time.perf_counter() - started,
        exhausted=exhausted,
        replay=replay,
    )


def _rounds(search: _Search, state: _State, history: list[ShrinkStep]) -> tuple[_State, bool]:
    """Every phase in turn until a round keeps nothing; (the smallest call, whether max_tests ran out)."""
    while True:
        kept_any = False
        for name, phase in _PHASES:
            try:
                smaller = phase(search, state)
            except _Exhausted as stop:
                if stop.state is not state:
                    history.append(ShrinkStep(name, search.tests, call_size(stop.state.call)))
                return stop.state, True
            if smaller is not state:
                history.append(ShrinkStep(name, search.tests, call_size(smaller.call)))
                state, kept_any = smaller, True
        if not kept_any:
            return state, False


def _confirm(search: _Search, state: _State) -> None:
    """Run the candidate on the smallest call once more: the same bits, or :class:`ShrinkError`."""
    again, _ = search.outcome(state.call)
    words = _UINT[again.dtype.itemsize]
    if not np.array_equal(again.view(words), state.grad_x.view(words)):
        raise ShrinkError(
            f"the candidate gave other bits when the smallest call ({call_size(state.call)}) was run again: "
            "shrinking needs a candidate that gives the same bits twice (moegrad.check_determinism counts its variants)"
        )
