"""A soak's workload and runner: concurrent clients against one moegrad server for a fixed time.

``python -m bench.soak`` (bench/soak.py) runs it for 60 s and writes bench/RESULTS.md's soak
section; tests/e2e/test_reliability.py runs it for 10 s. :func:`run_soak` takes a server URL (and
its pid, for the RSS); everything goes to 127.0.0.1 only and every loop ends by itself when the
duration is over.

The load: ``clients`` threads (``--clients`` of bench.soak), each with its own
:class:`moegrad.Client` (``retries`` generous, so a 503 -- the queue of 8 is smaller than the 16
clients -- is retried after its Retry-After), each calling back to back until the time is up:

- valid calls (about 70 %) of every mode (dropless, active, drop/pad), dtype (float16, bfloat16,
  float32) and order (the server's default, ``ascend910b@9.1``, ``sequential``), picked at random from a
  set prepared before the load; every reply must equal, bit for bit,
  :func:`moegrad.moe_init_routing_v2_grad` computed in this process;
- invalid calls (about 30 %): an index out of range, K not dividing the index length, an int32
  grad (each 422 with its documented aclnn code), an unknown field, a data length that does not
  match the shape, bytes that are not msgpack (each 400);
- a few big calls (:meth:`Workload.build`'s ``big_calls`` of ``big_mib`` MiB of grad each, float32,
  at evenly spread moments), checked bitwise too.

Every HTTP answer is recorded at the transport: a 200 must be msgpack and any other status a
problem document whose ``status`` is the HTTP status. The run fails when any call ends other than as
expected, when an answer is malformed, or when a status other than 200, 400, 422 and 503 appears.
Before the load, every prepared valid and invalid call is made once (a warm-up: the server's lazy
imports and compiled kernels are not growth). The server's RSS (``/proc/<pid>/status`` VmRSS) is
then sampled throughout: at the start (idle, warmed up), its maximum, and settled (idle again after
the load, once two samples a second apart agree).
"""

from __future__ import annotations

import collections
import json
import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import ml_dtypes
import numpy as np

import moegrad

__all__ = ["SoakReport", "Workload", "rss_bytes", "run_soak"]

GRAD_PATH = "/v1/moe_init_routing_v2_grad"
MIB = 1 << 20
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
ORDERS = (None, "ascend910b", "sequential")  # None: the server's default (ascend910b@9.1 unless configured)
#: Statuses a soak answer may have (docs/protocol.md): results, the two client mistakes, a full queue.
ALLOWED_STATUSES = frozenset({200, 400, 422, 503})


