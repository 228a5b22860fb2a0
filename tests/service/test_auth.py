"""Bearer-token authentication in-process: who may call what, where tokens come from, and how they are compared.

The rules under test are docs/protocol.md's and docs/operations.md's: authentication is off by default; with
tokens configured every route needs ``Authorization: Bearer <token>`` except the liveness and
readiness probes (v1 and v2) and the OpenAPI document; ``/metrics`` needs one unless
``metrics_public`` is set; a failure is 401 with ``WWW-Authenticate: Bearer`` and a problem document.
Tokens come from ``auth_tokens`` (a comma-separated environment variable) and ``auth_tokens_file``
(one a line; blank lines and ``#`` comments skipped). The comparison is constant-time by
construction: SHA-256 digests (always 32 bytes, whatever the token) through ``hmac.compare_digest``,
against every accepted token every time.
"""

from __future__ import annotations

import hmac

import numpy as np
import pytest
from fastapi.testclient import TestClient

from moegrad_service.app import create_app
from moegrad_service.settings import Settings
from support.docexample import example_document
from support.servicekit import grad_x_of, pack, post

F32_03, F32_07 = np.float32(0.3).view(np.uint32), np.float32(0.70000005).view(np.uint32)
SHA256_DIGEST_BYTES = 32  # FIPS 180-4: SHA-256 digests are 256 bits
OPEN = ["/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready", "/openapi.json"]
PROTECTED_GETS = ["/v1/info", "/v2"]


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def assert_unauthorized(response) -> dict:
    """401 + WWW-Authenticate: Bearer, with v1's problem document (v2 routes answer the Open
    Inference Protocol's ``{"error": ...}`` instead; docs/protocol.md)."""
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"].split()[0] == "Bearer"
    if response.request.url.path.startswith("/v2"):
        assert isinstance(response.json()["error"], str)
        return {"detail": response.json()["error"]}
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["status"] == 401 and problem["title"] and problem["detail"]
    return problem


def assert_example_result(response) -> None:
    assert response.status_code == 200, response.text
    assert (grad_x_of(response).view(np.uint32) == [[F32_03, F32_03], [F32_07, F32_07]]).all()


@pytest.fixture
def tokens_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# team A\nfile-token-one\n\n   file-token-two   \n#commented-out-token\n", encoding="utf-8")
    return path


@pytest.fixture
def guarded(serve, tokens_file):
    with serve(auth_tokens=["env-token"], auth_tokens_file=tokens_file) as client:
        yield client


def test_no_tokens_configured_means_no_authentication(client):
    assert_example_result(post(client, example_document()))
    for path in OPEN + PROTECTED_GETS + ["/metrics"]:
        assert client.get(path).status_code == 200, path


def test_missing_token_is_401_with_www_authenticate_bearer(guarded):
    assert_unauthorized(post(guarded, example_document()))
    for path in PROTECTED_GETS + ["/metrics"]:
        assert_unauthorized(guarded.get(path))


@pytest.mark.parametrize("header", [
    "Bearer wrong-token",
    "Bearer env-token-but-longer",
    "Bearer env-toke",
    "Bearer " + "x" * 10_000,
    "Bearer ",
    "Basic env-token",
    "env-token",
    "Bearer #commented-out-token",
    "Bearer # team A",
    "Bearer file-token-one,file-token-two",
])
def test_wrong_or_malformed_token_is_401_and_not_echoed(guarded, header):
    problem = assert_unauthorized(post(guarded, example_document(), headers={"authorization": header}))
    presented = header.partition(" ")[2]
    assert len(presented) < 8 or presented not in problem["detail"]  # the refusal never repeats the token


@pytest.mark.parametrize("token", ["env-token", "file-token-one", "file-token-two"])
def test_each_accepted_token_from_setting_and_file_is_admitted(guarded, token):
    assert_example_result(post(guarded, example_document(), headers=bearer(token)))
    for path in PROTECTED_GETS + ["/metrics"]:
        assert guarded.get(path, headers=bearer(token)).status_code == 200, path
    assert_example_result(post(guarded, example_document(), headers={"authorization": f"bearer   {token}  "}))


