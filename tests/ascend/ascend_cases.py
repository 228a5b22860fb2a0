"""Calls for the ascend tests: every mode, dtype and K that the reference tests cover, and a bitwise comparison.

The expected values always come from :func:`moegrad.moe_init_routing_v2_grad` (NumPy, independent of
the simulator's C code), from :func:`sum_in_950_order` (a per-row loop written from the 950 kernel's
rule) or from numbers worked out by hand in the test itself.
"""

from __future__ import annotations

import numpy as np

import moegrad

MODES = ("dropless", "active", "drop_pad")
DTYPE_NAMES = ("float16", "bfloat16", "float32")
K_VALUES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 127, 128, 129, 130, 256)


def values(rng: np.random.Generator, shape: tuple[int, ...], dtype_name: str) -> np.ndarray:
    """Random values over six decades of magnitude (both signs), in ``dtype_name``."""
    magnitude = 10.0 ** rng.integers(-3, 3, size=shape)
    return (rng.standard_normal(shape) * magnitude).astype(np.float32).astype(moegrad.DTYPES[dtype_name])


def make_call(mode: str, dtype_name: str, top_k: int, *, tokens: int = 3, hidden: int = 5,
              seed: int = 0) -> moegrad.MoeInitRoutingV2GradCall:
    """A valid call: dropless [N*K, H]; active [A, H] with A < N*K (some slots skipped);
    drop/pad [E, C, H] with about a quarter of the slots dropped (-1)."""
    rng = np.random.default_rng(seed * 1000 + top_k)
    slots = tokens * top_k
    if mode == "dropless":
        grad = values(rng, (slots, hidden), dtype_name)
        idx = rng.permutation(slots)
        return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=idx.astype(np.int32),
                                                top_k=top_k)
    if mode == "active":
        active = max(1, (2 * slots) // 3)
        grad = values(rng, (active, hidden), dtype_name)
        idx = rng.permutation(slots)  # indices >= active are skipped
        return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=idx.astype(np.int32),
                                                top_k=top_k, active_num=active)
    experts = 4
    capacity = -(-slots // experts) + 1
    grad = values(rng, (experts, capacity, hidden), dtype_name)
    idx = rng.choice(experts * capacity, size=slots, replace=False)
    idx[rng.random(slots) < 0.25] = -1
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=idx.astype(np.int32),
                                            top_k=top_k, drop_pad_mode=1)


def assert_bitwise(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same shape, dtype and bits; NaNs must sit in the same places (their payload is not specified)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, actual.dtype)
    width = {2: np.uint16, 4: np.uint32}[actual.dtype.itemsize]
    nan_actual = np.isnan(actual.astype(np.float32))
    nan_expected = np.isnan(expected.astype(np.float32))
    assert (nan_actual == nan_expected).all(), "NaNs in different places"
    bits_actual, bits_expected = actual.view(width), expected.view(width)
    differ = (bits_actual != bits_expected) & ~nan_expected
    if differ.any():
        where = tuple(int(i) for i in np.argwhere(differ)[0])
        raise AssertionError(f"{int(differ.sum())} of {actual.size} elements differ; first at {where}: "
                             f"{actual[where]!r} (0x{int(bits_actual[where]):x}) != "
                             f"{expected[where]!r} (0x{int(bits_expected[where]):x})")


def sum_in_950_order(call: moegrad.MoeInitRoutingV2GradCall, release: str = "9.1") -> np.ndarray:
    """grad_x by the Ascend 950 kernel's rule at CANN ``release``, one token at a time.

    Written from the arch35 kernel as docs/semantics.md (section 7) and the profile table describe
    it, for a K that fits in one chunk, not from moegrad's code: a float32 accumulator from +0.0;
    from 9.0 groups of four rows added as s += ((x0 + x1) + (x2 + x3)) and the leftover rows as
    s += x, at 8.5 every row as s += x; an invalid slot's row is +0.0, added in its place (drop/pad:
    a negative index; active: an index >= A; from 9.1 also any negative index and a dropless index
    >= N*K); one rounding (to nearest, ties to even) to the output dtype. fp16 / bf16 rows are
    widened to float32 exactly.
    """
    grad = np.asarray(call.grad_expanded_x)
    rows = grad.reshape(-1, grad.shape[-1]).astype(np.float32)
    idx, k = np.asarray(call.expanded_row_idx), call.top_k
    dropless = call.drop_pad_mode == 0 and call.active_num == 0
    out = np.empty((idx.size // k, rows.shape[1]), np.float32)
    for i in range(out.shape[0]):
        xs = []
        for slot in idx[i * k:(i + 1) * k]:
            invalid = slot < 0 if call.drop_pad_mode == 1 else 0 < call.active_num <= slot
            if release == "9.1":
                invalid = invalid or slot < 0 or (dropless and slot >= idx.size)
            xs.append(np.zeros(rows.shape[1], np.float32) if invalid else rows[slot])
        s, t = np.zeros(rows.shape[1], np.float32), 0
        while release != "8.5" and k - t >= 4:
            s = s + ((xs[t] + xs[t + 1]) + (xs[t + 2] + xs[t + 3]))
            t += 4
        while t < k:
            s = s + xs[t]
            t += 1
        out[i] = s
    return out.astype(grad.dtype)
