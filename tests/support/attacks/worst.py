"""The worst shapes for memory: requests whose answering holds many times their body.

Each builder returns ``(path, media type, body)`` and the peak it is built for, in bytes, from the
rules docs/operations.md ("Memory a request holds") states, written out here by hand rather than
taken from the service (moegrad_service.memory.peaks is what they check):

- a comparison holds 3 x 33 float64 per-row statistics for every token (792 bytes), whatever H;
- a call holds its grad_x [N, H], which for a drop/pad call whose tokens are all dropped is many
  times its body (the index is N x K, grad_expanded_x one row);
- a batch item holds its decoded map, call and reply map (2 KiB), a compare item its report (32 KiB);
- a v2 JSON body holds 24 times its bytes while it is parsed;
- an explanation holds the device's grad_x and what ``moegrad.explain_peak_bytes(call,
  device_result=True, reply=True)`` bounds (docs/accuracy.md gives its formula; its own bound is
  proven by tests/unit/accuracy/test_explain.py): a few KiB for every row that differs, whatever H.
"""

from __future__ import annotations

import json

import msgpack
import numpy as np

import moegrad

__all__ = [
    "COMPARE_PATH",
    "JUDGE_ROW_BYTES",
    "SHAPES",
    "batch_tiny_calls",
    "batch_tiny_compares",
    "compare_all_skipped",
    "compare_small_h",
    "explain_every_row",
    "grad_all_dropped",
    "v2_json",
]

GRAD_PATH = "/v1/moe_init_routing_v2_grad"
COMPARE_PATH = "/v1/moe_init_routing_v2_grad/compare"
BATCH_PATH = "/v1/moe_init_routing_v2_grad/batch"
INFER_PATH = "/v2/models/moe_init_routing_v2_grad/infer"
EXPLAIN_PATH = "/v1/moe_init_routing_v2_grad/explain"
MSGPACK = "application/msgpack"
#: docs/operations.md: the judge's per-row statistics, 3 comparisons x 33 float64.
JUDGE_ROW_BYTES = 3 * 33 * 8
REPORT_BYTES = 32 << 10
BATCH_ITEM_BYTES = 2 << 10
JSON_HOLD_PER_BYTE = 24

Built = tuple[str, str, bytes, int]  # path, media type, body, the peak it holds by the rules above


def _tensor(array: np.ndarray) -> dict:
    return {"dtype": str(array.dtype), "shape": list(array.shape), "data": array.tobytes()}


def _pack(document: object) -> bytes:
    return msgpack.packb(document, use_bin_type=True)


def compare_small_h(peak_bytes: int) -> Built:
    """A dropless compare with H = 1, K = 1: 12 bytes of body a token, 792 + 4 held by the judge."""
    tokens = max(1, peak_bytes // (JUDGE_ROW_BYTES + 16))
    grad = np.ones((tokens, 1), np.float32)
    body = _pack({"grad_expanded_x": _tensor(grad), "expanded_row_idx": _tensor(np.arange(tokens, dtype=np.int32)),
                  "top_k": 1, "drop_pad_mode": 0, "active_num": 0, "candidate": _tensor(grad)})
    return COMPARE_PATH, MSGPACK, body, len(body) + tokens * (JUDGE_ROW_BYTES + 4) + REPORT_BYTES


def compare_all_skipped(peak_bytes: int, hidden: int = 64) -> Built:
    """A drop/pad compare whose every token is dropped (every row must be +0.0), H = ``hidden``."""
    per_token = 2 * 4 * hidden + 4 + JUDGE_ROW_BYTES  # candidate and grad_x rows, the index, the judge's
    tokens = max(1, peak_bytes // per_token)
    body = _pack({"grad_expanded_x": _tensor(np.ones((1, 1, hidden), np.float32)),
                  "expanded_row_idx": _tensor(np.full(tokens, -1, np.int32)), "top_k": 1, "drop_pad_mode": 1,
                  "active_num": 0, "candidate": _tensor(np.zeros((tokens, hidden), np.float32))})
    return COMPARE_PATH, MSGPACK, body, len(body) + tokens * (4 * hidden + JUDGE_ROW_BYTES) + REPORT_BYTES


def grad_all_dropped(peak_bytes: int, hidden: int = 64) -> Built:
    """A drop/pad call whose every token is dropped: 4 bytes of index a token, a grad_x row of 4 x H."""
    tokens = max(1, peak_bytes // (4 * hidden + 4))
    body = _pack({"grad_expanded_x": _tensor(np.ones((1, 1, hidden), np.float32)),
                  "expanded_row_idx": _tensor(np.full(tokens, -1, np.int32)), "top_k": 1, "drop_pad_mode": 1,
                  "active_num": 0})
    return GRAD_PATH, MSGPACK, body, len(body) + tokens * 4 * hidden


def _doc_item(**more: object) -> dict:
    grad = np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]], np.float32)
    return {"grad_expanded_x": _tensor(grad), "expanded_row_idx": _tensor(np.array([2, 0, 1, 3], np.int32)),
            "top_k": 2, "drop_pad_mode": 0, "active_num": 0, **more}


