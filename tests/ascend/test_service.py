"""The whole service with ``backend="ascend"`` over the CANN simulator.

In-process (``TestClient(create_app(...))`` as a context manager, so the lifespan opens and closes the
backend): results bitwise equal to the reference backend's, faults as HTTP answers, and what the
simulator still holds after the app has closed. Then a real ``moegrad-service`` process on a loopback
port, driven by the real :class:`moegrad.Client`, for every mode, dtype and K.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import numpy as np
import pytest
from ascend_cases import DTYPE_NAMES, K_VALUES, MODES, assert_bitwise, make_call
from fastapi.testclient import TestClient

import moegrad
from moegrad_service.app import create_app
from moegrad_service.engine.ascend import AscendBackend
from moegrad_service.settings import Settings
from support.docexample import example_document
from support.servicekit import gauge, grad_x_of, post

LIVE = ("allocations", "tensors", "executors", "streams", "pending", "device_refs", "initialized")


@contextlib.contextmanager
def serve(opened=None, **settings):
    """A TestClient of the service, its lifespan open, over the backend ``opened`` (one made by the test)
    or else the one ``settings`` names."""
    app = create_app(Settings(**settings), backend=opened)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def document(call: moegrad.MoeInitRoutingV2GradCall) -> dict:
    return call.to_wire()


def assert_nothing_left(sim, before: dict[str, int]) -> None:
    after = sim.counts()
    assert {name: after[name] for name in LIVE} == dict.fromkeys(LIVE, 0)
    for name in ("violations", "reclaimed", "context_errors"):
        assert after[name] == before[name], name


def settled(client) -> bool:
    """True once the pool holds no call: none queued, none running (its /metrics gauges)."""
    return (gauge(client, "moegrad_inference_pending_request_count") == 0
            and gauge(client, "moegrad_inference_exec_count") == 0)


def hang_kernels(client, sim, pending: int, timeout: str = "0.05") -> None:
    """Post calls with a deadline of ``timeout`` s, arming a hang before each, until ``pending`` kernels hang.

    Every such call is answered 504, but a 504 does not say that the call's kernel took the hang: the
    pool answers at the deadline, from the event loop, while the call may still be queued (it is then
    never run) or still on its worker ahead of its launch (the launch comes after the answer, and the
    simulator's hang goes to the next kernel launched, whichever call's it is). So the next hang is
    armed only once the pool has let go of the call, and a call that never launched leaves its hang
    armed for the next one.
    """
    for _ in range(4 * pending + 8):
        if sim.counts()["pending"] >= pending:
            break
        sim.inject("hang", 1, -1)
        answer = post(client, example_document(), headers={"x-request-timeout": timeout})
        assert answer.status_code == 504, answer.text
        wait = time.monotonic() + 10
        while not settled(client) and time.monotonic() < wait:
            time.sleep(0.01)
    assert sim.counts()["pending"] == pending


def launch_after_the_answer(monkeypatch, backend, sim, hold_s: float = 0.5) -> None:
    """Hold each kernel launch of ``backend`` until the test arms its next fault (at most ``hold_s``).

    The interleaving CPU load makes: the worker thread runs a call up to its launch, the pool answers
    504 at the deadline, the test arms its next hang, and only then is the kernel launched. ``hold_s``
    stays well under the pool's ABANDON_GRACE_S (2 s), past which a worker still running is replaced.
    """
    armed = threading.Condition()
    injected = [0]
    inject = sim.inject

    def counted(*args) -> None:
        inject(*args)
        with armed:
            injected[0] += 1
            armed.notify_all()

    launch = backend._api.aclnnMoeInitRoutingV2Grad

    def late(*args):
        with armed:
            seen = injected[0]
            armed.wait_for(lambda: injected[0] > seen, timeout=hold_s)
        return launch(*args)

    monkeypatch.setattr(sim, "inject", counted)
    monkeypatch.setattr(backend._api, "aclnnMoeInitRoutingV2Grad", late)


def test_results_match_the_reference_backend_and_nothing_is_left(sim, sim_home):
    before = sim.counts()
    calls = [make_call(mode, dtype, k, seed=3) for mode in MODES for dtype in DTYPE_NAMES for k in (1, 3, 6, 8, 129)]
    with serve(backend="ascend", ascend_home_path=sim_home, streams=2) as ascend, serve(backend="reference") as ref:
        assert ascend.get("/health/ready").json() == {"status": "ready", "backend": "ascend",
                                                      "device": "Ascend910B3 #0, CANN 9.1.0 (aclsysGetVersionStr)"}
        for call in calls:
            got, want = post(ascend, document(call)), post(ref, document(call))
            assert got.status_code == want.status_code == 200, got.text
            assert_bitwise(grad_x_of(got), grad_x_of(want))
        with ThreadPoolExecutor(4) as clients:  # concurrent requests over both streams
            replies = list(clients.map(lambda call: post(ascend, document(call)), calls))
        for call, reply in zip(calls, replies, strict=True):
            assert_bitwise(grad_x_of(reply), moegrad.moe_init_routing_v2_grad(call))
        assert sim.counts()["streams"] == 3  # the two workers' and the express worker's (for small calls)
    assert_nothing_left(sim, before)


def test_a_batch_of_calls_of_one_shape_runs_each_on_the_device_with_its_own_bits(sim, sim_home, monkeypatch):
    """Batch members grouped by shape run one by one on the device (the ascend backend computes no
    group itself): each result has the bits of the reference's single call, and nothing is left."""
    from moegrad.operator._call import CallGroup

    members = []
    call_of = CallGroup.call
    monkeypatch.setattr(CallGroup, "call", lambda group, member: members.append(member) or call_of(group, member))
    before = sim.counts()
    calls = [make_call(mode, dtype, 3, seed=seed) for mode in MODES for dtype in DTYPE_NAMES for seed in range(4)]
    body = msgpack.packb([document(call) for call in calls], use_bin_type=True)
    with serve(backend="ascend", ascend_home_path=sim_home, streams=2) as ascend:
        reply = ascend.post(
            "/v1/moe_init_routing_v2_grad/batch", content=body, headers={"content-type": "application/msgpack"}
        )
    assert reply.status_code == 200, reply.text
    results = msgpack.unpackb(reply.content, raw=False)["results"]
    for call, result in zip(calls, results, strict=True):
        tensor = result["grad_x"]
        got = np.frombuffer(tensor["data"], moegrad.DTYPES[tensor["dtype"]]).reshape(tensor["shape"])
        assert_bitwise(got, moegrad.moe_init_routing_v2_grad(call))
        assert result["backend"] == "ascend"
    assert len(members) >= 12  # at least the dropless and active calls of each dtype ran as members
    assert_nothing_left(sim, before)


