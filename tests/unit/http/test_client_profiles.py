"""A call that names no device profile is checked by the replicas' profile (httpx.MockTransport servers).

Oracles: the documented codes of each profile (docs/semantics.md sections 8 and 9: an attribute or
shape failure is 561002 before CANN 9.1 and 561103 from 9.1; ``ascend950@9.1`` makes a dropless
index of -1 or ``N*K`` a +0.0 row, every other profile refuses it with 161002), and the requests
each fake server saw. The fake servers say their profile in ``GET /v1/info`` and in each answer's
``order``, as a moegrad server does (docs/protocol.md).
"""

from __future__ import annotations

import httpx
import msgpack
import numpy as np
import pytest

import moegrad
from moegrad import InvalidArgument
from moegrad.http._unnamed import RULE_SETS
from support.docexample import DOC_GRAD as GRAD
from support.docexample import DOC_IDX as IDX
from support.docexample import DOC_RESULT_BITS as BITS

TILING, NULLPTR_91, INVALID = 561002, 561103, 161002
MINUS_ONE = np.array([2, 0, 1, -1], np.int32)  # dropless, N*K = 4: -1 is a +0.0 row on ascend950@9.1 only


class Server:
    """A fake moegrad server of one profile: answers /v1/info, and every call with the example's grad_x."""

    def __init__(self, order: str | None, url: str = "http://a.test") -> None:
        self.order, self.url = order, url
        self.seen: list[tuple[str, str]] = []
        self.documents: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.method, request.url.path))
        if request.url.path == "/v1/info":
            return httpx.Response(200, json={"version": "v", "order": self.order})
        document = msgpack.unpackb(request.read(), raw=False)
        self.documents.append(document)
        items = document if isinstance(document, list) else [document]
        answers = [{"grad_x": {"dtype": "float32", "shape": [2, 2], "data": BITS.tobytes()}, "backend": "fake",
                    "order": item.get("order", self.order), "device": None, "timings_ms": {}} for item in items]
        answer = {"results": answers, "timings_ms": {}} if isinstance(document, list) else answers[0]
        return httpx.Response(200, content=msgpack.packb(answer), headers={"content-type": "application/msgpack"})


class Fleet:
    """Several fake servers behind one MockTransport, told apart by host."""

    def __init__(self, *servers: Server) -> None:
        self.servers = {httpx.URL(server.url).host: server for server in servers}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        return self.servers[request.url.host](request)


def client(handler, url: str | list[str] = "http://a.test", **kwargs) -> moegrad.Client:
    return moegrad.Client(url, transport=httpx.MockTransport(handler), retries=0, **kwargs)


def test_one_profile_of_each_set_of_rules():
    # before 9.1 (561002, -1 read outside the buffer), 9.1 on A2/A3 (561103), and the 950 at 9.1
    # (561103, negative and out-of-range dropless indices are +0.0 rows): docs/semantics.md section 9
    assert RULE_SETS == ("ascend910b@8.5", "ascend910b@9.1", "ascend950@9.1")


def test_a_call_every_profile_accepts_is_sent_at_once_and_its_answer_tells_the_profile():
    server = Server("ascend910b@9.0")
    with client(server) as c:
        assert c.moe_init_routing_v2_grad(GRAD, IDX, 2).view(np.uint32).tolist() == BITS.tolist()
        assert server.seen == [("POST", "/v1/moe_init_routing_v2_grad")]  # no /v1/info asked
        assert "order" not in server.documents[0]  # the server's own profile applies
        with pytest.raises(InvalidArgument) as refused:  # known from the answer: 9.0's code, no request
            c.moe_init_routing_v2_grad(GRAD, IDX, 3)
    assert (refused.value.aclnn_status, refused.value.field) == (TILING, "expanded_row_idx")
    assert len(server.seen) == 1


def test_a_rule_every_profile_shares_is_checked_with_no_request():
    with client(lambda request: pytest.fail(f"sent {request.url}")) as c, pytest.raises(InvalidArgument) as refused:
        c.moe_init_routing_v2_grad(GRAD.astype(np.float64), IDX, 2)
    assert (refused.value.aclnn_status, refused.value.field) == (INVALID, "grad_expanded_x")


