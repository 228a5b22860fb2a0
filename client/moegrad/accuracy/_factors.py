"""Which conditions separate a sweep's failing cases from its passing ones (docs/accuracy.md,
"Which factor makes cases fail"): :func:`analyse_factors`.

Each judged case is described by its report's context: the device profile, the mode, the dtype, K,
H, and the call's traits (:class:`~moegrad.accuracy.CallTraits`: skipped slots, repeated slots,
active_num and capacity edges). A *condition* is one of those facts (``dtype = bfloat16``,
``K >= 8``, ``H < 1025``, ``skipped slots``) or two at once (``K >= 8 and mode = drop_pad``). For each
condition the cases fall in a 2 x 2 table, failing or passing, with or without it: its *support*.

A condition is named only when the failing cases gather where it holds beyond chance: the one-sided
Fisher exact test (the hypergeometric tail: the chance that at least as many failing cases land on
it if the verdicts were shuffled), below 0.001 divided by the number of conditions that could have
been tested (Bonferroni: each condition in both directions, each pair in four). So verdicts that
do not depend on the conditions (a flaky candidate, random failures) name one in at most 0.1% of
sweeps, and the summary says plainly that no condition separates them. ``fail`` is
failing; ``pass`` and ``warning`` are passing; invalid cases and those not judged take no part.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from moegrad.accuracy._escape import markdown_text
from moegrad.accuracy._results import ComparisonReport
from moegrad.accuracy._traits import mode_of

__all__ = ["FAMILY_ALPHA", "Factor", "FactorAnalysis", "analyse_factors", "fisher_tail"]

#: The chance, over a whole sweep, that verdicts unrelated to every condition still name one.
FAMILY_ALPHA = 0.001
_THRESHOLDS = 16  # at most this many cut points per numeric attribute (K, H), at quantiles of its values
_SHOWN = 5


class _Judged(Protocol):
    """What the analysis reads of a case (:class:`~moegrad.accuracy.CaseResult`)."""

    @property
    def status(self) -> str: ...

    @property
    def report(self) -> ComparisonReport | None: ...


@dataclass(frozen=True)
class Factor:
    """A condition and its support.

    Attributes:
        condition: the condition, e.g. ``"K >= 8"`` or ``"dtype = bfloat16 and mode = drop_pad"``.
        same: other conditions that hold on exactly the same cases.
        failing_with, failing_without, passing_with, passing_without: the cases, failing or
            passing, where the condition holds or does not.
        p_value: the one-sided Fisher exact test's p-value (:func:`fisher_tail`).
    """

    condition: str
    same: tuple[str, ...]
    failing_with: int
    failing_without: int
    passing_with: int
    passing_without: int
    p_value: float

    @property
    def exact(self) -> bool:
        """The condition holds on every failing case and on no passing one."""
        return self.failing_without == 0 and self.passing_with == 0

    def describe(self) -> str:
        """One line, e.g. ``K >= 8: 40 of 40 failing cases, 0 of 60 passing (p = 7.3e-29): exactly the
        failing cases``."""
        failing, passing = self.failing_with + self.failing_without, self.passing_with + self.passing_without
        also = f" (the same cases: {', '.join(self.same)})" if self.same else ""
        text = (
            f"{self.condition}{also}: {self.failing_with} of {failing} failing cases, "
            f"{self.passing_with} of {passing} passing (p = {self.p_value:.2g})"
        )
        return text + (": exactly the failing cases" if self.exact else "")


@dataclass(frozen=True)
class FactorAnalysis:
    """What separates a sweep's failing cases from its passing ones (:func:`analyse_factors`).

    Attributes:
        failing, passing: the judged cases that failed; that passed (a warning passes).
        undescribed: judged cases whose report records no context (left out).
        tested: how many conditions the significance line is divided among (both directions
            of each, four orientations of each pair).
        threshold: the p-value a condition must stay below: :data:`FAMILY_ALPHA` / ``tested``.
        factors: the conditions below the threshold, strongest first, at most 5: a pair only when
            stronger than each of its parts, and none that another named condition dominates (as
            many failing cases or more, with no more passing ones); empty when none separates the cases.
        strongest: the condition with the smallest p-value, named or not (None without both
            failing and passing cases).
        traits_missing: cases whose context records no traits (slots and edges were not tested).
    """

    failing: int
    passing: int
    undescribed: int
    tested: int
    threshold: float
    factors: tuple[Factor, ...]
    strongest: Factor | None
    traits_missing: int = 0

    def lines(self) -> list[str]:
        """The analysis in plain sentences, one condition a line."""
        if not self.failing or not self.passing:
            what = "no case failed" if not self.failing else "no case passed"
            judged = self.failing + self.passing
            return [f"which factor makes cases fail: nothing to separate ({what}; {judged} judged)"]
        test = f"Fisher's exact test, p < {self.threshold:.2g} over {self.tested} conditions"
        notes = []
        if self.traits_missing:
            notes.append(f"{self.traits_missing} cases record no slot traits: slots and edges not tested")
        if self.undescribed:
            notes.append(f"{self.undescribed} cases record no call and are left out")
        if not self.factors:
            best = self.strongest
            if best is not None and best.exact:
                strongest = (
                    f"; {best.condition} holds on exactly the failing cases, but {self.failing + self.passing} "
                    f"cases are too few to tell that from chance (p = {best.p_value:.2g})"
                )
            else:
                strongest = "" if best is None else f"; the strongest, {best.describe()}"
            lines = [
                f"which factor makes cases fail: no condition separates the {self.failing} failing cases from "
                f"the {self.passing} passing ones ({test}){strongest}"
            ]
        else:
            lines = [f"which factor makes cases fail ({self.failing} failing, {self.passing} passing; {test}):"]
            lines += [f"  {factor.describe()}" for factor in self.factors]
        return lines + [f"  ({note})" for note in notes]

    def markdown(self) -> list[str]:
        """The analysis as a markdown section (its lines, and a table of the conditions named)."""
        lines = ["## Which factor makes cases fail", ""]
        head, *rest = self.lines()
        lines += [markdown_text(head), ""]
        if self.factors:
            lines += [
                "| condition | same cases | failing with | failing without | passing with | passing without | p |",
                "|---|---|---|---|---|---|---|",
            ]
            for f in self.factors:
                cells = [f.condition, ", ".join(f.same) or "-", f.failing_with, f.failing_without]
                cells += [f.passing_with, f.passing_without, f"{f.p_value:.3g}"]
                lines.append("| " + " | ".join(markdown_text(str(c)) for c in cells) + " |")
            lines.append("")
        lines += [markdown_text(line.strip()) for line in rest if line.strip().startswith("(")]
        return lines


def fisher_tail(failing_with: int, failing: int, with_condition: int, total: int) -> float:
    """P(X >= failing_with) for X hypergeometric: ``with_condition`` cases drawn from ``total`` of
    which ``failing`` fail (the one-sided Fisher exact test of a 2 x 2 table)."""
    low = max(0, with_condition - (total - failing))
    high = min(failing, with_condition)
    if failing_with <= low:
        return 1.0
    if failing_with > high:
        return 0.0

    def log_comb(n: int, k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)

    x = failing_with
    log_pmf = log_comb(failing, x) + log_comb(total - failing, with_condition - x) - log_comb(total, with_condition)
    pmf, tail = math.exp(log_pmf), 0.0
    mode = (with_condition + 1) * (failing + 1) // (total + 2)  # past it the terms only shrink
    while x <= high and pmf > 0.0:
        tail += pmf
        if x > mode and pmf < tail * 2.0**-60:  # what is left cannot change the float
            break
        # pmf(x + 1) / pmf(x) = (failing - x)(with - x) / ((x + 1)(total - failing - with + x + 1))
        pmf *= (failing - x) * (with_condition - x) / ((x + 1) * (total - failing - with_condition + x + 1))
        x += 1
    return min(1.0, tail)


@dataclass
class _Predicate:
    name: str
    negation: str
    mask: np.ndarray


def _cuts(values: np.ndarray) -> list[int]:
    distinct = np.unique(values)
    if distinct.size <= _THRESHOLDS + 1:
        return [int(v) for v in distinct[1:]]
    picks = np.quantile(distinct[1:], np.linspace(0, 1, _THRESHOLDS), method="inverted_cdf")
    return sorted({int(v) for v in picks})


def _predicates(table: dict[str, np.ndarray]) -> list[_Predicate]:
    """Every condition over the cases (the module docstring), each mask neither all nor none."""
    found: list[_Predicate] = []
    for name in ("profile", "mode", "dtype"):
        values = table[name]
        distinct = sorted(set(values.tolist()))
        for value in distinct[1:] if len(distinct) == 2 else distinct:
            found.append(_Predicate(f"{name} = {value}", f"{name} != {value}", values == value))
    for name in ("K", "H"):
        values = table[name]
        cuts = _cuts(values)
        found += [_Predicate(f"{name} >= {v}", f"{name} < {v}", values >= v) for v in cuts]
        if len(cuts) >= 2:
            found += [_Predicate(f"{name} = {int(v)}", f"{name} != {int(v)}", values == v) for v in np.unique(values)]
    for name, words in (
        ("skipped", ("skipped slots", "no skipped slots")),
        ("repeated", ("repeated slots", "no repeated slots")),
        ("active_edge", ("active_num at an edge (1 or N*K)", "active_num not at an edge")),
        ("capacity_edge", ("an expert at capacity", "no expert at capacity")),
    ):
        if name in table:
            found.append(_Predicate(words[0], words[1], table[name]))
    return [p for p in found if p.mask.any() and not p.mask.all()]


def _describe(results: Sequence[_Judged]) -> tuple[dict[str, np.ndarray], np.ndarray, int, int]:
    """The cases' attributes (one array per attribute), which failed, the undescribed and the
    traitless counts."""
    rows: list[dict[str, object]] = []
    failed: list[bool] = []
    undescribed = 0
    for result in results:
        context = None if result.report is None else result.report.context
        if context is None:
            undescribed += 1
            continue
        traits = context.traits
        row: dict[str, object] = {
            "profile": context.order,
            "mode": mode_of(context.drop_pad_mode, context.active_num),
            "dtype": context.dtypes.get("grad_expanded_x", "?"),
            "K": context.top_k,
            "H": (context.shapes.get("grad_expanded_x") or (0,))[-1],
        }
        if traits is not None:
            row |= {
                "skipped": traits.skipped_slots > 0,
                "repeated": traits.repeated_slots > 0,
                "active_edge": traits.active_edge,
                "capacity_edge": traits.capacity_edge,
            }
        rows.append(row)
        failed.append(result.status == "fail")
    traitless = sum(1 for row in rows if "skipped" not in row)
    names = ["profile", "mode", "dtype", "K", "H"]
    if not traitless:
        names += ["skipped", "repeated", "active_edge", "capacity_edge"]
    table = {name: np.array([row[name] for row in rows]) for name in names}
    return table, np.array(failed, dtype=np.bool_), undescribed, traitless


def _factor(name: str, same: tuple[str, ...], mask: np.ndarray, failed: np.ndarray) -> Factor:
    failing_with = int(np.count_nonzero(mask & failed))
    passing_with = int(np.count_nonzero(mask & ~failed))
    failing, total = int(np.count_nonzero(failed)), failed.size
    with_condition = failing_with + passing_with
    return Factor(
        condition=name,
        same=same,
        failing_with=failing_with,
        failing_without=failing - failing_with,
        passing_with=passing_with,
        passing_without=total - failing - passing_with,
        p_value=fisher_tail(failing_with, failing, with_condition, total),
    )


def _oriented(predicates: list[_Predicate]) -> list[tuple[str, tuple[str, ...], np.ndarray]]:
    """Each predicate both ways, conditions with the same cases merged (the first named, the others in ``same``)."""
    groups: dict[bytes, list[str]] = {}
    masks: dict[bytes, np.ndarray] = {}
    for p in predicates:
        for name, mask in ((p.name, p.mask), (p.negation, ~p.mask)):
            key = np.packbits(mask).tobytes()
            groups.setdefault(key, []).append(name)
            masks[key] = mask
    return [(names[0], tuple(names[1:]), masks[key]) for key, names in groups.items()]


def _dominates(g: Factor, f: Factor) -> bool:
    """``g`` covers at least the failing cases ``f`` covers with no more passing ones, and is better in one."""
    return (
        g.failing_with >= f.failing_with
        and g.passing_with <= f.passing_with
        and (g.failing_with, g.passing_with) != (f.failing_with, f.passing_with)
    )


def analyse_factors(results: Iterable[_Judged]) -> FactorAnalysis:
    """Which conditions separate the failing cases from the passing ones (the module docstring).

    Args:
        results: a sweep's :class:`~moegrad.accuracy.CaseResult` s (or a merge's).

    Returns:
        A :class:`FactorAnalysis`; ``factors`` is empty when no condition separates the cases.
    """
    judged = [r for r in results if r.status in ("pass", "warning", "fail")]
    table, failed, undescribed, traitless = _describe(judged)
    failing = int(np.count_nonzero(failed))
    passing = failed.size - failing
    predicates = _predicates(table) if failing and passing else []
    count = len(predicates)
    tested = max(1, 2 * count + 4 * (count * (count - 1) // 2))
    threshold = FAMILY_ALPHA / tested
    singles = [_factor(name, same, mask, failed) for name, same, mask in _oriented(predicates)]
    pairs: list[Factor] = []
    if not any(f.exact for f in singles):
        oriented = [(p.name, p.mask, p.negation, ~p.mask) for p in predicates]
        best = {f.condition: f.p_value for f in singles} | {s: f.p_value for f in singles for s in f.same}
        for i, (a, a_mask, not_a, not_a_mask) in enumerate(oriented):
            for b, b_mask, not_b, not_b_mask in oriented[i + 1 :]:
                for x, x_mask in ((a, a_mask), (not_a, not_a_mask)):
                    for y, y_mask in ((b, b_mask), (not_b, not_b_mask)):
                        mask = x_mask & y_mask
                        if mask.any() and np.count_nonzero(mask & failed) >= 2:
                            pair = _factor(f"{x} and {y}", (), mask, failed)
                            if pair.p_value < min(best.get(x, 1.0), best.get(y, 1.0)):
                                pairs.append(pair)
    ranked = sorted(singles + pairs, key=lambda f: (f.p_value, f.passing_with, f.failing_without, f.condition))
    significant = [f for f in ranked if f.p_value < threshold and f.failing_with >= 2]
    named = tuple(f for f in significant if not any(_dominates(g, f) for g in significant))[:_SHOWN]
    return FactorAnalysis(
        failing=failing,
        passing=passing,
        undescribed=undescribed,
        tested=tested,
        threshold=threshold,
        factors=named,
        strongest=ranked[0] if ranked else None,
        traits_missing=traitless,
    )
