"""The same call gets the same answer on every path, on every device profile: in-process, v1, v2 over
HTTP and v2 over gRPC (docs/semantics.md sections 2 and 8).

Oracle for the verdicts: tests/support/profile_cases.py (which slot values each kernel source
accepts), and for the bits the slow loop of each profile (tests/support/slow_loops.py); the paths
are then compared with each other: the same status, field and aclnn code for a refusal, the same
bits and the canonical profile name for an answer (an alias answers as the profile it names).
"""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest
import tritonclient.grpc as triton
from fastapi.testclient import TestClient
from tritonclient.utils import InferenceServerException

import moegrad
from moegrad_service.app import create_app
from moegrad_service.settings import Settings
from support.bits import assert_bitwise_equal
from support.grpckit import MODEL, inputs
from support.profile_cases import BOUNDARIES, LENIENT, boundary_call
from support.servicekit import grad_x_of, post
from support.slow_loops import SLOW_ALIASES, SLOW_PROFILES, slow_profile

NAMES = {161001: "ACLNN_ERR_PARAM_NULLPTR", 161002: "ACLNN_ERR_PARAM_INVALID", 561002: "ACLNN_ERR_INNER_TILING_ERROR",
         561103: "ACLNN_ERR_INNER_NULLPTR"}
PROFILE_NAMES = [*SLOW_PROFILES, "ascend950", "ascend950@2025-12"]


@pytest.fixture(scope="module")
def service():
    """(HTTP TestClient, tritonclient.grpc client) of one reference app serving gRPC on a free port."""
    app = create_app(Settings(backend="reference", grpc_port=0, warm_up=False))
    with TestClient(app, raise_server_exceptions=False) as http, \
            triton.InferenceServerClient(f"127.0.0.1:{app.state.grpc_port}") as grpc_client:
        yield http, grpc_client


def wire(array: np.ndarray) -> dict:
    name = {"f4": "float32", "f2": "float16", "i4": "int32"}[array.dtype.str[1:]]
    return {"dtype": name, "shape": list(array.shape), "data": np.ascontiguousarray(array).tobytes()}


def parameters(kwargs: dict, order: str | None) -> dict:
    named = {name: kwargs[name] for name in ("top_k", "drop_pad_mode", "active_num")}
    return named if order is None else {**named, "order": order}


def in_process(kwargs: dict, order: str | None) -> tuple:
    try:
        call = moegrad.MoeInitRoutingV2GradCall(**kwargs, **({} if order is None else {"order": order}))
    except moegrad.InvalidArgument as error:
        return ("refused", error.aclnn_status, error.field)
    return ("answered", moegrad.moe_init_routing_v2_grad(call), call.order)


def v1(http: TestClient, kwargs: dict, order: str | None) -> tuple:
    document = {"grad_expanded_x": wire(kwargs["grad_expanded_x"]), "expanded_row_idx": wire(kwargs["expanded_row_idx"]),
                **parameters(kwargs, order)}
    response = post(http, document)
    if response.status_code != 200:
        assert response.status_code == 422, response.text
        body = response.json()
        assert body["aclnn_name"] == NAMES[body["aclnn_status"]]
        return ("refused", body["aclnn_status"], body["field"])
    return ("answered", grad_x_of(response), msgpack.unpackb(response.content)["order"])


def v2_http(http: TestClient, kwargs: dict, order: str | None) -> tuple:
    tensors = [(name, kwargs[name]) for name in ("grad_expanded_x", "expanded_row_idx")]
    document = {"parameters": parameters(kwargs, order), "inputs": [
        {"name": name, "shape": list(array.shape), "datatype": {"f4": "FP32", "i4": "INT32"}[array.dtype.str[1:]],
         "parameters": {"binary_data_size": array.nbytes}} for name, array in tensors],
        "outputs": [{"name": "grad_x", "parameters": {"binary_data": True}}]}
    header = json.dumps(document).encode()
    response = http.post(f"/v2/models/{MODEL}/infer", content=header + b"".join(a.tobytes() for _, a in tensors),
                         headers={"Inference-Header-Content-Length": str(len(header))})
    if response.status_code != 200:
        assert response.status_code == 400, response.text
        return ("refused", response.json()["error"])
    size = int(response.headers["inference-header-content-length"])
    reply = json.loads(response.content[:size])
    (output,) = reply["outputs"]
    grad_x = np.frombuffer(response.content[size:], np.float32).reshape(output["shape"])
    return ("answered", grad_x, reply["parameters"]["order"])


def v2_grpc(client, kwargs: dict, order: str | None) -> tuple:
    call = {name: kwargs[name] for name in ("grad_expanded_x", "expanded_row_idx")}
    try:
        result = client.infer(MODEL, inputs(triton, call), parameters=parameters(kwargs, order))
    except InferenceServerException as error:
        assert error.status() == "StatusCode.INVALID_ARGUMENT"
        return ("refused", error.message())
    return ("answered", result.as_numpy("grad_x"), result.get_response().parameters["order"].string_param)


