"""Client and AsyncClient against a real moegrad-service (uvicorn subprocess, reference backend).

Expected values: the operator documentation's example (float32 bits of 0.3 and 0.70000005), the
in-process reference ``moegrad.moe_init_routing_v2_grad`` for random calls (bitwise), and the
documentation's return codes (docs/operator.md; docs/semantics.md section 8) for every validation rule's code and field.
"""

from __future__ import annotations

import asyncio
import math
import socket

import httpx
import ml_dtypes
import numpy as np
import pytest

import moegrad
from moegrad import (
    AsyncClient,
    Client,
    InvalidArgument,
    MalformedRequest,
    PayloadTooLarge,
    TransportError,
    Unauthorized,
)
from support.bits import bits
from support.docexample import DOC_GRAD as EXAMPLE_X
from support.docexample import DOC_IDX as EXAMPLE_IDX
from support.docexample import DOC_RESULT_BITS as EXAMPLE_BITS

try:  # the forward-routing generator a colleague keeps in tests/support/routing.py
    from support import routing
except ImportError:  # pragma: no cover - depends on the tree
    routing = None

assert np.array_equal(np.array([[0.3, 0.3], [0.70000005, 0.70000005]], np.float32).view(np.uint32), EXAMPLE_BITS)

NULLPTR, INVALID = 161001, 161002  # documentation, "Return Value"
SHAPE = 561103  # rules 3-6 on the default profile, ascend910b@9.1 (CANN 9.1's documented code; 561002 before)
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def random_call(rng: np.random.Generator, mode: str, dtype, top_k: int, tokens: int = 7, hidden: int = 33) -> dict:
    """Keyword arguments of one valid call: a forward routing's expanded_row_idx and a random gradient.

    Uses the forward-routing generator ``tests/support/routing.py`` when the tree has it, else random
    permutations with the same shapes and ranges.
    """
    if routing is not None:
        routed = routing.route(rng, tokens, top_k, experts=max(top_k, 8), mode=mode)
        grad = (rng.standard_normal(routed.grad_shape(hidden)) * 4).astype(dtype)
        return {"grad_expanded_x": grad, **routed.kwargs()}
    slots = tokens * top_k
    idx = rng.permutation(slots).astype(np.int32)  # slot -> its row of grad_expanded_x, every row once
    if mode == "dropless":
        shape, extra = (slots, hidden), {}
    elif mode == "active":
        active = max(1, (2 * slots) // 3)  # rows >= A were never materialised: those slots are skipped
        shape, extra = (active, hidden), {"active_num": active}
    else:  # drop/pad: E experts of capacity C; about a quarter of the slots are dropped (-1)
        experts = 3
        capacity = math.ceil(slots / experts)
        kept = rng.random(slots) < 0.75
        idx = np.full(slots, -1, dtype=np.int32)
        idx[kept] = rng.permutation(experts * capacity)[: int(kept.sum())]
        shape, extra = (experts, capacity, hidden), {"drop_pad_mode": 1}
    grad = (rng.standard_normal(shape) * 4).astype(dtype)
    return {"grad_expanded_x": grad, "expanded_row_idx": idx, "top_k": top_k, **extra}


def reference(kwargs: dict, order: str | None = None) -> np.ndarray:
    return moegrad.moe_init_routing_v2_grad(**kwargs, **({"order": order} if order else {}))


# ---- the documentation's example -----------------------------------------------------------------


def test_example_through_client(server_url):
    with Client(server_url) as client:
        grad_x = client.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
        result = client.run(moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=EXAMPLE_X, expanded_row_idx=EXAMPLE_IDX,
                                                              top_k=2))
    assert grad_x.dtype == np.float32
    np.testing.assert_array_equal(bits(grad_x), EXAMPLE_BITS)
    np.testing.assert_array_equal(bits(result.grad_x), EXAMPLE_BITS)
    assert (result.backend, result.order, result.device) == ("reference", "ascend910b@9.1", None)
    assert result.request_id
    assert set(result.timings_ms) >= {"queue", "compute", "total"}


