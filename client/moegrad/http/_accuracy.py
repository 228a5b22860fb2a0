"""The HTTP client's one door to :mod:`moegrad.accuracy`: what a reply, a request and a retry need of
it, and the sweep adapter behind ``Client.compare_many``.

Every other module of ``moegrad.http`` imports accuracy's names from here (an import-linter
contract in pyproject.toml keeps it so): a comparison's report (:class:`ComparisonReport`) and an
explanation (:class:`Explanation`), which replies are rebuilt into, the check of a candidate and
standards before any I/O (:func:`check_compare_arguments`, :func:`check_explain_arguments`), an
answer judged again with ``require_exact`` (:func:`rejudge`); and the sweep: each batch of cases
judged on the service (:func:`compare_batch_on`; explained too, :func:`explaining_batch`), the
cases refused up front where the replicas' profiles differ (:func:`refuse_mixed_profiles`), the
results file (:func:`sweep_output`) and the workers (:func:`compare_cases`), set up by :func:`sweep`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from moegrad.accuracy import (
    CaseResult,
    ComparisonReport,
    Explanation,
    aexplaining_batch,
    check_compare_arguments,
    check_explain_arguments,
    explaining_batch,
    rejudge,
)
from moegrad.accuracy._batches import SentCall, acompare_batch_on, compare_batch_on, refuse_mixed_profiles
from moegrad.accuracy._ledger import SweepFile, sweep_output
from moegrad.accuracy._sweep import acompare_cases, compare_cases

__all__ = [
    "CaseResult",
    "ComparisonReport",
    "Explanation",
    "SentCall",
    "SweepFile",
    "acompare_batch_on",
    "acompare_cases",
    "aexplaining_batch",
    "check_compare_arguments",
    "check_explain_arguments",
    "compare_batch_on",
    "compare_cases",
    "explaining_batch",
    "rejudge",
    "sweep",
]


@contextlib.contextmanager
def sweep(
    items: list[Any], orders: dict[str, str | None], order: Any, replicas: int, *options: Any
) -> Iterator[dict[str, Any]]:
    """``compare_many``'s cases (refused up front where the replicas' ``orders`` differ and a case
    names no profile), its results file (``orders`` in its header) and its concurrency (default:
    two per replica, at least four), as :func:`compare_cases`' keyword arguments.

    ``options``: ``standards, require_exact, output, concurrency`` as ``compare_many`` takes them.
    """
    refuse_mixed_profiles(orders, items, order)
    standards, require_exact, output, concurrency = options
    with sweep_output(
        output, cases=len(items), standards=standards, require_exact=require_exact, orders=orders
    ) as written:
        yield {
            "cases": items,
            "output": written,
            "concurrency": max(4, 2 * replicas) if concurrency is None else concurrency,
        }
