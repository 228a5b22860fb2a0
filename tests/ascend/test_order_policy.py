"""Every answer names the order that produced it, and a device never claims another chip's order.

The whole service over the simulator, reporting the SoC that MOEGRAD_SIM_SOC_NAME names. The rules
(docs/semantics.md, "Which chip answered"): a device computes its chip's order (Atlas A2/A3:
ascend910b; Ascend 950: ascend950); a call that names another order is refused with 161002 on v1,
compare and v2 alike; a call that names none gets the chip's; a chip whose order is unknown is
served only to calls that name none, and the reply says order "unknown".
"""

from __future__ import annotations

import contextlib
import json

import pytest
from fastapi.testclient import TestClient

from moegrad_service.app import create_app
from moegrad_service.settings import Settings
from support.docexample import example_document
from support.servicekit import pack, post


@contextlib.contextmanager
def serve_soc(monkeypatch, sim_home, soc: str):
    monkeypatch.setenv("MOEGRAD_SIM_SOC_NAME", soc)
    app = create_app(Settings(backend="ascend", ascend_home_path=sim_home, streams=1))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def v2_infer(client: TestClient, **parameters):
    body = {"parameters": {"top_k": 2, **parameters},
            "inputs": [{"name": "grad_expanded_x", "shape": [4, 2], "datatype": "FP32",
                        "data": [0.1, 0.1, 0.3, 0.3, 0.2, 0.2, 0.4, 0.4]},
                       {"name": "expanded_row_idx", "shape": [4], "datatype": "INT32", "data": [2, 0, 1, 3]}]}
    return client.post("/v2/models/moe_init_routing_v2_grad/infer", content=json.dumps(body))


def v1_order(response) -> str:
    import msgpack

    assert response.status_code == 200, response.text
    return msgpack.unpackb(response.content)["order"]


@pytest.mark.parametrize(("soc", "order", "other"), [("Ascend910B3", "ascend910b", "ascend950"),
                                                      ("Ascend950PR", "ascend950", "ascend910b")])
def test_a_device_answers_in_its_chips_order_and_refuses_another(sim, sim_home, monkeypatch, soc, order, other):
    with serve_soc(monkeypatch, sim_home, soc) as client:
        assert v1_order(post(client, example_document())) == order                 # named none: the chip's
        assert v1_order(post(client, example_document(order=order))) == order      # named the chip's
        refused = post(client, example_document(order=other)).json()
        assert (refused["status"], refused["field"], refused["aclnn_status"]) == (422, "order", 161002)
        assert order in refused["detail"]                                          # says what to name instead
        v2 = v2_infer(client, order=other)
        assert v2.status_code == 400 and "161002" in v2.json()["error"]
        assert v2_infer(client).json()["parameters"]["order"] == order
        assert client.get("/v1/info").json()["order"] == order


def test_an_unknown_chip_is_served_unnamed_and_says_its_order_is_unknown(sim, sim_home, monkeypatch):
    with serve_soc(monkeypatch, sim_home, "Ascend310P3") as client:
        assert v1_order(post(client, example_document())) == "unknown"
        refused = post(client, example_document(order="ascend910b")).json()
        assert (refused["status"], refused["field"], refused["aclnn_status"]) == (422, "order", 161002)
        assert client.post("/v1/moe_init_routing_v2_grad/compare", content=pack(example_document(order="ascend910b")),
                           headers={"content-type": "application/msgpack"}).status_code == 422
