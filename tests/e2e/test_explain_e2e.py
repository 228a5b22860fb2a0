"""Explanations end to end: one input, the same answer and the same errors on every path.

The paths: :func:`moegrad.explain` in this process; ``POST /v1/moe_init_routing_v2_grad/explain`` of
a real ``moegrad-service`` (uvicorn) with a msgpack body and with a frames body, packed here by hand
from docs/protocol.md (``support.servicekit``); ``moegrad.Client.explain`` (msgpack and frames) and
``AsyncClient.explain``; the ``moegrad explain`` command as a subprocess (``--json``). Transport
only: the reference backend serves the emulation, so the answer every path must give is the
in-process one; the labels themselves are proven by tests/unit/accuracy/test_explain.py.

And the service's memory: an explanation with every row differing keeps the server's peak RSS
(VmHWM, reset before the call) within what docs/operations.md ("Memory a request holds") says it
holds: its body, the device's grad_x and ``moegrad.explain_peak_bytes(call, device_result=True,
reply=True)``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import ml_dtypes
import msgpack
import numpy as np
import pytest

import moegrad
from support import planted
from support.attacks.probes import reset_peak, rss_bytes
from support.inputs import BF16, F16, F32
from support.launch import moegrad_server
from support.servicekit import FRAMES, MSGPACK_HEADERS, frames_body, pack

PATH = "/v1/moe_init_routing_v2_grad/explain"
WIRE = {np.dtype(np.float16): "float16", np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float32): "float32",
        np.dtype(np.int32): "int32"}
CASES = [("dropless", F32, 8, 7, "drop"), ("active", F16, 4, 7, "extra_active"), ("drop_pad", F32, 8, 256, "sequential"),
         ("drop_pad", BF16, 8, 7, "duplicate")]


def tensor(array: np.ndarray) -> dict:
    array = np.ascontiguousarray(array)
    return {"dtype": WIRE[array.dtype], "shape": list(array.shape),
            "data": array.astype(array.dtype.newbyteorder("<")).tobytes()}


def arguments(call: moegrad.MoeInitRoutingV2GradCall) -> dict:
    return {"grad_expanded_x": call.grad_expanded_x, "expanded_row_idx": call.expanded_row_idx, "top_k": call.top_k,
            "drop_pad_mode": call.drop_pad_mode, "active_num": call.active_num}


def document(call, candidate) -> dict:
    doc = {name: tensor(value) if isinstance(value, np.ndarray) else value for name, value in arguments(call).items()}
    if candidate is not None:
        doc["candidate"] = tensor(candidate)
    return doc


def planted_case(entry):
    case = planted.build(*entry, "ascend910b@9.1")
    assert case is not None
    return moegrad.MoeInitRoutingV2GradCall(**case.kwargs()), case.candidate


def cli(*argv: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MOEGRAD_")}
    return subprocess.run([sys.executable, "-m", "moegrad", *argv], capture_output=True, text=True, timeout=120,
                          env=environment)


def save_inputs(directory, call, candidate) -> list[str]:
    for name, array in (("x", call.grad_expanded_x), ("idx", call.expanded_row_idx), ("candidate", candidate)):
        np.save(directory / f"{name}.npy", array)  # bfloat16 is written as '<V2', read back as bfloat16
    return ["--grad-expanded-x", str(directory / "x.npy"), "--expanded-row-idx", str(directory / "idx.npy"),
            "--top-k", str(call.top_k), "--drop-pad-mode", str(call.drop_pad_mode), "--active-num",
            str(call.active_num), "--candidate", str(directory / "candidate.npy")]


def every_path(server_url: str, call, candidate, directory) -> dict[str, object]:
    """Each path's answer: the explanation's dict, or the refusal (type, status, field, message) /
    for the command, its exit status and the message on stderr."""
    answers: dict[str, object] = {}

    def refusal(exc: moegrad.MoegradError) -> tuple:
        return type(exc).__name__, getattr(exc, "aclnn_status", None), exc.field, exc.message

    try:
        answers["in-process"] = moegrad.explain(call, candidate).to_dict()
    except moegrad.InvalidArgument as exc:
        answers["in-process"] = refusal(exc)
    doc = document(call, candidate)
    for name, body, kind in (("v1 msgpack", pack(doc), MSGPACK_HEADERS["content-type"]),
                             ("v1 frames", frames_body(doc), FRAMES)):
        response = httpx.post(server_url + PATH, content=body, headers={"content-type": kind}, timeout=60)
        if response.status_code == 200:
            answers[name] = msgpack.unpackb(response.content, raw=False)["explanation"]
        else:
            problem = response.json()
            answers[name] = ("InvalidArgument" if response.status_code == 422 else str(response.status_code),
                             problem["aclnn_status"], problem["field"], problem["detail"])
    for name, options in (("client msgpack", {"wire": "msgpack"}), ("client frames", {"wire": "frames"}),
                          ("client, checked by the server", {"validate": False})):
        with moegrad.Client(server_url, **options) as client:
            try:
                answers[name] = client.explain(**arguments(call), candidate=candidate).explanation.to_dict()
            except moegrad.InvalidArgument as exc:
                answers[name] = refusal(exc)

    async def asynchronously():
        async with moegrad.AsyncClient(server_url) as client:
            return (await client.explain(**arguments(call), candidate=candidate)).explanation.to_dict()

    try:
        answers["async client"] = asyncio.run(asynchronously())
    except moegrad.InvalidArgument as exc:
        answers["async client"] = refusal(exc)
    command = cli("explain", *save_inputs(directory, call, candidate), "--url", server_url, "--json")
    answers["command"] = json.loads(command.stdout) if command.returncode in (0, 1) else (command.returncode,
                                                                                        command.stderr)
    return answers


@pytest.mark.parametrize("entry", CASES, ids=[entry[4] for entry in CASES])
def test_every_path_gives_the_in_process_explanation(server_url, tmp_path, entry):
    call, candidate = planted_case(entry)
    answers = every_path(server_url, call, candidate, tmp_path)
    expected = answers.pop("in-process")
    assert isinstance(expected, dict) and expected["differing_rows"] > 0
    assert answers == dict.fromkeys(answers, expected)


def test_every_path_gives_the_same_refusal(server_url, tmp_path):
    """A candidate of the wrong shape: InvalidArgument 161002, field candidate, one message; the
    command exits 3 and prints that message."""
    call, candidate = planted_case(CASES[0])
    answers = every_path(server_url, call, candidate[:-1], tmp_path)
    expected = answers.pop("in-process")
    command = answers.pop("command")
    assert expected[:3] == ("InvalidArgument", 161002, "candidate")
    assert answers == dict.fromkeys(answers, expected)
    code, stderr = command
    assert code == 3 and expected[3] in stderr and "ACLNN_ERR_PARAM_INVALID 161002" in stderr


def test_the_command_in_process_is_the_library(tmp_path):
    call, candidate = planted_case(CASES[1])
    command = cli("explain", *save_inputs(tmp_path, call, candidate), "--local", "--json")
    assert command.returncode == 1, command.stderr  # rows differ
    assert json.loads(command.stdout) == moegrad.explain(call, candidate).to_dict()


def test_the_server_stays_within_what_an_explanation_reserves(tmp_path):
    """Every row of a bfloat16 call (N = 512, K = 8, H = 4096: a 36 MiB body) differs by one ULP:
    the server's RSS grows by less than the request holds by the rules (and reserves)."""
    rng = np.random.default_rng(7)
    tokens, top_k, hidden = 512, 8, 4096
    grad = rng.standard_normal((tokens * top_k, hidden)).astype(ml_dtypes.bfloat16)
    call = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, top_k=top_k,
                                            expanded_row_idx=rng.permutation(tokens * top_k).astype(np.int32))
    candidate = moegrad.moe_init_routing_v2_grad(call)
    candidate.view(np.uint16)[...] ^= 1  # one ULP off, every element of every row
    small, small_candidate = planted_case(CASES[2])
    body = pack(document(call, candidate))
    grad_x = tokens * hidden * 2  # its tensors view the body: none copied out
    reserved = len(body) + grad_x + moegrad.explain_peak_bytes(call, device_result=True, reply=True)
    with moegrad_server(tmp_path, settings={"max_inflight_bytes": 4 << 30}) as server:
        post = lambda content: httpx.post(server.url + PATH, content=content, headers=MSGPACK_HEADERS,  # noqa: E731
                                          timeout=300)
        assert post(pack(document(small, small_candidate))).status_code == 200  # compiled kernels, caches: warm
        before = rss_bytes(server.pid)
        reset_peak(server.pid)
        response = post(body)
        peak = rss_bytes(server.pid, "VmHWM")
    assert response.status_code == 200, response.text
    assert msgpack.unpackb(response.content, raw=False)["explanation"]["differing_rows"] == tokens
    assert peak - before <= reserved, (peak - before, reserved)


def test_a_sweep_on_the_service_records_each_cases_counts(server_url):
    """Client.compare_many(explain=True): each report carries the label counts of the in-process
    explanation against the profile that judged it (AsyncClient the same)."""
    cases = [planted_case(entry) for entry in CASES]
    items = [(f"case{i}", arguments(call), candidate) for i, (call, candidate) in enumerate(cases)]
    want = {f"case{i}": moegrad.explain(call, candidate).labels for i, (call, candidate) in enumerate(cases)}
    with moegrad.Client(server_url) as client:
        results = client.compare_many(items, explain=True, progress=False)

    async def asynchronously():
        async with moegrad.AsyncClient(server_url) as client:
            return await client.compare_many(items, explain=True, progress=False)

    for found in (results, asyncio.run(asynchronously())):
        assert {result.name: result.report.explained for result in found} == want
