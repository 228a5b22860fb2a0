"""Helpers for in-process service tests: request documents, posting, decoding replies, a gated backend hook."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import msgpack
import numpy as np

import moegrad

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

MSGPACK_HEADERS = {"content-type": "application/msgpack"}
DOC_GRAD = np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]], dtype=np.float32)
DOC_IDX = np.array([2, 0, 1, 3], dtype=np.int32)


def example_document(**overrides) -> dict:
    """The documentation's example as a request document (tensors encoded by hand, not by moegrad)."""
    document = {
        "grad_expanded_x": {"dtype": "float32", "shape": [4, 2], "data": DOC_GRAD.tobytes()},
        "expanded_row_idx": {"dtype": "int32", "shape": [4], "data": DOC_IDX.tobytes()},
        "top_k": 2,
        "drop_pad_mode": 0,
        "active_num": 0,
    }
    document.update(overrides)
    return {k: v for k, v in document.items() if v is not None}


def pack(document: dict) -> bytes:
    return msgpack.packb(document, use_bin_type=True)


def post(client: TestClient, document: dict | bytes, **kwargs):
    body = pack(document) if isinstance(document, dict) else document
    headers = {**MSGPACK_HEADERS, **kwargs.pop("headers", {})}
    return client.post("/v1/moe_init_routing_v2_grad", content=body, headers=headers, **kwargs)


def grad_x_of(response) -> np.ndarray:
    reply = msgpack.unpackb(response.content, raw=False)
    tensor = reply["grad_x"]
    return np.frombuffer(tensor["data"], dtype=moegrad.DTYPES[tensor["dtype"]]).reshape(tensor["shape"])


class GateHook:
    """A reference-backend fault hook that blocks each call until released (or raises / hangs)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.calls = 0
        self.error: BaseException | None = None

    def __call__(self, call, timeout_s) -> None:
        self.calls += 1
        self.started.release()
        if self.error is not None:
            raise self.error
        self.release.wait(30)
