"""Helpers for in-process service tests: v1 bodies (msgpack and frames), replies, metrics, a gated backend hook.

Request documents and frames bodies are encoded here by hand from docs/protocol.md (never by
moegrad's encoder); replies are read with ``moegrad.DTYPES`` only for the dtype names. The
documentation's example document is :func:`support.docexample.example_document`.
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING

import msgpack
import numpy as np

import moegrad

from .docexample import example_document

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

__all__ = ["FRAMES", "MSGPACK_HEADERS", "GateHook", "Recorder", "frames_body", "frames_reply", "gauge", "grad_x_of", "pack", "post",
           "post_frames_call", "random_call"]

MSGPACK_HEADERS = {"content-type": "application/msgpack"}
FRAMES = "application/vnd.moegrad.frames"


def pack(document: dict) -> bytes:
    """A v1 document as msgpack bytes."""
    return msgpack.packb(document, use_bin_type=True)


def post(client: TestClient, document: dict | bytes, **kwargs):
    """POST a document (packed here) or raw bytes to the v1 grad route as msgpack; the response."""
    body = pack(document) if isinstance(document, dict) else document
    headers = {**MSGPACK_HEADERS, **kwargs.pop("headers", {})}
    return client.post("/v1/moe_init_routing_v2_grad", content=body, headers=headers, **kwargs)


def grad_x_of(response) -> np.ndarray:
    """grad_x of a v1 msgpack reply, as the array its dtype and shape name."""
    reply = msgpack.unpackb(response.content, raw=False)
    tensor = reply["grad_x"]
    return np.frombuffer(tensor["data"], dtype=moegrad.DTYPES[tensor["dtype"]]).reshape(tensor["shape"])


def random_call(dtype, *, n=37, k=3, h=13, seed=0):
    """(grad [n*k, h] of ``dtype``, a dropless idx [n*k] int32, k): standard normal values, a random permutation."""
    rng = np.random.default_rng(seed)
    grad = rng.standard_normal((n * k, h)).astype(dtype)
    idx = rng.permutation(n * k).astype(np.int32)
    return grad, idx, k


def frames_body(document: dict) -> bytes:
    """A frames body built here from docs/protocol.md (not by moegrad): magic, header length, header,
    each tensor's bytes at the next 16-byte aligned offset."""
    header, blobs = {}, []
    for key, value in document.items():
        if isinstance(value, dict) and "data" in value:
            header[key] = {"dtype": value["dtype"], "shape": value["shape"], "offset": 0, "nbytes": len(value["data"])}
            blobs.append((key, value["data"]))
        else:
            header[key] = value
    for key, _ in blobs:
        header[key]["offset"] = 1 << 32  # a fixed width for the offsets: uint64
    start = -(-(8 + len(msgpack.packb(header))) // 16) * 16
    offset = start
    for key, data in blobs:
        header[key]["offset"] = offset
        offset = -(-(offset + len(data)) // 16) * 16
    packed = msgpack.packb(header)
    body = bytearray(b"MGF1" + struct.pack("<I", len(packed)) + packed)
    for key, data in blobs:
        body += bytes(header[key]["offset"] - len(body)) + data
    return bytes(body)


def frames_reply(response) -> tuple[dict, dict[str, np.ndarray]]:
    """A frames reply read per docs/protocol.md (not by moegrad): the header and its tensors."""
    body = response.content
    assert body[:4] == b"MGF1"
    (length,) = struct.unpack("<I", body[4:8])
    header = msgpack.unpackb(body[8:8 + length], raw=False)
    tensors = {}
    for key, value in header.items():
        if isinstance(value, dict) and "offset" in value:
            assert value["offset"] % 16 == 0 and value["offset"] >= 8 + length
            data = body[value["offset"]:value["offset"] + value["nbytes"]]
            tensors[key] = np.frombuffer(data, dtype=moegrad.DTYPES[value["dtype"]]).reshape(value["shape"])
    return header, tensors


def post_frames_call(client, grad: np.ndarray, idx: np.ndarray, top_k: int, headers: dict | None = None):
    """POST a float32 call as a frames body to the v1 grad route; the response."""
    document = example_document(
        grad_expanded_x={"dtype": "float32", "shape": list(grad.shape), "data": grad.tobytes()},
        expanded_row_idx={"dtype": "int32", "shape": list(idx.shape), "data": idx.tobytes()}, top_k=top_k)
    return client.post("/v1/moe_init_routing_v2_grad", content=frames_body(document),
                       headers={"content-type": FRAMES, **(headers or {})})


def gauge(client, name: str) -> float:
    """The value of an unlabelled metric from the service's ``GET /metrics``."""
    line = next(line for line in client.get("/metrics").text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


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


class Recorder:
    """A fault hook that holds the first call until released and records every call's H, in the order run."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.first = threading.Event()
        self.order: list[int] = []

    def __call__(self, call, timeout_s) -> None:
        self.order.append(call.hidden_size)
        if len(self.order) == 1:
            self.first.set()
            self.release.wait(30)
