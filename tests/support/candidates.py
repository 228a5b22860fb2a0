"""Candidates whose order of adds is known, for the candidate harness's tests: the oracle of the probe.

Nothing here imports moegrad. Each tree is written from its definition (a chain, pairwise halves,
a random tree) or from docs/semantics.md's rules (the A2/A3 bins of section 3.1, the Ascend 950's
groups of four per K chunk of section 7.2), and a candidate sums each token's K slots in that
tree's order with float32 adds, then rounds once to the input dtype (NumPy's cast: round half to
even). A tree is a slot number or a tuple of two or more subtrees.

Candidates that no single tree describes: :func:`random_tree_per_call` (a new tree every call),
:func:`shuffled_rows` (a new order for every token, as atomic adds give), :func:`sorted_by_magnitude`
(depends on the values), :func:`row_order` (a scatter over the rows in row order: depends on the
index), :func:`float64_sum` (exact at the probe's magnitudes). Planted faults for the order-free
inputs: :func:`faulty` (a slot dropped, counted twice, or read from the neighbouring row).
"""

from __future__ import annotations

import numpy as np

__all__ = ["bins_tree", "chain_tree", "expression_of", "faulty", "float64_sum", "groups_tree", "pairwise_tree",
           "random_tree", "random_tree_per_call", "reversed_tree", "row_order", "shuffled_rows", "slot_values",
           "sorted_by_magnitude", "tree_candidate", "tree_sum"]


# --------------------------------------------------------------------------------------------------
# Trees, from their definitions.
# --------------------------------------------------------------------------------------------------

def chain_tree(top_k: int):
    """((v0 + v1) + v2) + ...: slot after slot."""
    tree = 0
    for t in range(1, top_k):
        tree = (tree, t)
    return tree


def reversed_tree(top_k: int):
    """((v[K-1] + v[K-2]) + v[K-3]) + ...: slot after slot, from the last."""
    tree = top_k - 1
    for t in range(top_k - 2, -1, -1):
        tree = (tree, t)
    return tree


def pairwise_tree(first: int, last: int):
    """Slots first..last-1 split in halves (the larger half second), each half summed the same way."""
    if last - first == 1:
        return first
    middle = first + (last - first) // 2
    return (pairwise_tree(first, middle), pairwise_tree(middle, last))


def random_tree(top_k: int, rng: np.random.Generator):
    """A random binary tree: two random operands of the pool are added until one is left."""
    pool = list(range(top_k))
    while len(pool) > 1:
        a, b = sorted(rng.choice(len(pool), 2, replace=False), reverse=True)
        left, right = pool.pop(a), pool.pop(b)
        pool.append((left, right))
    return pool[0]