@pytest.mark.asyncio
async def test_example_through_async_client(server_url):
    async with AsyncClient(server_url) as client:
        grad_x = await client.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    np.testing.assert_array_equal(bits(grad_x), EXAMPLE_BITS)


def test_info_ready_live(server_url):
    with Client(server_url) as client:
        info = client.info()
        assert client.ready() is True
        assert client.live() is True
    assert info["backend"] == "reference" and info["order"] == "ascend910b@9.1"
    assert info["version"] == moegrad.__version__
    assert {"device", "streams", "max_queue", "max_body_bytes", "max_elements", "request_timeout_s"} <= set(info)


def test_probes_are_false_when_nothing_listens():
    with Client(closed_port_url(), retries=0) as client:
        assert client.ready() is False
        assert client.live() is False
        with pytest.raises(TransportError):
            client.info()


# ---- random calls equal the in-process reference bitwise -----------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", ["dropless", "active", "drop_pad"])
@pytest.mark.parametrize("top_k", [1, 3, 8, 17])
def test_random_calls_match_reference_bitwise(server_url, dtype, mode, top_k):
    rng = np.random.default_rng([top_k, len(mode), len(dtype)])
    kwargs = random_call(rng, mode, DTYPES[dtype], top_k)
    want = reference(kwargs)
    with Client(server_url) as client:
        got = client.moe_init_routing_v2_grad(**kwargs)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize(("order", "profile"), [("ascend910b", "ascend910b@9.1"), ("sequential", "sequential"),
                                               ("ascend950@9.0", "ascend950@9.0")])
def test_orders_match_reference_bitwise(server_url, order, profile):
    kwargs = random_call(np.random.default_rng(5), "dropless", np.float32, top_k=6, tokens=50, hidden=64)
    with Client(server_url) as client:
        result = client.run(moegrad.MoeInitRoutingV2GradCall(**kwargs, order=order))
    assert result.order == profile  # an alias answers as the profile it names
    np.testing.assert_array_equal(bits(result.grad_x), bits(reference(kwargs, order)))


def test_empty_call_gives_empty_result(server_url):
    x, idx = np.zeros((0, 5), np.float32), np.zeros(0, np.int32)  # documentation: empty tensors are supported
    with Client(server_url) as client:
        grad_x = client.moe_init_routing_v2_grad(x, idx, 2)
    assert grad_x.shape == (0, 5) and grad_x.dtype == np.float32


def test_duplicates_allowed_when_asked(server_url):
    idx = np.array([2, 0, 2, 3], np.int32)
    with Client(server_url) as client:
        grad_x = client.moe_init_routing_v2_grad(EXAMPLE_X, idx, 2, allow_duplicate_indices=True)
    expected = np.stack([EXAMPLE_X[2] + EXAMPLE_X[0], EXAMPLE_X[2] + EXAMPLE_X[3]])  # float32 adds, K=2
    np.testing.assert_array_equal(bits(grad_x), bits(expected))


@pytest.mark.asyncio
async def test_32_concurrent_async_calls(server_url):
    rng = np.random.default_rng(32)
    modes, dtypes = ["dropless", "active", "drop_pad"], list(DTYPES)
    calls = [random_call(rng, modes[i % 3], DTYPES[dtypes[i % 3 - 1]], top_k=1 + i % 9, tokens=5 + i, hidden=16 + i)
             for i in range(32)]
    async with AsyncClient(server_url) as client:
        results = await asyncio.gather(*(client.moe_init_routing_v2_grad(**kwargs) for kwargs in calls))
    for kwargs, got in zip(calls, results, strict=True):
        want = reference(kwargs)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(bits(got), bits(want))


# ---- every validation rule, from the server and from the local check -----------------------------


def tensor(array: np.ndarray) -> dict:
    array = np.ascontiguousarray(array)
    name = {np.dtype("<f4"): "float32", np.dtype("<i4"): "int32", np.dtype("<f2"): "float16"}[array.dtype]
    return {"dtype": name, "shape": list(array.shape), "data": array.tobytes()}


