"""What moegrad's gRPC admission (moegrad_service.api.grpc.admission, .server) stands on in grpcio,
beyond its documented API, shown on a live ``grpc.aio`` server.

- A request-streaming handler runs, and may answer, before the request message is read: it
  answers an RPC whose message is over the server's limit with its own status, where grpc would
  refuse the message once asked for it (grpc/grpc src/python/grpcio/grpc/_cython/_cygrpc/aio/server.pyx.pxi).
- ``context.read()`` gives the message as bytes, and ``grpc.aio.EOF`` when none was sent.
- ``grpc.server.max_pending_requests`` and its ``_hard_limit`` (grpc/grpc src/core/server/server.h,
  not in the public channel_arg_names.h) are live: at 0 and 1 a burst of RPCs is partly CANCELLED;
  at the values moegrad sets, none is.

pyproject.toml bounds grpcio to the releases this file passed on; requirements.lock holds the exact one.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from support.launch import free_port

MIB = 1 << 20


async def _serve(handler, options) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", {"M": handler}),))
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    return server, address


@pytest.mark.asyncio
async def test_a_request_streaming_handler_answers_before_the_message_is_read():
    calls = []

    async def refuse(requests, context):
        calls.append(context.invocation_metadata())
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "decided from the metadata")

    server, address = await _serve(grpc.stream_unary_rpc_method_handler(refuse),
                                   [("grpc.max_receive_message_length", 1024)])
    try:
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await channel.unary_unary("/t.S/M")(b"x" * (16 * MIB), timeout=30)
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED  # not the over-limit RESOURCE_EXHAUSTED
        assert len(calls) == 1
    finally:
        await server.stop(0)


@pytest.mark.asyncio
async def test_read_gives_the_message_as_bytes_or_eof():
    seen = []

    async def read(requests, context):
        seen.append(await context.read())
        return b"ok"

    server, address = await _serve(grpc.stream_unary_rpc_method_handler(read), [])
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            assert await channel.unary_unary("/t.S/M")(b"\x01\x02", timeout=30) == b"ok"
            assert await channel.stream_unary("/t.S/M")(iter(()), timeout=30) == b"ok"
        assert seen == [b"\x01\x02", grpc.aio.EOF]
    finally:
        await server.stop(0)


async def _burst(options, count: int = 600) -> Counter:
    async def answer(requests, context):
        await asyncio.sleep(0.05)
        return b"ok"

    server, address = await _serve(grpc.stream_unary_rpc_method_handler(answer), options)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            rpc = channel.unary_unary("/t.S/M")

            async def one() -> str:
                try:
                    await rpc(b"", timeout=30)
                    return "OK"
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name

            return Counter(await asyncio.gather(*(one() for _ in range(count))))
    finally:
        await server.stop(0)


@pytest.mark.asyncio
async def test_the_pending_request_limits_are_live():
    dropped = await _burst([("grpc.server.max_pending_requests", 0),
                            ("grpc.server.max_pending_requests_hard_limit", 1)])
    assert dropped["CANCELLED"] > 0, dropped
    kept = await _burst([("grpc.server.max_pending_requests", 2**31 - 1),
                         ("grpc.server.max_pending_requests_hard_limit", 2**31 - 1)])
    assert kept == Counter(OK=600), kept
