"""A call that names no device profile, against two real servers of different profiles.

Two reference-backend servers on loopback: one with ``MOEGRAD_ORDER=ascend950@9.1``, one with
``ascend910b@9.1``. A dropless call whose index holds -1 is defined on the first (the 950 at CANN
9.1 makes any negative index a +0.0 row: docs/semantics.md section 9, read in the 9.1 kernel's
``IsInvalidRowIdx``) and refused on the second (161002: the A2 kernel would read outside its
buffer). Through every client path (Client, AsyncClient, the CLI's grad, a batch of a wire
document, a sweep case) the answer must be the server's own: the accepted result, or the refusal
with the status, field and message the server gives to the same call sent unchecked
(``validate=False``). The expected grad_x is written out by hand from the operator's definition
(its values are small integers, exact in float32 in any order of adds). A sweep over both servers
of cases that name no profile is refused before anything is sent; with ``--order`` it runs, and
its results file and summary record the profile that judged each case.
"""

from __future__ import annotations

import csv
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

import moegrad
from moegrad import InvalidArgument, accuracy
from moegrad.accuracy._batches import ProfilesDiffer
from moegrad.cli._main import main
from moegrad.cli._parser import with_flags
from support.launch import moegrad_server

A950, A910 = "ascend950@9.1", "ascend910b@9.1"
GRAD = np.array([[1, 1], [2, 2], [4, 4], [8, 8]], np.float32)  # [N*K, H] = [4, 2]
IDX = np.array([1, 0, 2, -1], np.int32)  # token 1's second slot: -1
TOP_K = 2
# grad_x[i] = sum over t of grad[idx[i*K + t]], a -1 slot adding +0.0 (ascend950@9.1): by hand
EXPECTED = np.array([[2 + 1, 2 + 1], [4 + 0, 4 + 0]], np.float32)
# the refusal of ascend910b@9.1: rule 7 (docs/semantics.md section 8), the field and code documented
REFUSED = (161002, "expanded_row_idx")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """profile -> URL of a reference server whose calls that name no profile run on it."""
    log_dir = tmp_path_factory.mktemp("profiles")
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(
            lambda order: moegrad_server(log_dir, settings={"order": order}, name=order.replace("@", "-"),
                                         ready_within_s=120.0), (A950, A910)))
    try:
        yield {A950: started[0].url, A910: started[1].url}
    finally:
        for server in started:
            server.stop()


class Recording(httpx.HTTPTransport):
    """The network, with each request's method and path recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, str]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.method, request.url.path))
        return super().handle_request(request)


def wire_document() -> dict:
    return {"grad_expanded_x": {"dtype": "float32", "shape": [4, 2], "data": GRAD.tobytes()},
            "expanded_row_idx": {"dtype": "int32", "shape": [4], "data": IDX.tobytes()}, "top_k": TOP_K}


def servers_own_refusal(url: str) -> InvalidArgument:
    """The server's answer to the call sent as given (no local check)."""
    with moegrad.Client(url, validate=False, retries=0) as client, pytest.raises(InvalidArgument) as refused:
        client.moe_init_routing_v2_grad(GRAD, IDX, TOP_K)
    return refused.value


def answer_of(error: InvalidArgument) -> tuple:
    return error.aclnn_status, error.field, error.message


def test_the_server_itself_accepts_on_950_at_9_1_and_refuses_on_910b(servers):
    with moegrad.Client(servers[A950], validate=False, retries=0) as client:
        result = client.run(wire_document())
    assert result.order == A950 and result.grad_x.view(np.uint32).tolist() == EXPECTED.view(np.uint32).tolist()
    refused = servers_own_refusal(servers[A910])
    assert (refused.aclnn_status, refused.field) == REFUSED and f"on profile {A910}" in refused.message


def test_client_answers_as_each_server_and_never_sends_what_its_server_refuses(servers):
    transport = Recording()
    with moegrad.Client(servers[A950], transport=transport, retries=0) as client:
        grad_x = client.moe_init_routing_v2_grad(GRAD, IDX, TOP_K)
    assert grad_x.view(np.uint32).tolist() == EXPECTED.view(np.uint32).tolist()
    assert ("POST", "/v1/moe_init_routing_v2_grad") in transport.sent
    transport = Recording()
    with moegrad.Client(servers[A910], transport=transport, retries=0) as client:
        with pytest.raises(InvalidArgument) as refused:
            client.moe_init_routing_v2_grad(GRAD, IDX, TOP_K)
        with pytest.raises(InvalidArgument) as again:  # the profile is known now: checked at once
            client.moe_init_routing_v2_grad(GRAD, IDX, TOP_K)
    assert answer_of(refused.value) == answer_of(again.value) == answer_of(servers_own_refusal(servers[A910]))
    assert transport.sent == [("GET", "/v1/info")]  # asked its profile once; the call never sent


@pytest.mark.asyncio
async def test_async_client_answers_as_each_server(servers):
    async with moegrad.AsyncClient(servers[A950], retries=0) as client:
        grad_x = await client.moe_init_routing_v2_grad(GRAD, IDX, TOP_K)
    assert grad_x.view(np.uint32).tolist() == EXPECTED.view(np.uint32).tolist()
    async with moegrad.AsyncClient(servers[A910], retries=0) as client:
        with pytest.raises(InvalidArgument) as refused:
            await client.moe_init_routing_v2_grad(GRAD, IDX, TOP_K)
    assert answer_of(refused.value) == answer_of(servers_own_refusal(servers[A910]))


