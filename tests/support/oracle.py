"""An independent float64 oracle for the accuracy tests: the figures the standards judge, from their definitions.

Written from docs/accuracy.md alone (never from ``moegrad.accuracy``): the golden is the float64 sum
of each output's summands (exact to float64 rounding for the few summands these tests use), the
scale is the sum of the summands' magnitudes, and each standard's float32 thresholds are the
numbers docs/accuracy.md lists. ``device_k2`` is the device's result for K <= 2, which the
operator's documented order fixes (docs/semantics.md: one float32 add from +0.0, rounded once).
Tests that take expected values from here are *oracles*; tests that compare a reply with
``moegrad.compare`` of the same inputs check transport and serialisation only.
"""

from __future__ import annotations

import numpy as np

# docs/accuracy.md, float32 rows of the tables ("Small values" and "Standards").
SMALL_VALUE = 2.0**-20
THRESHOLD_T = 2.0**-13
ACCUMULATIVE_BOUND = 2.0**-11


def summands(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=0, active_num=0) -> np.ndarray:
    """[N, K, H] float64: each output's summands, 0.0 for a skipped slot."""
    hidden = grad_expanded_x.shape[-1]
    rows = np.asarray(grad_expanded_x).reshape(-1, hidden).astype(np.float64)
    index = np.asarray(expanded_row_idx).reshape(-1, top_k)
    if drop_pad_mode == 1:
        skipped = index < 0
    elif active_num > 0:
        skipped = index >= active_num
    else:
        skipped = np.zeros(index.shape, dtype=bool)
    return np.where(skipped[..., None], 0.0, rows[np.where(skipped, 0, index)])


def golden_and_scale(call) -> tuple[np.ndarray, np.ndarray]:
    """The float64 golden [N, H] and the scale of relative errors (sum of |summands|) [N, H]."""
    parts = summands(call.grad_expanded_x, call.expanded_row_idx, call.top_k, call.drop_pad_mode, call.active_num)
    return parts.sum(axis=1), np.abs(parts).sum(axis=1)


def device_k2(call) -> np.ndarray:
    """The device's grad_x for K <= 2: the float32 sum from +0.0 in slot order, rounded once to the call's dtype."""
    assert call.top_k <= 2
    parts = summands(call.grad_expanded_x, call.expanded_row_idx, call.top_k, call.drop_pad_mode, call.active_num)
    total = np.full(parts[:, 0].shape, 0.0, dtype=np.float32)
    for t in range(call.top_k):
        total = total + parts[:, t].astype(np.float32)  # each summand is a widened input: exact in float32
    return total.astype(call.grad_expanded_x.dtype)


def figures(actual: np.ndarray, golden: np.ndarray, scale: np.ndarray) -> dict[str, float]:
    """The float32 figures of ``actual`` against ``golden`` (finite data; docs/accuracy.md, "Metrics")."""
    a = actual.astype(np.float64)
    err = np.abs(a - golden)
    normal = scale >= SMALL_VALUE
    rel = err[normal] / scale[normal]
    within = err / np.maximum(scale, SMALL_VALUE)
    return {
        "max_abs_error": float(err.max()),
        "rmse": float(np.sqrt(np.mean((a - golden) ** 2))),
        "mean_relative_error": float(rel.mean()),
        "max_relative_error": float(rel.max()),
        "max_accumulative_error": float((err / np.maximum(scale, 1.0)).max()),
        "thousandth_share": float(np.mean(within <= 1e-3)),
        "ten_thousandth_share": float(np.mean(within <= 1e-4)),
        "error_imbalance": _imbalance(a, golden),
    }


def _imbalance(a: np.ndarray, e: np.ndarray) -> float:
    """max(|#up - #down|, |#away - #toward|) / #nonzero errors; NaN with fewer than 64 (not assessed)."""
    up, down = np.count_nonzero(a > e), np.count_nonzero(a < e)
    away, toward = np.count_nonzero(np.abs(a) > np.abs(e)), np.count_nonzero(np.abs(a) < np.abs(e))
    nonzero = up + down
    return max(abs(up - down), abs(away - toward)) / nonzero if nonzero >= 64 else float("nan")


def float32_statuses(candidate: np.ndarray, device: np.ndarray, golden: np.ndarray,
                     scale: np.ndarray) -> dict[str, str]:
    """Each standard's status for a float32 candidate with no NaN/Inf, no skipped rows and no small
    values (scale >= 2^-20 everywhere, so the benchmark's small-value criterion is not assessed)."""
    c, d = figures(candidate, golden, scale), figures(device, golden, scale)
    mismatches = int(np.count_nonzero(candidate.view(np.uint32) != device.view(np.uint32)))

    def ratio(name: str) -> float:
        return 0.0 if c[name] == 0 else (np.inf if d[name] == 0 else c[name] / d[name])

    if c["thousandth_share"] <= 0.999:
        dual = "fail"
    else:
        dual = "pass" if c["ten_thousandth_share"] > 0.9999 else "warning"
    excess = c["error_imbalance"] - (0.0 if np.isnan(d["error_imbalance"]) else d["error_imbalance"])
    benchmark_ok = (ratio("rmse") <= 2 and ratio("mean_relative_error") <= 2 and ratio("max_relative_error") <= 10
                    and not excess > 0.5)
    return {
        "bitwise": "pass" if mismatches == 0 else "fail",
        "dual_thousandth": dual,
        "threshold": "pass" if c["mean_relative_error"] < THRESHOLD_T and c["max_relative_error"] < 10 * THRESHOLD_T
        else "fail",
        "benchmark": "pass" if benchmark_ok else "fail",
        "accumulative": "pass" if c["max_accumulative_error"] <= ACCUMULATIVE_BOUND else "fail",
    }


ALL_STANDARDS = ["bitwise", "dual_thousandth", "threshold", "benchmark", "accumulative"]
ORACLE_CASES = ("device", "one_ulp_noise", "scaled_up", "one_gross_element")


def oracle_call(seed: int = 0, tokens: int = 32, hidden: int = 16):
    """A float32 dropless call with K=2 whose summands have magnitudes in [0.25, 1) and random signs:
    every scale is >= 0.5 (no small values), and the device's result is :func:`device_k2`."""
    import moegrad  # the call object only; nothing of moegrad.accuracy

    rng = np.random.default_rng(seed)
    slots = tokens * 2
    values = rng.uniform(0.25, 1.0, (slots, hidden)) * rng.choice([-1.0, 1.0], (slots, hidden))
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=values.astype(np.float32),
                                            expanded_row_idx=rng.permutation(slots).astype(np.int32), top_k=2)


def oracle_candidate(case: str, device: np.ndarray, seed: int = 1) -> np.ndarray:
    """A float32 candidate: the device itself, 1-ULP noise on a quarter of the elements, every value
    scaled by 1 + 2^-12, or one element off by 1.0."""
    rng = np.random.default_rng(seed)
    if case == "device":
        return device.copy()
    if case == "one_ulp_noise":
        steps = rng.choice([-1, 0, 0, 0, 0, 0, 0, 1], device.shape).astype(np.int64)
        return (device.view(np.uint32).astype(np.int64) + steps * np.sign(device).astype(np.int64)
                ).astype(np.uint32).view(np.float32)
    if case == "scaled_up":
        return (device.astype(np.float64) * (1 + 2.0**-12)).astype(np.float32)
    if case == "one_gross_element":
        candidate = device.copy()
        candidate[5, 3] += np.float32(1.0)
        return candidate
    raise ValueError(case)
