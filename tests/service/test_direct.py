"""Direct dispatch (api/direct.py) answers exactly as FastAPI's routing of the same handlers would.

Two apps from the same settings take the same requests: one as built, one with the DirectRoutes
middleware removed (every request through FastAPI's router). Their answers must agree in status,
content type, the headers a client acts on, and the body (less what differs per request: request
ids and timings); their metrics must count the same successes and failures. A probe on the direct
app's inner stack proves the inference POSTs really took the direct path and nothing else did.
"""

from __future__ import annotations

import json
import re

import msgpack
import pytest
from fastapi.testclient import TestClient
from servicekit import DOC_GRAD, DOC_IDX, MSGPACK_HEADERS, example_document, pack

from moegrad_service.api.direct import DirectRoutes
from moegrad_service.app import create_app
from moegrad_service.settings import Settings

GRAD = "/v1/moe_init_routing_v2_grad"
INFER = "/v2/models/moe_init_routing_v2_grad/infer"
INFER_V1 = "/v2/models/moe_init_routing_v2_grad/versions/1/infer"
TOKEN = {"authorization": "Bearer s3cret"}
HEADERS_THAT_MATTER = ("content-type", "retry-after", "www-authenticate", "allow")


def v2_json(**parameters) -> bytes:
    return json.dumps({
        "parameters": {"top_k": 2, **parameters},
        "inputs": [{"name": "grad_expanded_x", "shape": [4, 2], "datatype": "FP32", "data": DOC_GRAD.ravel().tolist()},
                   {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32", "data": DOC_IDX.tolist()}],
    }).encode()


def v2_binary() -> tuple[bytes, dict[str, str]]:
    header = json.dumps({
        "parameters": {"top_k": 2, "binary_data_output": True},
        "inputs": [{"name": "grad_expanded_x", "shape": [4, 2], "datatype": "FP32", "parameters": {"binary_data_size": 32}},
                   {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32", "parameters": {"binary_data_size": 16}}],
    }).encode()
    return header + DOC_GRAD.tobytes() + DOC_IDX.tobytes(), {"inference-header-content-length": str(len(header))}


BINARY_BODY, BINARY_HEADERS = v2_binary()
#: (name, method, path, body, headers): every kind of answer the two inference routes give, and
#: neighbours that must not be taken by the direct path (other methods, paths, models, versions).
REQUESTS = [
    ("v1 example", "POST", GRAD, pack(example_document()), MSGPACK_HEADERS),
    ("v1 x-msgpack", "POST", GRAD, pack(example_document()), {"content-type": "application/x-msgpack"}),
    ("v1 wrong media type", "POST", GRAD, pack(example_document()), {"content-type": "application/json"}),
    ("v1 no media type", "POST", GRAD, pack(example_document()), {}),
    ("v1 not msgpack", "POST", GRAD, b"\xc1\xc1", MSGPACK_HEADERS),
    ("v1 empty body", "POST", GRAD, b"", MSGPACK_HEADERS),
    ("v1 top_k=0", "POST", GRAD, pack(example_document(top_k=0)), MSGPACK_HEADERS),
    ("v1 repeated index", "POST", GRAD,
     pack(example_document(expanded_row_idx={"dtype": "int32", "shape": [4], "data": bytes(16)})), MSGPACK_HEADERS),
    ("v1 unknown field", "POST", GRAD, pack(example_document(colour="red")), MSGPACK_HEADERS),
    ("v1 too large", "POST", GRAD, b"\x80" * 5000, MSGPACK_HEADERS),
    ("v1 bad timeout", "POST", GRAD, pack(example_document()), {**MSGPACK_HEADERS, "x-request-timeout": "soon"}),
    ("v1 sequential", "POST", GRAD, pack(example_document(order="sequential")), MSGPACK_HEADERS),
    ("v1 GET (405)", "GET", GRAD, b"", {}),
    ("v1 trailing slash", "POST", GRAD + "/", pack(example_document()), MSGPACK_HEADERS),
    ("v2 JSON", "POST", INFER, v2_json(), {}),
    ("v2 JSON, version 1", "POST", INFER_V1, v2_json(), {}),
    ("v2 binary", "POST", INFER, BINARY_BODY, BINARY_HEADERS),
    ("v2 top_k=3", "POST", INFER, v2_json(top_k=3), {}),
    ("v2 not JSON", "POST", INFER, b"{", {}),
    ("v2 gzip", "POST", INFER, v2_json(), {"content-encoding": "gzip"}),
    ("v2 too large", "POST", INFER, b" " * 5000, {}),
    ("v2 header length of 5000 digits", "POST", INFER, v2_json(), {"inference-header-content-length": "9" * 5000}),
    ("v2 unknown model", "POST", "/v2/models/other/infer", v2_json(), {}),
    ("v2 unknown version", "POST", "/v2/models/moe_init_routing_v2_grad/versions/2/infer", v2_json(), {}),
    ("v2 GET infer", "GET", INFER, b"", {}),
]
DIRECT = {"POST " + path for path in (GRAD, INFER, INFER_V1)}


def inner_of(app, kind: type):
    """The instance of middleware ``kind`` in a started app's stack."""
    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, kind):
        layer = getattr(layer, "app", None)
    assert layer is not None, f"no {kind.__name__} in the stack"
    return layer


def comparable(response) -> tuple:
    """What a client acts on, less what differs per request (ids, timings, the sequential order's
    own value is kept)."""
    headers = tuple((name, response.headers.get(name)) for name in HEADERS_THAT_MATTER)
    headers += ("binary", "inference-header-content-length" in response.headers),  # its value varies with the timings
    kind = response.headers.get("content-type", "")
    if kind == "application/msgpack":
        body = msgpack.unpackb(response.content, raw=False)
        body.pop("timings_ms")
    elif "json" in kind and response.headers.get("inference-header-content-length") is None:
        body = response.json()
        if isinstance(body, dict):
            body.pop("request_id", None)
            body.get("parameters", {}).pop("queue_ms", None)
            body.get("parameters", {}).pop("compute_ms", None)
    else:
        size = int(response.headers.get("inference-header-content-length", 0))
        header = json.loads(response.content[:size]) if size else None
        if header:
            header["parameters"].pop("queue_ms")
            header["parameters"].pop("compute_ms")
        body = (header, response.content[size:])
    return response.status_code, headers, json.dumps(body, sort_keys=True, default=repr)


def counters(client) -> list[str]:
    """The success and failure counter lines of /metrics (labels and values)."""
    text = client.get("/metrics", headers=TOKEN).text
    return sorted(line for line in text.splitlines()
                  if re.match(r"moegrad_inference_request_(success|failure)_total\{", line))


@pytest.fixture(params=[False, True], ids=["open", "with-tokens"])
def both(request):
    """(direct client, routed client, pass-through log of the direct app's inner stack)."""
    settings = Settings(backend="reference", max_body_bytes=4096,
                        auth_tokens=["s3cret"] if request.param else [])
    direct_app, routed_app = create_app(settings), create_app(settings)
    routed_app.user_middleware = [m for m in routed_app.user_middleware if m.cls is not DirectRoutes]
    with TestClient(direct_app, raise_server_exceptions=False) as direct, \
            TestClient(routed_app, raise_server_exceptions=False) as routed:
        direct.get("/health/live")  # builds the stack
        layer = inner_of(direct_app, DirectRoutes)
        passed: list[str] = []
        inner = layer.app

        async def recording(scope, receive, send):
            passed.append(f"{scope['method']} {scope['path']}")
            await inner(scope, receive, send)

        layer.app = recording
        yield direct, routed, passed, request.param


def test_direct_and_routed_answers_agree(both):
    direct, routed, passed, tokens = both
    seen = []
    for name, method, path, body, headers in REQUESTS:
        for auth in ([{}, TOKEN, {"authorization": "Bearer wrong"}] if tokens else [{}]):
            sent = {**headers, **auth}
            passed.clear()
            a = direct.request(method, path, content=body, headers=sent)
            b = routed.request(method, path, content=body, headers=sent)
            assert comparable(a) == comparable(b), (name, auth)
            assert a.headers["x-request-id"] and b.headers["x-request-id"]
            took_direct = f"{method} {path}" in DIRECT
            assert passed == ([] if took_direct else [f"{method} {path}"]), name
            seen.append(a.status_code)
    assert counters(direct) == counters(routed)
    # the list covers success and each kind of refusal
    assert {200, 400, 401 if tokens else 200, 404, 405, 413, 415, 422} <= set(seen)


def test_an_unexpected_error_is_a_500_problem_on_both_paths(serve, monkeypatch):
    """A handler bug (not a client's mistake) is a 500 problem document, not a dropped connection."""
    from moegrad_service.api import inputs

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(inputs, "decode_body", broken)
    with serve() as client:
        response = client.post(GRAD, content=pack(example_document()), headers=MSGPACK_HEADERS)
        assert response.status_code == 500
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["title"] == "Internal error" and "a bug" in response.json()["detail"]
