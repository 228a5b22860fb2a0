"""The route owns a request's intake: its admission is held while the answer is sent, and released
once after it on every path (api/routing.py's EndpointRoute, api/intake.py's Intake).

The rule (docs/operations.md, "Resources"): a request holds twice its body's bytes from admission
until its answer is sent. The routes here are plain EndpointRoutes over a Memory of their own, driven
as an ASGI server would drive them; the bytes held are read from the budget at each step.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from starlette.responses import Response

from moegrad import InvalidArgument
from moegrad_service.api.intake import Intake
from moegrad_service.api.routing import EndpointRoute
from moegrad_service.memory import Memory
from moegrad_service.settings import Settings

BODY = b"x" * 1000


def _scope(memory: Memory, body: bytes = BODY) -> dict:
    return {
        "type": "http",
        "method": "POST",
        "path": "/",
        "query_string": b"",
        "headers": [(b"content-type", b"application/msgpack"), (b"content-length", str(len(body)).encode())],
        "state": {"dataplane": SimpleNamespace(admit=Memory.admit.__get__(memory)), "settings": Settings()},
    }


def _serve(handler, memory: Memory, *, fail_send: bool = False) -> dict:
    """Drive ``handler``'s route once; what the budget held while the answer was sent, and after."""
    seen: dict = {"while_sent": [], "status": None}

    async def receive():
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            seen["status"] = message["status"]
            seen["headers"] = dict(message["headers"])
        seen["while_sent"].append(memory.budget.held_bytes)
        if fail_send:
            raise OSError("the client went away while the answer was sent")

    route = EndpointRoute("/", handler, operation={})
    asyncio.run(route.app(_scope(memory), receive, send))
    seen["after"] = memory.budget.held_bytes
    return seen


async def _reads_and_answers(request, intake: Intake) -> Response:
    body = await intake.read(limit=1 << 20)
    assert bytes(body) == BODY
    return Response(b"ok")


async def _reads_then_fails(request, intake: Intake) -> Response:
    await intake.read(limit=1 << 20)
    raise InvalidArgument("refused once read", aclnn_status=161002, field="top_k")


async def _fails_before_reading(request, intake: Intake) -> Response:
    raise InvalidArgument("refused before the body", aclnn_status=161002, field="top_k")


def test_the_admission_is_held_while_the_answer_is_sent_and_released_after():
    memory = Memory(1 << 30)
    seen = _serve(_reads_and_answers, memory)
    assert seen["status"] == 200
    assert seen["while_sent"] == [2 * len(BODY)] * 2  # the head and the body: twice the body's bytes
    assert seen["after"] == 0


def test_an_error_after_the_body_is_read_is_answered_and_released():
    memory = Memory(1 << 30)
    seen = _serve(_reads_then_fails, memory)
    assert seen["status"] == 422 and seen["after"] == 0
    assert b"connection" not in seen["headers"]  # the body was all read: the connection stays open


def test_an_answer_before_the_body_is_read_closes_the_connection_and_holds_nothing():
    memory = Memory(1 << 30)
    seen = _serve(_fails_before_reading, memory)
    assert seen["status"] == 422 and seen["while_sent"] == [0, 0] and seen["after"] == 0
    assert seen["headers"][b"connection"] == b"close"


def test_a_send_that_fails_still_releases_the_admission():
    memory = Memory(1 << 30)
    with pytest.raises(OSError):
        _serve(_reads_and_answers, memory, fail_send=True)
    assert memory.budget.held_bytes == 0


def test_a_refused_admission_holds_nothing():
    memory = Memory(len(BODY))  # twice the body could never fit: 413 before a byte is read
    seen = _serve(_reads_and_answers, memory)
    assert seen["status"] == 413 and seen["while_sent"] == [0, 0] and seen["after"] == 0
