"""Delta debugging: a 1-minimal subset of items on which a test still fails (Zeller's ddmin).

A. Zeller and R. Hildebrandt, "Simplifying and Isolating Failure-Inducing Input", IEEE Transactions
on Software Engineering 28(2), 2002, section 3.3 (the algorithm ddmin): split the items into n
chunks; if one chunk alone fails, keep it (n = 2); else if the items without one chunk fail, keep
those (n = max(n - 1, 2)); else split finer (n = min(2n, len)), until n reaches the number of items.
The result fails, and removing any one of its items makes it pass: 1-minimal. At n = 2 a chunk's
complement is the other chunk, so it is not tested twice; a subset already tested is answered from
a cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["ddmin"]


def _chunks(items: Sequence[int], n: int) -> list[list[int]]:
    """``items`` in ``n`` consecutive chunks of sizes differing by at most one, larger first."""
    size, extra = divmod(len(items), n)
    chunks, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        chunks.append(list(items[start:stop]))
        start = stop
    return chunks


def ddmin(items: Sequence[int], fails: Callable[[list[int]], bool]) -> list[int]:
    """A 1-minimal subset of ``items`` (distinct integers, in their order) on which ``fails`` still holds.

    Args:
        items: what may be removed; ``fails(list(items))`` is taken to hold (it is not tested).
        fails: the test of a non-empty subset, kept in the items' order; it may raise to stop the
            search (the caller keeps what the last passing test found).

    Returns:
        The subset; ``items`` as a list when nothing could be removed. The empty subset is never tested.
    """
    current = list(items)
    seen: dict[tuple[int, ...], bool] = {}

    def test(subset: list[int]) -> bool:
        key = tuple(subset)
        if key not in seen:
            seen[key] = fails(subset)
        return seen[key]

    n = 2
    while len(current) >= 2:
        chunks = _chunks(current, n)
        kept = next((chunk for chunk in chunks if test(chunk)), None)
        if kept is not None:
            current, n = kept, 2
            continue
        if n > 2:
            complement = next(
                (rest for i in range(n) if test(rest := [x for j, c in enumerate(chunks) if j != i for x in c])),
                None,
            )
            if complement is not None:
                current, n = complement, max(n - 1, 2)
                continue
        if n >= len(current):
            break
        n = min(2 * n, len(current))
    return current