def test_launch_failure_is_a_500_with_the_device_text_then_200(sim, sim_home):
    before = sim.counts()
    with serve(backend="ascend", ascend_home_path=sim_home, streams=2) as client:
        sim.inject("launch")
        failed = post(client, example_document())
        assert failed.status_code == 500 and failed.headers["content-type"] == "application/problem+json"
        problem = failed.json()
        assert "injected kernel launch failure" in problem["device_message"]
        assert "injected kernel launch failure" in problem["detail"]
        assert problem["aclnn_status"] == 361001 and problem["aclnn_name"] == "ACLNN_ERR_RUNTIME_ERROR"
        assert post(client, example_document()).status_code == 200
    assert_nothing_left(sim, before)


def test_phase_one_rejection_is_a_422_with_the_device_code(sim, sim_home):
    with serve(backend="ascend", ascend_home_path=sim_home, streams=1) as client:
        sim.inject("tiling")
        rejected = post(client, example_document())
        assert rejected.status_code == 422
        assert rejected.json()["aclnn_status"] == 561103  # the CANN 9.1 code of a tiling failure (conftest: 9.1.0)
        assert "injected tiling failure" in rejected.json()["detail"]
        assert post(client, example_document()).status_code == 200


def test_an_installation_fault_in_phase_one_is_a_500_never_a_422(sim, sim_home):
    before = sim.counts()
    with serve(backend="ascend", ascend_home_path=sim_home, streams=1) as client:
        sim.inject("kernel")  # no kernel binary (561003): the host's fault, not the call's
        failed = post(client, example_document())
        assert failed.status_code == 500, failed.text
        problem = failed.json()
        assert problem["aclnn_status"] == 561003 and "install the operator package" in problem["detail"]
        assert "injected missing kernel" in problem["device_message"]
        assert post(client, example_document()).status_code == 200
    assert_nothing_left(sim, before)


def test_a_host_without_ascend_opp_path_is_never_ready(sim, sim_home, monkeypatch):
    monkeypatch.delenv("ASCEND_OPP_PATH")
    before = sim.counts()
    app = create_app(Settings(backend="ascend", ascend_home_path=sim_home))
    with pytest.raises(moegrad.DeviceFault, match="ASCEND_OPP_PATH is not set"):
        with TestClient(app):
            pass
    assert_nothing_left(sim, before)


def test_hung_kernel_is_a_504_and_the_pool_keeps_its_capacity(sim, sim_home):
    before = sim.counts()
    with serve(backend="ascend", ascend_home_path=sim_home, streams=2, express_max_adds=0) as client:
        hang_kernels(client, sim, pending=1, timeout="0.2")
        # Both workers still serve at once, the one that timed out on a fresh stream.
        with ThreadPoolExecutor(4) as clients:
            replies = list(clients.map(lambda _: post(client, example_document()), range(8)))
        assert [r.status_code for r in replies] == [200] * 8
        assert sim.counts()["streams"] == 3  # two workers' streams and the retired one
        assert sim.release_hung() == 1
        for _ in range(20):  # each worker polls its retired streams before a call; which worker takes a
            assert post(client, example_document()).status_code == 200  # call is the queue's choice
            if sim.counts()["pending"] == 0:
                break
        assert sim.counts()["pending"] == 0 and sim.counts()["streams"] == 2
        assert client.get("/health/ready").status_code == 200
    assert_nothing_left(sim, before)