def document(**overrides) -> dict:
    """The documentation's example as a wire document built by hand; None removes a field."""
    doc = {"grad_expanded_x": tensor(EXAMPLE_X), "expanded_row_idx": tensor(EXAMPLE_IDX), "top_k": 2,
           "drop_pad_mode": 0, "active_num": 0}
    doc.update(overrides)
    return {key: value for key, value in doc.items() if value is not None}


EPC = np.zeros((2, 2, 2), np.float32)  # drop/pad grad_expanded_x [E=2, C=2, H=2]: indices in [-1, 4)

RULES = [
    # rule 1: a missing tensor
    ("missing grad", document(grad_expanded_x=None), NULLPTR, "grad_expanded_x"),
    ("missing idx", document(expanded_row_idx=None), NULLPTR, "expanded_row_idx"),
    # rule 2: dtypes
    ("grad int32", document(grad_expanded_x=tensor(EXAMPLE_X.astype(np.int32))), INVALID, "grad_expanded_x"),
    ("idx float32", document(expanded_row_idx=tensor(EXAMPLE_IDX.astype(np.float32))), INVALID, "expanded_row_idx"),
    ("idx float16", document(expanded_row_idx=tensor(EXAMPLE_IDX.astype(np.float16))), INVALID, "expanded_row_idx"),
    # rule 3: attribute values
    ("drop_pad_mode 2", document(drop_pad_mode=2), SHAPE, "drop_pad_mode"),
    ("drop_pad_mode -1", document(drop_pad_mode=-1), SHAPE, "drop_pad_mode"),
    ("top_k 0", document(top_k=0), SHAPE, "top_k"),
    ("top_k -3", document(top_k=-3), SHAPE, "top_k"),
    ("active_num -1", document(active_num=-1), SHAPE, "active_num"),
    # rule 4: ranks
    ("grad rank 3 in mode 0", document(grad_expanded_x=tensor(EXAMPLE_X.reshape(4, 1, 2))), SHAPE, "grad_expanded_x"),
    ("grad rank 2 in mode 1", document(drop_pad_mode=1), SHAPE, "grad_expanded_x"),
    ("grad rank 1", document(grad_expanded_x=tensor(EXAMPLE_X.reshape(8))), SHAPE, "grad_expanded_x"),
    ("idx rank 2", document(expanded_row_idx=tensor(EXAMPLE_IDX.reshape(2, 2))), SHAPE, "expanded_row_idx"),
    # rule 5: dim 0
    ("dropless rows", document(grad_expanded_x=tensor(EXAMPLE_X[:3])), SHAPE, "grad_expanded_x"),
    ("active rows", document(active_num=3), SHAPE, "grad_expanded_x"),
    # rule 6: divisibility
    ("len % top_k", document(top_k=3), SHAPE, "expanded_row_idx"),
    # rule 7: index values and uniqueness
    ("dropless idx = N*K", document(expanded_row_idx=tensor(np.array([2, 0, 1, 4], np.int32))), INVALID, "expanded_row_idx"),
    ("dropless idx -1", document(expanded_row_idx=tensor(np.array([2, 0, -1, 3], np.int32))), INVALID, "expanded_row_idx"),
    ("drop/pad idx = E*C", document(drop_pad_mode=1, grad_expanded_x=tensor(EPC),
                                    expanded_row_idx=tensor(np.array([-1, 0, 4, 1], np.int32))), INVALID, "expanded_row_idx"),
    ("drop/pad idx -2", document(drop_pad_mode=1, grad_expanded_x=tensor(EPC),
                                 expanded_row_idx=tensor(np.array([-2, 0, 3, 1], np.int32))), INVALID, "expanded_row_idx"),
    ("duplicate", document(expanded_row_idx=tensor(np.array([2, 0, 2, 3], np.int32))), INVALID, "expanded_row_idx"),
    ("drop/pad duplicate", document(drop_pad_mode=1, grad_expanded_x=tensor(EPC),
                                    expanded_row_idx=tensor(np.array([-1, 1, -1, 1], np.int32))), INVALID, "expanded_row_idx"),
]


