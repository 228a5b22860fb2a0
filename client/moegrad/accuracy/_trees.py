"""Trees of adds: the order in which one output element's K slots are summed, as data.

A tree is a slot number (a leaf, ``int``) or a tuple of two or more subtrees (an add of its
operands, rounded once). Every device profile adds two operands at a time in float32; a node with
more operands is a *multi-term* add (its operands summed as if exactly, then rounded once), which
only the order probe reports (:class:`~moegrad.accuracy.MultiTermOrder`). Adds commute in IEEE
arithmetic (``a + b`` and ``b + a`` give the same bits), so a tree is kept in one canonical form:
each node's operands sorted by their smallest slot. The expression of a tree names slot t ``vt``
and puts every add in parentheses: ``((v0+v1)+(v2+v3))``.

The profiles' trees come from :func:`moegrad.accumulation_schedule`, the same steps the emulation
runs (docs/semantics.md sections 3 and 7): a bin set to +0.0 and then added to is the identity
(``+0.0 + x`` is ``x``), so the 950's accumulator that starts at +0.0 adds no node.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np

from moegrad.numerics._ascend950 import UB_SIZE_BYTES, VECTOR_CORE_COUNT
from moegrad.numerics._schedules import accumulation_schedule
from moegrad.operator._profiles import PROFILES

__all__ = [
    "Tree",
    "canonical",
    "expression",
    "lca_sizes",
    "profile_sizes",
    "profile_trees",
    "rebuild",
    "replay",
    "schedule_tree",
]

#: A leaf (slot number) or an add of two or more subtrees.
Tree: TypeAlias = int | tuple["Tree", ...]


def _smallest(tree: Tree) -> int:
    while not isinstance(tree, int):
        tree = tree[0]  # canonical: the first operand holds the smallest slot
    return tree


def canonical(tree: Tree) -> Tree:
    """``tree`` with every node's operands sorted by their smallest slot (adds commute)."""
    if isinstance(tree, int):
        return tree
    operands = [canonical(operand) for operand in tree]
    return tuple(sorted(operands, key=_smallest))


def expression(tree: Tree) -> str:
    """The tree written out: slot t is ``vt``, every add in parentheses, e.g. ``((v0+v1)+v2)``."""
    if isinstance(tree, int):
        return f"v{tree}"
    return "(" + "+".join(expression(operand) for operand in tree) + ")"


def leaves(tree: Tree) -> list[int]:
    """The slots under ``tree``, in the order the expression writes them."""
    if isinstance(tree, int):
        return [tree]
    return [slot for operand in tree for slot in leaves(operand)]


def schedule_tree(steps: Sequence[tuple[str, int, int]]) -> Tree:
    """The canonical tree of the steps :func:`moegrad.accumulation_schedule` returns.

    Raises:
        ValueError: steps that leave bin 0 empty (no slot added).
    """
    bins: dict[int, Tree | None] = {}
    for op, dst, src in steps:
        if op == "zero":
            bins[dst] = None
        elif op == "set":
            bins[dst] = src
        else:
            left = bins.get(dst)
            right: Tree | None = src if op == "add" else bins.get(src)
            bins[dst] = right if left is None else left if right is None else (left, right)
    root = bins.get(0)
    if root is None:
        raise ValueError("the schedule adds no slot into bin 0")
    return canonical(root)


@functools.lru_cache(maxsize=256)
def profile_trees(
    top_k: int,
    dtype: str,
    num_tokens: int,
    hidden_size: int,
    ub_size_bytes: int = UB_SIZE_BYTES,
    vector_core_count: int = VECTOR_CORE_COUNT,
) -> dict[str, Tree]:
    """Every device profile's tree (and ``"sequential"``'s) for one call shape, by canonical name.

    Args:
        top_k: K >= 1.
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``: the 950's tiling reads it.
        num_tokens, hidden_size: N and H, which the 950's tiling reads as well.
        ub_size_bytes, vector_core_count: the 950 platform (docs/semantics.md section 7.4).
    """
    return {
        name: schedule_tree(
            accumulation_schedule(
                top_k,
                name,
                dtype=dtype,
                num_tokens=num_tokens,
                hidden_size=hidden_size,
                ub_size_bytes=ub_size_bytes,
                vector_core_count=vector_core_count,
            )
        )
        for name in PROFILES
    }


