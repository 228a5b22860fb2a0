"""The callers a run times, below and beside moegrad's own clients: tritonclient, prebuilt requests over a
plain socket (:class:`RawCaller`, :class:`RawWire`) and the loopback floor (:class:`LoopbackFloor`: raw
TCP moving the same bytes, the floor any HTTP server on this machine stands on)."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import numpy as np

from .common import MODEL
from .payloads import Payload

__all__ = ["LoopbackFloor", "PlainMsgpack", "RawCaller", "RawWire", "TritonCaller", "content_length", "grad_request",
           "grad_x_of_reply", "triton_inputs"]


def triton_inputs(module: Any, payload: Payload) -> tuple[list, list]:
    """tritonclient inputs and outputs (binary tensor data both ways) for ``payload``."""
    grad = module.InferInput("grad_expanded_x", list(payload.grad_expanded_x.shape), "FP32")
    grad.set_data_from_numpy(payload.grad_expanded_x, binary_data=True)
    idx = module.InferInput("expanded_row_idx", list(payload.expanded_row_idx.shape), "INT32")
    idx.set_data_from_numpy(payload.expanded_row_idx, binary_data=True)
    return [grad, idx], [module.InferRequestedOutput("grad_x", binary_data=True)]


class TritonCaller:
    """Sync tritonclient[http] calls of the model (the same request to moegrad v2 and PyTriton)."""

    def __init__(self, url: str) -> None:
        import tritonclient.http as triton

        self._triton = triton
        self.client = triton.InferenceServerClient(url.removeprefix("http://"), connection_timeout=120.0,
                                                   network_timeout=120.0)

    def __call__(self, payload: Payload) -> np.ndarray:
        inputs, outputs = triton_inputs(self._triton, payload)
        result = self.client.infer(MODEL, inputs, outputs=outputs, parameters={"top_k": payload.top_k})
        return result.as_numpy("grad_x")

    def close(self) -> None:
        self.client.close()


def grad_request(url: str, payload: Payload) -> bytes:
    """The bytes of one v1 POST of ``payload`` (HTTP/1.1, keep-alive), built once for the raw clients."""
    from moegrad import MoeInitRoutingV2GradCall, encode_body

    call = MoeInitRoutingV2GradCall(grad_expanded_x=payload.grad_expanded_x,
                                    expanded_row_idx=payload.expanded_row_idx, top_k=payload.top_k)
    body = bytes(encode_body({k: v for k, v in call.to_wire().items() if k != "order"}))
    host = url.removeprefix("http://")
    return (f"POST /v1/moe_init_routing_v2_grad HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/msgpack\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def grad_x_of_reply(status_and_headers: bytes, body: bytes) -> np.ndarray:
    """grad_x from a raw v1 reply (the status line must be 200)."""
    from moegrad import decode_body, decode_tensor

    if not status_and_headers.startswith(b"HTTP/1.1 200 "):
        raise RuntimeError(f"the server answered {status_and_headers.splitlines()[0]!r}")
    return decode_tensor(decode_body(body)["grad_x"], "grad_x")


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    raise RuntimeError("a reply without Content-Length")


class RawCaller:
    """One keep-alive connection sending a prebuilt v1 request over a plain socket: no client library,
    so the time is the server's and the kernel's (the floor under any HTTP client)."""

    def __init__(self, url: str, payload: Payload) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.request = grad_request(url, payload)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __call__(self) -> np.ndarray:
        self.sock.sendall(self.request)
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            buffer += self._recv()
        head, _, body = buffer.partition(b"\r\n\r\n")
        length = content_length(head)
        while len(body) < length:
            body += self._recv()
        return grad_x_of_reply(head, body)

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise RuntimeError("the server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


class LoopbackFloor:
    """Raw TCP on 127.0.0.1: send the request's bytes, receive the reply's bytes, nothing else.

    Buffers are allocated and touched once up front, so a round trip measures only the kernel's
    loopback path (the floor any HTTP server on this machine stands on).
    """

    def __init__(self, request_bytes: int, reply_bytes: int) -> None:
        self.request = np.ones(request_bytes, dtype=np.uint8)
        self.reply = np.ones(reply_bytes, dtype=np.uint8)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._serve, name="loopback-floor", daemon=True)
        self._thread.start()
        self._sock = socket.create_connection(self._listener.getsockname())
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._inbox = np.zeros(reply_bytes, dtype=np.uint8)

    def _serve(self) -> None:
        connection, _ = self._listener.accept()
        inbox = np.zeros(self.request.nbytes, dtype=np.uint8)
        with connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while _recv_exactly(connection, memoryview(inbox)):
                connection.sendall(memoryview(self.reply))

    def round_trip_s(self) -> float:
        t0 = time.perf_counter()
        self._sock.sendall(memoryview(self.request))
        if not _recv_exactly(self._sock, memoryview(self._inbox)):
            raise RuntimeError("the loopback floor's peer closed the connection")
        return time.perf_counter() - t0

    def close(self) -> None:
        self._sock.close()
        self._thread.join(10)
        self._listener.close()


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    filled = 0
    while filled < len(view):
        got = sock.recv_into(view[filled:])
        if got == 0:
            return False
        filled += got
    return True


class PlainMsgpack:
    """A v1 client in a few lines of plain msgpack and the standard library's ``http.client``, as a
    host in any language writes one from docs/protocol.md (nothing of moegrad). Each call packs the
    document with one msgpack ``Packer`` kept across calls (the arrays' bytes copied as ``bin``
    into its buffer, whose pages stay resident), POSTs it on a keep-alive connection, reads the
    reply into a buffer kept across calls (``readinto``), unpacks it with ``msgpack.unpackb`` and
    views grad_x's bytes."""

    def __init__(self, url: str, payload: Payload) -> None:
        import http.client

        import msgpack

        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.payload = payload
        self.connection = http.client.HTTPConnection(host, int(port), timeout=300)
        self.packer = msgpack.Packer(use_bin_type=True, autoreset=False)
        self.inbox = bytearray(payload.reply_bytes + (1 << 16))
        self.used = 0.0

    def connect(self) -> None:
        """A fresh connection when the last one sat idle (uvicorn closes keep-alives after 5 s)."""
        if time.monotonic() - self.used >= 2.0:
            self.connection.close()
            self.connection.connect()

    def __call__(self) -> np.ndarray:
        import msgpack

        self.connect()
        grad, idx = self.payload.grad_expanded_x, self.payload.expanded_row_idx
        self.packer.reset()
        self.packer.pack({
            "grad_expanded_x": {"dtype": grad.dtype.name, "shape": list(grad.shape),
                                "data": grad.reshape(-1).view(np.uint8).data},
            "expanded_row_idx": {"dtype": "int32", "shape": list(idx.shape), "data": idx.view(np.uint8).data},
            "top_k": self.payload.top_k})
        with self.packer.getbuffer() as body:
            self.connection.request("POST", "/v1/moe_init_routing_v2_grad", body=body,
                                    headers={"Content-Type": "application/msgpack"})
        response = self.connection.getresponse()
        length = int(response.getheader("content-length", "0"))
        if response.status != 200:
            raise RuntimeError(f"the server answered {response.status}: {response.read()[:200]!r}")
        if len(self.inbox) < length:
            self.inbox = bytearray(length)
        with memoryview(self.inbox)[:length] as view:
            filled = 0
            while filled < length:
                got = response.readinto(view[filled:])
                if not got:
                    raise RuntimeError("the server closed the connection")
                filled += got
            tensor = msgpack.unpackb(view)["grad_x"]
        self.used = time.monotonic()
        return np.frombuffer(tensor["data"], dtype=self.payload.expected.dtype).reshape(tensor["shape"])

    def close(self) -> None:
        self.connection.close()