def accepted_on(profile: str, before: bool, at_9_1: bool) -> bool:
    return at_9_1 if SLOW_PROFILES[SLOW_ALIASES.get(profile, profile)][1] else before


@pytest.mark.parametrize("profile", PROFILE_NAMES)
@pytest.mark.parametrize(("mode", "label", "value", "before", "at_9_1"), BOUNDARIES,
                         ids=[f"{b[0]}-{b[1]}" for b in BOUNDARIES])
def test_every_path_gives_the_same_answer_at_each_invalid_slot_boundary(service, profile, mode, label, value,
                                                                        before, at_9_1):
    http, grpc_client = service
    kwargs = boundary_call(mode, value)
    local, one, two, three = (in_process(kwargs, profile), v1(http, kwargs, profile), v2_http(http, kwargs, profile),
                              v2_grpc(grpc_client, kwargs, profile))
    canonical = SLOW_ALIASES.get(profile, profile)
    if not accepted_on(profile, before, at_9_1):
        assert local == one == ("refused", 161002, "expanded_row_idx")
        assert two[0] == three[0] == "refused" and two[1] == three[1]
        assert two[1].endswith("[field expanded_row_idx] (ACLNN_ERR_PARAM_INVALID 161002)")
        assert (f"{LENIENT} accepts it" in two[1]) == at_9_1
        return
    want = slow_profile(**kwargs, profile=profile)
    for kind, grad_x, order in (local, one, two, three):
        assert (kind, order) == ("answered", canonical)
        assert_bitwise_equal(grad_x, want)


@pytest.mark.parametrize(("profile", "status"), [("ascend910b@9.1", 561103), ("ascend950@9.1", 561103),
                                                 ("ascend910_93@9.0", 561002), ("ascend950@8.5", 561002),
                                                 ("sequential", 561002), (None, 561103)])
def test_every_path_gives_the_profiles_attribute_code(service, profile, status):
    http, grpc_client = service
    kwargs = {**boundary_call("dropless", 5), "top_k": 4}  # 6 slots are not a multiple of 4
    assert in_process(kwargs, profile) == v1(http, kwargs, profile) == ("refused", status, "expanded_row_idx")
    two, three = v2_http(http, kwargs, profile), v2_grpc(grpc_client, kwargs, profile)
    assert two == three and two[1].endswith(f"[field expanded_row_idx] ({NAMES[status]} {status})")


def test_an_empty_grad_x_from_cann_9_1_is_answered_on_every_path(service):
    http, grpc_client = service
    # H = 0 with a drop_pad_mode, an index and a dim 0 that every profile before 9.1 refuses
    kwargs = {"grad_expanded_x": np.zeros((3, 0), np.float32), "expanded_row_idx": np.array([9, -4, 0, 0], np.int32),
              "top_k": 2, "drop_pad_mode": 0, "active_num": 0}
    for profile in ("ascend910b@9.1", LENIENT, None):
        for kind, grad_x, order in (in_process(kwargs, profile), v1(http, kwargs, profile),
                                    v2_http(http, kwargs, profile), v2_grpc(grpc_client, kwargs, profile)):
            assert (kind, grad_x.shape, order) == ("answered", (2, 0), profile or "ascend910b@9.1")
    for profile in ("ascend910b@9.0", "ascend950@8.5"):
        assert in_process(kwargs, profile) == v1(http, kwargs, profile) == ("refused", 561002, "grad_expanded_x")
        assert v2_http(http, kwargs, profile) == v2_grpc(grpc_client, kwargs, profile)


@pytest.mark.parametrize("profile", ["ascend910b@9.1", "ascend950@9.0", "ascend950"])
def test_a_batch_of_one_shape_answers_each_member_as_alone(service, profile):
    # the batch endpoint checks small calls of one shape as a group: the same verdicts and bits
    http, _ = service
    members = [boundary_call("dropless", value) for value in (5, -1, 6, 5)]
    items = [{"grad_expanded_x": wire(kwargs["grad_expanded_x"]), "expanded_row_idx": wire(kwargs["expanded_row_idx"]),
              **parameters(kwargs, profile)} for kwargs in members]
    response = http.post("/v1/moe_init_routing_v2_grad/batch", content=msgpack.packb(items, use_bin_type=True),
                         headers={"content-type": "application/msgpack"})
    assert response.status_code == 200, response.text
    results = msgpack.unpackb(response.content, raw=False)["results"]
    for kwargs, result in zip(members, results, strict=True):
        alone = v1(http, kwargs, profile)
        if alone[0] == "refused":
            assert (result["problem"]["aclnn_status"], result["problem"]["field"]) == alone[1:]
        else:
            tensor = result["grad_x"]
            grad_x = np.frombuffer(tensor["data"], np.float32).reshape(tensor["shape"])
            assert result["order"] == alone[2] == SLOW_ALIASES.get(profile, profile)
            assert_bitwise_equal(grad_x, slow_profile(**kwargs, profile=profile))
    assert [("problem" in result) for result in results] == [False, profile != "ascend950", profile != "ascend950",
                                                              False]
