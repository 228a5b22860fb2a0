"""Helpers for the protocol v2 over gRPC tests: calls, their independently computed results, the
invalid-input classes with the aclnn codes the operator documentation gives, and tritonclient inputs.

The expected grad_x is ``moegrad.moe_init_routing_v2_grad`` computed in the test process (which
shares nothing with the gRPC path); the documentation's example is checked against its bits.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

import moegrad

from . import routing
from .docexample import DOC_GRAD, DOC_IDX, DOC_RESULT_BITS

MODEL = "moe_init_routing_v2_grad"
MODES = ("dropless", "active", "drop_pad")
DTYPES = (np.float16, ml_dtypes.bfloat16, np.float32)
DATATYPE_NAMES = {np.dtype(np.float16): "FP16", np.dtype(ml_dtypes.bfloat16): "BF16",
                  np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64", np.dtype(np.int32): "INT32",
                  np.dtype(np.int64): "INT64"}
#: The documentation's result as nested lists: 0.2 + 0.1 = 0.3 (0x3E99999A), 0.3 + 0.4 = 0.70000005 (0x3F333334).
DOC_BITS = DOC_RESULT_BITS.tolist()


def routed_call(seed: int, mode: str = "dropless", dtype=np.float32, *, tokens: int = 6, top_k: int = 3,
                hidden: int = 16) -> dict:
    """Keyword arguments of a valid call (support.routing: a real forward routing) in ``mode``."""
    rng = np.random.default_rng(seed)
    r = routing.route(rng, tokens=tokens, top_k=top_k, experts=max(5, top_k + 2), mode=mode)
    grad = rng.standard_normal(r.grad_shape(hidden), dtype=np.float32).astype(dtype)
    return {"grad_expanded_x": grad, **r.kwargs()}


def expected(call: dict, **options) -> np.ndarray:
    return moegrad.moe_init_routing_v2_grad(**call, **options)


def attributes(call: dict) -> dict:
    return {name: call[name] for name in ("top_k", "drop_pad_mode", "active_num") if name in call}


def inputs(client_module, call: dict) -> list:
    """tritonclient InferInputs (``tritonclient.grpc`` or its ``aio``) for the call's tensors present."""
    made = []
    for name in ("grad_expanded_x", "expanded_row_idx"):
        if call.get(name) is None:
            continue
        array = np.asarray(call[name])
        tensor = client_module.InferInput(name, list(array.shape), DATATYPE_NAMES[array.dtype])
        tensor.set_data_from_numpy(array)
        made.append(tensor)
    return made


def _with(**changes) -> Callable[[dict], dict]:
    return lambda call: {**call, **changes}


def _index(values: list[int]) -> Callable[[dict], dict]:
    return lambda call: {**call, "expanded_row_idx": np.array(values, dtype=np.int32)}


#: Invalid calls built from the documentation's example (K = 2) and the aclnn code the operator
#: documentation gives for each (161001 null tensor, 161002 unsupported dtype or value, 561103 an
#: attribute or shape the kernel cannot tile on the default profile, ascend910b@9.1: the CANN 9.1
#: documentation's code; 561002 before 9.1), with the field the message must name.
INVALID = [
    ("no grad_expanded_x", _with(grad_expanded_x=None), 161001, "grad_expanded_x"),
    ("no expanded_row_idx", _with(expanded_row_idx=None), 161001, "expanded_row_idx"),
    ("float64 grad", _with(grad_expanded_x=DOC_GRAD.astype(np.float64)), 161002, "grad_expanded_x"),
    ("int64 index", _with(expanded_row_idx=DOC_IDX.astype(np.int64)), 161002, "expanded_row_idx"),
    ("drop_pad_mode 2", _with(drop_pad_mode=2), 561103, "drop_pad_mode"),
    ("top_k 0", _with(top_k=0), 561103, "top_k"),
    ("active_num -1", _with(active_num=-1), 561103, "active_num"),
    ("drop_pad of a 2-D grad", _with(drop_pad_mode=1), 561103, "grad_expanded_x"),
    ("2-D index", _with(expanded_row_idx=DOC_IDX.reshape(2, 2)), 561103, "expanded_row_idx"),
    ("active_num not the grad's rows", _with(active_num=3), 561103, "grad_expanded_x"),
    ("slots not a multiple of top_k", _with(top_k=3), 561103, "expanded_row_idx"),
    ("index out of range", _index([2, 0, 1, 4]), 161002, "expanded_row_idx"),
    ("repeated index", _index([2, 0, 2, 3]), 161002, "expanded_row_idx"),
    ("unknown order", _with(order="ascend960"), 161002, "order"),
    ("top_k 0 before CANN 9.1", _with(top_k=0, order="ascend910b@9.0"), 561002, "top_k"),
    ("slots not a multiple of top_k on the 950 at 8.5", _with(top_k=3, order="ascend950@8.5"), 561002, "expanded_row_idx"),
]


def doc_call() -> dict:
    return {"grad_expanded_x": DOC_GRAD, "expanded_row_idx": DOC_IDX, "top_k": 2, "drop_pad_mode": 0,
            "active_num": 0}


def parameters_of(call: dict) -> dict:
    """The request parameters of a call (its attributes and, when given, its order)."""
    return {**attributes(call), **({"order": call["order"]} if "order" in call else {})}
