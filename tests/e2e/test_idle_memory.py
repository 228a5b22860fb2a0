"""What an idle server holds (docs/operations.md, "Memory"): its kept receive buffers go within
``MOEGRAD_RECEIVE_KEEP_S``, and its RSS is back within 10% (or 64 MiB) of where it settles.

A real ``moegrad-service`` (reference backend) with a small keep time answers a few large v1
msgpack calls from a plain msgpack client; then, idle, ``/metrics`` shows its kept buffers and the
RSS of its process (/proc/<pid>/status) is read ``receive_keep_s`` + 1 s after the last answer and
again once it has settled. Tolerant: the bound is the issue's, not a measurement.
"""

from __future__ import annotations

import time

import httpx
import msgpack
import numpy as np

from support.attacks.probes import rss_bytes
from support.launch import moegrad_server

MIB = 1 << 20
KEEP_S = 1.0


def kept_bytes(client: httpx.Client) -> float:
    line = next(line for line in client.get("/metrics").text.splitlines()
                if line.startswith("moegrad_receive_buffer_kept_bytes "))
    return float(line.split()[1])


def test_an_idle_server_gives_back_its_kept_buffers_within_receive_keep_s_plus_a_second(tmp_path):
    tokens, top_k, hidden = 2048, 2, 4096  # 64 MiB of float32 grad, a 32 MiB grad_x
    rng = np.random.default_rng(0)
    grad = rng.standard_normal((tokens * top_k, hidden), dtype=np.float32)
    idx = rng.permutation(tokens * top_k).astype(np.int32)
    body = msgpack.packb({"grad_expanded_x": {"dtype": "float32", "shape": list(grad.shape), "data": grad.tobytes()},
                          "expanded_row_idx": {"dtype": "int32", "shape": [idx.size], "data": idx.tobytes()},
                          "top_k": top_k}, use_bin_type=True)
    settings = {"receive_keep_s": KEEP_S, "warm_up": "false", "max_inflight_bytes": 1 << 30}
    with moegrad_server(tmp_path, settings=settings) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(3):
            response = client.post("/v1/moe_init_routing_v2_grad", content=body,
                                   headers={"content-type": "application/msgpack"})
            assert response.status_code == 200
        answered = time.monotonic()
        busy = rss_bytes(server.pid)
        assert kept_bytes(client) >= len(body)  # the body's buffer (and grad_x's) kept for the next call
        time.sleep(max(0.0, answered + KEEP_S + 1.0 - time.monotonic()))
        idle = rss_bytes(server.pid)
        assert kept_bytes(client) == 0
        time.sleep(3.0)
        settled = rss_bytes(server.pid)
    assert busy - idle >= len(body) // 2, (busy >> 20, idle >> 20)  # what was kept went back to the OS
    assert abs(idle - settled) <= max(settled // 10, 64 * MIB), (idle >> 20, settled >> 20)
