"""The gRPC attacks: messages that the server must not receive, or not all at once; typed contents that
must not hold the event loop; RPCs over the connection limit. Each runs against a server started by
:func:`grpc_server` (reference backend, gRPC beside HTTP, bearer token :data:`AUTH_TOKEN`), watched
by the HTTP probes (support.attacks.probes) and judged on the five rules (support.attacks.outcome),
with its own figure besides.

``quick`` sizes fit the tests (tests/e2e/test_grpc_attacks_e2e.py); the full sizes are the original
finding's (``python -m bench.grpc_attack``). The messages are built from the protocol's stubs
(tritonclient's ``service_pb2``) and sent by grpc's own client, several channels at a time.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2

from ..launch import LOOPBACK, REFERENCE_FLAGS, ServerProcess, free_port, moegrad_server
from .outcome import Outcome, summary, watched
from .probes import Probes, rss_bytes
from .suite import ATTACK_SETTINGS, AUTH_TOKEN
from .wire import MIB, example_call

__all__ = ["GRPC_ATTACKS", "GRPC_FULL_SETTINGS", "GRPC_SETTINGS", "GrpcTarget", "LivenessProbe", "grpc_server",
           "infer_message", "messages_within_the_budget", "one_large_call", "rpcs_over_the_limit", "typed_contents",
           "unauthenticated_messages", "warm_up"]

#: The gRPC attack server's settings: the HTTP attack settings, a 128 MiB budget, and 24 MiB messages
#: (each read reserves 4 times that: 96 of the 112 MiB one call may take).
GRPC_SETTINGS = {**ATTACK_SETTINGS, "max_inflight_bytes": 128 * MIB, "grpc_max_message_bytes": 24 * MIB,
                 "auth_tokens": AUTH_TOKEN}
#: The full-size settings: the original finding's 512 MiB budget and 112 MiB messages.
GRPC_FULL_SETTINGS = {**GRPC_SETTINGS, "max_inflight_bytes": 512 * MIB, "grpc_max_message_bytes": 112 * MIB}
SERVICE = "inference.GRPCInferenceService"
MODEL = "moe_init_routing_v2_grad"
_TOKEN = (("authorization", f"Bearer {AUTH_TOKEN}"),)
_CHANNEL = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


@dataclass
class GrpcTarget:
    """A started server, the port of its gRPC side, and the settings it runs with."""

    server: ServerProcess
    grpc_port: int
    settings: dict

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def budget(self) -> int:
        return int(self.settings["max_inflight_bytes"])

    @property
    def max_message(self) -> int:
        return int(self.settings["grpc_max_message_bytes"])


@contextmanager
def grpc_server(log_dir: Path, settings: dict, *, source: Path | None = None) -> Iterator[GrpcTarget]:
    """A server with ``settings`` and gRPC on a free port; ``source``: a checkout whose ``client`` and
    ``service`` folders it runs from instead of this one's (to measure an earlier commit)."""
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(source / "client"), str(source / "service")])
    port = free_port()
    with moegrad_server(log_dir, flags=[*REFERENCE_FLAGS, "--grpc-port", str(port)], settings=settings, env=env,
                        name="grpc-attack") as server:
        yield GrpcTarget(server, port, dict(settings))


def warm_up(target: GrpcTarget) -> None:
    """Compile the kernel (the example call over HTTP) and make a first call over gRPC, so that
    neither counts in an attack's figures."""
    example_call(target.server.port, timeout_s=120, token=AUTH_TOKEN)
    answers = _fire(target.address, f"/{SERVICE}/ModelInfer", infer_message(MIB), 2, metadata=_TOKEN)
    if answers != Counter(OK=2):
        raise RuntimeError(f"the warm-up calls over gRPC got {dict(answers)}")


