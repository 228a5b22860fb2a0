"""Errors that say what to do: the cast, the mode, where the server should be, the URL requested."""

from __future__ import annotations

import socket

import httpx
import numpy as np
import pytest

import moegrad
from moegrad import InvalidArgument, MoeInitRoutingV2GradCall, ServiceError, TransportError


def call(**overrides):
    fields = {"grad_expanded_x": np.zeros((6, 4), np.float32), "expanded_row_idx": np.arange(6, dtype=np.int32),
              "top_k": 2, **overrides}
    return MoeInitRoutingV2GradCall(**fields)


def test_a_float64_grad_names_the_cast():
    with pytest.raises(InvalidArgument) as caught:
        call(grad_expanded_x=np.zeros((6, 4)))
    assert "grad_expanded_x.astype(numpy.float32)" in caught.value.message


def test_an_int64_index_names_the_cast():
    with pytest.raises(InvalidArgument) as caught:
        call(expanded_row_idx=np.arange(6))
    assert "expanded_row_idx.astype(numpy.int32)" in caught.value.message


def test_a_3d_grad_in_mode_0_names_drop_pad_mode_1():
    with pytest.raises(InvalidArgument) as caught:
        call(grad_expanded_x=np.zeros((3, 2, 4), np.float32))
    assert "pass drop_pad_mode=1" in caught.value.message and caught.value.aclnn_status == 561103  # CANN 9.1's


def test_a_2d_grad_in_mode_1_names_drop_pad_mode_0():
    with pytest.raises(InvalidArgument) as caught:
        call(drop_pad_mode=1)
    assert "pass drop_pad_mode=0" in caught.value.message


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_connection_refused_says_start_a_server_or_pass_the_url():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with moegrad.Client(url, retries=0) as client, pytest.raises(TransportError) as caught:
        client.moe_init_routing_v2_grad(np.zeros((2, 1), np.float32), np.arange(2, dtype=np.int32), 1)
    message = caught.value.message
    assert url in message and "moegrad-service serve" in message and "--url" in message and "MOEGRAD_URL" in message


def test_a_base_url_ending_in_v1_names_the_url_requested():
    def not_found(request: httpx.Request) -> httpx.Response:  # what FastAPI answers for an unknown path
        return httpx.Response(404, json={"detail": "Not Found"})

    with moegrad.Client("http://svc:8000/v1", transport=httpx.MockTransport(not_found)) as client:
        with pytest.raises(ServiceError) as caught:
            client.moe_init_routing_v2_grad(np.zeros((2, 1), np.float32), np.arange(2, dtype=np.int32), 1)
    message = caught.value.message
    assert "http://svc:8000/v1/v1/moe_init_routing_v2_grad" in message and "without the /v1" in message
    assert caught.value.status_code == 404