def rss_bytes(pid: int) -> int:
    """VmRSS of process ``pid`` in bytes (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# --- the workload ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Planned:
    """One call to make: keyword arguments for ``Client.moe_init_routing_v2_grad`` or a raw body, and
    what must come back (an array, or an exception class with the aclnn code a 422 must carry)."""

    kind: str
    kwargs: dict[str, Any] | None = None
    document: dict[str, Any] | None = None
    raw_body: bytes | None = None
    expected: np.ndarray | None = None
    error: type[moegrad.MoegradError] | None = None
    aclnn_status: int | None = None


def routed_index(rng: np.random.Generator, mode: str, tokens: int,
                 top_k: int) -> tuple[np.ndarray, tuple[int, ...], int]:
    """(expanded_row_idx int32, grad rows shape, active_num) for a well-formed call of ``mode``.

    dropless: a permutation of [0, N*K); active: the same, with A of the rows materialised;
    drop/pad: E*C rows, each kept slot naming a distinct one, the dropped slots -1.
    """
    slots = tokens * top_k
    if mode == "dropless":
        return rng.permutation(slots).astype(np.int32), (slots,), 0
    if mode == "active":
        active = int(rng.integers(1, slots + 1))
        return rng.permutation(slots).astype(np.int32), (active,), active
    experts = int(rng.integers(1, 9))
    capacity = max(1, math.ceil(slots * 0.6 / experts))
    kept = min(slots, experts * capacity, int(rng.integers(0, slots + 1)))
    idx = np.full(slots, -1, dtype=np.int32)
    idx[rng.choice(slots, kept, replace=False)] = rng.choice(experts * capacity, kept, replace=False)
    return idx, (experts, capacity), 0


def valid_call(rng: np.random.Generator, mode: str, dtype: str, order: str | None, tokens: int, top_k: int,
               hidden: int) -> Planned:
    idx, rows, active = routed_index(rng, mode, tokens, top_k)
    grad = rng.standard_normal((*rows, hidden), dtype=np.float32).astype(DTYPES[dtype])
    kwargs = {"grad_expanded_x": grad, "expanded_row_idx": idx, "top_k": top_k,
              "drop_pad_mode": int(mode == "drop_pad"), "active_num": active, "order": order}
    expected = moegrad.moe_init_routing_v2_grad(
        grad, idx, top_k, kwargs["drop_pad_mode"], active, order=order or "ascend910b@9.1")
    return Planned(kind=f"valid {mode} {dtype} {order or 'default'}", kwargs=kwargs, expected=expected)


def tensor(array: np.ndarray) -> dict[str, Any]:
    """A wire tensor map built by hand (docs/protocol.md, "Tensors")."""
    name = {np.dtype(np.float16): "float16", np.dtype(ml_dtypes.bfloat16): "bfloat16",
            np.dtype(np.float32): "float32", np.dtype(np.int32): "int32"}[array.dtype]
    return {"dtype": name, "shape": list(array.shape), "data": np.ascontiguousarray(array).tobytes()}


def invalid_calls(rng: np.random.Generator) -> list[Planned]:
    """Calls the server must refuse, each with the documented answer (docs/protocol.md, "Errors")."""
    grad = rng.standard_normal((8, 4), dtype=np.float32)
    idx = rng.permutation(8).astype(np.int32)
    out_of_range = idx.copy()
    out_of_range[3] = 8  # dropless range is [0, N*K) = [0, 8)
    document = {"grad_expanded_x": tensor(grad), "expanded_row_idx": tensor(idx), "top_k": 2}
    short = {**document, "grad_expanded_x": {**tensor(grad), "data": grad.tobytes()[:-4]}}
    return [
        Planned("invalid: index out of range", kwargs={"grad_expanded_x": grad, "expanded_row_idx": out_of_range,
                                                        "top_k": 2}, error=moegrad.InvalidArgument,
                aclnn_status=161002),
        Planned("invalid: top_k does not divide", kwargs={"grad_expanded_x": grad, "expanded_row_idx": idx,
                                                          "top_k": 3}, error=moegrad.InvalidArgument,
                aclnn_status=561103),  # the default profile's (CANN 9.1) code
        Planned("invalid: int32 grad", kwargs={"grad_expanded_x": grad.view(np.int32), "expanded_row_idx": idx,
                                               "top_k": 2}, error=moegrad.InvalidArgument, aclnn_status=161002),
        Planned("invalid: unknown field", document={**document, "bogus": 1}, error=moegrad.MalformedRequest),
        Planned("invalid: data length", document=short, error=moegrad.MalformedRequest),
        Planned("invalid: not msgpack", raw_body=b"\xc1 this is not msgpack", error=moegrad.MalformedRequest),
    ]


@dataclass
class Workload:
    """What the clients send, prepared (expected results included) before the load starts."""

    valid: list[Planned]
    invalid: list[Planned]
    big: list[Planned]

    @classmethod
    def build(cls, *, seed: int = 8, big_calls: int = 3, big_mib: float = 64.0) -> Workload:
        rng = np.random.default_rng(seed)
        valid = []
        for mode in ("dropless", "active", "drop_pad"):
            for dtype in DTYPES:
                for order in ORDERS:
                    for _ in range(2):
                        tokens, top_k = int(rng.integers(1, 65)), int(rng.integers(1, 9))
                        hidden = int(rng.choice([1, 7, 64, 256, 1024]))
                        valid.append(valid_call(rng, mode, dtype, order, tokens, top_k, hidden))
        big = []
        if big_calls:
            top_k, hidden = 8, 2048
            rows = max(top_k, int(big_mib * MIB) // (hidden * 4) // top_k * top_k)  # float32 [rows, H]
            planned = valid_call(rng, "dropless", "float32", None, rows // top_k, top_k, hidden)
            big = [Planned(kind=f"big {planned.kwargs['grad_expanded_x'].nbytes / MIB:.0f} MiB float32",
                           kwargs=planned.kwargs, expected=planned.expected)] * big_calls
        return cls(valid=valid, invalid=invalid_calls(rng), big=big)


# --- the run --------------------------------------------------------------------------------------

class RecordingTransport(httpx.HTTPTransport):
    """An httpx transport that checks and counts every answer before the client sees it."""

    def __init__(self, report: SoakReport, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._report = report

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        response.read()
        self._report.answer(response)
        return response


@dataclass
class SoakReport:
    """What a soak saw. ``failures`` is empty when every call and every answer was as expected."""

    duration_s: float = 0.0
    clients: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    calls: collections.Counter = field(default_factory=collections.Counter)
    bitwise_checked: int = 0
    failures: list[str] = field(default_factory=list)
    rss_start: int = 0
    rss_max: int = 0
    rss_settled: int = 0
    server_exit_code: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def answer(self, response: httpx.Response) -> None:
        status, problem = response.status_code, None
        if status == 200:
            well_formed = response.headers.get("content-type", "").startswith("application/msgpack")
        else:
            try:
                problem = json.loads(response.content)
                well_formed = (response.headers.get("content-type") == "application/problem+json"
                               and problem.get("status") == status and isinstance(problem.get("detail"), str))
            except ValueError:
                well_formed = False
        with self._lock:
            self.statuses[status] += 1
            if status not in ALLOWED_STATUSES:
                self.fail(f"status {status}: {response.content[:200]!r}")
            if not well_formed:
                content_type = response.headers.get("content-type")
                self.fail(f"malformed {status} answer: {content_type} {response.content[:200]!r}")

    def fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)
        else:
            self.failures[-1] = f"... and more ({what})"

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def markdown(self, *, command: str, machine: str, server: str) -> str:
        statuses = ", ".join(f"{status}: {count}" for status, count in sorted(self.statuses.items()))
        kinds = collections.Counter()
        for (kind, outcome), count in self.calls.items():
            kinds[(kind.split(" ")[0].rstrip(":"), outcome)] += count
        calls = ", ".join(f"{kind} {outcome}: {count}" for (kind, outcome), count in sorted(kinds.items()))
        verdict = ("**pass**" if not self.failures
                   else f"**FAIL** ({len(self.failures)}: {'; '.join(self.failures[:3])})")
        failed_calls = sum(n for (_, outcome), n in self.calls.items() if outcome == "FAILED")
        exit_code = self.server_exit_code if self.server_exit_code is not None else "n/a"
        return "\n".join([
            "## Soak",
            "",
            f"Command: `{command}`. Machine: {machine}.",
            "",
            f"Server: `{server}` (127.0.0.1 only), stopped with SIGTERM at the end. {self.clients} client threads, "
            "each its own `moegrad.Client` (503s retried after Retry-After), mixing valid calls of every mode, "
            "dtype and order, invalid calls and big calls; every valid reply compared bitwise with "
            "`moegrad.moe_init_routing_v2_grad` computed in the bench process.",
            "",
            "| | value |",
            "|---|---|",
            f"| duration of the load | {self.duration_s:.1f} s |",
            f"| HTTP requests (retries included) | {self.requests} |",
            f"| by status | {statuses} |",
            f"| calls by kind and outcome | {calls} |",
            f"| valid replies checked bitwise | {self.bitwise_checked} |",
            f"| 503s (queue full), each retried by the client | {self.statuses.get(503, 0)}; calls that ended in a "
            f"503 or any unexpected answer: {failed_calls} |",
            f"| server RSS start (idle, warmed up) / max / settled (idle after) | {self.rss_start / MIB:.0f} / "
            f"{self.rss_max / MIB:.0f} / {self.rss_settled / MIB:.0f} MiB |",
            f"| server exit code after SIGTERM | {exit_code} |",
            f"| result | {verdict} |",
        ])


def _call(client: moegrad.Client, raw: httpx.Client, url: str, planned: Planned, report: SoakReport) -> None:
    try:
        if planned.raw_body is not None:
            for _ in range(30):  # a 503 (queue full, answered before the body is read) is retried as the Client does
                response = raw.post(url + GRAD_PATH, content=planned.raw_body,
                                    headers={"content-type": "application/msgpack"})
                if response.status_code != 503:
                    break
                time.sleep(float(response.headers.get("retry-after", "1")))
            if response.status_code == 400:
                raise moegrad.MalformedRequest(response.json()["detail"])
            raise moegrad.ServiceError(f"status {response.status_code}")
        if planned.document is not None:
            got = client.run(planned.document).grad_x
        else:
            got = client.moe_init_routing_v2_grad(**planned.kwargs)
    except moegrad.MoegradError as exc:
        ok = planned.error is not None and isinstance(exc, planned.error) and (
            planned.aclnn_status is None or getattr(exc, "aclnn_status", None) == planned.aclnn_status)
        with report._lock:
            report.calls[(planned.kind, "refused as documented" if ok else "FAILED")] += 1
            if not ok:
                report.fail(f"{planned.kind}: {type(exc).__name__}: {exc}")
        return
    if planned.expected is None:
        with report._lock:
            report.calls[(planned.kind, "FAILED")] += 1
            report.fail(f"{planned.kind}: answered 200, expected {planned.error.__name__}")
        return
    same = (got.dtype == planned.expected.dtype and got.shape == planned.expected.shape
            and got.tobytes() == planned.expected.tobytes())
    with report._lock:
        report.calls[(planned.kind, "bitwise equal" if same else "FAILED")] += 1
        report.bitwise_checked += same
        if not same:
            report.fail(f"{planned.kind}: reply differs from the in-process result")


def run_soak(url: str, workload: Workload, *, duration_s: float, clients: int = 16, server_pid: int | None = None,
             seed: int = 8, invalid_share: float = 0.3, settle_within_s: float = 10.0) -> SoakReport:
    """Drive ``clients`` threads against ``url`` for ``duration_s`` seconds; see the module docstring."""
    report = SoakReport(clients=clients)
    samples: list[int] = []
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.wait(0.2):
            samples.append(rss_bytes(server_pid))

    warm = SoakReport()  # one call of each kind first: lazy imports and compiled kernels are not growth
    with moegrad.Client(url, retries=30, timeout_s=300.0, validate=False,
                        transport=RecordingTransport(warm)) as client, \
            httpx.Client(transport=RecordingTransport(warm), timeout=60.0) as raw:
        for planned in workload.valid + workload.invalid:
            _call(client, raw, url, planned, warm)
    for failure in warm.failures:
        report.fail(f"warm-up: {failure}")
    if server_pid is not None:
        report.rss_start = rss_bytes(server_pid)
        sampler = threading.Thread(target=sample, name="soak-rss", daemon=True)
        sampler.start()
    start = time.monotonic()
    end = start + duration_s
    big_at = [start + duration_s * (i + 1) / (len(workload.big) + 1) for i in range(len(workload.big))]

    def client_loop(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        transport = RecordingTransport(report)
        with moegrad.Client(url, retries=30, timeout_s=300.0, validate=False, transport=transport) as client, \
                httpx.Client(transport=RecordingTransport(report), timeout=60.0) as raw:
            big = workload.big[number] if number < len(workload.big) else None
            while time.monotonic() < end:
                if big is not None and time.monotonic() >= big_at[number]:
                    planned, big = big, None
                elif rng.random() < invalid_share:
                    planned = rng.choice(workload.invalid)
                else:
                    planned = rng.choice(workload.valid)
                _call(client, raw, url, planned, report)
            if big is not None:  # a run too short to reach its moment still sends it
                _call(client, raw, url, big, report)

    threads = [threading.Thread(target=client_loop, args=(i,), name=f"soak-client-{i}") for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report.duration_s = time.monotonic() - start
    if server_pid is not None:
        previous, settle_end = -1, time.monotonic() + settle_within_s
        while time.monotonic() < settle_end:  # idle again: two samples a second apart within 1 MiB
            time.sleep(1.0)
            current = rss_bytes(server_pid)
            if abs(current - previous) < MIB:
                break
            previous = current
        stop_sampling.set()
        sampler.join()
        report.rss_settled = rss_bytes(server_pid)
        report.rss_max = max([report.rss_start, report.rss_settled, *samples])
    return report