def infer_message(nbytes: int, *, top_k: int = 1, typed: bool = False, hidden: int = 1024) -> bytes:
    """A serialized valid ModelInfer request of about ``nbytes``: a dropless call with ``top_k`` (1:
    grad_x as large as its input), float32 grad [N * top_k, hidden] and a permutation as index, raw
    or in typed contents (``fp32_contents``, ``int_contents``, packed as protobuf packs them)."""
    rows = max(1, nbytes // (4 * hidden))
    tokens = max(1, rows // top_k)
    rng = np.random.default_rng(rows)
    grad = rng.standard_normal((tokens * top_k, hidden), dtype=np.float32)
    index = rng.permutation(tokens * top_k).astype(np.int32)
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.parameters["top_k"].int64_param = top_k
    grad_input = request.inputs.add(name="grad_expanded_x", datatype="FP32", shape=list(grad.shape))
    index_input = request.inputs.add(name="expanded_row_idx", datatype="INT32", shape=list(index.shape))
    if not typed:
        request.raw_input_contents.extend([grad.tobytes(), index.tobytes()])
        return request.SerializeToString()
    # typed values written by hand (a list of millions of floats for protobuf would cost gigabytes here)
    grad_tensor = grad_input.SerializeToString() + _field(5, _field(6, grad.tobytes()))  # contents.fp32_contents
    index_tensor = index_input.SerializeToString() + _field(5, _field(2, _varints(index)))  # contents.int_contents
    del request.inputs[:]
    return request.SerializeToString() + _field(5, grad_tensor) + _field(5, index_tensor)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (protobuf's wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varints(values: np.ndarray) -> bytes:
    """Non-negative integers as consecutive varints (a packed repeated field's payload)."""
    return b"".join(_varint(int(v)) for v in values)


def _fire(address: str, method: str, body: bytes, count: int, *, metadata=(), channels: int = 4,
          timeout_s: float = 60.0) -> Counter:
    """``count`` RPCs of ``method`` with ``body`` at once over ``channels`` channels; their status names."""
    opened = [grpc.insecure_channel(address, options=_CHANNEL) for _ in range(channels)]
    try:
        futures: list[Future] = [opened[i % channels].unary_unary(method).future(body, metadata=metadata,
                                                                                   timeout=timeout_s)
                                 for i in range(count)]
        return Counter(_status(future) for future in futures)
    finally:
        for channel in opened:
            channel.close()


def _status(future) -> str:
    try:
        future.result()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


@dataclass
class LivenessProbe:
    """``ServerLive`` over gRPC every 20 ms on a thread while the block runs: the latencies, and the
    failures by status name."""

    address: str
    latencies_s: list[float] = field(default_factory=list)
    failures: Counter = field(default_factory=Counter)

    @contextmanager
    def running(self) -> Iterator[LivenessProbe]:
        stop = threading.Event()

        def probe() -> None:
            with grpc.insecure_channel(self.address) as channel:
                live = channel.unary_unary(f"/{SERVICE}/ServerLive")
                request = service_pb2.ServerLiveRequest().SerializeToString()
                while not stop.is_set():
                    sent = time.monotonic()
                    try:
                        live(request, timeout=10)
                    except grpc.RpcError as exc:
                        self.failures[exc.code().name] += 1
                    self.latencies_s.append(time.monotonic() - sent)
                    stop.wait(max(0.0, sent + 0.02 - time.monotonic()))

        thread = threading.Thread(target=probe, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(15)

    @property
    def max_s(self) -> float:
        return max(self.latencies_s, default=float("nan"))


def unauthenticated_messages(target: GrpcTarget, probes: Probes, quick: bool) -> Outcome:
    """Large messages without a token, to ModelInfer (token required) and ServerLive (open): none is read."""
    count, size = (12, 20 * MIB) if quick else (28, 112 * MIB)
    size = min(size, target.max_message - MIB)
    outcome = Outcome("gRPC: large messages without a token", 1,
                      "28 x 112 MiB: OOM-killed in a 4 GiB cgroup (512 MiB budget) 7.3 s after the first send")
    body = infer_message(size)
    start = rss_bytes(target.server.pid)
    with watched(target.server, probes, outcome, target.budget):
        infer = _fire(target.address, f"/{SERVICE}/ModelInfer", body, count)
        live = _fire(target.address, f"/{SERVICE}/ServerLive", body, count // 3)
    outcome.statuses.update({f"ModelInfer {k}": v for k, v in infer.items()})
    outcome.statuses.update({f"ServerLive {k}": v for k, v in live.items()})
    rise = (outcome.peak_rss_bytes - start) / MIB
    outcome.figures.update(rise_mib=rise, start_mib=start / MIB)
    outcome.now = (f"{count} x {size / MIB:.0f} MiB to ModelInfer: {summary(infer)}; {count // 3} to ServerLive: "
                   f"{summary(live)}; RSS {start / MIB:.0f} -> {outcome.peak_rss_bytes / MIB:.0f} MiB peak "
                   f"(+{rise:.0f})")
    return outcome


def messages_within_the_budget(target: GrpcTarget, probes: Probes, quick: bool) -> Outcome:
    """Valid large calls with the token, all at once (top_k 1: grad_x as large as the message), and
    large health checks without one: the server holds no more than its budget for them."""
    count, size = (8, 20 * MIB) if quick else (28, 100 * MIB)
    size = min(size, target.max_message - MIB)
    outcome = Outcome("gRPC: large calls with a token, at once", 1,
                      "one 112 MiB message: RSS +732 MiB (3.3 times its admission)", probe_may_get_503=True)
    body = infer_message(size)
    check = health_pb2.HealthCheckRequest(service="x" * (size // 4)).SerializeToString()
    start = rss_bytes(target.server.pid)
    with watched(target.server, probes, outcome, target.budget):
        health: list[Counter] = []
        thread = threading.Thread(target=lambda: health.append(
            _fire(target.address, "/grpc.health.v1.Health/Check", check, max(1, count // 4))))
        thread.start()
        infer = _fire(target.address, f"/{SERVICE}/ModelInfer", body, count, metadata=_TOKEN)
        thread.join(120)
    outcome.statuses.update({f"ModelInfer {k}": v for k, v in infer.items()})
    outcome.statuses.update({f"Check {k}": v for k, v in (health[0] if health else Counter()).items()})
    rise = (outcome.peak_rss_bytes - start) / MIB
    outcome.figures.update(rise_mib=rise, start_mib=start / MIB, budget_mib=target.budget / MIB)
    outcome.now = (f"{count} x {size / MIB:.0f} MiB calls: {summary(infer)}; {max(1, count // 4)} x "
                   f"{len(check) / MIB:.0f} MiB health checks: {summary(health[0] if health else Counter())}; RSS "
                   f"+{rise:.0f} MiB at the peak, budget {target.budget / MIB:.0f} MiB")
    return outcome


def one_large_call(target: GrpcTarget, probes: Probes, quick: bool) -> Outcome:
    """One valid call as large as the server takes (top_k 1, grad_x as large as its input), alone:
    the server's peak RSS rise against its message, twice (the second finds the heap warm)."""
    size = target.max_message - MIB
    outcome = Outcome("gRPC: one large call, alone", 1, "one 112 MiB message: RSS +732 MiB")
    body = infer_message(size)
    ratios = []
    for _ in range(2):
        time.sleep(1.0)  # the heap trimmer's pause after a release, so the start is settled
        start = rss_bytes(target.server.pid)
        with watched(target.server, probes, outcome, target.budget):
            answers = _fire(target.address, f"/{SERVICE}/ModelInfer", body, 1, metadata=_TOKEN, channels=1)
        outcome.statuses.update(answers)
        ratios.append((outcome.peak_rss_bytes - start) / len(body))
    outcome.figures.update(times_message=max(ratios))
    outcome.now = (f"{len(body) / MIB:.0f} MiB message, {summary(outcome.statuses)}: RSS rose "
                   f"{' and '.join(f'{r:.2f}' for r in ratios)} times the message (what a call reserves now: 4 times)")
    return outcome


def typed_contents(target: GrpcTarget, probes: Probes, quick: bool) -> Outcome:
    """One huge message of typed contents (``fp32_contents``), then one just under the typed limit:
    liveness over HTTP and gRPC meanwhile."""
    size = min(20 * MIB if quick else 486 * MIB, target.max_message - MIB)
    outcome = Outcome("gRPC: typed contents", 4, "one 486 MiB message: /health/live stopped for 12.8 s")
    huge, under = infer_message(size, typed=True), infer_message(3 * MIB, typed=True)
    live = LivenessProbe(target.address)
    with watched(target.server, probes, outcome, target.budget), live.running():
        started = time.monotonic()
        answers = _fire(target.address, f"/{SERVICE}/ModelInfer", huge, 1, metadata=_TOKEN, channels=1)
        huge_s = time.monotonic() - started
        answers += _fire(target.address, f"/{SERVICE}/ModelInfer", under, 1, metadata=_TOKEN, channels=1)
    outcome.statuses.update(answers)
    http_max = max(probes.window(started - 0.1, time.monotonic())[0], default=float("nan"))
    outcome.figures.update(http_live_max_s=http_max, grpc_live_max_s=live.max_s, huge_s=huge_s)
    if live.failures:
        outcome.problems.append(f"ServerLive failed: {dict(live.failures)}")
    outcome.now = (f"{len(huge) / MIB:.0f} MiB of fp32_contents, then {len(under) / MIB:.1f} MiB: "
                   f"{summary(answers)} ({huge_s:.2f} s for the first); /health/live at most {http_max:.3f} s, "
                   f"ServerLive at most {live.max_s:.3f} s")
    return outcome


def rpcs_over_the_limit(target: GrpcTarget, probes: Probes, quick: bool) -> Outcome:
    """``max_connections`` health watches held open, then 10,000 RPCs at once (more than grpc's core
    holds for the server by default): each is over the limit."""
    limit = int(target.settings["max_connections"])
    extra = 10_000
    outcome = Outcome(f"gRPC: RPCs over max_connections ({limit})", 12, "3,000 concurrent RPCs: 640 CANCELLED")
    with grpc.insecure_channel(target.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch
        streams = [watch(health_pb2.HealthCheckRequest(), timeout=120) for _ in range(limit)]
        try:
            for stream in streams:
                next(stream)  # its first status: the watch is being served
            with watched(target.server, probes, outcome, target.budget):
                answers = _fire(target.address, f"/{SERVICE}/ServerLive", b"", extra, channels=8)
        finally:
            for stream in streams:
                stream.cancel()
    outcome.statuses.update(answers)
    outcome.now = f"{limit} watches open, then {extra} RPCs at once: {summary(answers)}"
    return outcome


#: The attacks, in the order ``python -m bench.grpc_attack`` runs them.
GRPC_ATTACKS = (unauthenticated_messages, one_large_call, messages_within_the_budget, typed_contents,
                rpcs_over_the_limit)
