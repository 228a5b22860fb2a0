"""The one module that touches uvicorn's and httptools' private members: small named accessors.

uvicorn documents its command line and ``uvicorn.Config``/``uvicorn.Server.run``, not its protocol
classes. The head limits, the lingering close, the body sink and the draining server stand on the
members below; each is reached here and nowhere else (the other modules of this package call
these functions), so that an upgrade that renames or re-types one breaks one place, which the
contract test names member by member. Tested with uvicorn 0.55 and httptools 0.9 (pyproject
pins the range).

``uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`` (an instance, one per connection):

- ``loop``: the connection's event loop (the head timer, the lingering close, the sink's future);
- ``cycle``: the newest request's ``RequestResponseCycle`` (None before the first head);
- ``scope``: the ASGI scope of the request being parsed (told from ``cycle.scope`` when the head
  is an upgrade, which gets no cycle, or a pipelined head not yet complete);
- ``pipeline``: the pipelined requests parsed but not yet started (a refusal waits for them);
- ``flow``: its ``FlowControl``; reading is resumed through it so that its ``read_paused`` stays true
  to the transport (a resume on the transport alone would leave uvicorn believing reading is paused);
- ``parser``: the ``httptools.HttpRequestParser``, replaced after a body read by the sink (the old
  one still counts the body's bytes), set up as uvicorn's ``__init__`` sets it up;
- the constructor's keywords ``config``, ``server_state``, ``app_state`` (a connection made by
  hand for the backlog answered at shutdown, as ``uvicorn.Server.startup``'s factory makes one).

Its methods overridden by the protocol subclass (``_protocol.GuardedProtocol``), each calling
uvicorn's own through ``super()``: ``connection_made``, ``connection_lost``, ``data_received``,
``eof_received`` (called by the sink), ``on_message_begin``, ``on_headers_complete``,
``on_message_complete`` (httptools' callbacks, which uvicorn implements), ``on_response_complete``
(the cycle's callback once an answer is sent), ``send_400_response`` (uvicorn's answer to bytes that
are no request) and ``shutdown`` (what ``uvicorn.Server.shutdown`` calls on every connection).

``uvicorn.protocols.http.httptools_impl.RequestResponseCycle`` (one per request):

- ``scope``: its request's scope; ``response_started``: its answer's head is written (so whether
  it keeps the connection alive is said); ``response_complete``: its answer is all sent;
- ``disconnected`` and ``message_event``: set together when the client goes, so that a reply being
  sent stops and a handler waiting in ``receive()`` wakes to ``http.disconnect``;
- ``keep_alive``: cleared so that its answer carries ``Connection: close`` (draining);
- ``body``: the body bytes the parser has passed on and ``receive()`` has not yet given out (taken
  by the sink); ``waiting_for_100_continue``: its ``Expect: 100-continue`` is not yet answered.

``uvicorn.Server`` (subclassed by ``_server.DrainingServer``): the methods ``handle_exit`` (the
signal handler), ``startup`` and ``shutdown`` are overridden; read: ``started``, ``config``,
``servers`` (the ``asyncio.Server`` objects listening), ``server_state.connections`` (the open
connections' protocols) and ``lifespan.state`` (the app state every connection's scope copies).

httptools: ``HttpRequestParser(protocol)`` and its ``set_dangerous_leniencies`` (0.6.3 and later;
public, listed because uvicorn's behaviour with pipelined requests depends on it).

asyncio (public API, listed for the behaviour relied on): ``Transport.set_protocol`` with an
``asyncio.BufferedProtocol`` mid-connection makes the selector transport (and uvloop's) read with
``recv_into`` into the new protocol's buffer from its next read on.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

__all__ = [
    "HttpToolsProtocol",
    "RequestResponseCycle",
    "answered",
    "client_gone",
    "close_after_answer",
    "continue_awaited",
    "continue_sent",
    "current_cycle",
    "cycle_scope",
    "event_loop",
    "has_started",
    "is_client_gone",
    "listening_servers",
    "make_connection",
    "open_connections",
    "parsed_body_bytes",
    "parsing_scope",
    "pipelined",
    "renew_parser",
    "reply_started",
    "resume_reading",
    "take_parsed_body",
]

# --- HttpToolsProtocol ----------------------------------------------------------------------------


def event_loop(protocol: HttpToolsProtocol) -> asyncio.AbstractEventLoop:
    """The connection's event loop (``protocol.loop``)."""
    return protocol.loop