def test_a_broken_cann_is_a_startup_error_with_the_hint(tmp_path):
    # (A CANN that is missing altogether is tested in a clean subprocess in test_loading.py.)
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libascendcl.so").write_bytes(b"not a shared library")
    app = create_app(Settings(backend="ascend", ascend_home_path=tmp_path))
    with pytest.raises(moegrad.DeviceFault, match=r"libascendcl\.so exists but cannot be loaded.*set_env\.sh"):
        with TestClient(app):
            pass


# --- a real server and the real client ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def ascend_server(sim_home, tmp_path):
    """A ``moegrad-service`` process with backend=ascend over the simulator; faults armed by environment."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEGRAD_", "ASCEND_"))}
    # Phase one #1 is the backend's startup check (the documentation's example), so the first
    # client call is phase one #2.
    env.update(MOEGRAD_ASCEND_HOME_PATH=str(sim_home), ASCEND_OPP_PATH=str(sim_home / "opp"), MOEGRAD_STREAMS="2",
               MOEGRAD_SIM_FAULTS="tiling@2,launch@2", MOEGRAD_SHUTDOWN_DRAIN_S="0")
    log = open(tmp_path / "server.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "moegrad_service", "serve", "--host", "127.0.0.1", "--port",
                                str(port), "--backend", "ascend", "--log-level", "warning"],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"the ascend server did not start: {(tmp_path / 'server.log').read_text()}")
        yield url
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def test_real_client_against_a_real_server(ascend_server):
    with moegrad.Client(ascend_server, retries=0) as client:
        assert client.info()["backend"] == "ascend"
        doc = make_call("dropless", "float32", 2)
        with pytest.raises(moegrad.InvalidArgument) as rejected:  # phase one #2: MOEGRAD_SIM_FAULTS tiling@2
            client.run(doc)  # the 9.1 code (conftest's release), read here from the home's version.info
        assert rejected.value.aclnn_status == 561103 and "injected tiling failure" in str(rejected.value)
        client.run(doc)                                             # launch #1
        with pytest.raises(moegrad.DeviceFault, match="injected kernel launch failure"):
            client.run(doc)                                         # launch #2 fails
        for mode in MODES:
            for dtype in DTYPE_NAMES:
                for k in K_VALUES:
                    call = make_call(mode, dtype, k, seed=11)
                    reply = client.run(call)
                    assert reply.backend == "ascend" and reply.device == "Ascend910B3 #0, CANN 9.1.0 (version.info)"
                    assert_bitwise(reply.grad_x, moegrad.moe_init_routing_v2_grad(call))


@pytest.mark.parametrize("launch", ["prompt", "after_its_504"])
def test_a_worker_with_too_many_hung_kernels_is_lost_capacity_and_shutdown_stays_clean(sim, sim_home, monkeypatch,
                                                                                       launch):
    # One stream: after 4 kernels that missed their deadline (MAX_RETIRED_STREAMS) the only worker
    # cannot run calls, so the service is not ready and refuses calls with 503 instead of failing them.
    # "after_its_504": every kernel is launched only after its call was answered (see hang_kernels).
    before = sim.counts()
    # closing waits for the kernel still hung at the end no longer than shutdown_grace_s, as open_backend's does
    backend = AscendBackend(ascend_home_path=sim_home, drain_timeout_s=1)
    if launch == "after_its_504":
        launch_after_the_answer(monkeypatch, backend, sim)
    with serve(opened=backend, backend="ascend", ascend_home_path=sim_home, streams=1, express_max_adds=0,
               shutdown_grace_s=1) as client:
        hang_kernels(client, sim, pending=4)
        wait = time.monotonic() + 5
        while client.get("/health/ready").status_code == 200 and time.monotonic() < wait:
            time.sleep(0.05)
        ready = client.get("/health/ready")
        assert ready.status_code == 503 and "none of the 1 backend workers" in ready.json()["detail"], ready.text
        refused = post(client, example_document())
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert sim.counts()["pending"] == 4
        assert sim.release_hung() == 4  # the kernels finish: the worker polls them and serves again
        wait = time.monotonic() + 5
        while client.get("/health/ready").status_code != 200 and time.monotonic() < wait:
            time.sleep(0.05)
        assert client.get("/health/ready").status_code == 200
        assert post(client, example_document()).status_code == 200
        hang_kernels(client, sim, pending=1)  # and one still hung when the service shuts down
    after = sim.counts()  # no CANN call after aclFinalize, nothing left but what the device reset took
    assert after["violations"] == before["violations"] and after["context_errors"] == before["context_errors"]
    assert after["initialized"] == after["streams"] == after["allocations"] == 0
    assert after["forced"] == before["forced"] + 1  # the hung kernel's stream, destroyed without waiting
