"""The result objects of a comparison and their dict form (JSON- and msgpack-safe), via pydantic.

Every object is a frozen dataclass; :meth:`to_dict` and :meth:`from_dict` go through a pydantic
``TypeAdapter`` of the class. The dict holds only str keys, str, int, float, bool, None and lists,
so JSON and msgpack carry it as is. A float that is not finite is written as a string: ``"nan"``,
``"inf"`` or ``"-inf"`` (NaN means *undefined*, e.g. a mean over no elements). ``from_dict``
reverses this, ignores keys it does not know (a newer server may add some) and raises
``ValueError`` (a ``pydantic.ValidationError``) naming a missing or mistyped field; numbers are
checked strictly (an int field refuses 2.0 and True, a float field refuses True and "1.5").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BeforeValidator, PlainSerializer, Strict, TypeAdapter

from moegrad.accuracy._standards import Op, Status

__all__ = [
    "CallTraits",
    "ComparisonReport",
    "CriterionResult",
    "ExactMatch",
    "Metrics",
    "NonfiniteRow",
    "ReportContext",
    "RowErrors",
    "RowPercentiles",
    "SlotTable",
    "StandardVerdict",
    "WorstElement",
    "ZeroRowCheck",
]

_FLOAT_WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _float_in(value: Any) -> Any:
    return _FLOAT_WORDS.get(value, value) if isinstance(value, str) else value


def _float_out(value: float) -> float | str:
    if math.isfinite(value):  # the common case first: one test
        return value
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


#: A float on the wire: a number, or one of the strings "nan", "inf", "-inf".
WireFloat = Annotated[float, BeforeValidator(_float_in), Strict(), PlainSerializer(_float_out, return_type=Any)]
Int = Annotated[int, Strict()]
Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]

_T = TypeVar("_T")


@functools.cache
def _adapter(cls: type) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


class _Serializable:
    """``to_dict`` / ``from_dict`` through a pydantic ``TypeAdapter`` of the dataclass."""

    __slots__ = ()  # a subclass declared with slots=True then holds no __dict__

    def to_dict(self) -> dict[str, Any]:
        """This object as a JSON- and msgpack-safe dict (non-finite floats as strings, tuples as lists)."""
        # mypy takes a class for non-Hashable (its __hash__ is seen unbound), so functools.cache's stub refuses it
        return _adapter(type(self)).dump_python(self, mode="json")  # type: ignore[arg-type]

    def to_json(self) -> bytes:
        """:meth:`to_dict`'s document as compact JSON (UTF-8, one line), written by pydantic's
        serializer: several times faster than ``json.dumps(self.to_dict())``; floats in their shortest
        form that reads back to the same value."""
        return _adapter(type(self)).dump_json(self)  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[_T], data: Mapping[str, Any]) -> _T:
        """Rebuild the object from :meth:`to_dict`'s output (for example a server's reply).

        Raises:
            ValueError: a field is missing or has the wrong type (the message names it).
        """
        # a class is Hashable at run time; see to_dict
        return _adapter(cls).validate_python(data)  # type: ignore[arg-type]


@dataclass(frozen=True)
class WorstElement(_Serializable):
    """The element with the largest error of one comparison (a NaN/Inf mismatch ranks above any).

    Attributes:
        row: the token index i in [0, N).
        column: the hidden index in [0, H).
        actual, expected, golden: the three values at (row, column), as float64 (may be non-finite).
        abs_error: ``|actual - expected|`` (inf or NaN for a NaN/Inf mismatch).
    """

    row: Int
    column: Int
    actual: WireFloat
    expected: WireFloat
    golden: WireFloat
    abs_error: WireFloat


@dataclass(frozen=True)
class Metrics(_Serializable):
    """Error statistics of ``actual`` against ``expected`` (see :func:`metrics`; docs/accuracy.md).

    Counts are element counts; shares are fractions in [0, 1]; errors are in the values' own units
    unless the name says relative or ULP. A statistic over an empty set is NaN. *Scale* below is
    ``|golden|``, or the summands' magnitude when :func:`compare` computed the metrics
    (``relative_to`` says which).

    Attributes:
        dtype: the tolerance dtype (the operator's dtype): picks :data:`DTYPE_LIMITS`.
        actual_dtype: the dtype of ``actual``; ULPs are ULPs of this dtype.
        relative_to: ``"golden"`` (scale = |golden|) or ``"magnitude"`` (scale = sum of |summands|).
        count: elements compared (N*H).
        finite_count: elements where actual, expected, golden and the scale are all finite: the
            error statistics below cover these.
        normal_count: finite elements with scale >= ``small_value``.
        small_count: finite elements with scale < ``small_value``.
        max_abs_error, mean_abs_error: of ``|actual - expected|``.
        rmse: ``sqrt(mean((actual - expected)^2))``.
        max_relative_error, mean_relative_error: of ``|actual - expected| / scale`` over the normal
            elements only.
        small_value_error_count: small elements with ``|actual - expected| > small_value_atol``.
        small_value_error_rate: ``small_value_error_count / small_count``.
        max_small_value_abs_error: the largest absolute error among the small elements.
        max_accumulative_error: the largest ``|actual - expected| / max(scale, accumulative_small_value)``.
        cosine_similarity: of the finite elements as vectors (1.0 when both are all zeros, 0.0 when
            only one is).
        bitwise_equal_count, bitwise_equal_share: elements whose values are identical, the sign of
            zero included (any NaN equals any NaN); the share is over ``count``.
        max_ulp_error, mean_ulp_error: ``|actual - expected|`` in ULPs of golden in ``actual_dtype``.
        ulp_error_above_1_share: finite elements more than 1 ULP off, over ``finite_count``.
        hundredth_share, thousandth_share, ten_thousandth_share: elements (over ``count``) whose error
            is within 1e-2 / 1e-3 / 1e-4 of ``max(scale, small_value)``; an element whose NaN/Inf
            class matches counts as within, a mismatch does not.
        nan_mismatch_count: elements where exactly one of actual and expected is NaN.
        inf_mismatch_count: other elements whose classes (finite, +inf, -inf) differ; expected is
            first rounded to ``actual_dtype``, so an overflow that rounds to inf matches inf.
        positive_error_share, negative_error_share: finite elements with actual > / < expected.
        toward_zero_share, away_from_zero_share: finite elements with |actual| < / > |expected|.
        nonzero_error_count: finite elements with actual != expected.
        error_imbalance: ``max(|positive - negative|, |away - toward|) / nonzero_error_count`` in
            [0, 1]: 0 for errors that fall on both sides equally, 1 for errors all on one side.
        worst: the worst element, or None when nothing differs.
    """

    dtype: Str
    actual_dtype: Str
    relative_to: Literal["golden", "magnitude"]
    count: Int
    finite_count: Int
    normal_count: Int
    small_count: Int
    max_abs_error: WireFloat
    mean_abs_error: WireFloat
    rmse: WireFloat
    max_relative_error: WireFloat
    mean_relative_error: WireFloat
    small_value_error_count: Int
    small_value_error_rate: WireFloat
    max_small_value_abs_error: WireFloat
    max_accumulative_error: WireFloat
    cosine_similarity: WireFloat
    bitwise_equal_count: Int
    bitwise_equal_share: WireFloat
    max_ulp_error: WireFloat
    mean_ulp_error: WireFloat
    ulp_error_above_1_share: WireFloat
    hundredth_share: WireFloat
    thousandth_share: WireFloat
    ten_thousandth_share: WireFloat
    nan_mismatch_count: Int
    inf_mismatch_count: Int
    positive_error_share: WireFloat
    negative_error_share: WireFloat
    toward_zero_share: WireFloat
    away_from_zero_share: WireFloat
    nonzero_error_count: Int
    error_imbalance: WireFloat
    worst: WorstElement | None


@dataclass(frozen=True)
class ZeroRowCheck(_Serializable):
    """The rows that must be exactly +0.0 (every slot skipped), checked bit for bit in the candidate.

    Attributes:
        rows: how many rows must be +0.0.
        mismatched_rows: how many of them hold any element that is not +0.0 (-0.0 and NaN included).
        mismatched_elements: how many elements of those rows are not +0.0.
        first_mismatched_row: the lowest such row index, or None.
    """

    rows: Int
    mismatched_rows: Int
    mismatched_elements: Int
    first_mismatched_row: Int | None


@dataclass(frozen=True)
class CriterionResult(_Serializable):
    """One criterion of a standard as judged: the number, the threshold, the outcome.

    Attributes:
        measure: the measure's name (:attr:`Criterion.measure`).
        status: ``"pass"``, ``"warning"`` or ``"fail"``.
        value: the measured number (NaN when the measure is undefined).
        op, limit: the requirement, ``value op limit``.
        assessed: False when the measure was undefined or rested on fewer than ``samples_needed``
            elements; such a criterion passes.
        samples: the elements the measure rests on.
        samples_needed: :attr:`Criterion.min_samples`.
        device_value: the same measure with the device's result in the candidate's place (against
            the golden): what the device itself achieves on these inputs. For the benchmark's
            ratios this is 1 (0 where the device is exact), for its excesses 0; NaN when undefined.
    """

    measure: Str
    status: Status
    value: WireFloat
    op: Op
    limit: WireFloat
    assessed: Bool
    samples: Int
    samples_needed: Int = 0
    device_value: WireFloat = math.nan

    def describe(self) -> str:
        """One line for people, e.g. ``"rmse_ratio = 2.31 (needs <= 2; device 1): fail"``."""
        if not self.assessed:
            why = "undefined" if math.isnan(self.value) else f"{self.samples} < {self.samples_needed} samples"
            return f"{self.measure}: not assessed ({why})"
        device = "" if math.isnan(self.device_value) else f"; device {self.device_value:.6g}"
        return f"{self.measure} = {self.value:.6g} (needs {self.op} {self.limit:.6g}{device}): {self.status}"


@dataclass(frozen=True)
class StandardVerdict(_Serializable):
    """One standard's verdict: the worst of its criteria.

    Attributes:
        standard: one of :data:`STANDARDS`.
        status: ``"pass"``, ``"warning"`` or ``"fail"``.
        criteria: every criterion as judged, in table order.
        device_status: the status the device's own result gets under this standard (the same
            criteria, judged on each criterion's ``device_value``).
    """

    standard: Str
    status: Status
    criteria: tuple[CriterionResult, ...]
    device_status: Status = "pass"

    @property
    def failures(self) -> tuple[CriterionResult, ...]:
        """The criteria that did not pass (warnings and failures)."""
        return tuple(c for c in self.criteria if c.status != "pass")


@dataclass(frozen=True)
class ExactMatch(_Serializable):
    """Whether the candidate is bit-exact to the device's result, stated apart from the verdict.

    Attributes:
        bit_exact: every element equals the device's, the sign of zero included (NaN payloads
            are not compared).
        mismatched: elements that differ.
        count: elements compared (N*H).
        share: ``mismatched / count`` (0 for an empty grad_x).
        required: the caller asked for exactness (``require_exact``): then a candidate that is not
            bit-exact fails, whatever the tolerance standards say.
    """

    bit_exact: Bool
    mismatched: Int
    count: Int
    share: WireFloat
    required: Bool = False


@dataclass(frozen=True, slots=True)
class SlotTable(_Serializable):
    """A row's K slots, one list per field, in slot order (t = 0..K-1).

    Attributes:
        t: the slot position, 0..K-1.
        index: ``expanded_row_idx[i*K + t]``.
        row: the row of grad_expanded_x (flat [rows, H]; drop/pad: ``e*C + c``) it reads, or None
            when the slot is skipped.
        skipped: whether the device skips the slot (docs/semantics.md section 2).
        expert: drop/pad mode: ``index // C`` (None for a skipped slot and in the other modes).
        capacity_row: drop/pad mode: ``index % C``, the slot's row within its expert's capacity.
    """

    t: tuple[Int, ...]
    index: tuple[Int, ...]
    row: tuple[Int | None, ...]
    skipped: tuple[Bool, ...]
    expert: tuple[Int | None, ...]
    capacity_row: tuple[Int | None, ...]


@dataclass(frozen=True)
class RowPercentiles(_Serializable):
    """One figure over the rows of grad_x, each row's figure the largest over its elements.

    Attributes:
        rows: the rows where the figure is defined (a finite element; for a relative error, a
            finite element whose scale is at least ``small_value``).
        p50, p90, p99, max: nearest-rank percentiles over those rows: the value of rank
            ``ceil(p * rows / 100)`` in ascending order (a row's own figure, never an interpolation);
            NaN when ``rows`` is 0.
        max_row: the lowest row with the largest figure; None when ``rows`` is 0.
    """

    rows: Int
    p50: WireFloat
    p90: WireFloat
    p99: WireFloat
    max: WireFloat
    max_row: Int | None


@dataclass(frozen=True)
class NonfiniteRow(_Serializable):
    """The first row of the candidate that holds a NaN or an Inf, and where it came from.

    Attributes:
        row: the token index i.
        count: the row's NaN/Inf elements in the candidate.
        columns: the first 8 of those columns.
        device_count, golden_count: the same row's NaN/Inf elements in the device's result and in
            the float64 golden (an input that carries a NaN/Inf gives them to every implementation).
        slots: the row's K slots (:class:`SlotTable`): index, the row read, skipped or not.
        carriers: the slots t (not skipped) whose row of grad_expanded_x holds a NaN/Inf in a column
            where the candidate has one; empty when no input carries it.
    """

    row: Int
    count: Int
    columns: tuple[Int, ...]
    device_count: Int
    golden_count: Int
    slots: SlotTable
    carriers: tuple[Int, ...]


@dataclass(frozen=True)
class RowErrors(_Serializable):
    """Where the error lives: the candidate's error row by row, beside the device's (docs/accuracy.md,
    "Where the error lives"; :func:`~moegrad.accuracy.with_row_errors`).

    Attributes:
        rows: N, the rows of grad_x.
        differing: rows whose values differ from the device's somewhere (the sign of zero
            included; any NaN matches any NaN).
        failing, device_failing: rows with an element past an element's limit (a NaN/Inf unlike
            the golden's, a relative error at or above the ``threshold`` standard's maximum, an
            error past the ``accumulative`` bound, or a value other than +0.0 in a row that must
            be +0.0): the candidate's, the device's.
        outside_bound: rows of the candidate with a finite element farther from the golden than
            any order of float32 adds can land (:func:`~moegrad.any_order_bound`): not rounding.
        nonfinite, device_nonfinite: rows holding a NaN or an Inf: the candidate's, the device's.
        relative_error, device_relative_error: each row's largest relative error (against the
            summands' magnitude, elements at or above ``small_value``), over the rows.
        ulp_error, device_ulp_error: each row's largest ``|value - golden|`` in ULPs of the golden in
            the value's dtype, over the rows.
        first_nonfinite: :class:`NonfiniteRow` of the lowest candidate row holding a NaN/Inf, or None.
    """

    rows: Int
    differing: Int
    failing: Int
    device_failing: Int
    outside_bound: Int
    nonfinite: Int
    device_nonfinite: Int
    relative_error: RowPercentiles
    device_relative_error: RowPercentiles
    ulp_error: RowPercentiles
    device_ulp_error: RowPercentiles
    first_nonfinite: NonfiniteRow | None


@dataclass(frozen=True)
class CallTraits(_Serializable):
    """The conditions of a call that a sweep's factor analysis splits its cases by
    (docs/accuracy.md, "Which factor makes cases fail").

    Attributes:
        tokens, hidden: N and H.
        mode: ``"dropless"``, ``"active"`` (active_num > 0) or ``"drop_pad"`` (drop_pad_mode 1).
        skipped_slots: slots the device skips (-1 in drop/pad mode, an index >= active_num, an
            index past the rows on a profile that skips it).
        repeated_slots: slots (not skipped) whose index another slot of the call reads too.
        active_edge: active mode with active_num at an end of its range: 1, or N*K (no slot skipped).
        capacity_edge: drop/pad mode with an expert filled to its capacity: a slot reads capacity
            row C - 1.
        experts, capacity: drop/pad mode: E and C; None in the other modes.
    """

    tokens: Int
    hidden: Int
    mode: Str
    skipped_slots: Int
    repeated_slots: Int
    active_edge: Bool
    capacity_edge: Bool
    experts: Int | None = None
    capacity: Int | None = None


@dataclass(frozen=True)
class ReportContext(_Serializable):
    """What a saved report needs to be reproduced: the call, its inputs' digests, who answered, when.

    Attributes:
        operator: ``"aclnnMoeInitRoutingV2Grad"``.
        shapes: name -> shape of ``grad_expanded_x``, ``expanded_row_idx``, ``candidate``.
        dtypes: name -> dtype name of the same tensors.
        sha256: name -> SHA-256 (hex) of each tensor's bytes, C order, little-endian.
        top_k, drop_pad_mode, active_num: the call's attributes.
        order: the device profile of the device result (``"ascend910b@9.1"``, ...,
            ``"sequential"``; docs/semantics.md), or ``"unknown"``.
        product_line: the products and release ``order`` stands for (``"Atlas A2, CANN 9.1"``,
            or ``"sequential golden (no device)"``).
        moegrad_version: the client's version that wrote the report.
        backend: who computed the device result (``"reference"``, ``"ascend"``, ``"in-process"``).
        device: the device, or None for an emulation.
        server_url: the service's URL, or None in-process.
        created: the time the report was made, ISO 8601 in UTC.
        case: the case's name (a bulk run's file stem), or None.
        traits: the call's conditions a sweep's factor analysis reads (:class:`CallTraits`), or None
            in a report written before they were recorded.
    """

    operator: Str
    shapes: dict[Str, tuple[Int, ...]]
    dtypes: dict[Str, Str]
    sha256: dict[Str, Str]
    top_k: Int
    drop_pad_mode: Int
    active_num: Int
    order: Str
    product_line: Str
    moegrad_version: Str
    backend: Str
    device: Str | None
    server_url: Str | None
    created: Str
    case: Str | None = None
    traits: CallTraits | None = None


@dataclass(frozen=True)
class ComparisonReport(_Serializable):
    """Everything :func:`compare` found: three comparisons, the zero rows, exactness, the verdicts.

    Attributes:
        dtype: the operator's dtype (the thresholds' key).
        candidate_dtype: the candidate's dtype (the operator's, or float32).
        shape: [N, H] of grad_x.
        verdict: the overall status: the worst of ``verdicts``, and ``"fail"`` when exactness was
            required and the candidate is not bit-exact.
        verdicts: one :class:`StandardVerdict` per judged standard, in :data:`STANDARDS` order.
        candidate_vs_golden, device_vs_golden, candidate_vs_device: :class:`Metrics`.
        zero_rows: :class:`ZeroRowCheck` of the candidate.
        exact: :class:`ExactMatch`: bit-exactness to the device, with the count and share.
        device_zero_rows: :class:`ZeroRowCheck` of the device's result (for ``device_status``).
        context: :class:`ReportContext` when the report was made for saving (CLI, bulk runs,
            :func:`with_context`); None otherwise.
        profiles_matching: the device profiles (:data:`moegrad.PROFILES`) whose emulation of the
            call is bit-identical to the candidate, possibly none, when asked for
            (:func:`with_profiles`; ``moegrad compare`` asks); None otherwise.
        explained: when the candidate was explained (:func:`moegrad.explain`; ``moegrad compare
            --explain``): every label of :data:`~moegrad.accuracy.LABELS` -> the rows that got it
            (all 0 when every row is bit-identical to the device's); None otherwise.
        row_errors: where the error lives, row by row (:class:`RowErrors`), when asked for
            (:func:`~moegrad.accuracy.with_row_errors`; ``moegrad compare`` asks); None otherwise.
    """

    dtype: Str
    candidate_dtype: Str
    shape: tuple[Int, Int]
    verdict: Status
    verdicts: tuple[StandardVerdict, ...]
    candidate_vs_golden: Metrics
    device_vs_golden: Metrics
    candidate_vs_device: Metrics
    zero_rows: ZeroRowCheck
    exact: ExactMatch | None = None
    device_zero_rows: ZeroRowCheck | None = None
    context: ReportContext | None = None
    profiles_matching: tuple[Str, ...] | None = None
    explained: dict[Str, Int] | None = None
    row_errors: RowErrors | None = None

    @property
    def passed(self) -> bool:
        """True unless the overall verdict is ``"fail"`` (a warning passes)."""
        return self.verdict != "fail"

    def verdict_of(self, standard: str) -> StandardVerdict:
        """The verdict of ``standard``.

        Raises:
            KeyError: the standard was not requested.
        """
        for verdict in self.verdicts:
            if verdict.standard == standard:
                return verdict
        raise KeyError(f"standard {standard!r} is not in this report ({', '.join(v.standard for v in self.verdicts)})")
