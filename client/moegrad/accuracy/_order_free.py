"""Order-free inputs: calls whose every order of adds gives the golden's bits, so any mismatch is a fault.

The idea is RepDL's correctness test (microsoft/RepDL ``tools/LinearOpCorrectness/README.md`` @
6562ec6b4b731f9e757eb56863d0561f28c3eeb5): values on a grid sum exactly in any order. Here each
output element (token i, column h) gets its own grid step q = 2**e, and each of its K slots holds
``m * q`` with m a nonzero integer, ``|m| <= cap``, ``cap = 2**(p - 1 - ceil(log2 K))`` where p is the
dtype's significand (24 float32, 11 float16, 8 bfloat16). Then:

- every partial sum of the element, in any order, is a multiple of q below ``2**(p - 1) * q`` in
  magnitude: exact in float32 (p <= 24), so every order of float32 adds gives the exact sum;
- the exact sum has at most p significant bits: it is exact in the output dtype, so the final cast
  changes nothing and the result equals the float64 golden cast to the dtype;
- a slot missing or counted twice changes the element by ``±m * q``, and the changed sum (below
  ``2**p * q``) is exact too, so such a fault always shows, in every column; a slot that reads
  another row shows wherever that row's value differs from the right one.

Magnitudes spread two ways: within an element from q to ``cap * q`` (23 - ceil(log2 K) binades in
float32, 10 - ceil(log2 K) in float16, 7 - ceil(log2 K) in bfloat16), and across elements over the
dtype's whole normal range (q from its smallest normal up to ``2**(emax - p)``). Skipped slots (a
drop/pad -1, an active index >= A) add nothing in any order, and rows no slot reads hold values of
the same kind. Limits: K <= 2**(p - 1), i.e. 8388608 (float32), 1024 (float16), 128 (bfloat16).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from moegrad._dtypes import DTYPES, dtype_name
from moegrad.numerics._routing import moe_init_routing_v2
from moegrad.operator._call import GRAD_DTYPES, MoeInitRoutingV2GradCall
from moegrad.operator._profiles import DEFAULT_PROFILE

__all__ = ["ORDER_FREE_LIMITS", "order_free_inputs"]

# (significand bits p, smallest normal exponent, largest finite exponent) of each dtype.
_FORMATS: Mapping[str, tuple[int, int, int]] = {
    "float32": (24, -126, 127),
    "float16": (11, -14, 15),
    "bfloat16": (8, -126, 127),
}
#: The largest K of an order-free call, per dtype: ``2**(p - 1)``, p the significand's bits.
ORDER_FREE_LIMITS: Mapping[str, int] = {name: 2 ** (bits - 1) for name, (bits, _, _) in _FORMATS.items()}


def _positive(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def _dtype(dtype: Any) -> str:
    name = dtype if isinstance(dtype, str) else dtype_name(np.dtype(dtype))
    if name not in GRAD_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(GRAD_DTYPES)}")
    return name


def _cap(top_k: int, name: str) -> int:
    """The largest |m| of an element's K slots (module docstring)."""
    bits = _FORMATS[name][0]
    if top_k > ORDER_FREE_LIMITS[name]:
        raise ValueError(
            f"top_k={top_k}: order-free {name} inputs reach K <= {ORDER_FREE_LIMITS[name]} (the sum of K nonzero "
            f"multiples of the grid step must keep to {name}'s {bits} significant bits); use float32 "
            f"(K <= {ORDER_FREE_LIMITS['float32']}) or a smaller K"
        )
    return 2 ** (bits - 1 - math.ceil(math.log2(top_k)))


def _multiples(rng: np.random.Generator, shape: tuple[int, ...], cap: int) -> np.ndarray:
    """Nonzero integers in [-cap, cap], both signs, magnitudes spread evenly over the binades of [1, cap]."""
    binade = rng.integers(0, cap.bit_length(), shape)  # m in [2**b, 2**(b+1)), clipped to cap
    low = np.left_shift(1, binade)
    magnitude = np.minimum(low + rng.integers(0, low), cap)
    return magnitude * rng.choice(np.array([-1, 1]), shape)


def _index(
    rng: np.random.Generator, tokens: int, top_k: int, mode: int, active: int, experts: int, capacity: int
) -> np.ndarray:
    """expanded_row_idx of a forward routing (aclnnMoeInitRoutingV2) of random expert choices."""
    choices = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]) if tokens else np.zeros((0, top_k))
    routed = moe_init_routing_v2(
        np.zeros((tokens, 1), np.float32),
        choices.astype(np.int32),
        active_num=active if mode == 0 else 0,
        expert_capacity=capacity if mode == 1 else 0,
        expert_num=experts,
        drop_pad_mode=mode,
    )
    return np.asarray(routed.expanded_row_idx, np.int32)


