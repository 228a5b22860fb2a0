"""The sync client receives a large frames reply's tensors straight from the socket (moegrad.http._transport.read_frames).

A local HTTP/1.1 responder answers with a frames reply built here from docs/protocol.md (magic
``MGF1``, the header's length, the msgpack header, the tensor at the next 16-byte aligned offset),
sent in pieces with pauses, so that the client finds most of the body still to come. The result
is the responder's array bit for bit and arrives through ``receive_into``; a reply cut short fails
as it fails through httpx's own transport (which reads everything through h11).
"""

from __future__ import annotations

import socket
import struct
import time

import httpx
import msgpack
import numpy as np
import pytest

import moegrad
from moegrad.http import _transport
from support.rawhttp import Responder

N, K, H = 2048, 2, 512  # grad_x 4 MiB of float32


def frames_reply(grad_x: np.ndarray) -> bytes:
    header = {"grad_x": {"dtype": "float32", "shape": list(grad_x.shape), "offset": 1 << 32, "nbytes": grad_x.nbytes},
              "backend": "reference", "order": "ascend910b", "device": None, "timings_ms": {}}
    offset = -(-(8 + len(msgpack.packb(header))) // 16) * 16  # the offset's width is fixed (uint64) above
    header["grad_x"]["offset"] = offset
    packed = msgpack.packb(header)
    head = b"MGF1" + struct.pack("<I", len(packed)) + packed
    return head + bytes(offset - len(head)) + grad_x.tobytes()


class FramesResponder(Responder):
    """Answers every request with ``reply`` (a frames body) in three sends with pauses; ``cut``
    bytes of it left out, and the connection closed, when set. Counts the connections it served."""

    def __init__(self, reply: bytes, cut: int = 0) -> None:
        self.reply, self.cut = reply, cut
        self.connections = 0
        super().__init__()

    def _answer(self, connection: socket.socket) -> None:
        self.connections += 1
        with connection:
            while True:
                data = b""
                while b"\r\n\r\n" not in data:
                    more = connection.recv(65536)
                    if not more:
                        return
                    data += more
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                while len(body) < length:
                    body += connection.recv(1 << 20)
                sent = self.reply[: len(self.reply) - self.cut]
                connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.moegrad.frames\r\n"
                                   b"content-length: %d\r\n\r\n" % len(self.reply) + sent[:1000])
                for piece in (sent[1000 : len(sent) // 2], sent[len(sent) // 2 :]):
                    time.sleep(0.05)
                    connection.sendall(piece)
                if self.cut:
                    return


@pytest.fixture
def call():
    rng = np.random.default_rng(11)
    grad = rng.standard_normal((N * K, H), dtype=np.float32)
    return grad, rng.permutation(N * K).astype(np.int32)


@pytest.fixture
def counted(monkeypatch):
    calls = []
    receive = _transport.receive_into

    def counting(sock, room, timeout, request):
        got = receive(sock, room, timeout, request)
        calls.append(got)
        return got

    monkeypatch.setattr(_transport, "receive_into", counting)
    return calls


def test_a_large_frames_reply_arrives_straight_into_the_result_bit_for_bit(call, counted):
    grad, idx = call
    want = np.random.default_rng(12).standard_normal((N, H), dtype=np.float32)
    responder = FramesResponder(frames_reply(want))
    try:
        with moegrad.Client(responder.url.rstrip("/"), wire="frames", retries=0) as client:
            for _ in range(2):
                got = client.moe_init_routing_v2_grad(grad, idx, K)
                assert got.flags.owndata and got.flags.writeable
                assert (got.view(np.uint32) == want.view(np.uint32)).all()
    finally:
        responder.close()
    assert sum(counted) >= want.nbytes - (1 << 20) - 1000  # all but what came with the head
    assert responder.connections == 2  # h11 did not see the body's end: each call's connection closed


def test_a_reply_cut_short_fails_as_through_httpx_own_transport(call, counted):
    grad, idx = call
    responder = FramesResponder(frames_reply(np.zeros((N, H), np.float32)), cut=12345)
    errors = []
    try:
        for transport in (None, httpx.HTTPTransport()):
            with moegrad.Client(responder.url.rstrip("/"), wire="frames", retries=0, transport=transport) as client:
                with pytest.raises(moegrad.MoegradError) as caught:
                    client.moe_init_routing_v2_grad(grad, idx, K)
                errors.append(caught.value)
    finally:
        responder.close()
    assert counted  # the first client read the body off the socket, the second through h11
    assert type(errors[0]) is type(errors[1])
    assert str(errors[0]).split("(received")[0] == str(errors[1]).split("(received")[0]