def batch_tiny_compares(peak_bytes: int) -> Built:
    """A batch of the documentation's example as compare items: a report each."""
    items = max(1, min(10_000, peak_bytes // (REPORT_BYTES + BATCH_ITEM_BYTES)))
    body = _pack([_doc_item(op="compare", candidate=_tensor(np.zeros((2, 2), np.float32)))] * items)
    return BATCH_PATH, MSGPACK, body, len(body) + items * (REPORT_BYTES + BATCH_ITEM_BYTES)


def batch_tiny_calls(peak_bytes: int) -> Built:
    """A batch of the documentation's example, up to 10,000 of them (the most a batch takes)."""
    items = max(1, min(10_000, peak_bytes // BATCH_ITEM_BYTES))
    body = _pack([_doc_item()] * items)
    return BATCH_PATH, MSGPACK, body, len(body) + items * BATCH_ITEM_BYTES


def v2_json(peak_bytes: int) -> Built:
    """A v2 JSON call whose numbers are written short ("1.0"), 16 tokens a row of 4."""
    tokens = max(1, peak_bytes // JSON_HOLD_PER_BYTE // 20)
    document = {"inputs": [
        {"name": "grad_expanded_x", "shape": [tokens, 4], "datatype": "FP32", "data": [1.0] * (4 * tokens)},
        {"name": "expanded_row_idx", "shape": [tokens], "datatype": "INT32", "data": list(range(tokens))}],
        "parameters": {"top_k": 1}}
    body = json.dumps(document, separators=(",", ":")).encode()
    return INFER_PATH, "application/json", body, len(body) * JSON_HOLD_PER_BYTE


def _explained(tokens: int) -> tuple[bytes, int]:
    """An explain body of ``tokens`` tokens, H = 1, K = 1, the candidate one ULP off every row (each
    row differs, none is explained by an order), and what it holds by the rules above."""
    grad = np.random.default_rng(tokens).standard_normal((tokens, 1)).astype(np.float32)
    index = np.arange(tokens, dtype=np.int32)
    candidate = (grad.view(np.uint32) ^ 1).view(np.float32)  # dropless, K = 1: grad_x is grad_expanded_x
    body = _pack({"grad_expanded_x": _tensor(grad), "expanded_row_idx": _tensor(index), "top_k": 1,
                  "drop_pad_mode": 0, "active_num": 0, "candidate": _tensor(candidate)})
    call = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=index, top_k=1)
    inputs = 3 * 4 * tokens  # grad_expanded_x, the index and the candidate, copied out up to 64 KiB
    copies = inputs if inputs <= 64 << 10 else 0
    return body, len(body) + copies + 4 * tokens + moegrad.explain_peak_bytes(call, device_result=True, reply=True)


def explain_every_row(peak_bytes: int) -> Built:
    """An explanation of H = 1 whose every row differs: 12 bytes of body a token, each row's result
    (its slots, its worst elements, then its reply map and encoding) held besides a fixed working
    set; the fewest tokens (one) where ``peak_bytes`` is below that set."""
    _, one = _explained(1)
    _, two = _explained(2)
    tokens = max(1, 1 + (peak_bytes - one) // (two - one))
    body, held = _explained(tokens)
    return EXPLAIN_PATH, MSGPACK, body, held


#: name -> builder of a body of the given peak: the worst shapes, each checked against a budget.
SHAPES = {
    "compare, H = 1": compare_small_h,
    "compare, every token dropped": compare_all_skipped,
    "grad, every token dropped": grad_all_dropped,
    "batch of tiny compares": batch_tiny_compares,
    "batch of 10,000 tiny calls": batch_tiny_calls,
    "v2 JSON, short numbers": v2_json,
    "explain, every row differing": explain_every_row,
}
