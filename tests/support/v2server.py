"""A tiny protocol v2 server for a planted candidate, written from docs/protocol.md ("Protocol v2").

``candidate_app(fn)`` is a bare ASGI application (no moegrad, no web framework) that answers
``POST /v2/models/moe_init_routing_v2_grad/infer`` with ``fn``'s grad_x: it reads the JSON part
(``Inference-Header-Content-Length`` bytes) and the binary inputs that follow it, calls
``fn(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=..., active_num=...)``, and replies
with grad_x as binary data. Any other route is 404; a failing ``fn`` is 400 ``{"error": ...}``.
``serving(app)`` runs it under uvicorn on a free loopback port in a thread and yields the base URL.
It also counts the requests it answered (``app.requests``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import ml_dtypes
import numpy as np
import uvicorn

from support.launch import LOOPBACK, free_port

__all__ = ["candidate_app", "serving"]

INFER = "/v2/models/moe_init_routing_v2_grad/infer"
DTYPES = {"FP16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16), "FP32": np.dtype("<f4"),
          "INT32": np.dtype("<i4")}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _decode(body: bytes, header_length: int | None) -> tuple[dict, dict]:
    """The request's parameters and its input arrays by name."""
    split = header_length if header_length is not None else len(body)
    document = json.loads(body[:split])
    offset, arrays = split, {}
    for item in document["inputs"]:
        dtype, shape = DTYPES[item["datatype"]], tuple(item["shape"])
        if "data" in item:
            arrays[item["name"]] = np.asarray(item["data"], dtype=dtype).reshape(shape)
            continue
        size = item["parameters"]["binary_data_size"]
        arrays[item["name"]] = np.frombuffer(body[offset:offset + size], dtype=dtype).reshape(shape).copy()
        offset += size
    return document.get("parameters", {}), arrays


def candidate_app(fn):
    """A v2 ASGI app serving ``fn`` as the model ``moe_init_routing_v2_grad``."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] != "POST" or scope["path"] != INFER:
            await _reply(send, 404, {"error": f"no route {scope['path']}"})
            return
        headers = {key.decode().lower(): value.decode() for key, value in scope["headers"]}
        length = headers.get("inference-header-content-length")
        try:
            parameters, arrays = _decode(body, int(length) if length is not None else None)
            grad_x = np.asarray(fn(arrays["grad_expanded_x"], arrays["expanded_row_idx"], parameters["top_k"],
                                   drop_pad_mode=parameters.get("drop_pad_mode", 0),
                                   active_num=parameters.get("active_num", 0)))
        except Exception as error:  # the planted candidate's failure is the client's answer
            await _reply(send, 400, {"error": f"{type(error).__name__}: {error}"})
            return
        app.requests += 1
        data = np.ascontiguousarray(grad_x).tobytes()
        head = json.dumps({"model_name": "moe_init_routing_v2_grad", "model_version": "1", "outputs": [
            {"name": "grad_x", "datatype": NAMES[grad_x.dtype], "shape": list(grad_x.shape),
             "parameters": {"binary_data_size": len(data)}}]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/octet-stream"),
            (b"inference-header-content-length", str(len(head)).encode())]})
        await send({"type": "http.response.body", "body": head + data})

    app.requests = 0
    return app


async def _reply(send, status: int, document: dict) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(document).encode()})


@contextlib.contextmanager
def serving(app, timeout_s: float = 20.0):
    """Run ``app`` under uvicorn on a free loopback port in a thread; yields ``http://127.0.0.1:<port>``."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="v2-candidate", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the v2 candidate server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
