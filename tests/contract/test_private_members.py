"""The other libraries' private members moegrad stands on, named one by one.

The server's connection layer (moegrad_service.connections._uvicorn_private, the one module that
reaches them) uses members of uvicorn's httptools protocol, its request cycle and its Server that
uvicorn does not document; the client's transport (moegrad.http._transport) sets httpx's and httpcore's.
pyproject.toml bounds these libraries to the releases this file passed on and requirements.lock
holds the exact ones. An upgrade that renames, re-types or starts defining one of these names fails
here, by name, instead of silently undoing the attack hardening or the wire speed.

Oracle: the libraries themselves (their classes, and live instances made as they make them).
"""

from __future__ import annotations

import asyncio
import inspect
import socket

import httpcore
import httptools
import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from moegrad.http._transport import PRIVATE_MEMBERS

# ---- uvicorn's httptools protocol -------------------------------------------------------------------

#: methods of HttpToolsProtocol that moegrad's GuardedProtocol overrides (each calls uvicorn's through super())
PROTOCOL_METHODS = (
    "connection_made",
    "connection_lost",
    "data_received",
    "eof_received",
    "on_message_begin",
    "on_headers_complete",
    "on_message_complete",
    "on_response_complete",
    "send_400_response",
    "shutdown",
)
#: attributes moegrad reads or sets on a connection's protocol, with what each must be
PROTOCOL_ATTRIBUTES = {
    "loop": asyncio.AbstractEventLoop,
    "cycle": (RequestResponseCycle, type(None)),
    "scope": dict,
    "pipeline": object,  # a deque of parsed requests: only its truth is used
    "flow": FlowControl,
    "parser": httptools.HttpRequestParser,
}
#: attributes moegrad reads or sets on a request's cycle
CYCLE_ATTRIBUTES = {
    "scope": dict,
    "response_started": bool,
    "response_complete": bool,
    "disconnected": bool,
    "message_event": asyncio.Event,
    "keep_alive": bool,
    "body": (bytes, bytearray),
    "waiting_for_100_continue": bool,
}
#: names moegrad adds to the protocol and the server: uvicorn must not define them itself
ADDED_TO_PROTOCOL = (
    "_raw_transport",
    "_guarded_transport",
    "_peer",
    "_lost",
    "_head_bytes",
    "_lingering",
    "_message_done",
    "_deferred",
    "_unparsed",
    "_cycles",
    "_head_timer",
    "draining",
    "drain",
    "max_header_bytes",
    "header_timeout_s",
)
ADDED_TO_SERVER = ("protocol", "drain_s", "on_drain", "draining", "has_started")


async def _app(scope, receive, send):
    await asyncio.Event().wait()  # holds the request unanswered until the loop closes


class _Transport(asyncio.Transport):
    """A transport that keeps what is written (enough for uvicorn's protocol to parse a request)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_protocol_constructor_takes_the_keywords_the_backlog_answer_uses():
    parameters = inspect.signature(HttpToolsProtocol.__init__).parameters
    assert {"config", "server_state", "app_state"} <= parameters.keys()


@pytest.mark.parametrize("name", PROTOCOL_METHODS)
def test_protocol_defines_each_overridden_method(name):
    assert callable(getattr(HttpToolsProtocol, name, None)), f"HttpToolsProtocol.{name} is gone"


@pytest.mark.parametrize("name", ADDED_TO_PROTOCOL)
def test_protocol_does_not_define_a_name_moegrad_adds(name):
    assert not hasattr(HttpToolsProtocol, name), f"uvicorn now defines HttpToolsProtocol.{name} itself"


@pytest.mark.parametrize("name", ADDED_TO_SERVER)
def test_server_does_not_define_a_name_moegrad_adds(name):
    assert not hasattr(uvicorn.Server, name), f"uvicorn now defines Server.{name} itself"


def test_a_live_connection_has_every_member_read_or_set():
    async def scenario():
        config = uvicorn.Config(_app, http="httptools", log_level="warning", log_config=None)
        protocol = HttpToolsProtocol(config=config, server_state=ServerState(), app_state={})
        protocol.connection_made(_Transport())
        protocol.data_received(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\nab")
        return protocol

    protocol = asyncio.run(scenario())
    for name, kind in PROTOCOL_ATTRIBUTES.items():
        assert isinstance(getattr(protocol, name), kind), f"HttpToolsProtocol.{name}: {type(getattr(protocol, name))}"
    assert callable(protocol.flow.resume_reading)
    assert callable(getattr(protocol.parser, "set_dangerous_leniencies", None)), "httptools older than 0.6.3"
    cycle = protocol.cycle
    assert isinstance(cycle, RequestResponseCycle)
    for name, kind in CYCLE_ATTRIBUTES.items():
        assert isinstance(getattr(cycle, name), kind), f"RequestResponseCycle.{name}: {type(getattr(cycle, name))}"
    assert bytes(cycle.body) == b"ab", "the parsed body bytes not yet given out wait in cycle.body"


def test_a_started_server_has_every_member_read():
    async def scenario():
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        config = uvicorn.Config(_app, lifespan="off", log_level="warning", log_config=None)
        server = uvicorn.Server(config)
        config.load()
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[listener])
        try:
            assert server.started is True
            assert server.config is config
            assert all(isinstance(s, asyncio.Server) for s in server.servers) and server.servers
            assert isinstance(server.server_state.connections, set)
            assert isinstance(server.lifespan.state, dict)
        finally:
            await server.shutdown()
            listener.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("name", ("handle_exit", "startup", "shutdown"))
def test_server_defines_each_overridden_method(name):
    assert callable(getattr(uvicorn.Server, name, None)), f"uvicorn.Server.{name} is gone"


# ---- httpx's transports (the client) --------------------------------------------------------------


@pytest.mark.parametrize(("owner", "name"), PRIVATE_MEMBERS)
def test_httpx_transport_keeps_its_pool_where_the_client_replaces_it(owner, name):
    cls = getattr(httpx, owner.removeprefix("httpx."))
    transport = cls()
    pool = getattr(transport, name, None)
    wanted = httpcore.AsyncConnectionPool if cls is httpx.AsyncHTTPTransport else httpcore.ConnectionPool
    assert isinstance(pool, wanted), f"{owner}.{name} is not an httpcore pool: {type(pool)}"
    method = cls.handle_async_request if cls is httpx.AsyncHTTPTransport else cls.handle_request
    assert f"self.{name}" in inspect.getsource(method), f"{owner} no longer sends its requests through self.{name}"
    assert "network_backend" in inspect.signature(wanted).parameters, "httpcore's pool takes no network backend"
