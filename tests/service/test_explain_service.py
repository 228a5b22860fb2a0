"""``POST /v1/moe_init_routing_v2_grad/explain`` in-process: msgpack and frames bodies, checks before
the backend runs, the reservation (docs/operations.md's rules, 413 and 503), and an explanation
nobody waits for any more (its client hung up, its deadline passed: 504) stopped within its search.

Bodies are packed here by hand (msgpack, and frames by ``support.servicekit.frames_body``, written
from docs/protocol.md). Transport only: the expected explanation is :func:`moegrad.explain` of the
same call and candidate against the server's result (the reference backend serves the emulation),
the function the server runs; the labels themselves are proven by tests/unit/accuracy/test_explain.py
(the planted-fault matrix of tests/support/planted.py). The rejections' status, field, aclnn code
and message are the ones ``moegrad.explain`` raises in-process for the same input.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import ml_dtypes
import msgpack
import numpy as np
import pytest

import moegrad
from support import planted
from support.inputs import BF16, F16, F32
from support.servicekit import FRAMES, MSGPACK_HEADERS, frames_body, gauge, pack

PATH = "/v1/moe_init_routing_v2_grad/explain"
WIRE = {np.dtype(np.float16): "float16", np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float32): "float32",
        np.dtype(np.int32): "int32", np.dtype(np.float64): "float64"}
# one case per label family (tests/support/planted.py): its mode, dtype, K, H and plant
CASES = [
    ("dropless", F32, 8, 7, "drop"),
    ("active", F16, 4, 7, "neighbour"),
    ("drop_pad", BF16, 3, 7, "extra_capacity"),
    ("dropless", BF16, 8, 256, "accumulate_f16"),
    ("dropless", F32, 16, 7, "sequential"),
    ("drop_pad", F32, 4, 7, "nan_input"),
    ("dropless", F32, 2, 1, "duplicate"),
]


def tensor(array: np.ndarray) -> dict:
    array = np.ascontiguousarray(array)
    return {"dtype": WIRE[array.dtype], "shape": list(array.shape),
            "data": array.astype(array.dtype.newbyteorder("<")).tobytes()}


def document(call: moegrad.MoeInitRoutingV2GradCall, candidate=None, **extra) -> dict:
    doc = {"grad_expanded_x": tensor(call.grad_expanded_x), "expanded_row_idx": tensor(call.expanded_row_idx),
           "top_k": call.top_k, "drop_pad_mode": call.drop_pad_mode, "active_num": call.active_num}
    if candidate is not None:
        doc["candidate"] = tensor(candidate)
    return {**doc, **extra}


def post(client, doc: dict, *, frames: bool = False):
    if frames:
        return client.post(PATH, content=frames_body(doc), headers={"content-type": FRAMES})
    return client.post(PATH, content=pack(doc), headers=MSGPACK_HEADERS)


def planted_case(entry) -> tuple[moegrad.MoeInitRoutingV2GradCall, np.ndarray]:
    case = planted.build(*entry, "ascend910b@9.1")
    assert case is not None
    return moegrad.MoeInitRoutingV2GradCall(**case.kwargs()), case.candidate


@pytest.mark.parametrize("frames", [False, True], ids=["msgpack", "frames"])
@pytest.mark.parametrize("entry", CASES, ids=[entry[4] for entry in CASES])
def test_the_reply_is_the_in_process_explanation(client, entry, frames):
    call, candidate = planted_case(entry)
    response = post(client, document(call, candidate), frames=frames)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/msgpack"
    reply = msgpack.unpackb(response.content, raw=False)
    assert reply["explanation"] == moegrad.explain(call, candidate).to_dict()
    assert reply["explanation"]["differing_rows"] > 0
    assert (reply["backend"], reply["order"], reply["device"]) == ("reference", "ascend910b@9.1", None)
    assert set(reply["timings_ms"]) == {"queue", "compute", "explain", "total"}
    assert all(value >= 0 for value in reply["timings_ms"].values())


def test_the_device_result_itself_has_nothing_to_explain(client):
    call, _ = planted_case(CASES[0])
    reply = msgpack.unpackb(post(client, document(call, moegrad.moe_init_routing_v2_grad(call))).content)
    assert reply["explanation"]["rows"] == [] and reply["explanation"]["differing_rows"] == 0
    assert set(reply["explanation"]["labels"].values()) == {0}


def test_the_named_profile_picks_the_device_result(client):
    """A call naming ascend950@9.1 is explained against that profile's result (docs/protocol.md)."""
    call, candidate = planted_case(("dropless", F32, 8, 7, "sequential"))
    named = call.model_copy(update={"order": "ascend950@9.1"})
    reply = msgpack.unpackb(post(client, document(call, candidate, order="ascend950@9.1")).content)
    assert reply["order"] == "ascend950@9.1"
    assert reply["explanation"] == moegrad.explain(named, candidate).to_dict()