def lca_sizes(tree: Tree, top_k: int) -> np.ndarray:
    """For every pair of slots, the number of slots under the smallest node holding both.

    Returns:
        [K, K] int64, symmetric, 1 on the diagonal (a slot alone). A slot missing from the tree
        keeps 0 in its row and column.
    """
    sizes = np.zeros((top_k, top_k), np.int64)
    np.fill_diagonal(sizes, 1)

    def visit(node: Tree) -> np.ndarray:
        if isinstance(node, int):
            return np.array([node])
        groups = [visit(operand) for operand in node]
        under = np.concatenate(groups)
        for a, first in enumerate(groups[:-1]):
            rest = np.concatenate(groups[a + 1 :])
            sizes[first[:, None], rest] = under.size
            sizes[rest[:, None], first] = under.size
        return under

    visit(tree)
    return sizes


@functools.lru_cache(maxsize=256)
def profile_sizes(
    top_k: int,
    dtype: str,
    num_tokens: int,
    hidden_size: int,
    ub_size_bytes: int = UB_SIZE_BYTES,
    vector_core_count: int = VECTOR_CORE_COUNT,
) -> dict[str, np.ndarray]:
    """:func:`lca_sizes` of every tree of :func:`profile_trees` (read-only arrays)."""
    trees = profile_trees(top_k, dtype, num_tokens, hidden_size, ub_size_bytes, vector_core_count)
    sizes = {name: lca_sizes(tree, top_k) for name, tree in trees.items()}
    for array in sizes.values():
        array.flags.writeable = False
    return sizes


def rebuild(sizes: np.ndarray) -> Tree | None:
    """The tree whose :func:`lca_sizes` are ``sizes``, or None when no tree has them.

    Top down: a node of n slots splits into the groups of slots that meet below it (a pair whose
    smallest common node is smaller than n lies in one operand). Nodes may have more than two
    operands (a flat multi-term add gives n for every pair). The result is checked against
    ``sizes`` in full, so None is the only answer for sizes that no tree gives.

    Args:
        sizes: [K, K] integers, as :func:`lca_sizes` returns them.
    """
    top_k = len(sizes)

    def split(members: list[int]) -> Tree | None:
        if len(members) == 1:
            return members[0]
        count, rest, operands = len(members), np.asarray(members), []
        while rest.size:
            inside = sizes[rest[0], rest] < count
            operands.append(rest[inside].tolist())
            rest = rest[~inside]
        if len(operands) < 2:
            return None
        subtrees = [split(operand) for operand in operands]
        if any(subtree is None for subtree in subtrees):
            return None
        return tuple(subtree for subtree in subtrees if subtree is not None)

    tree = split(list(range(top_k)))
    if tree is None or not np.array_equal(lca_sizes(tree, top_k), sizes):
        return None
    return canonical(tree)


def replay(tree: Tree, values: np.ndarray) -> np.ndarray:
    """The float32 sum of ``values`` in the order of a binary ``tree`` (every add rounded to float32).

    Args:
        tree: a tree whose every node has two operands.
        values: [K, ...] float32; ``values[t]`` is slot t's value (or row of values).

    Returns:
        float32, ``values.shape[1:]``.

    Raises:
        ValueError: a node with more than two operands (a multi-term add has no float32 replay).
    """
    if isinstance(tree, int):
        return np.array(values[tree], dtype=np.float32)
    if len(tree) != 2:
        raise ValueError(f"{expression(tree)} adds {len(tree)} operands at once; only two-operand adds replay")
    with np.errstate(all="ignore"):
        return np.add(replay(tree[0], values), replay(tree[1], values), dtype=np.float32)