def test_every_route_of_the_app_needs_a_token_except_the_open_ones(guarded):
    """Walks the app's own API description, so a route added later without the authenticated route
    class is caught here: each method of each path, path parameters filled with the served model,
    answers 401 without a token unless the path is a probe."""
    filled = {"model_name": "moe_init_routing_v2_grad", "model_version": "1"}
    paths = guarded.get("/openapi.json").json()["paths"]
    checked = 0
    for template, operations in paths.items():
        path = template.format(**filled)
        for method in operations:
            response = guarded.request(method.upper(), path, content=b"")
            if path in OPEN:
                assert response.status_code != 401, (method, path)
            else:
                assert_unauthorized(response)
                checked += 1
    assert checked >= 10  # v1 grad, compare and info, metrics, the v2 metadata, ready and infer routes, ...
    assert_unauthorized(guarded.get("/v2/no/such/route"))  # v2's catch-all (not described) too


def test_probes_and_openapi_stay_open(guarded):
    for path in OPEN:
        assert guarded.get(path).status_code == 200, path
        assert guarded.get(path, headers=bearer("wrong")).status_code == 200, path


def test_metrics_public_opens_only_metrics(serve):
    with serve(auth_tokens=["t0k3n"], metrics_public=True) as client:
        response = client.get("/metrics")
        assert response.status_code == 200 and "moegrad_inference_request_success" in response.text
        assert_unauthorized(client.get("/v1/info"))
        assert_unauthorized(post(client, example_document()))
        assert_example_result(post(client, example_document(), headers=bearer("t0k3n")))


def test_tokens_from_the_environment_variable(monkeypatch):
    monkeypatch.setenv("MOEGRAD_AUTH_TOKENS", " first-token , second-token,, ")
    settings = Settings(backend="reference")
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        for token in ("first-token", "second-token"):
            assert_example_result(post(client, example_document(), headers=bearer(token)))
        assert_unauthorized(post(client, example_document(), headers=bearer("first-token , second-token")))
        assert_unauthorized(post(client, example_document()))


def test_an_unreadable_tokens_file_fails_at_startup(tmp_path):
    with pytest.raises(OSError):
        create_app(Settings(backend="reference", auth_tokens_file=tmp_path / "absent"))


def test_comparison_is_constant_time_by_construction(guarded, monkeypatch):
    """Every request compares fixed-length digests with hmac.compare_digest, against every accepted
    token (three here), whatever the presented token's length and whether it matches: neither the
    token's length nor the position of a match can change the work done."""
    calls: list[tuple[type, int, type, int]] = []
    original = hmac.compare_digest

    def recording(a, b):
        calls.append((type(a), len(a), type(b), len(b)))
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    per_request = {}
    for name, token in [("short wrong", "x"), ("long wrong", "y" * 4096), ("first accepted", "env-token"),
                        ("last accepted", "file-token-two")]:
        calls.clear()
        response = guarded.get("/v1/info", headers=bearer(token))
        assert response.status_code == (200 if "accepted" in name else 401)
        per_request[name] = list(calls)
    for name, recorded in per_request.items():
        assert recorded == [(bytes, SHA256_DIGEST_BYTES, bytes, SHA256_DIGEST_BYTES)] * 3, name


def test_probes_stay_open_under_a_root_path(tokens_file):
    """Behind a proxy that strips a prefix (ASGI root_path), the open paths are still the probes."""
    app = create_app(Settings(backend="reference", auth_tokens=["env-token"]))
    with TestClient(app, raise_server_exceptions=False, root_path="/api") as client:
        for path in ("/api/health/live", "/api/health/ready", "/api/v2/health/live"):
            assert client.get(path).status_code == 200, path
        assert_unauthorized(client.get("/api/v1/info"))
        assert_unauthorized(client.post("/api/v1/moe_init_routing_v2_grad", content=pack(example_document()),
                                        headers={"content-type": "application/msgpack"}))
        assert client.get("/api/v1/info", headers=bearer("env-token")).status_code == 200


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/no/such/route"),                         # an unknown path: 404 once admitted
    ("GET", "/v1/moe_init_routing_v2_grad"),           # a wrong method: 405 once admitted
    ("GET", "/health/live/"),                          # a trailing slash: a redirect once admitted
    ("DELETE", "/v2/models/moe_init_routing_v2_grad"),
])
def test_a_request_without_a_token_learns_nothing_about_the_routes(guarded, method, path):
    """The token is checked before routing: what a path would answer once admitted stays unknown."""
    response = guarded.request(method, path, follow_redirects=False)
    assert_unauthorized(response)
    assert "location" not in response.headers and "allow" not in response.headers
    assert guarded.request(method, path, headers=bearer("env-token"), follow_redirects=False).status_code in (
        307, 404, 405)