def _rejections():
    call, candidate = planted_case(("dropless", F16, 4, 7, "drop"))
    return call, candidate, [
        ("missing candidate", {}, None, 422),
        ("short candidate", {"candidate": tensor(candidate[:-1])}, candidate[:-1], 422),
        ("float32 candidate of a float16 call", {"candidate": tensor(candidate.astype(np.float32))},
         candidate.astype(np.float32), 422),
        ("1-D candidate", {"candidate": tensor(candidate.reshape(-1))}, candidate.reshape(-1), 422),
        ("constraint", {"candidate": tensor(candidate), "top_k": 5}, None, 422),
        ("unknown profile", {"candidate": tensor(candidate), "order": "ascend999"}, None, 422),
    ]


@pytest.mark.parametrize("case", range(len(_rejections()[2])), ids=[case[0] for case in _rejections()[2]])
def test_rejections_are_the_in_process_ones_and_never_run_the_backend(serve, gate, gated_backend, case):
    call, candidate, cases = _rejections()
    name, overrides, given, status = cases[case]
    fields = {"grad_expanded_x": call.grad_expanded_x, "expanded_row_idx": call.expanded_row_idx, "top_k": call.top_k}
    with pytest.raises(moegrad.InvalidArgument) as raised:  # the same input, in-process
        if name in ("constraint", "unknown profile"):
            moegrad.MoeInitRoutingV2GradCall(**{**fields, **{k: v for k, v in overrides.items() if k != "candidate"}})
        else:
            moegrad.explain(call, given)
    gate.release.set()
    with serve(backend=gated_backend) as client:
        response = post(client, {**document(call), **overrides})
        assert response.status_code == status, response.text
        body = response.json()
        assert (body["field"], body["aclnn_status"], body["detail"]) == (
            raised.value.field, raised.value.aclnn_status, raised.value.message)
        assert gate.calls == 0  # refused before the device was asked for anything
        assert post(client, document(call, candidate)).status_code == 200
        assert gate.calls == 1


def test_a_broken_candidate_map_and_an_unknown_key_are_400(client):
    call, candidate = planted_case(CASES[0])
    broken = post(client, {**document(call), "candidate": {"dtype": "float32", "shape": [1, 2], "data": bytes(3)}})
    assert broken.status_code == 400 and broken.json()["field"] == "candidate"
    unknown = post(client, document(call, candidate, standards=["bitwise"]))
    assert unknown.status_code == 400 and unknown.json()["field"] == "standards"


def held_by_the_rules(call, candidate, body: bytes) -> int:
    """What docs/operations.md ("Memory a request holds") says an explanation holds: its body; tensors
    up to 64 KiB copied out of it; the device's grad_x (N x H x itemsize); moegrad.explain_peak_bytes
    with the device's result given and the reply; never less than the body twice it reserved first."""
    inputs = call.grad_expanded_x.nbytes + call.expanded_row_idx.nbytes + candidate.nbytes
    copies = inputs if inputs <= 64 << 10 else 0
    grad_x = call.num_tokens * call.hidden_size * call.grad_expanded_x.dtype.itemsize
    rules = len(body) + copies + grad_x + moegrad.explain_peak_bytes(call, device_result=True, reply=True)
    return max(2 * len(body), rules)


def test_the_explanation_is_reserved_beside_the_body(serve, gate, gated_backend):
    """While the call runs, the request holds what its shapes say an explanation holds."""
    call, candidate = planted_case(("dropless", F32, 8, 256, "sequential"))
    body = pack(document(call, candidate))
    answers: list = []
    with serve(backend=gated_backend) as client:
        sender = threading.Thread(target=lambda: answers.append(
            client.post(PATH, content=body, headers=MSGPACK_HEADERS)))
        sender.start()
        assert gate.started.acquire(timeout=30)
        held = gauge(client, "moegrad_inflight_bytes")
        gate.release.set()
        sender.join(60)
        assert answers and answers[0].status_code == 200
        assert held == held_by_the_rules(call, candidate, body)
        assert gauge(client, "moegrad_inflight_bytes") == 0  # all given back once answered