def current_cycle(protocol: HttpToolsProtocol) -> RequestResponseCycle | None:
    """The newest request's cycle (``protocol.cycle``), None before the first head is complete."""
    return protocol.cycle


def parsing_scope(protocol: HttpToolsProtocol) -> dict[str, Any]:
    """The scope of the request being parsed (``protocol.scope``)."""
    return protocol.scope  # type: ignore[return-value]  # an HTTPScope TypedDict


def pipelined(protocol: HttpToolsProtocol) -> bool:
    """Whether parsed requests wait for the one being answered (``protocol.pipeline``)."""
    return bool(protocol.pipeline)


def resume_reading(protocol: HttpToolsProtocol) -> None:
    """Resume reading through uvicorn's flow control (``protocol.flow.resume_reading()``)."""
    protocol.flow.resume_reading()


def renew_parser(protocol: HttpToolsProtocol) -> None:
    """A fresh parser for the next request (``protocol.parser``), set up as uvicorn sets up its own:
    lenient to data after a ``Connection: close`` request, so that the first of pipelined requests
    is answered (httptools 0.6.3 and later)."""
    protocol.parser = httptools.HttpRequestParser(protocol)
    try:
        protocol.parser.set_dangerous_leniencies(lenient_data_after_close=True)
    except AttributeError:  # httptools < 0.6.3
        pass


def make_connection(protocol_class: type[HttpToolsProtocol], server: uvicorn.Server) -> HttpToolsProtocol:
    """A connection's protocol made as ``server``'s own factory makes one (its config, its state
    shared by every connection, the lifespan's app state); the loop is the running one."""
    return protocol_class(config=server.config, server_state=server.server_state, app_state=server.lifespan.state)


# --- RequestResponseCycle -------------------------------------------------------------------------


def answered(cycle: RequestResponseCycle) -> bool:
    """Whether the cycle's answer is all sent (``cycle.response_complete``)."""
    return cycle.response_complete


def reply_started(cycle: RequestResponseCycle) -> bool:
    """Whether the cycle's answer's head is written (``cycle.response_started``): its ``Connection``
    header is said, so the connection's fate after it can no longer change."""
    return cycle.response_started


def client_gone(cycle: RequestResponseCycle) -> None:
    """Tell the cycle its client went: a reply being sent stops, ``receive()`` answers disconnect
    (``cycle.disconnected``, ``cycle.message_event``), as uvicorn's ``connection_lost`` tells its
    newest cycle."""
    cycle.disconnected = True
    cycle.message_event.set()


def is_client_gone(cycle: RequestResponseCycle) -> bool:
    """Whether the cycle knows its client went (``cycle.disconnected``)."""
    return cycle.disconnected


def close_after_answer(cycle: RequestResponseCycle) -> None:
    """The cycle's answer carries ``Connection: close`` and ends the connection (``cycle.keep_alive``)."""
    cycle.keep_alive = False


def cycle_scope(cycle: RequestResponseCycle) -> dict[str, Any]:
    """The scope of the cycle's request (``cycle.scope``)."""
    return cycle.scope  # type: ignore[return-value]  # an HTTPScope TypedDict


def parsed_body_bytes(cycle: RequestResponseCycle) -> int:
    """Body bytes passed on by the parser and not yet given out by ``receive()`` (``len(cycle.body)``)."""
    return len(cycle.body)


def take_parsed_body(cycle: RequestResponseCycle) -> bytearray:
    """The body bytes the parser passed on and ``receive()`` has not given out; the cycle keeps none."""
    body, cycle.body = cycle.body, bytearray()
    return body


def continue_awaited(cycle: RequestResponseCycle) -> bool:
    """Whether the request's ``Expect: 100-continue`` is not yet answered (``cycle.waiting_for_100_continue``)."""
    return cycle.waiting_for_100_continue


def continue_sent(cycle: RequestResponseCycle) -> None:
    """Record that ``100 Continue`` was written, as uvicorn's ``receive()`` does after writing it."""
    cycle.waiting_for_100_continue = False


# --- uvicorn.Server -------------------------------------------------------------------------------


def listening_servers(server: uvicorn.Server) -> list[asyncio.Server]:
    """The ``asyncio.Server`` objects ``server`` listens with (``server.servers``)."""
    return list(server.servers)


def has_started(server: uvicorn.Server) -> bool:
    """Whether ``server`` finished starting: the lifespan ran and it listens (``server.started``)."""
    return server.started


def open_connections(server: uvicorn.Server) -> list[asyncio.Protocol]:
    """The protocols of ``server``'s open connections (``server.server_state.connections``), a copy."""
    return list(server.server_state.connections)
