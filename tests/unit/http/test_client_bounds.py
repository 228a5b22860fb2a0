"""The client against a hostile server: a call ends by its deadline and reads at most what it can produce.

Each attack is run on the sync and the async client, against ``support.hostile`` (raw sockets): a
reply dripped a byte at a time, a reply far larger than the call's grad_x, a msgpack bomb, a
frames header claiming a huge shape, a problem document with a huge ``detail``, a JSON nested past
the recursion limit, a compressed reply.

Oracles: the documentation's example call (N = 2, H = 2, float32: a grad_x of 16 bytes) and
docs/protocol.md's reply bounds (grad_x's bytes plus 64 KiB; an error body read up to 64 KiB, its
text cut to 4096 characters); the bytes the server managed to send, counted by the server; the
Python heap's peak (tracemalloc) while a bomb is decoded; the wall clock against the deadline,
with several seconds of margin to what the attack takes when nothing bounds it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
import tracemalloc

import msgpack
import numpy as np
import pytest

from moegrad import AsyncClient, Client, DeadlineExceeded, MoegradError, ServiceError
from moegrad.cli._main import main
from moegrad.http._reply_bounds import batch_reply_bytes, compare_reply_bytes, grad_reply_bytes, grad_x_nbytes
from support.docexample import DOC_GRAD, DOC_IDX, DOC_TOP_K, example_document
from support.hostile import HostileServer, drip, flood, frames_claiming, head, msgpack_bomb, whole

KINDS = ("sync", "async")
ORDER = "ascend910b@9.1"  # named: no call asks /v1/info first
KIB, MIB = 1 << 10, 1 << 20
DOC_GRAD_X_BYTES = 2 * 2 * 4  # the documentation's example: grad_x [2, 2] float32
FRAMES = "application/vnd.moegrad.frames"


def grad(kind, url, *, timeout_s=10.0, x=DOC_GRAD, idx=DOC_IDX, top_k=DOC_TOP_K):
    """One call of the sync or the async client, no retry, msgpack."""
    options = {"timeout_s": timeout_s, "retries": 0, "wire": "msgpack"}
    if kind == "sync":
        with Client(url, **options) as client:
            return client.moe_init_routing_v2_grad(x, idx, top_k, order=ORDER)

    async def run():
        async with AsyncClient(url, **options) as client:
            return await client.moe_init_routing_v2_grad(x, idx, top_k, order=ORDER)

    return asyncio.run(run())


def info(kind, url):
    if kind == "sync":
        with Client(url, retries=0, timeout_s=10.0) as client:
            return client.info()

    async def run():
        async with AsyncClient(url, retries=0, timeout_s=10.0) as client:
            return await client.info()

    return asyncio.run(run())


def test_the_bytes_a_call_can_produce_are_its_grad_x_and_the_allowances():
    assert grad_x_nbytes(example_document()) == DOC_GRAD_X_BYTES  # a wire document, read as the server reads it
    assert grad_reply_bytes(example_document()) == DOC_GRAD_X_BYTES + 64 * KIB
    drop_pad = {  # [E, C, H] = [3, 2, 5] bfloat16 with N*K = 8 slots, K = 2: grad_x [4, 5]
        "grad_expanded_x": {"dtype": "bfloat16", "shape": [3, 2, 5], "data": bytes(60)},
        "expanded_row_idx": {"dtype": "int32", "shape": [8], "data": bytes(32)},
        "top_k": 2,
    }
    assert grad_x_nbytes(drop_pad) == 4 * 5 * 2
    for broken in ({}, {**drop_pad, "top_k": 0}, {**drop_pad, "top_k": True}, {**drop_pad, "expanded_row_idx": []}):
        assert grad_x_nbytes(broken) == 0  # answered with a problem, not a grad_x
    assert compare_reply_bytes(drop_pad, False) == 128 * KIB
    assert compare_reply_bytes(drop_pad, True) == 40 + 128 * KIB
    items = [("grad", drop_pad, False), ("compare", drop_pad, False), ("compare", drop_pad, True)]
    assert batch_reply_bytes(items) == 64 * KIB + 3 * 8 * KIB + 40 + 2 * 64 * KIB + 40


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", ["head", "body"])
def test_timeout_s_is_a_deadline_for_the_whole_call_against_a_drip(kind, stage):
    body = bytes(40)
    response = head(length=len(body)) + body
    start = 0 if stage == "head" else len(response) - len(body)
    # a byte every 0.2 s: each read gets one long before its timeout; unbounded, this takes 8 s or more
    with HostileServer(drip(response, 0.2, start=start)) as server:
        began = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="within 1.0 s"):
            grad(kind, server.url, timeout_s=1.0)
        took = time.monotonic() - began
    assert took < 4.0, f"the call took {took:.1f} s against a deadline of 1 s"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_reply_larger_than_the_call_can_produce_is_refused_unread(kind, chunked):
    total = 64 * MIB
    with HostileServer(flood(head(length=None if chunked else total), total, chunked=chunked)) as server:
        with pytest.raises(ServiceError, match=f"at most {DOC_GRAD_X_BYTES + 64 * KIB} bytes"):
            grad(kind, server.url)
        sent = server.sent
    assert sent < 16 * MIB, f"the client let {sent} bytes arrive for a grad_x of {DOC_GRAD_X_BYTES}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_msgpack_bomb_is_refused_by_the_structure_limits_before_it_is_built(kind):
    bomb = msgpack_bomb()  # ~1 MB that decodes to a million lists (~60 MB of Python objects)
    x, idx = np.zeros((256, 1024), np.float32), np.arange(256, dtype=np.int32)  # grad_x of 1 MiB: the bomb fits
    assert len(bomb) < 256 * 1024 * 4 + 64 * KIB
    with HostileServer(whole(head(length=len(bomb)) + bomb)) as server:
        tracemalloc.start()
        try:
            with pytest.raises(ServiceError, match="more than 256 maps and arrays"):
                grad(kind, server.url, x=x, idx=idx, top_k=1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 16 * MIB, f"decoding the bomb took {peak} bytes of the Python heap"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_frames_header_claiming_a_huge_shape_is_a_service_error_not_an_allocation(kind, chunked):
    body = frames_claiming([1 << 40, 1 << 10])  # 4 PiB of float32 claimed in a body of about 100 bytes
    framed = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n" if chunked else body
    reply = head(content_type=FRAMES, length=None if chunked else len(body)) + framed
    with HostileServer(whole(reply)) as server, pytest.raises(ServiceError, match="run past the frames body"):
        grad(kind, server.url)


def test_the_command_exits_4_on_a_frames_header_claiming_a_huge_shape(capsys):
    body = frames_claiming([1 << 40, 1 << 10])
    with HostileServer(whole(head(content_type=FRAMES, length=len(body)) + body)) as server:
        status = main(["example", "--url", server.url, "--retries", "0"])
    err = capsys.readouterr().err
    assert status == 4 and "ServiceError" in err and "bug in moegrad" not in err


@pytest.mark.parametrize("kind", KINDS)
def test_a_huge_error_detail_is_neither_read_whole_nor_carried(kind):
    problem = {"title": "Invalid argument", "status": 422, "detail": "x" * (32 * MIB), "aclnn_status": 161002}
    body = json.dumps(problem).encode()
    with HostileServer(whole(head(422, "application/problem+json", len(body)) + body)) as server:
        with pytest.raises(MoegradError) as error:
            grad(kind, server.url)
        sent = server.sent
    message = str(error.value)
    assert len(message) < 1024 and "read up to 65536 bytes" in message, message[:300]
    assert sent < 16 * MIB


@pytest.mark.parametrize("kind", KINDS)
def test_a_long_error_detail_is_cut_to_4096_characters_and_the_status_kept(kind):
    problem = {"title": "Invalid argument", "status": 422, "detail": "y" * 10_000, "aclnn_status": 161002}
    body = json.dumps(problem).encode()
    with HostileServer(whole(head(422, "application/problem+json", len(body)) + body)) as server:
        with pytest.raises(MoegradError) as error:
            grad(kind, server.url)
    assert error.value.aclnn_status == 161002
    assert error.value.message == "y" * 4096 + "... (5904 more characters)"


@pytest.mark.parametrize("kind", KINDS)
def test_an_info_reply_nested_past_the_recursion_limit_is_a_service_error(kind):
    body = b"[" * 100_000 + b"]" * 100_000
    with HostileServer(whole(head(content_type="application/json", length=len(body)) + body)) as server:
        with pytest.raises(ServiceError, match="did not answer a JSON object"):
            info(kind, server.url)


@pytest.mark.parametrize("kind", KINDS)
def test_a_compressed_reply_is_refused(kind):
    reply = {"grad_x": {"dtype": "float32", "shape": [2, 2], "data": bytes(16)}, "backend": "x", "order": ORDER}
    body = gzip.compress(msgpack.packb(reply))
    with HostileServer(whole(head(length=len(body), Content_Encoding="gzip") + body)) as server:
        with pytest.raises(ServiceError, match="content coding 'gzip'"):
            grad(kind, server.url)
    assert server.requests and all("\r\naccept-encoding: identity\r\n" in r.lower() + "\r\n" for r in server.requests)