def assert_problem(response, status: int) -> dict:
    """A problem document (docs/protocol.md, "Errors") of ``status``, with no field or aclnn code: a
    refusal of the request's size, not of an argument."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["status"] == status and problem["type"] == "about:blank" and problem["title"]
    assert problem.get("field") is None and problem.get("aclnn_status") is None
    return problem


def test_an_explanation_over_the_budget_is_413_and_a_compare_of_it_is_not(serve):
    """A budget that holds the body twice but not the explanation beside it: explain is refused as
    too large, its problem naming what it holds part by part (nothing runs), the comparison of the
    same body answered."""
    call, candidate = planted_case(CASES[0])
    body = pack(document(call, candidate))
    need = held_by_the_rules(call, candidate, body)
    with serve(max_inflight_bytes=need) as client:  # seven eighths of it for a large reservation
        problem = assert_problem(post(client, document(call, candidate)), 413)
        assert f"holds {need} bytes" in problem["detail"]
        assert "work " in problem["detail"] and "max_inflight_bytes" in problem["detail"]
        assert gauge(client, "moegrad_inflight_bytes") == 0
        compared = client.post("/v1/moe_init_routing_v2_grad/compare", content=body, headers=MSGPACK_HEADERS)
        assert compared.status_code == 200
        assert gauge(client, "moegrad_inflight_bytes") == 0


def test_an_explanation_that_does_not_fit_now_is_503_and_fits_once_the_other_is_answered(serve, gate,
                                                                                           gated_backend):
    """One explanation held at the gate takes two thirds of what one request may hold; a second of
    the same shape fits the budget alone but not beside it: 503 with Retry-After, nothing run."""
    call, candidate = planted_case(CASES[0])
    body = pack(document(call, candidate))
    need = held_by_the_rules(call, candidate, body)
    budget = (3 * need // 2) * 8 // 7 + 8  # seven eighths of it: one and a half explanations
    answers: list = []
    with serve(backend=gated_backend, max_inflight_bytes=budget) as client:
        first = threading.Thread(target=lambda: answers.append(post(client, document(call, candidate))))
        first.start()
        assert gate.started.acquire(timeout=30)
        problem = assert_problem(post(client, document(call, candidate)), 503)
        assert float(client.get("/metrics").status_code) == 200
        assert gate.calls == 1  # the second never reached the device
        gate.release.set()
        first.join(60)
        assert answers and answers[0].status_code == 200
        assert "in-flight" in problem["detail"] or "max_inflight_bytes" in problem["detail"]
        assert post(client, document(call, candidate)).status_code == 200
        assert gauge(client, "moegrad_inflight_bytes") == 0


# --- an explanation nobody waits for any more stops within its row search -------------------------


class HeldStop(threading.Event):
    """The judges' stop event as explain sees it: at look ``at`` (within its search of other rows) it
    says that it was reached and waits for the real event to be set (the client gone, the deadline
    passed), then reads as the real one; every look is counted."""

    def __init__(self, real: threading.Event, at: int, reached: threading.Event) -> None:
        super().__init__()
        self.real, self.at, self.reached, self.looks = real, at, reached, 0

    def is_set(self) -> bool:
        self.looks += 1
        if self.looks == self.at:
            self.reached.set()
            self.real.wait(30)
        return self.real.is_set()


def every_row_searched():
    """48 tokens, K = 4, H = 4096 bf16, the candidate one ULP off everywhere: every row is searched
    for a wrong summand among the others (tests/unit/accuracy/test_explain.py counts the looks)."""
    rng = np.random.default_rng(11)
    call = moegrad.MoeInitRoutingV2GradCall(
        grad_expanded_x=rng.standard_normal((48 * 4, 4096)).astype(ml_dtypes.bfloat16),
        expanded_row_idx=rng.permutation(48 * 4).astype(np.int32), top_k=4)
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate.view(np.uint16)[...] ^= 1
    return call, candidate


class CountedStop(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def is_set(self) -> bool:
        self.looks += 1
        return False


@pytest.fixture
def held_explain(monkeypatch):
    """moegrad.explain as the service's judges call it, held halfway through its looks at the stop
    event (the middle of its search of other rows) until the real one is set; what it raised recorded."""
    import moegrad_service.dataplane.judging as judging

    call, candidate = every_row_searched()
    counted = CountedStop()
    moegrad.explain(call, candidate, stop=counted)  # the looks of a whole explanation of it
    state = {"reached": threading.Event(), "raised": [], "stops": []}
    real = judging.explain

    def held(*args, stop, **options):
        held_stop = HeldStop(stop, counted.looks // 2, state["reached"])
        state["stops"].append(held_stop)
        try:
            return real(*args, stop=held_stop, **options)
        except BaseException as exc:
            state["raised"].append(type(exc))
            raise

    monkeypatch.setattr(judging, "explain", held)
    state.update(call=call, candidate=candidate, looks=counted.looks)
    return state


def hang_up_after(client, body: bytes, reached: threading.Event) -> list[dict]:
    """POST ``body`` to the explain route as an ASGI client that hangs up (http.disconnect) once
    ``reached`` is set; the messages the app sent it."""
    sent: list[dict] = []

    async def exchange() -> None:
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            while not reached.is_set():
                await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": PATH, "raw_path": PATH.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"testserver"), (b"content-type", b"application/msgpack"),
                             (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 50001), "server": ("testserver", 80), "state": client.app_state.copy()}
        await client.app(scope, receive, send)

    client.portal.call(exchange)
    return sent


def ended(state: dict) -> list[type]:
    """What the held explanation raised, once its judging thread has ended it (it does once it sees
    the stop; the request may be answered before)."""
    deadline = time.monotonic() + 30
    while not state["raised"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return state["raised"]


def settled(client) -> tuple[float, float, float]:
    """Bytes held by requests (the in-flight bytes less the receive buffers kept for reuse), work
    running, work waiting: once all are 0, or as they are after 30 s (a judging thread counts its
    work out just after the work has raised)."""
    deadline = time.monotonic() + 30
    while True:
        held = gauge(client, "moegrad_inflight_bytes") - gauge(client, "moegrad_receive_buffer_kept_bytes")
        now = (held, gauge(client, "moegrad_inference_exec_count"),
               gauge(client, "moegrad_inference_pending_request_count"))
        if now == (0, 0, 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.01)


def test_an_explanation_whose_client_hung_up_stops_within_its_row_search(serve, held_explain):
    body = pack(document(held_explain["call"], held_explain["candidate"]))
    with serve(judge_workers=1) as client:
        hang_up_after(client, body, held_explain["reached"])
        assert held_explain["reached"].is_set()
        (stop,) = held_explain["stops"]
        assert stop.real.is_set() and stop.looks == stop.at  # stopped at the look it was held at ...
        assert stop.at < held_explain["looks"]  # ... halfway through
        assert ended(held_explain) == [moegrad.DeadlineExceeded]
        metrics = client.get("/metrics").text.splitlines()
        assert f'moegrad_inference_request_failure_total{{endpoint="{PATH}",reason="client_disconnected"}} 1.0' \
            in metrics
        assert settled(client) == (0, 0, 0)  # nothing held, running or waiting
        # the judge's thread takes the next explanation
        reply = msgpack.unpackb(post(client, document(*planted_case(CASES[0]))).content, raw=False)
        assert reply["explanation"]["differing_rows"] > 0


def test_an_explanation_past_its_deadline_is_504_and_stops_within_its_row_search(serve, held_explain):
    call, candidate = held_explain["call"], held_explain["candidate"]
    with serve(judge_workers=1) as client:
        small, small_candidate = planted_case(CASES[0])
        assert post(client, document(small, small_candidate)).status_code == 200  # compiled: the call is quick
        late = client.post(PATH, content=pack(document(call, candidate)),
                           headers={**MSGPACK_HEADERS, "x-request-timeout": "5"})
        problem = assert_problem(late, 504)
        # what was left of the 5 s once the call had run: the explanation's own deadline
        assert re.fullmatch(r"the deadline of \d\.\d{3} s passed while it was explained \(stopped\)",
                            problem["detail"])
        stop = held_explain["stops"][-1]  # the first was the small call's, never held
        assert held_explain["reached"].is_set() and stop.looks == stop.at < held_explain["looks"]
        assert ended(held_explain) == [moegrad.DeadlineExceeded]
        assert settled(client) == (0, 0, 0)


def test_success_is_counted(client):
    call, candidate = planted_case(CASES[0])
    assert post(client, document(call, candidate)).status_code == 200
    metrics = client.get("/metrics").text
    assert f'moegrad_inference_request_success_total{{endpoint="{PATH}"}} 1.0' in metrics.splitlines()