class RawWire:
    """One keep-alive connection POSTing a prebuilt request (v1 msgpack, v1 frames or v2 binary)
    and receiving the reply into a pre-touched buffer with ``recv_into``: what the client side of
    the floor does, so the time above the floor is the server's."""

    def __init__(self, url: str, payload: Payload, kind: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.kind = kind
        head, parts = self._request(f"{host}:{port}", payload, kind)
        self.request = np.empty(len(head) + sum(len(p) for p in parts), dtype=np.uint8)
        view, at = memoryview(self.request), len(head)
        view[:at] = head
        for part in parts:
            view[at:at + len(part)] = part
            at += len(part)
        self.reply = np.ones(payload.reply_bytes + (1 << 20), dtype=np.uint8)  # pre-touched, with room for headers
        self.address = (host, int(port))
        self.sock: socket.socket | None = None
        self.used = 0.0
        self.length = 0

    def connect(self) -> None:
        """A fresh connection when the last one sat idle (uvicorn closes keep-alives after 5 s)."""
        if self.sock is not None and time.monotonic() - self.used < 2.0:
            return
        if self.sock is not None:
            self.sock.close()
        self.sock = socket.create_connection(self.address, timeout=120)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @staticmethod
    def _request(host: str, payload: Payload, kind: str) -> tuple[bytes, list]:
        from moegrad import FRAMES_MEDIA_TYPE, encode_body, encode_frames, encode_tensor

        fields = {"grad_expanded_x": encode_tensor(payload.grad_expanded_x),
                  "expanded_row_idx": encode_tensor(payload.expanded_row_idx), "top_k": payload.top_k}
        if kind == "v1":
            parts, path = [encode_body(fields)], "/v1/moe_init_routing_v2_grad"
            extra = "Content-Type: application/msgpack\r\n"
        elif kind == "frames":
            parts, _ = encode_frames(fields)
            path = "/v1/moe_init_routing_v2_grad"
            extra = f"Content-Type: {FRAMES_MEDIA_TYPE}\r\nAccept: {FRAMES_MEDIA_TYPE}\r\n"
        else:
            from moegrad import dtype_name

            names = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16"}
            grad, idx = payload.grad_expanded_x, payload.expanded_row_idx
            header = json.dumps({"inputs": [
                {"name": "grad_expanded_x", "datatype": names[dtype_name(grad.dtype)], "shape": list(grad.shape),
                 "parameters": {"binary_data_size": grad.nbytes}},
                {"name": "expanded_row_idx", "datatype": "INT32", "shape": list(idx.shape),
                 "parameters": {"binary_data_size": idx.nbytes}}],
                "outputs": [{"name": "grad_x", "parameters": {"binary_data": True}}],
                "parameters": {"top_k": payload.top_k}}).encode()
            parts = [header, memoryview(grad.reshape(-1).view(np.uint8)), memoryview(idx.view(np.uint8))]
            path = f"/v2/models/{MODEL}/infer"
            extra = f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {len(header)}\r\n"
        length = sum(len(p) for p in parts)
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Length: {length}\r\n\r\n").encode()
        return head, parts

    def __call__(self) -> None:
        self.connect()
        assert self.sock is not None
        self.sock.sendall(memoryview(self.request))
        view, filled = memoryview(self.reply), 0
        while True:
            got = self.sock.recv_into(view[filled:])
            if not got:
                raise RuntimeError("the server closed the connection")
            filled += got
            end = bytes(view[:min(filled, 4096)]).find(b"\r\n\r\n")
            if end >= 0:
                break
        head = bytes(view[:end])
        if not head.startswith(b"HTTP/1.1 200 "):
            raise RuntimeError(f"the server answered {head.splitlines()[0]!r}")
        self.start, self.length = end + 4, content_length(head)
        while filled < self.start + self.length:
            filled += self.sock.recv_into(view[filled:self.start + self.length])
        self.used = time.monotonic()

    def result(self) -> np.ndarray:
        """grad_x of the last reply (decoded after the timing)."""
        from moegrad import decode_body, decode_frames, decode_tensor

        body = bytes(memoryview(self.reply)[self.start:self.start + self.length])
        if self.kind == "v1":
            return decode_tensor(decode_body(body)["grad_x"], "grad_x")
        if self.kind == "frames":
            return decode_tensor(decode_frames(body)["grad_x"], "grad_x")
        header = json.loads(body[:body.index(b"}]}") + 3])
        output = header["outputs"][0]
        raw = body[len(json.dumps(header, separators=(",", ":")).encode()):]
        from moegrad import DTYPES

        names = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16"}
        return np.frombuffer(raw, dtype=DTYPES[names[output["datatype"]]]).reshape(output["shape"])

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