def test_cli_grad_answers_as_each_server(servers, tmp_path, capsys):
    np.save(x := tmp_path / "x.npy", GRAD)
    np.save(idx := tmp_path / "idx.npy", IDX)

    def grad(url: str) -> int:
        return main(["grad", "--url", url, "--grad-expanded-x", str(x), "--expanded-row-idx", str(idx),
                     "--top-k", str(TOP_K), "-o", str(tmp_path / "out.npy"), "--retries", "0"])

    assert grad(servers[A950]) == 0
    assert f"order {A950}" in capsys.readouterr().out
    assert np.load(tmp_path / "out.npy").view(np.uint32).tolist() == EXPECTED.view(np.uint32).tolist()
    assert grad(servers[A910]) == 3  # refused, as the server refuses it
    err = capsys.readouterr().err
    # the server's refusal as the command prints any refusal (the fields named by their flags)
    assert f"moegrad: rejected input: InvalidArgument: {with_flags(str(servers_own_refusal(servers[A910])))}" in err


def test_a_batch_of_a_wire_document_answers_as_each_server(servers):
    with moegrad.Client(servers[A950], retries=0) as client:
        [answer] = client.batch([wire_document()])
    assert answer.order == A950 and answer.grad_x.view(np.uint32).tolist() == EXPECTED.view(np.uint32).tolist()
    transport = Recording()
    with moegrad.Client(servers[A910], transport=transport, retries=0) as client:
        [answer] = client.batch([wire_document()])
    assert isinstance(answer, InvalidArgument)
    assert answer_of(answer) == answer_of(servers_own_refusal(servers[A910]))
    assert ("POST", "/v1/moe_init_routing_v2_grad/batch") not in transport.sent  # refused before it was sent


def test_a_sweep_case_answers_as_each_server(servers):
    case = ("minus_one", {"grad_expanded_x": GRAD, "expanded_row_idx": IDX, "top_k": TOP_K}, EXPECTED.copy())
    with moegrad.Client(servers[A950], retries=0) as client:
        [judged] = client.compare_many([case], progress=False)
    assert judged.status == "pass" and judged.report.context.order == A950
    assert judged.report.exact.bit_exact  # the candidate is the hand-written device result
    with moegrad.Client(servers[A910], retries=0) as client:
        [refused] = client.compare_many([case], progress=False)
    assert refused.status == "invalid" and servers_own_refusal(servers[A910]).message in refused.error


def valid_case(name: str, order: str | None = None) -> tuple:
    fields = {"grad_expanded_x": GRAD, "expanded_row_idx": np.array([1, 0, 2, 3], np.int32), "top_k": TOP_K}
    if order is not None:
        fields["order"] = order
    return name, fields, np.array([[3, 3], [12, 12]], np.float32)  # exact sums by hand


def test_a_sweep_over_replicas_of_different_profiles_is_refused_before_anything_is_sent(servers):
    urls = [servers[A950], servers[A910]]
    transport = Recording()
    with moegrad.Client(urls, transport=transport, retries=0) as client:
        assert client.info()["orders"] == {servers[A950]: A950, servers[A910]: A910}
        with pytest.raises(ProfilesDiffer) as refused:
            client.compare_many([valid_case("named", A950), valid_case("unnamed")], progress=False)
        message = str(refused.value)
        assert f"{servers[A950]} {A950}" in message and f"{servers[A910]} {A910}" in message
        assert "unnamed" in message and "--order" in message
        assert {path for _, path in transport.sent} == {"/v1/info"}  # nothing but the profiles asked
        # cases that all name their profile are fine on any replica of the reference backend
        results = client.compare_many([valid_case("a", A950), valid_case("b", A910)], progress=False)
        assert [(r.status, r.report.context.order) for r in results] == [("pass", A950), ("pass", A910)]
        results = client.compare_many([valid_case("c"), valid_case("d")], order=A950, progress=False)
        assert [(r.status, r.report.context.order) for r in results] == [("pass", A950)] * 2


def test_the_cli_sweep_refuses_mixed_profiles_and_records_the_profile_of_each_case(servers, tmp_path, capsys):
    cases = tmp_path / "cases"
    cases.mkdir()
    for name in ("c0", "c1"):
        _, fields, candidate = valid_case(name)
        accuracy.save_case(cases / f"{name}.npz", candidate=candidate, **fields)
    urls = ["--url", servers[A950], "--url", servers[A910]]
    sweep = ["compare", "--cases", str(cases), "--no-progress", "--retries", "0"]
    assert main([*sweep, *urls, "--output", str(tmp_path / "run.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"{servers[A950]} {A950}" in err and f"{servers[A910]} {A910}" in err and "--order" in err
    assert main([*sweep, *urls, "--order", A950, "--output", str(tmp_path / "run.jsonl"),
                 "--summary", str(cases / "summary")]) == 0
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["header", "case", "case"]  # the refused run wrote nothing
    assert lines[0]["orders"] == {servers[A950]: A950, servers[A910]: A910}
    assert [line["order"] for line in lines[1:]] == [A950, A950]
    with open(cases / "summary.csv", encoding="utf-8-sig") as file:
        rows = list(csv.DictReader(file))
    assert [row["order"] for row in rows] == [A950, A950]
    # one profile's replica alone: the cases that name none are judged on its profile, and say so
    assert main([*sweep, "--url", servers[A910], "--summary", str(tmp_path / "one")]) == 0
    with open(tmp_path / "one.csv", encoding="utf-8-sig") as file:
        assert [row["order"] for row in csv.DictReader(file)] == [A910, A910]