@pytest.mark.parametrize(("doc", "code", "field"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule_from_the_server(server_url, doc, code, field):
    with Client(server_url, validate=False) as client:
        with pytest.raises(InvalidArgument) as info:
            client.run(doc)
        np.testing.assert_array_equal(bits(client.run(document()).grad_x), EXAMPLE_BITS)  # still serving
    assert (info.value.aclnn_status, info.value.field) == (code, field)
    assert info.value.aclnn_name == moegrad.AclnnStatus(code).name


class Recording(httpx.HTTPTransport):
    """The network, with each request's path recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return super().handle_request(request)


@pytest.mark.parametrize(("doc", "code", "field"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule_from_the_local_check(server_url, doc, code, field):
    # the call names no profile: it is checked by the server's (its /v1/info's order, ascend910b@9.1
    # by default), asked only when the profiles' rules disagree about it; the call itself is never sent
    sent = Recording()
    with Client(server_url, retries=0, transport=sent) as client, pytest.raises(InvalidArgument) as info:
        client.run(doc)
    assert (info.value.aclnn_status, info.value.field) == (code, field)
    assert set(sent.paths) <= {"/v1/info"}
    with Client(server_url, validate=False) as client, pytest.raises(InvalidArgument) as server:
        client.run(doc)
    assert info.value.message == server.value.message  # the server's own answer, word for word


@pytest.mark.parametrize(("doc", "code", "field"), [r[1:] for r in RULES[:5]], ids=[r[0] for r in RULES[:5]])
def test_a_rule_every_profile_shares_needs_no_server(doc, code, field):
    # nothing listens at this URL: a request that got sent would raise TransportError instead
    with Client(closed_port_url(), retries=0) as client, pytest.raises(InvalidArgument) as info:
        client.run(doc)
    assert (info.value.aclnn_status, info.value.field) == (code, field)


@pytest.mark.asyncio
async def test_rule_from_the_server_async(server_url):
    async with AsyncClient(server_url, validate=False) as client:
        with pytest.raises(InvalidArgument) as info:
            await client.moe_init_routing_v2_grad(EXAMPLE_X, np.array([2, 0, 2, 3], np.int32), 2)
    assert (info.value.aclnn_status, info.value.field) == (INVALID, "expanded_row_idx")


def test_keyword_api_reaches_the_server_unchecked(server_url):
    with Client(server_url, validate=False) as client:
        with pytest.raises(InvalidArgument) as info:
            client.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 3)
        assert (info.value.aclnn_status, info.value.field) == (SHAPE, "expanded_row_idx")
        with pytest.raises(InvalidArgument) as info:
            client.moe_init_routing_v2_grad(None, EXAMPLE_IDX, 2)
        assert (info.value.aclnn_status, info.value.field) == (NULLPTR, "grad_expanded_x")


def test_unknown_field_from_the_server_and_locally(server_url):
    doc = document(mystery=1)
    with Client(server_url, validate=False) as client, pytest.raises(MalformedRequest) as info:
        client.run(doc)
    assert type(info.value) is MalformedRequest and info.value.field == "mystery"
    with Client(closed_port_url(), retries=0) as client, pytest.raises(MalformedRequest) as info:
        client.run(doc)
    assert info.value.field == "mystery"


# ---- servers with custom settings ----------------------------------------------------------------


def test_body_over_the_limit_is_payload_too_large(server_factory):
    url = server_factory(max_body_bytes=4096)
    big = np.zeros((64, 32), np.float32)  # 8 KiB of data
    with Client(url) as client:
        with pytest.raises(PayloadTooLarge):
            client.moe_init_routing_v2_grad(big, np.arange(64, dtype=np.int32), 2)
        np.testing.assert_array_equal(bits(client.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)), EXAMPLE_BITS)


def test_bearer_token(server_factory):
    url = server_factory(auth_tokens="e2e-token")
    with Client(url) as client, pytest.raises(Unauthorized) as info:
        client.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)
    assert info.value.status_code == 401
    with Client(url, token="wrong") as client, pytest.raises(Unauthorized):
        client.info()
    with Client(url, token="e2e-token") as client:
        np.testing.assert_array_equal(bits(client.moe_init_routing_v2_grad(EXAMPLE_X, EXAMPLE_IDX, 2)), EXAMPLE_BITS)
        assert client.info()["backend"] == "reference"