def _routing_sizes(tokens: int, top_k: int, mode: int, experts: int | None, capacity: int | None) -> tuple[int, int]:
    """E and C: E defaults to max(8, K) (each token picks K distinct experts), C to a fair share
    ``ceil(N*K / E)`` (so a random routing drops some slots)."""
    count = _positive("expert_num", experts if experts is not None else max(8, top_k))
    if count < top_k:
        raise ValueError(f"expert_num={count} must be >= top_k={top_k}: each token picks top_k distinct experts")
    share = (
        _positive("expert_capacity", capacity) if capacity is not None else max(1, math.ceil(tokens * top_k / count))
    )
    if mode == 1 and share > max(tokens, 1):
        raise ValueError(f"expert_capacity={share} must be <= n={tokens} (aclnnMoeInitRoutingV2: C in (0, N])")
    return count, share


def order_free_inputs(
    n: int,
    top_k: int,
    h: int,
    dtype: Any = "float32",
    *,
    drop_pad_mode: int = 0,
    active_num: int = 0,
    expert_num: int | None = None,
    expert_capacity: int | None = None,
    order: str = DEFAULT_PROFILE,
    seed: int | None = None,
) -> MoeInitRoutingV2GradCall:
    """A valid call whose every order of float32 adds gives the float64 golden's bits (module docstring).

    On these inputs every correct implementation, in any order of adds and on any chip, returns
    ``moe_init_routing_v2_grad_golden(call).astype(dtype)`` bit for bit, so a difference is a fault
    (a slot missed, counted twice or read from the wrong row; a wrong skip rule; a narrow
    accumulator), never rounding.

    Args:
        n: N >= 1 tokens.
        top_k: K, 1 to :data:`ORDER_FREE_LIMITS` [dtype] (8388608 float32, 1024 float16, 128 bfloat16).
        h: H >= 1 columns.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (or the NumPy dtype).
        drop_pad_mode: 0 dropless (``active_num`` 0) or active (``active_num`` = A > 0); 1 drop/pad.
        active_num: A, the rows of grad_expanded_x in active mode; slots routed to rows >= A are skipped.
        expert_num: E, the experts the random routing picks from (each token picks K distinct ones);
            default max(8, K). In drop/pad mode grad_expanded_x is [E, C, H].
        expert_capacity: C, drop/pad mode's rows per expert, 1 to N; default ceil(N*K / E), so that
            a random routing drops some slots (index -1).
        order: the profile whose rules validate the call (the bits do not depend on it).
        seed: the random generator's seed (None: fresh entropy).

    Returns:
        A :class:`~moegrad.MoeInitRoutingV2GradCall`; expanded_row_idx comes from the forward
        routing (:func:`moegrad.moe_init_routing_v2`) of random expert choices.

    Raises:
        ValueError: a size out of range, an unknown dtype, or K beyond the dtype's limit (the
            message gives the limit and why).
    """
    name = _dtype(dtype)
    tokens, top_k, hidden = _positive("n", n), _positive("top_k", top_k), _positive("h", h)
    if drop_pad_mode not in (0, 1):
        raise ValueError(f"drop_pad_mode={drop_pad_mode!r} must be 0 (dropless/active) or 1 (drop/pad)")
    active = _positive("active_num", active_num, 0) if drop_pad_mode == 0 else 0
    cap = _cap(top_k, name)
    experts, capacity = _routing_sizes(tokens, top_k, drop_pad_mode, expert_num, expert_capacity)
    rng = np.random.default_rng(seed)
    index = _index(rng, tokens, top_k, drop_pad_mode, active, experts, capacity)
    rows = experts * capacity if drop_pad_mode == 1 else (active or tokens * top_k)
    bits, lowest, highest = _FORMATS[name]
    exponents = (lowest, highest - bits + 1)  # q = 2**e: normal, and cap * q well inside the range
    values = np.ldexp(_multiples(rng, (rows, hidden), cap).astype(np.float64), rng.integers(*exponents, (rows, hidden)))
    read = (index >= 0) & (index < rows)
    token = np.arange(tokens * top_k) // top_k
    steps = rng.integers(*exponents, (tokens, hidden))
    slot_values = _multiples(rng, (tokens * top_k, hidden), cap).astype(np.float64)
    values[index[read]] = np.ldexp(slot_values[read], steps[token[read]])
    grad = values.astype(DTYPES[name])
    if drop_pad_mode == 1:
        grad = grad.reshape(experts, capacity, hidden)
    return MoeInitRoutingV2GradCall(
        grad_expanded_x=grad,
        expanded_row_idx=index,
        top_k=top_k,
        drop_pad_mode=drop_pad_mode,
        active_num=active,
        order=order,
    )