def bins_tree(top_k: int):
    """The A2/A3 kernel's bins, docs/semantics.md section 3.1 (S1 to S4)."""
    bins = 64 if top_k >= 128 else 2 ** max(int(np.floor(np.log2(top_k))) - 1, 0)
    acc = {b: 2 * b for b in range(bins) if 2 * b < top_k}  # S1
    for t in range(2 * bins, top_k, 2):  # S2
        acc[(t // 2) % bins] = (acc[(t // 2) % bins], t)
    for t in range(1, top_k, 2):  # S3
        acc[((t - 1) // 2) % bins] = (acc[((t - 1) // 2) % bins], t)
    step = 1
    while step < bins:  # S4
        for j in range(step, bins, 2 * step):
            acc[j - step] = (acc[j - step], acc[j])
        step *= 2
    return acc[0]


def groups_tree(top_k: int, chunk: int):
    """The Ascend 950 from CANN 9.0, docs/semantics.md section 7.2: per chunk of slots, groups of four
    added as ((a + b) + (c + d)), leftovers one by one, into one accumulator (+0.0 + x is x)."""
    total = None
    for start in range(0, top_k, chunk):
        end, t = min(start + chunk, top_k), start
        while t + 4 <= end:
            group = ((t, t + 1), (t + 2, t + 3))
            total = group if total is None else (total, group)
            t += 4
        for leftover in range(t, end):
            total = leftover if total is None else (total, leftover)
    return total


def expression_of(tree) -> str:
    """The tree written as the harness documents it: operands sorted by their smallest slot, slot t as
    ``vt``, every add in parentheses."""

    def smallest(node):
        return node if isinstance(node, int) else min(smallest(operand) for operand in node)

    if isinstance(tree, int):
        return f"v{tree}"
    return "(" + "+".join(expression_of(operand) for operand in sorted(tree, key=smallest)) + ")"


# --------------------------------------------------------------------------------------------------
# Candidates.
# --------------------------------------------------------------------------------------------------

def slot_values(grad, idx, top_k, drop_pad_mode, active_num) -> np.ndarray:
    """[K, N, H] float32: each slot's row (widened exactly), +0.0 for a skipped slot."""
    rows = grad.reshape(-1, grad.shape[-1]).astype(np.float32)
    limit = active_num if (drop_pad_mode == 0 and active_num > 0) else rows.shape[0]
    index = idx.reshape(-1, top_k).T
    skipped = (index < 0) | (index >= limit)
    values = rows[np.where(skipped, 0, index)]
    values[skipped] = 0.0
    return values


def tree_sum(tree, values):
    """The float32 sum of ``values[t]`` in ``tree``'s order (operands left to right); no recursion, so
    a chain of a thousand slots is fine."""
    stack, results = [(tree, False)], []
    while stack:
        node, operands_done = stack.pop()
        if isinstance(node, int):
            results.append(values[node])
        elif operands_done:
            operands = results[len(results) - len(node):]
            del results[len(results) - len(node):]
            total = operands[0]
            for operand in operands[1:]:
                total = np.add(total, operand, dtype=np.float32)
            results.append(total)
        else:
            stack.append((node, True))
            stack.extend((operand, False) for operand in reversed(node))
    return results[0]


def tree_candidate(tree):
    """A NumPy candidate that sums in ``tree``'s order (float32 adds, one rounding to the dtype)."""

    def candidate(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
        values = slot_values(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num)
        return tree_sum(tree, values).astype(grad_expanded_x.dtype)

    return candidate


def random_tree_per_call(seed: int = 0):
    """A candidate with a new random tree at every call (the same for every row of one call)."""
    rng = np.random.default_rng(seed)

    def candidate(grad_expanded_x, expanded_row_idx, top_k, **attributes):
        return tree_candidate(random_tree(top_k, rng))(grad_expanded_x, expanded_row_idx, top_k, **attributes)

    return candidate


def shuffled_rows(seed: int = 0):
    """A candidate adding each token's slots one by one in a random order of its own, new every call."""
    rng = np.random.default_rng(seed)

    def candidate(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
        values = slot_values(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num)
        order = rng.permuted(np.tile(np.arange(top_k), (values.shape[1], 1)), axis=1)  # [N, K]
        tokens = np.arange(values.shape[1])
        total = values[order[:, 0], tokens]
        for t in range(1, top_k):
            total = np.add(total, values[order[:, t], tokens], dtype=np.float32)
        return total.astype(grad_expanded_x.dtype)

    return candidate


def sorted_by_magnitude(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """Adds each element's slots from the smallest magnitude up: an order that depends on the values."""
    values = slot_values(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num)
    values = np.take_along_axis(values, np.argsort(np.abs(values), axis=0, kind="stable"), axis=0)
    return tree_sum(chain_tree(top_k), values).astype(grad_expanded_x.dtype)


def float64_sum(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """Accumulates in float64 slot after slot, then rounds once to the dtype."""
    values = slot_values(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num).astype(np.float64)
    total = values[0]
    for t in range(1, top_k):
        total = total + values[t]
    return total.astype(grad_expanded_x.dtype)


def row_order(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
    """A scatter over the rows of grad_expanded_x in row order (float32 adds from +0.0): the order of
    a token's slots follows the rows the index gives them."""
    rows = grad_expanded_x.reshape(-1, grad_expanded_x.shape[-1]).astype(np.float32)
    limit = active_num if (drop_pad_mode == 0 and active_num > 0) else rows.shape[0]
    token_of_row = np.full(rows.shape[0], -1)
    valid = (expanded_row_idx >= 0) & (expanded_row_idx < limit)
    token_of_row[expanded_row_idx[valid]] = np.flatnonzero(valid) // top_k
    out = np.zeros((len(expanded_row_idx) // top_k, rows.shape[1]), np.float32)
    for row in np.flatnonzero(token_of_row >= 0):
        out[token_of_row[row]] = np.add(out[token_of_row[row]], rows[row], dtype=np.float32)
    return out.astype(grad_expanded_x.dtype)


def faulty(kind: str, token: int, slot: int, tree=None):
    """A candidate correct but for one slot of one token: ``"drop"`` (left out), ``"duplicate"``
    (added twice), ``"neighbour"`` (reads the next row of grad_expanded_x, or the previous one at
    the end). Sums in ``tree``'s order (default: the chain)."""
    assert kind in ("drop", "duplicate", "neighbour")

    def candidate(grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
        values = slot_values(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num)
        if kind == "drop":
            values[slot, token] = 0.0
        elif kind == "neighbour":
            rows = grad_expanded_x.reshape(-1, grad_expanded_x.shape[-1])
            row = int(expanded_row_idx[token * top_k + slot])
            values[slot, token] = rows[row + 1 if row + 1 < rows.shape[0] else row - 1].astype(np.float32)
        total = tree_sum(tree if tree is not None else chain_tree(top_k), values)
        if kind == "duplicate":
            total[token] = np.add(total[token], values[slot, token], dtype=np.float32)
        return total.astype(grad_expanded_x.dtype)

    return candidate
