"""The workloads: S1 (the documentation's example), S2 (32 MiB in) and SL (DeepSeek-V3's layer, 448 MiB in),
each with its expected grad_x, and the bitwise checks every reply goes through."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from support.docexample import DOC_GRAD, DOC_IDX, DOC_RESULT, DOC_TOP_K

__all__ = ["PAYLOADS", "Payload", "check", "s1", "s2", "same_bits", "sl"]


@dataclass(frozen=True)
class Payload:
    """One call and its expected grad_x (computed here, independently of moegrad)."""

    name: str
    grad_expanded_x: np.ndarray
    expanded_row_idx: np.ndarray
    top_k: int
    expected: np.ndarray

    @property
    def request_bytes(self) -> int:
        return self.grad_expanded_x.nbytes + self.expanded_row_idx.nbytes

    @property
    def reply_bytes(self) -> int:
        return self.expected.nbytes


def s1() -> Payload:
    """The documentation's example (support.docexample); its result per docs/operator.md (float32: 0.3, 0.70000005)."""
    return Payload("S1", DOC_GRAD, DOC_IDX, DOC_TOP_K, DOC_RESULT)


def s2() -> Payload:
    """N=1024, K=2, H=4096 float32 dropless: a random permutation of the 2048 rows (32 MiB in)."""
    rng = np.random.default_rng(7)
    grad = rng.standard_normal((2048, 4096), dtype=np.float32)
    idx = rng.permutation(2048).astype(np.int32)
    expected = grad[idx[0::2]] + grad[idx[1::2]]  # K=2: one float32 add per element, v0 + v1
    return Payload("S2", grad, idx, 2, expected)


def sl() -> Payload:
    """DeepSeek-V3's layer: N=4096, K=8, H=7168 bfloat16 dropless (448 MiB in, 56 MiB out).

    The expected grad_x is the in-process emulation's (``moegrad.moe_init_routing_v2_grad``): for
    K=8 the order of adds matters, and the bench compares every path's bits against it.
    """
    import ml_dtypes

    import moegrad

    rng = np.random.default_rng(11)
    rows = 4096 * 8
    grad = np.empty((rows, 7168), dtype=ml_dtypes.bfloat16)
    for start in range(0, rows, 4096):  # in blocks: a float32 array of the whole would be 896 MiB more
        grad[start:start + 4096] = rng.standard_normal((4096, 7168), dtype=np.float32).astype(ml_dtypes.bfloat16)
    idx = rng.permutation(rows).astype(np.int32)
    expected = moegrad.moe_init_routing_v2_grad(grad, idx, 8)
    return Payload("SL", grad, idx, 8, expected)


PAYLOADS: dict[str, Callable[[], Payload]] = {"s1": s1, "s2": s2}


def check(result: np.ndarray, payload: Payload, where: str) -> None:
    if result.dtype != payload.expected.dtype or not np.array_equal(result.view(np.uint32),
                                                                    payload.expected.view(np.uint32)):
        raise AssertionError(f"{where}: the {payload.name} reply differs from the expected result")


def same_bits(result: np.ndarray, payload: Payload, where: str) -> None:
    if result.dtype != payload.expected.dtype or result.shape != payload.expected.shape or not np.array_equal(
            result.view(np.uint16 if result.dtype.itemsize == 2 else np.uint32),
            payload.expected.view(np.uint16 if result.dtype.itemsize == 2 else np.uint32)):
        raise AssertionError(f"{where}: the {payload.name} reply differs from the in-process result")
