"""The operator documentation's example, the one place the tests and benchmarks take it from.

docs/operator.md: gradExpandedX [[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]] float32,
expandedRowIdx [2, 0, 1, 3] int32, K = 2, dropless; gradX [[0.3, 0.3], [0.7, 0.7]]. In float32,
row 0 is 0.2 + 0.1 = 0.3 (0x3E99999A) and row 1 is 0.3 + 0.4 = 0.70000005 (0x3F333334), each one
add from float32 inputs, so every order of adds gives these bits. Nothing here comes from moegrad:
the request document is encoded by hand from docs/protocol.md.
"""

from __future__ import annotations

import msgpack
import numpy as np

__all__ = [
    "DOC_BODY",
    "DOC_GRAD",
    "DOC_IDX",
    "DOC_RESULT",
    "DOC_RESULT_BITS",
    "DOC_TOP_K",
    "example_document",
    "v2_inputs",
]

#: gradExpandedX [4, 2] float32.
DOC_GRAD = np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]], dtype=np.float32)
#: expandedRowIdx [4] int32.
DOC_IDX = np.array([2, 0, 1, 3], dtype=np.int32)
DOC_TOP_K = 2
#: gradX [2, 2] float32: [[0.3, 0.3], [0.70000005, 0.70000005]].
DOC_RESULT = np.array([[0.3, 0.3], [0.70000005, 0.70000005]], dtype=np.float32)
#: gradX's bits [2, 2] uint32: 0.3 -> 0x3E99999A, 0.70000005 -> 0x3F333334.
DOC_RESULT_BITS = np.array([[0x3E99999A, 0x3E99999A], [0x3F333334, 0x3F333334]], dtype=np.uint32)

for _array in (DOC_GRAD, DOC_IDX, DOC_RESULT, DOC_RESULT_BITS):
    _array.flags.writeable = False  # shared by every test: a test that needs to change one copies it
assert np.array_equal(DOC_RESULT.view(np.uint32), DOC_RESULT_BITS)


def example_document(**overrides) -> dict:
    """The example as a v1 request document (docs/protocol.md), tensors encoded by hand.

    ``overrides`` replace fields (a tensor field takes a ``{"dtype", "shape", "data"}`` map); a field
    set to None is left out.
    """
    document = {
        "grad_expanded_x": {"dtype": "float32", "shape": [4, 2], "data": DOC_GRAD.tobytes()},
        "expanded_row_idx": {"dtype": "int32", "shape": [4], "data": DOC_IDX.tobytes()},
        "top_k": DOC_TOP_K,
        "drop_pad_mode": 0,
        "active_num": 0,
    }
    document.update(overrides)
    return {k: v for k, v in document.items() if v is not None}


#: The example's msgpack request body (``example_document()`` packed).
DOC_BODY = msgpack.packb(example_document(), use_bin_type=True)


def v2_inputs() -> list[dict]:
    """The example's two inputs as a v2 JSON infer request carries them (docs/protocol.md, "The
    request"): grad_expanded_x FP32 [4, 2] and expanded_row_idx INT32 [4], row-major, fresh each call."""
    return [
        {"name": "grad_expanded_x", "shape": [4, 2], "datatype": "FP32", "data": DOC_GRAD.ravel().tolist()},
        {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32", "data": DOC_IDX.tolist()},
    ]
