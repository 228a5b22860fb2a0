"""The Ascend 950 orders through the service in-process: v1, v2 and compare, and the two 950 settings.

Expected bits are computed here by hand from docs/semantics.md section 7: a float32 accumulator from
+0.0, groups of four slots added as ((a + b) + (c + d)), leftovers one by one, the groups restarting
at every chunk of kUbFactor slots that the Regbase template of the tiling picks.
"""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from moegrad_service.settings import Settings
from support.docexample import example_document
from support.servicekit import MSGPACK_HEADERS, grad_x_of, pack, post

K, H, TOKENS = 17, 8, 3


def order950(rows: np.ndarray, chunk: int) -> np.ndarray:
    """[tokens, K, H] float32 rows summed in the 950's order with K chunks of ``chunk`` slots."""
    total = np.zeros((rows.shape[0], rows.shape[2]), np.float32)
    for first in range(0, rows.shape[1], chunk):
        t, last = first, min(first + chunk, rows.shape[1])
        while t + 4 <= last:
            total = total + ((rows[:, t] + rows[:, t + 1]) + (rows[:, t + 2] + rows[:, t + 3]))
            t += 4
        for leftover in range(t, last):
            total = total + rows[:, leftover]
    return total


@pytest.fixture
def call():
    rng = np.random.default_rng(950)
    grad = (rng.standard_normal((TOKENS * K, H)) * np.exp2(rng.integers(-12, 12, (TOKENS * K, H)))).astype(np.float32)
    idx = rng.permutation(TOKENS * K).astype(np.int32)
    return grad, idx


def v1_document(grad, idx, **fields):
    return example_document(grad_expanded_x={"dtype": "float32", "shape": list(grad.shape), "data": grad.tobytes()},
                            expanded_row_idx={"dtype": "int32", "shape": [idx.size], "data": idx.tobytes()},
                            top_k=K, **fields)


def test_v1_ascend950_with_the_default_platform_is_one_pass(serve, call):
    grad, idx = call
    # fp32 H = 8 pads to 8 elements; FullLoad: (2 * 17 + 1) * 4 * 8 = 1120 <= 253952: all 17 slots at once
    with serve() as client:
        response = post(client, v1_document(grad, idx, order="ascend950"))
        assert response.status_code == 200, response.text
        assert msgpack.unpackb(response.content)["order"] == "ascend950@9.1"
        want = order950(grad[idx].reshape(TOKENS, K, H), K)
        assert grad_x_of(response).view(np.uint32).tolist() == want.view(np.uint32).tolist()


@pytest.mark.parametrize(("ub", "chunk"), [(576, 8), (448, 6)])
def test_v1_the_ub_setting_decides_the_chunks(serve, call, ub, chunk):
    grad, idx = call
    # FullLoad needs (2K + 1) * 32 <= UB and K = 17 > 10, so Regbase: kUbFactor = (UB - 8 * 8) // (8 * 8)
    with serve(order="ascend950", ascend950_ub_size_bytes=ub) as client:
        response = post(client, v1_document(grad, idx))  # no order named: the settings' default
        assert msgpack.unpackb(response.content)["order"] == "ascend950@9.1"
        want = order950(grad[idx].reshape(TOKENS, K, H), chunk)
        assert grad_x_of(response).view(np.uint32).tolist() == want.view(np.uint32).tolist()
        one_pass = order950(grad[idx].reshape(TOKENS, K, H), K)
        # chunks of a multiple of four keep the groups where one pass has them; chunks of 6 do not
        assert (want.view(np.uint32).tolist() == one_pass.view(np.uint32).tolist()) == (chunk % 4 == 0)


