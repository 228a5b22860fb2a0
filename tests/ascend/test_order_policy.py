"""Every answer names the profile that produced it, and a device never claims another profile.

The whole service over the simulator, reporting the SoC that MOEGRAD_SIM_SOC_NAME names and the
CANN release its home's version.info records (conftest.release_home). The rules (docs/ascend.md,
"Which profile"; docs/semantics.md): a device computes one profile, ``"<chip>@<release>"``; a call
that names another (another chip, or the same chip at another release) is refused with 161002 on
v1, compare and v2 alike, with a message that names the device's profile; a call that names none
gets the device's; an alias counts as the profile it means (a bare chip: its newest release, 9.1);
a device whose chip or release is unknown is served only to calls that name none, and the reply
says order "unknown".
"""

from __future__ import annotations

import contextlib
import json

import msgpack
import pytest
from fastapi.testclient import TestClient

from moegrad_service.app import create_app
from moegrad_service.settings import Settings
from support.docexample import example_document, v2_inputs
from support.servicekit import pack, post


@contextlib.contextmanager
def serve_device(monkeypatch, release_home, soc: str, version: str | None):
    monkeypatch.setenv("MOEGRAD_SIM_SOC_NAME", soc)
    app = create_app(Settings(backend="ascend", ascend_home_path=release_home(version), streams=1))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def v2_infer(client: TestClient, **parameters):
    body = {"parameters": {"top_k": 2, **parameters},
            "inputs": v2_inputs()}
    return client.post("/v2/models/moe_init_routing_v2_grad/infer", content=json.dumps(body))


def v1_order(response) -> str:
    assert response.status_code == 200, response.text
    return msgpack.unpackb(response.content)["order"]


def compare(client: TestClient, order: str):
    candidate = {"dtype": "float32", "shape": [2, 2], "data": bytes(16)}  # grad_x's shape: [N, H]
    document = {**example_document(order=order), "candidate": candidate}
    return client.post("/v1/moe_init_routing_v2_grad/compare", content=pack(document),
                       headers={"content-type": "application/msgpack"})


def assert_refused(response, *words: str) -> None:
    problem = response.json()
    assert (problem["status"], problem["field"], problem["aclnn_status"]) == (422, "order", 161002), problem
    for word in words:
        assert word in problem["detail"], problem["detail"]


@pytest.mark.parametrize(("soc", "version", "profile", "alias", "others"), [
    ("Ascend910B3", "9.1.0", "ascend910b@9.1", "ascend910b", ("ascend950@9.1", "ascend910b@9.0", "ascend910_93@9.1")),
    ("Ascend950PR", "9.0.0", "ascend950@9.0", None, ("ascend950", "ascend950@9.1", "ascend950@8.5")),
    ("Ascend910_9391", "8.5.0", "ascend910_93@8.5", None, ("ascend910b@8.5", "ascend910_93", "sequential")),
])
def test_a_device_answers_its_profile_and_refuses_another(sim, release_home, monkeypatch, soc, version, profile,
                                                          alias, others):
    with serve_device(monkeypatch, release_home, soc, version) as client:
        assert v1_order(post(client, example_document())) == profile                # named none: the device's
        assert v1_order(post(client, example_document(order=profile))) == profile   # named the device's
        if alias is not None:                                                        # an alias of it: canonical
            assert v1_order(post(client, example_document(order=alias))) == profile
        for other in others:
            assert_refused(post(client, example_document(order=other)), profile)   # names what to name instead
            assert_refused(compare(client, other), profile)
            v2 = v2_infer(client, order=other)
            assert v2.status_code == 400 and "161002" in v2.json()["error"]
        assert v2_infer(client).json()["parameters"]["order"] == profile
        info = client.get("/v1/info").json()
        assert info["order"] == info["device_order"] == profile
        assert info["device"] == f"{soc} #0, CANN {version} (aclsysGetVersionStr)"
        assert client.get("/health/ready").json()["device"] == info["device"]


@pytest.mark.parametrize(("soc", "version", "device"), [
    ("Ascend910B3", "10.0.0", "Ascend910B3 #0, CANN 10.0.0 (aclsysGetVersionStr): release unknown to moegrad"),
    ("Ascend950PR", None, "Ascend950PR #0, CANN release unknown"),
    ("Ascend310P3", "9.1.0", "Ascend310P3 #0, CANN 9.1.0 (aclsysGetVersionStr)"),   # a chip with no profile
])
def test_an_unknown_profile_is_served_unnamed_and_says_so(sim, release_home, monkeypatch, soc, version, device):
    with serve_device(monkeypatch, release_home, soc, version) as client:
        assert v1_order(post(client, example_document())) == "unknown"
        assert v2_infer(client).json()["parameters"]["order"] == "unknown"
        unknown = "release unknown" if "release unknown" in device else soc
        for named in ("ascend910b@9.1", "ascend950@9.1", "ascend910b"):
            assert_refused(post(client, example_document(order=named)), unknown)
            assert_refused(compare(client, named), unknown)
        info = client.get("/v1/info").json()
        assert info["device"] == device and info["device_order"] == "unknown"