@pytest.mark.parametrize(("order", "code"), [("ascend910b@9.0", TILING), ("ascend910_93@9.1", NULLPTR_91),
                                             ("ascend950@8.5", TILING), ("sequential", TILING)])
def test_where_the_profiles_disagree_the_server_is_asked_its_profile_once(order, code):
    server = Server(order)
    with client(server) as c:
        for _ in range(2):
            with pytest.raises(InvalidArgument) as refused:
                c.moe_init_routing_v2_grad(GRAD, IDX, 3)
            assert (refused.value.aclnn_status, refused.value.field) == (code, "expanded_row_idx")
            assert f"top_k={3}" in refused.value.message
    assert server.seen == [("GET", "/v1/info")]


@pytest.mark.parametrize("order", ["ascend950@9.1", "ascend950"])
def test_an_index_only_ascend950_at_9_1_defines_is_sent_to_such_a_server(order):
    server = Server(order)
    with client(server) as c:
        c.moe_init_routing_v2_grad(GRAD, MINUS_ONE, 2)
    assert server.seen == [("GET", "/v1/info"), ("POST", "/v1/moe_init_routing_v2_grad")]
    assert "order" not in server.documents[0]


@pytest.mark.asyncio
async def test_the_async_client_checks_by_the_server_s_profile_too():
    for order, refused_code in (("ascend950@9.1", None), ("ascend910b@9.0", INVALID)):
        server = Server(order)
        async with moegrad.AsyncClient("http://a.test", transport=httpx.MockTransport(server), retries=0) as c:
            if refused_code is None:
                await c.moe_init_routing_v2_grad(GRAD, MINUS_ONE, 2)
                continue
            with pytest.raises(InvalidArgument) as refused:
                await c.moe_init_routing_v2_grad(GRAD, MINUS_ONE, 2)
        assert refused.value.aclnn_status == refused_code and "profile ascend910b@9.0" in refused.value.message
        assert server.seen == [("GET", "/v1/info")]


@pytest.mark.parametrize("order", [None, "ascend999@10.0"])
def test_a_server_that_names_no_profile_this_client_knows_judges_the_call_itself(order):
    server = Server(order)
    with client(server) as c:
        c.moe_init_routing_v2_grad(GRAD, MINUS_ONE, 2)  # the fake accepts whatever it is sent
    assert server.seen == [("GET", "/v1/info"), ("POST", "/v1/moe_init_routing_v2_grad")]


def test_replicas_of_different_profiles_judge_what_they_disagree_on_and_info_says_so():
    fleet = Fleet(Server("ascend950@9.1", "http://a.test"), Server("ascend910b@9.1", "http://b.test"))
    with client(fleet, ["http://a.test", "http://b.test"]) as c:
        info = c.info()
        assert info["orders"] == {"http://a.test": "ascend950@9.1", "http://b.test": "ascend910b@9.1"}
        assert info["order"] == "ascend950@9.1"  # the first replica's own answer
        c.moe_init_routing_v2_grad(GRAD, MINUS_ONE, 2)  # sent unchecked: whichever replica takes it judges it
        c.run({"grad_expanded_x": moegrad.encode_tensor(GRAD), "expanded_row_idx": moegrad.encode_tensor(MINUS_ONE),
               "top_k": 2})
    posts = [seen for server in fleet.servers.values() for seen in server.seen if seen[0] == "POST"]
    assert len(posts) == 2


def test_a_replica_that_fails_is_asked_again():
    answers = iter([httpx.ConnectError("down")])
    server = Server("ascend910b@9.0")

    def flaky(request):
        if request.method == "POST" and (failure := next(answers, None)) is not None:
            server.seen.append(("POST", "failed"))
            raise failure
        return server(request)

    with moegrad.Client("http://a.test", transport=httpx.MockTransport(flaky), retries=1) as c:
        with pytest.raises(InvalidArgument):
            c.moe_init_routing_v2_grad(GRAD, IDX, 3)  # asks its profile: 9.0
        c.moe_init_routing_v2_grad(GRAD, IDX, 2)  # fails once (forgotten), then answers 9.0 (learnt again)
        with pytest.raises(InvalidArgument) as refused:
            c.moe_init_routing_v2_grad(GRAD, IDX, 3)
    assert refused.value.aclnn_status == TILING
    assert server.seen == [("GET", "/v1/info"), ("POST", "failed"), ("POST", "/v1/moe_init_routing_v2_grad")]