def test_v1_the_core_count_setting_decides_the_template(serve):
    # fp32 K = 64, H = 4096, N = 1: SplitH ((4096 // 512) // 4 = 2 > 1) with 64 cores, all 64 slots at
    # once; with 1 core Regbase, (253952 - 8 * 4096) // (8 * 4096) = 6 slots per chunk
    rng = np.random.default_rng(64)
    grad = rng.standard_normal((64, 4096)).astype(np.float32)
    idx = rng.permutation(64).astype(np.int32)
    document = example_document(grad_expanded_x={"dtype": "float32", "shape": [64, 4096], "data": grad.tobytes()},
                                expanded_row_idx={"dtype": "int32", "shape": [64], "data": idx.tobytes()},
                                top_k=64, order="ascend950")
    rows = grad[idx].reshape(1, 64, 4096)
    for cores, chunk in ((64, 64), (1, 6)):
        with serve(ascend950_vector_core_count=cores) as client:
            got = grad_x_of(post(client, document))
            assert got.view(np.uint32).tolist() == order950(rows, chunk).view(np.uint32).tolist()


def test_v1_earlier_revision_is_a_plain_chain(serve, call):
    grad, idx = call
    rows = grad[idx].reshape(TOKENS, K, H)
    chain = np.zeros((TOKENS, H), np.float32)
    for t in range(K):
        chain = chain + rows[:, t]
    with serve(ascend950_ub_size_bytes=448) as client:
        response = post(client, v1_document(grad, idx, order="ascend950@2025-12"))
        assert msgpack.unpackb(response.content)["order"] == "ascend950@8.5"  # the alias, as its profile
        assert grad_x_of(response).view(np.uint32).tolist() == chain.view(np.uint32).tolist()


def test_v1_info_names_the_default_order(serve):
    with serve(order="ascend950") as client:
        assert client.get("/v1/info").json()["order"] == "ascend950@9.1"


def test_v2_ascend950_as_a_parameter(serve, call):
    grad, idx = call
    document = {
        "parameters": {"top_k": K, "order": "ascend950"},
        "inputs": [
            {"name": "grad_expanded_x", "shape": list(grad.shape), "datatype": "FP32", "data": grad.ravel().tolist()},
            {"name": "expanded_row_idx", "shape": [idx.size], "datatype": "INT32", "data": idx.tolist()},
        ],
    }
    with serve(ascend950_ub_size_bytes=448) as client:
        response = client.post("/v2/models/moe_init_routing_v2_grad/infer", content=json.dumps(document).encode())
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["parameters"]["order"] == "ascend950@9.1"
        (output,) = body["outputs"]
        got = np.array(output["data"], dtype=np.float64).astype(np.float32)
        want = order950(grad[idx].reshape(TOKENS, K, H), 6)
        assert got.view(np.uint32).tolist() == want.ravel().view(np.uint32).tolist()


def test_compare_against_the_950_order(serve, call):
    grad, idx = call
    want = order950(grad[idx].reshape(TOKENS, K, H), 6)  # UB 448: chunks of 6 (not a multiple of 4)
    document = v1_document(grad, idx, order="ascend950")
    document["candidate"] = {"dtype": "float32", "shape": [TOKENS, H], "data": want.tobytes()}
    with serve(ascend950_ub_size_bytes=448) as client:
        response = client.post("/v1/moe_init_routing_v2_grad/compare", content=pack(document), headers=MSGPACK_HEADERS)
        assert response.status_code == 200, response.text
        answer = msgpack.unpackb(response.content)
        assert answer["order"] == "ascend950@9.1"
        assert answer["report"]["candidate_vs_device"]["bitwise_equal_count"] == TOKENS * H


@pytest.mark.parametrize(("field", "value"), [("ascend950_ub_size_bytes", 31), ("ascend950_vector_core_count", 0),
                                              ("order", "ascend960")])
def test_settings_refuse_bad_values_at_startup(field, value):
    with pytest.raises(ValidationError, match=field):
        Settings(**{field: value})


def test_settings_defaults_and_environment(monkeypatch):
    settings = Settings()
    assert (settings.ascend950_ub_size_bytes, settings.ascend950_vector_core_count) == (253952, 64)
    monkeypatch.setenv("MOEGRAD_ORDER", "ascend950@2025-12")
    monkeypatch.setenv("MOEGRAD_ASCEND950_VECTOR_CORE_COUNT", "56")
    settings = Settings()
    assert (settings.order, settings.ascend950_vector_core_count) == ("ascend950@8.5", 56)
