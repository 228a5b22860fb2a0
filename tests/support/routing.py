"""Forward-routing input generator for tests: what aclnnMoeInitRoutingV2 hands its backward.

The forward routing takes each token's K expert choices ``expert_ids`` [N, K], sorts the N*K slots
by expert id with a *stable* sort (so slots of one expert stay in token order), and records for slot
``i*K + t`` where it landed: ``expanded_row_idx[i*K + t]`` is that slot's row in the expanded,
expert-sorted tensor. The backward reads gradExpandedX at those rows (docs/operator.md).

- dropless (drop_pad_mode=0, active_num=0): the row is the slot's position p in the sorted order;
  expanded_row_idx is a permutation of [0, N*K) and gradExpandedX is [N*K, H].
- active (drop_pad_mode=0, active_num=A): the same index, but only the first A sorted rows exist;
  gradExpandedX is [A, H] and an index >= A is a row the forward never materialised.
- drop/pad (drop_pad_mode=1, capacity C): expert e keeps its first C slots (in the stable order) at
  rows e*C + r, r < C; later slots are dropped and get -1. gradExpandedX is [E, C, H].

Usage::

    from support import routing
    r = routing.route(np.random.default_rng(0), tokens=5, top_k=3, experts=8, mode="drop_pad", capacity=2)
    grad = rng.standard_normal(r.grad_shape(hidden=4)).astype(np.float32)
    moe_init_routing_v2_grad(grad, **r.kwargs())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["Routing", "drop_pad_index", "dropless_index", "expert_choices", "route"]

Mode = Literal["dropless", "active", "drop_pad"]


def expert_choices(rng: np.random.Generator, tokens: int, top_k: int, experts: int) -> np.ndarray:
    """Each token's K distinct experts, in the token's own (score) order: [tokens, top_k] int32."""
    if not 0 < top_k <= experts:
        raise ValueError(f"need 0 < top_k={top_k} <= experts={experts}")
    keys = rng.random((tokens, experts))
    return np.argsort(keys, axis=1)[:, :top_k].astype(np.int32)


def _sorted_positions(expert_ids: np.ndarray) -> np.ndarray:
    """position[s] = where flat slot s lands in the stable sort of the flat expert ids."""
    flat = expert_ids.reshape(-1)
    order = np.argsort(flat, kind="stable")  # order[p] = the slot at sorted position p
    position = np.empty(flat.size, dtype=np.int64)
    position[order] = np.arange(flat.size)
    return position


def dropless_index(expert_ids: np.ndarray) -> np.ndarray:
    """expanded_row_idx [N*K] int32 of a dropless (and active) forward routing."""
    return _sorted_positions(expert_ids).astype(np.int32)


def drop_pad_index(expert_ids: np.ndarray, experts: int, capacity: int) -> np.ndarray:
    """expanded_row_idx [N*K] int32 of a drop/pad forward routing: row e*C + r, or -1 once r >= C."""
    flat = expert_ids.reshape(-1).astype(np.int64)
    position = _sorted_positions(expert_ids)
    first = np.searchsorted(np.sort(flat), np.arange(experts))  # the first sorted position of each expert
    rank = position - first[flat]  # the slot's rank within its expert (token order)
    return np.where(rank < capacity, flat * capacity + rank, -1).astype(np.int32)


@dataclass(frozen=True)
class Routing:
    """One routed batch: the index and attributes to call the backward with, and the grad's row shape.

    Attributes:
        expert_ids: [N, K] int32, each token's experts.
        expanded_row_idx: [N*K] int32.
        top_k: K.
        drop_pad_mode: 0 or 1.
        active_num: A (0 unless mode is "active").
        rows: gradExpandedX's shape without H: (N*K,), (A,) or (E, C).
    """

    expert_ids: np.ndarray
    expanded_row_idx: np.ndarray
    top_k: int
    drop_pad_mode: int
    active_num: int
    rows: tuple[int, ...]

    def grad_shape(self, hidden: int) -> tuple[int, ...]:
        """The shape gradExpandedX must have for hidden size H = ``hidden``."""
        return (*self.rows, hidden)

    def kwargs(self) -> dict[str, object]:
        """expanded_row_idx, top_k, drop_pad_mode, active_num as keyword arguments."""
        return {
            "expanded_row_idx": self.expanded_row_idx,
            "top_k": self.top_k,
            "drop_pad_mode": self.drop_pad_mode,
            "active_num": self.active_num,
        }


def route(
    rng: np.random.Generator,
    tokens: int,
    top_k: int,
    experts: int,
    mode: Mode = "dropless",
    *,
    active_num: int | None = None,
    capacity: int | None = None,
) -> Routing:
    """Route ``tokens`` random tokens to ``top_k`` of ``experts`` experts each.

    Args:
        mode: "dropless", "active" (``active_num`` rows kept, default about half of N*K, at least 1)
            or "drop_pad" (``capacity`` rows per expert, default about half of the mean load).
    """
    expert_ids = expert_choices(rng, tokens, top_k, experts)
    slots = tokens * top_k
    if mode == "dropless":
        return Routing(expert_ids, dropless_index(expert_ids), top_k, 0, 0, (slots,))
    if mode == "active":
        active = max(1, slots // 2) if active_num is None else active_num
        return Routing(expert_ids, dropless_index(expert_ids), top_k, 0, active, (active,))
    if mode == "drop_pad":
        cap = max(1, slots // (2 * experts)) if capacity is None else capacity
        return Routing(expert_ids, drop_pad_index(expert_ids, experts, cap), top_k, 1, 0, (experts, cap))
    raise ValueError(f"mode={mode!r} is not dropless, active or drop_pad")