def test_a_batch_checks_its_unnamed_items_by_the_server_s_profile_and_sends_the_named_as_they_are():
    server = Server("ascend910b@9.1")
    named = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=GRAD, expanded_row_idx=MINUS_ONE, top_k=2,
                                             order="ascend950@9.1")
    document = {"grad_expanded_x": moegrad.encode_tensor(GRAD), "expanded_row_idx": moegrad.encode_tensor(MINUS_ONE),
                "top_k": 2}
    with client(server) as c:
        answers = c.batch([named, document])
    assert isinstance(answers[0], moegrad.GradResult)
    assert isinstance(answers[1], InvalidArgument) and answers[1].aclnn_status == INVALID
    assert "on profile ascend910b@9.1" in answers[1].message and "ascend950@9.1 accepts it" in answers[1].message
    assert server.seen == [("GET", "/v1/info"), ("POST", "/v1/moe_init_routing_v2_grad/batch")]
    assert [item.get("order") for item in server.documents[0]] == ["ascend950@9.1"]  # only the named one sent


def test_a_comparison_that_names_no_profile_is_checked_by_the_server_s():
    server = Server("ascend910b@9.0")
    with client(server) as c, pytest.raises(InvalidArgument) as refused:
        c.compare(GRAD, IDX, 3, candidate=np.zeros((1, 2), np.float32))
    assert refused.value.aclnn_status == TILING and server.seen == [("GET", "/v1/info")]


def test_a_replica_set_aside_does_not_stop_the_others_profile_from_judging():
    a, b = Server("ascend910b@9.0", "http://a.test"), Server("ascend910b@9.0", "http://b.test")
    fleet = Fleet(a, b)

    def b_down_after_info(request):
        if request.url.host == "b.test" and request.method == "POST":
            b.seen.append(("POST", "failed"))
            raise httpx.ConnectError("down")
        return fleet(request)

    with moegrad.Client(["http://a.test", "http://b.test"], transport=httpx.MockTransport(b_down_after_info),
                        retries=3) as c:
        assert c.info()["orders"] == {"http://a.test": "ascend910b@9.0", "http://b.test": "ascend910b@9.0"}
        while ("POST", "failed") not in b.seen:  # until a call tried b (set aside now, its profile forgotten)
            c.moe_init_routing_v2_grad(GRAD, IDX, 2)
        with pytest.raises(InvalidArgument) as refused:  # judged by a's profile, b not asked while set aside
            c.moe_init_routing_v2_grad(GRAD, IDX, 3)
    assert refused.value.aclnn_status == TILING
    assert b.seen.count(("GET", "/v1/info")) == 1


def test_one_record_per_replica_its_info_asked_once_for_the_profile_and_the_wire_formats():
    """What the client knows of a server is one record (docs/protocol.md, "GET /v1/info"): the
    /v1/info asked for the profile also tells the wire formats, so a large call that then decides
    between msgpack and frames asks nothing more (this server offers none: msgpack)."""
    server = Server("ascend910b@9.0")
    large = np.ones((2 * 1024, 64), np.float32)  # 512 KiB: over the frames threshold
    with client(server) as c:
        with pytest.raises(InvalidArgument):
            c.moe_init_routing_v2_grad(GRAD, IDX, 3)  # the profiles disagree: the server is asked
        with pytest.raises(moegrad.ServiceError):  # the fake answers a [2, 2] grad_x: a broken reply
            c.moe_init_routing_v2_grad(large, np.arange(2048, dtype=np.int32), 2, order="ascend910b@9.0")
        record = c._core.replicas.replicas[0].server
    assert server.seen == [("GET", "/v1/info"), ("POST", "/v1/moe_init_routing_v2_grad")]
    assert (record.profile, record.wire_formats, record.asked) == ("ascend910b@9.0", None, True)
