"""Service benchmarks: moegrad on loopback, its floors, a PyTriton peer, memory.

Everything runs on this machine, on 127.0.0.1 only, with bounded loops; every server this module
starts is stopped in a ``finally``. Three sections of bench/RESULTS.md come from here:

- ``service``: S1 sequential latency with the sync :class:`moegrad.Client` against its
  floors (the same bytes POSTed by bare httpx and by a plain socket; ``GET /health/live`` with the
  same client); S1 throughput with 16 concurrent requests from a separate load process (moegrad's
  clients, tritonclient, and a plain-socket load that measures the server's capacity); S2 end to end against the in-process time of the same
  call's encode + validate + compute + decode, and against raw TCP loopback moving the same bytes;
  the PyTriton peer (the naive NumPy function under PyTriton 0.7, bench/pytriton_peer/) against
  moegrad's v2 endpoint, both driven by tritonclient[http] on the same payloads.
- ``memory``: the server's peak RSS growth over one S2 call (VmHWM after resetting it
  through /proc/<pid>/clear_refs), and its RSS while serving S2 again and again.
- ``wire``: large calls against the loopback floor, side by side in one run (S2, and SL: DeepSeek-V3's
  N=4096, K=8, H=7168 bfloat16, 448 MiB in, 56 MiB out): raw socket -> v1 msgpack, -> v1 frames,
  -> v2 binary, ``moegrad.Client`` -> v1 msgpack and -> v1 frames; the server's peak RSS growth per
  call and its RSS after; 1,000 S1 calls one by one against one ``Client.batch``.

The workloads: S1 is the documentation's example (grad [[.1,.1],[.3,.3],[.2,.2],[.4,.4]] float32,
idx [2,0,1,3], K=2); S2 is N=1024, K=2, H=4096 float32 dropless (32 MiB in, 16 MiB out). Every
reply is checked bitwise against a result computed here (for K=2 the device order and the naive sum
are both v0 + v1 in float32).

Usage::

    .venv/bin/python -m bench.service [--quick|--full]     # only this module's sections
    .venv/bin/python -m bench.service wire [--sl-rounds N]  # only the wire tables, SL included, printed
    .venv/bin/python -m bench.run [--quick|--full]         # every section (make bench)

``--server-pythonpath DIR`` runs the moegrad server from another source tree (DIR/client and
DIR/service first on its PYTHONPATH), e.g. an export of an older commit for a before/after check.
The internal ``load`` command is the load-generating process (one JSON line per event on stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench._results import QUICK_BUDGET_S, machine, write_section
from support import launch as _procs
from support.launch import REFERENCE_FLAGS, ServerProcess, free_port, log_tail, stop_on_sigterm

__all__ = ["FULL", "QUICK", "Mode", "Payload", "main", "s1", "s2"]

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "bench" / "_out"
MODEL = "moe_init_routing_v2_grad"
CONCURRENCY = 16
MIB = float(1 << 20)


@dataclass(frozen=True)
class Mode:
    """How much of each measurement a run makes (quick: ``make bench``'s default)."""

    name: str
    s1_calls: int  # S1 calls with the sync Client (and as many GET /health/live, interleaved)...
    s1_max_s: float  # ... or fewer: blocks of 100 of each stop starting after this many seconds
    s1_rounds: int  # concurrency rounds: each server gets one window per round, in turn
    s1_window_s: float  # the measured window of one round, after a 0.5 s warm-up
    peer_s1_calls: int  # sequential S1 calls per v2 server with sync tritonclient...
    peer_s1_max_s: float  # ... or fewer: blocks of 50 stop starting after this many seconds
    s2_calls: int  # S2 calls per path (in-process, v1 Client, tritonclient x2, raw loopback)
    memory_s: float  # how long the memory run serves S2 again and again
    venv_limit_s: float  # how long building the PyTriton venv may take before the peer is skipped


QUICK = Mode("quick", s1_calls=1000, s1_max_s=12.0, s1_rounds=2, s1_window_s=2.5, peer_s1_calls=300,
             peer_s1_max_s=5.0, s2_calls=7, memory_s=15.0, venv_limit_s=150.0)
FULL = Mode("full", s1_calls=5000, s1_max_s=120.0, s1_rounds=5, s1_window_s=5.0, peer_s1_calls=1000,
            peer_s1_max_s=30.0, s2_calls=15, memory_s=60.0, venv_limit_s=900.0)


# --- payloads ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    """One call and its expected grad_x (computed here, independently of moegrad)."""

    name: str
    grad_expanded_x: np.ndarray
    expanded_row_idx: np.ndarray
    top_k: int
    expected: np.ndarray

    @property
    def request_bytes(self) -> int:
        return self.grad_expanded_x.nbytes + self.expanded_row_idx.nbytes

    @property
    def reply_bytes(self) -> int:
        return self.expected.nbytes


def s1() -> Payload:
    """The documentation's example; its result per docs/operator.md (float32: 0.3, 0.70000005)."""
    grad = np.array([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]], dtype=np.float32)
    idx = np.array([2, 0, 1, 3], dtype=np.int32)
    expected = np.array([[0.3, 0.3], [0.70000005, 0.70000005]], dtype=np.float32)
    return Payload("S1", grad, idx, 2, expected)


def s2() -> Payload:
    """N=1024, K=2, H=4096 float32 dropless: a random permutation of the 2048 rows (32 MiB in)."""
    rng = np.random.default_rng(7)
    grad = rng.standard_normal((2048, 4096), dtype=np.float32)
    idx = rng.permutation(2048).astype(np.int32)
    expected = grad[idx[0::2]] + grad[idx[1::2]]  # K=2: one float32 add per element, v0 + v1
    return Payload("S2", grad, idx, 2, expected)


PAYLOADS: dict[str, Callable[[], Payload]] = {"s1": s1, "s2": s2}


# --- processes --------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                children.setdefault(int(_stat_fields(int(entry.name))[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (those still alive)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = _stat_fields(pid)
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def status_kib(pid: int, key: str) -> int:
    """A ``kB`` line of /proc/<pid>/status (VmRSS, VmHWM, ...)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss(pid: int) -> None:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def moegrad_server(*, streams: int = 2, pythonpath: str | None = None) -> ServerProcess:
    """A moegrad server (reference backend, ``streams`` streams) on a free loopback port, ready.

    ``pythonpath``: run it from another source tree (its client/ and service/ first on PYTHONPATH).
    """
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([f"{pythonpath}/client", f"{pythonpath}/service"])
    return _procs.moegrad_server(OUT_DIR / "logs", flags=(*REFERENCE_FLAGS, "--streams", str(streams)), env=env,
                                 cwd=ROOT)


def moegrad_command(streams: int = 2) -> str:
    return " ".join(["python -m moegrad_service serve --host 127.0.0.1 --port PORT", *REFERENCE_FLAGS,
                     "--streams", str(streams)])


def pytriton_server(venv: Any) -> ServerProcess:
    """The PyTriton peer on a free loopback port, ready."""
    port = free_port()
    argv = [str(venv.python), str(ROOT / "bench" / "pytriton_peer" / "server.py"), "--port", str(port),
            "--workspace", str(OUT_DIR / f"pytriton-workspace-{port}")]
    return ServerProcess(argv, url=f"http://127.0.0.1:{port}", log_path=OUT_DIR / "logs" / f"pytriton-{port}.log",
                         ready_path=f"/v2/models/{MODEL}/ready", env=venv.env(), cwd=ROOT, ready_within_s=240.0,
                         name="pytriton").start()


# --- statistics -------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..100) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 0.1 else f"{seconds * 1e3:.1f}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**pass**" if ok else "**MISS**")


# --- clients ----------------------------------------------------------------------------------


def triton_inputs(module: Any, payload: Payload) -> tuple[list, list]:
    """tritonclient inputs and outputs (binary tensor data both ways) for ``payload``."""
    grad = module.InferInput("grad_expanded_x", list(payload.grad_expanded_x.shape), "FP32")
    grad.set_data_from_numpy(payload.grad_expanded_x, binary_data=True)
    idx = module.InferInput("expanded_row_idx", list(payload.expanded_row_idx.shape), "INT32")
    idx.set_data_from_numpy(payload.expanded_row_idx, binary_data=True)
    return [grad, idx], [module.InferRequestedOutput("grad_x", binary_data=True)]


class TritonCaller:
    """Sync tritonclient[http] calls of the model (the same request to moegrad v2 and PyTriton)."""

    def __init__(self, url: str) -> None:
        import tritonclient.http as triton

        self._triton = triton
        self.client = triton.InferenceServerClient(url.removeprefix("http://"), connection_timeout=120.0,
                                                   network_timeout=120.0)

    def __call__(self, payload: Payload) -> np.ndarray:
        inputs, outputs = triton_inputs(self._triton, payload)
        result = self.client.infer(MODEL, inputs, outputs=outputs, parameters={"top_k": payload.top_k})
        return result.as_numpy("grad_x")

    def close(self) -> None:
        self.client.close()


def grad_request(url: str, payload: Payload) -> bytes:
    """The bytes of one v1 POST of ``payload`` (HTTP/1.1, keep-alive), built once for the raw clients."""
    from moegrad import MoeInitRoutingV2GradCall, encode_body

    call = MoeInitRoutingV2GradCall(grad_expanded_x=payload.grad_expanded_x,
                                    expanded_row_idx=payload.expanded_row_idx, top_k=payload.top_k)
    body = bytes(encode_body({k: v for k, v in call.to_wire().items() if k != "order"}))
    host = url.removeprefix("http://")
    return (f"POST /v1/moe_init_routing_v2_grad HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/msgpack\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def grad_x_of_reply(status_and_headers: bytes, body: bytes) -> np.ndarray:
    """grad_x from a raw v1 reply (the status line must be 200)."""
    from moegrad import decode_body, decode_tensor

    if not status_and_headers.startswith(b"HTTP/1.1 200 "):
        raise RuntimeError(f"the server answered {status_and_headers.splitlines()[0]!r}")
    return decode_tensor(decode_body(body)["grad_x"], "grad_x")


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    raise RuntimeError("a reply without Content-Length")


class RawCaller:
    """One keep-alive connection sending a prebuilt v1 request over a plain socket: no client library,
    so the time is the server's and the kernel's (the floor under any HTTP client)."""

    def __init__(self, url: str, payload: Payload) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.request = grad_request(url, payload)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __call__(self) -> np.ndarray:
        self.sock.sendall(self.request)
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            buffer += self._recv()
        head, _, body = buffer.partition(b"\r\n\r\n")
        length = _content_length(head)
        while len(body) < length:
            body += self._recv()
        return grad_x_of_reply(head, body)

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise RuntimeError("the server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


def check(result: np.ndarray, payload: Payload, where: str) -> None:
    if result.dtype != payload.expected.dtype or not np.array_equal(result.view(np.uint32),
                                                                    payload.expected.view(np.uint32)):
        raise AssertionError(f"{where}: the {payload.name} reply differs from the expected result")


# --- the load process -------------------------------------------------------------------------


def _commands() -> Iterator[None]:
    """One item per ``go`` line on stdin; ends at ``quit`` or end of input (the parent's control)."""
    for line in sys.stdin:
        if line.strip() != "go":
            return
        yield None


def _event(name: str, **fields: Any) -> None:
    print(json.dumps({"event": name, **fields}), flush=True)


async def _load_async(kind: str, url: str, payload: Payload, concurrency: int, duration_s: float,
                      warmup_s: float) -> None:
    """``concurrency`` asyncio tasks over one client; one measured window per ``go`` command."""
    if kind == "moegrad":
        from moegrad import AsyncClient

        client = AsyncClient(url, retries=0, timeout_s=60.0)

        async def one() -> np.ndarray:
            return await client.moe_init_routing_v2_grad(payload.grad_expanded_x, payload.expanded_row_idx,
                                                         payload.top_k)

        close = client.aclose
    elif kind == "raw":
        host, port = url.removeprefix("http://").rsplit(":", 1)
        request = grad_request(url, payload)
        connections: asyncio.LifoQueue = asyncio.LifoQueue()
        for _ in range(concurrency):  # one connection per task, as with the clients
            connections.put_nowait(await asyncio.open_connection(host, int(port)))

        async def one() -> np.ndarray:
            reader, writer = await connections.get()
            try:
                if reader.at_eof():  # the server closed it while idle (keep-alive timeout between windows)
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                body = await reader.readexactly(_content_length(head))
            except (OSError, asyncio.IncompleteReadError):
                writer.close()
                reader, writer = await asyncio.open_connection(host, int(port))
                raise
            finally:
                connections.put_nowait((reader, writer))
            return grad_x_of_reply(head, body)

        async def close() -> None:
            while not connections.empty():
                connections.get_nowait()[1].close()
    else:
        import tritonclient.http.aio as triton_aio

        triton_client = triton_aio.InferenceServerClient(url.removeprefix("http://"), conn_limit=concurrency)

        async def one() -> np.ndarray:
            inputs, outputs = triton_inputs(triton_aio, payload)
            result = await triton_client.infer(MODEL, inputs, outputs=outputs, parameters={"top_k": payload.top_k})
            return result.as_numpy("grad_x")

        close = triton_client.close
    loop = asyncio.get_running_loop()
    try:
        check(await one(), payload, f"{kind} at {url}")
        _event("ready")
        commands = _commands()
        while await loop.run_in_executor(None, next, commands, "quit") is None:
            begin = loop.time() + warmup_s
            end = begin + duration_s
            counts = {"ok": 0, "errors": 0}
            first_error: list[str] = []

            async def worker() -> None:
                while loop.time() < end:
                    try:
                        check(await one(), payload, kind)  # every reply, bitwise; a mismatch counts as an error
                    except Exception as exc:  # noqa: BLE001 - counted and reported
                        counts["errors"] += 1
                        first_error[:1] = first_error[:1] or [f"{type(exc).__name__}: {exc}"]
                        await asyncio.sleep(0.01)
                        continue
                    if begin <= loop.time() <= end:
                        counts["ok"] += 1

            workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
            await asyncio.sleep(max(0.0, begin - loop.time()))
            cpu0 = time.process_time()
            _event("start")
            await asyncio.sleep(max(0.0, end - loop.time()))
            _event("stop")
            client_cpu_s = time.process_time() - cpu0
            await asyncio.gather(*workers)
            _event("result", requests=counts["ok"], errors=counts["errors"], window_s=duration_s,
                   first_error=first_error[0] if first_error else None, client_cpu_s=client_cpu_s)
    finally:
        await close()


def _load_threads(url: str, payload: Payload, concurrency: int, duration_s: float, warmup_s: float) -> None:
    """``concurrency`` threads, each with its own sync Client (own connection); a window per ``go``."""
    from moegrad import Client

    clients = [Client(url, retries=0, timeout_s=60.0) for _ in range(concurrency)]
    args = (payload.grad_expanded_x, payload.expanded_row_idx, payload.top_k)
    try:
        for client in clients:
            check(client.moe_init_routing_v2_grad(*args), payload, f"Client at {url}")
        _event("ready")
        for _ in _commands():
            begin = time.monotonic() + warmup_s
            end = begin + duration_s
            counts = [0] * concurrency
            failures = [0] * concurrency
            first_error: list[str] = []

            def worker(k: int, end: float = end, begin: float = begin) -> None:
                while time.monotonic() < end:
                    try:
                        check(clients[k].moe_init_routing_v2_grad(*args), payload, "Client")
                    except Exception as exc:  # noqa: BLE001 - counted and reported
                        failures[k] += 1
                        first_error[:1] = first_error[:1] or [f"{type(exc).__name__}: {exc}"]
                        time.sleep(0.01)
                        continue
                    if begin <= time.monotonic() <= end:
                        counts[k] += 1

            threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(concurrency)]
            for thread in threads:
                thread.start()
            time.sleep(max(0.0, begin - time.monotonic()))
            cpu0 = time.process_time()
            _event("start")
            time.sleep(max(0.0, end - time.monotonic()))
            _event("stop")
            client_cpu_s = time.process_time() - cpu0
            for thread in threads:
                thread.join(120)
            _event("result", requests=sum(counts), errors=sum(failures), window_s=duration_s,
                   first_error=first_error[0] if first_error else None, client_cpu_s=client_cpu_s)
    finally:
        for client in clients:
            client.close()


class LoadProcess:
    """A load-generating process (``python -m bench.service load``) kept for several windows.

    It connects and checks one reply, then runs one measured window per :meth:`window` call; the
    server's CPU time is read from /proc when the window starts and stops.
    """

    def __init__(self, kind: str, url: str, payload: str, duration_s: float,
                 concurrency: int = CONCURRENCY) -> None:
        self.kind, self.url, self.duration_s = kind, url, duration_s
        argv = [sys.executable, "-m", "bench.service", "load", "--client", kind, "--url", url, "--payload", payload,
                "--concurrency", str(concurrency), "--duration-s", str(duration_s)]
        self.log_path = OUT_DIR / "logs" / f"load-{kind}-{url.rsplit(':', 1)[1]}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            cwd=ROOT, text=True)

    def _next_event(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(30)
            raise RuntimeError(f"the load process for {self.kind} at {self.url} exited ({self.process.returncode}):\n"
                               f"{log_tail(self.log_path)}")
        return json.loads(line)

    def wait_ready(self) -> None:
        event = self._next_event()
        if event["event"] != "ready":
            raise RuntimeError(f"the load process for {self.kind} sent {event} before ready")

    def window(self, server_pids: list[int]) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        marks: dict[str, float] = {}
        while True:
            event = self._next_event()
            if event["event"] in ("start", "stop"):
                marks[event["event"]] = cpu_s(server_pids)
            elif event["event"] == "result":
                break
        event["server_cpu_s"] = marks["stop"] - marks["start"]
        event["rate"] = event["requests"] / event["window_s"]
        return event

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.process.stdin is not None
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


# --- S1 ---------------------------------------------------------------------------------------


def s1_sequential(url: str, payload: Payload, calls: int, pid: int, max_s: float) -> dict:
    """S1 with the sync Client, interleaved in blocks of 100 with its floors: GET /health/live with the
    same Client, the same request bytes POSTed by bare httpx (the client library alone, no moegrad code),
    and by a plain socket (no client library: the server's and the kernel's time)."""
    import httpx

    from moegrad import Client

    block = 100
    kinds = ("grad", "live", "httpx", "raw")
    wall: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu = dict.fromkeys(kinds, 0.0)
    client_cpu = dict.fromkeys(kinds, 0.0)
    args = (payload.grad_expanded_x, payload.expanded_row_idx, payload.top_k)
    head, _, body = grad_request(url, payload).partition(b"\r\n\r\n")
    with Client(url, retries=0) as client, httpx.Client(timeout=60) as bare, contextlib.closing(RawCaller(url, payload)) as raw:
        def bare_post() -> np.ndarray:
            response = bare.post(url + "/v1/moe_init_routing_v2_grad", content=body,
                                 headers={"content-type": "application/msgpack"})
            return grad_x_of_reply(f"HTTP/1.1 {response.status_code} ".encode(), response.content)

        def live() -> None:
            if not client.live():
                raise RuntimeError("GET /health/live failed")

        steps: dict[str, Callable[[], Any]] = {"grad": lambda: client.moe_init_routing_v2_grad(*args), "live": live,
                                               "httpx": bare_post, "raw": raw}
        for kind in ("grad", "httpx", "raw"):
            check(steps[kind](), payload, f"S1 sequential ({kind})")
        for _ in range(block):  # warm-up: connections, caches, the server's first-call paths
            for step in steps.values():
                step()
        deadline = time.monotonic() + max_s
        while len(wall["grad"]) < calls and time.monotonic() < deadline:
            for kind, step in steps.items():
                before, own_before = cpu_s([pid]), time.process_time()
                for _ in range(block):
                    t0 = time.perf_counter()
                    out = step()
                    wall[kind].append(time.perf_counter() - t0)
                    if kind != "live":
                        check(out, payload, f"S1 sequential ({kind})")  # every reply, outside the timing
                cpu[kind] += cpu_s([pid]) - before
                client_cpu[kind] += time.process_time() - own_before
    result: dict[str, Any] = dict(wall)
    for kind in kinds:
        result[f"server_cpu_per_{kind}_s"] = cpu[kind] / len(wall[kind])
        result[f"client_cpu_per_{kind}_s"] = client_cpu[kind] / len(wall[kind])
    return result


def triton_sequential(callers: dict[str, TritonCaller], payload: Payload, calls: int, block: int,
                      max_s: float = math.inf) -> dict[str, dict[str, list[float]]]:
    """Sequential calls with sync tritonclient, servers taking turns in blocks of ``block`` calls.

    Returns, per server, ``wall`` (each call's latency) and ``client_cpu`` (this process's CPU
    seconds per call: the client's own share, the same for any server).
    """
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "client_cpu": []} for name in callers}
    for name, caller in callers.items():
        check(caller(payload), payload, f"{name} (tritonclient)")
    deadline = time.monotonic() + max_s
    while min(len(t["wall"]) for t in times.values()) < calls and time.monotonic() < deadline:
        for name, caller in callers.items():
            for _ in range(min(block, calls - len(times[name]["wall"]))):
                c0, t0 = time.process_time(), time.perf_counter()
                caller(payload)
                times[name]["wall"].append(time.perf_counter() - t0)
                times[name]["client_cpu"].append(time.process_time() - c0)
    return times


# --- S2 ---------------------------------------------------------------------------------------


def s2_in_process(payload: Payload) -> dict[str, float]:
    """The same call without HTTP: the client's and the server's encode/validate/compute/decode steps.

    Mirrors what ``Client.moe_init_routing_v2_grad`` and the v1 handler do: build and validate the
    call, pack it; unpack and validate it again; compute with the reference (the server's backend);
    pack the reply; unpack it and copy grad_x out (GradResult owns its array).
    """
    from moegrad import MoeInitRoutingV2GradCall, decode_body, decode_tensor, encode_tensor, moe_init_routing_v2_grad
    from moegrad._wire import encode_body_view

    steps: dict[str, float] = {}
    t0 = time.perf_counter()
    call = MoeInitRoutingV2GradCall(grad_expanded_x=payload.grad_expanded_x,
                                    expanded_row_idx=payload.expanded_row_idx, top_k=payload.top_k)
    document = call.to_wire()
    del document["order"]  # as the Client sends it: the server's default applies
    body = encode_body_view(document)  # as the Client packs it (and streams it from msgpack's buffer)
    t1 = time.perf_counter()
    received = MoeInitRoutingV2GradCall.from_wire(decode_body(body), default_order="ascend910b")
    t2 = time.perf_counter()
    grad_x = moe_init_routing_v2_grad(received)
    t3 = time.perf_counter()
    reply = encode_body_view({"grad_x": encode_tensor(grad_x), "backend": "reference", "order": received.order,
                              "device": None, "timings_ms": {"queue": 0.0, "compute": 0.0, "total": 0.0}})
    t4 = time.perf_counter()
    result = decode_tensor(decode_body(reply)["grad_x"], "grad_x").copy()
    t5 = time.perf_counter()
    check(result, payload, "in-process")
    steps.update({"encode": t1 - t0, "validate": t2 - t1, "compute": t3 - t2, "reply_encode": t4 - t3,
                  "decode": t5 - t4, "total": t5 - t0})
    return steps


class LoopbackFloor:
    """Raw TCP on 127.0.0.1: send the request's bytes, receive the reply's bytes, nothing else.

    Buffers are allocated and touched once up front, so a round trip measures only the kernel's
    loopback path (the floor any HTTP server on this machine stands on).
    """

    def __init__(self, request_bytes: int, reply_bytes: int) -> None:
        self.request = np.ones(request_bytes, dtype=np.uint8)
        self.reply = np.ones(reply_bytes, dtype=np.uint8)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._serve, name="loopback-floor", daemon=True)
        self._thread.start()
        self._sock = socket.create_connection(self._listener.getsockname())
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._inbox = np.zeros(reply_bytes, dtype=np.uint8)

    def _serve(self) -> None:
        connection, _ = self._listener.accept()
        inbox = np.zeros(self.request.nbytes, dtype=np.uint8)
        with connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while _recv_exactly(connection, memoryview(inbox)):
                connection.sendall(memoryview(self.reply))

    def round_trip_s(self) -> float:
        t0 = time.perf_counter()
        self._sock.sendall(memoryview(self.request))
        if not _recv_exactly(self._sock, memoryview(self._inbox)):
            raise RuntimeError("the loopback floor's peer closed the connection")
        return time.perf_counter() - t0

    def close(self) -> None:
        self._sock.close()
        self._thread.join(10)
        self._listener.close()


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    filled = 0
    while filled < len(view):
        got = sock.recv_into(view[filled:])
        if got == 0:
            return False
        filled += got
    return True


def s2_measure(url: str, payload: Payload, calls: int) -> dict[str, Any]:
    """In-process, end to end (v1 Client) and raw loopback, taking turns call by call."""
    from moegrad import Client

    in_process: list[dict[str, float]] = []
    e2e: list[float] = []
    floor_s: list[float] = []
    floor = LoopbackFloor(payload.request_bytes, payload.reply_bytes)
    args = (payload.grad_expanded_x, payload.expanded_row_idx, payload.top_k)
    try:
        with Client(url, retries=0, timeout_s=120.0) as client:
            check(client.moe_init_routing_v2_grad(*args), payload, "moegrad v1 (Client)")  # warm-up
            s2_in_process(payload)
            floor.round_trip_s()
            for _ in range(calls):
                in_process.append(s2_in_process(payload))
                t0 = time.perf_counter()
                client.moe_init_routing_v2_grad(*args)
                e2e.append(time.perf_counter() - t0)
                floor_s.append(floor.round_trip_s())
    finally:
        floor.close()
    return {"in_process": in_process, "e2e": e2e, "floor": floor_s}


# --- memory -----------------------------------------------------------------------------------


def one_call_peaks(pid: int, calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Peak RSS growth (MiB) of the server over single calls: VmHWM after the call minus VmRSS before."""
    peaks: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            time.sleep(0.2)  # let the previous reply's buffers go
            before = status_kib(pid, "VmRSS")
            reset_peak_rss(pid)
            call()
            peaks[name].append((status_kib(pid, "VmHWM") - before) / 1024)
    return peaks


@dataclass
class RssRun:
    duration_s: float
    calls: int = 0
    after_call: list[tuple[float, float]] = field(default_factory=list)  # (t, MiB) as each reply arrived
    sampled: list[tuple[float, float]] = field(default_factory=list)  # (t, MiB) every 50 ms
    final_mib: float = math.nan

    def _quarter(self, series: list[tuple[float, float]], q: int) -> list[float]:
        lo, hi = self.duration_s * q / 4, self.duration_s * (q + 1) / 4
        return [mib for t, mib in series if lo <= t < hi] or [math.nan]

    @property
    def settled_mib(self) -> float:
        """The median of the after-call samples in the run's second quarter."""
        return statistics.median(self._quarter(self.after_call, 1))

    @property
    def last_quarter_mib(self) -> float:
        return statistics.median(self._quarter(self.after_call, 3))

    def peak_mib(self, q: int) -> float:
        return max(self._quarter(self.sampled, q))

    @property
    def deviation(self) -> float:
        """The larger relative distance of the last-quarter median and the final value from settled."""
        settled = self.settled_mib
        return max(abs(self.last_quarter_mib - settled), abs(self.final_mib - settled)) / settled


def rss_run(pid: int, calls: list[Callable[[], Any]], duration_s: float) -> RssRun:
    """Serve S2 again and again for ``duration_s`` (the ``calls`` in turn), watching the server's RSS."""
    run = RssRun(duration_s)
    stop = threading.Event()
    started = time.monotonic()

    def sample() -> None:
        while not stop.wait(0.05):
            with contextlib.suppress(OSError, KeyError):
                run.sampled.append((time.monotonic() - started, status_kib(pid, "VmRSS") / 1024))

    sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    sampler.start()
    try:
        while time.monotonic() - started < duration_s:
            calls[run.calls % len(calls)]()
            run.calls += 1
            run.after_call.append((time.monotonic() - started, status_kib(pid, "VmRSS") / 1024))
    finally:
        stop.set()
        sampler.join(5)
    time.sleep(1.0)
    run.final_mib = status_kib(pid, "VmRSS") / 1024
    return run


# --- wire speed: large calls against the floor, memory per call, batches ----------------------------


def sl() -> Payload:
    """DeepSeek-V3's layer: N=4096, K=8, H=7168 bfloat16 dropless (448 MiB in, 56 MiB out).

    The expected grad_x is the in-process emulation's (``moegrad.moe_init_routing_v2_grad``): for
    K=8 the order of adds matters, and the bench compares every path's bits against it.
    """
    import ml_dtypes

    import moegrad

    rng = np.random.default_rng(11)
    rows = 4096 * 8
    grad = np.empty((rows, 7168), dtype=ml_dtypes.bfloat16)
    for start in range(0, rows, 4096):  # in blocks: a float32 array of the whole would be 896 MiB more
        grad[start:start + 4096] = rng.standard_normal((4096, 7168), dtype=np.float32).astype(ml_dtypes.bfloat16)
    idx = rng.permutation(rows).astype(np.int32)
    expected = moegrad.moe_init_routing_v2_grad(grad, idx, 8)
    return Payload("SL", grad, idx, 8, expected)


class RawWire:
    """One keep-alive connection POSTing a prebuilt request (v1 msgpack, v1 frames or v2 binary)
    and receiving the reply into a pre-touched buffer with ``recv_into``: what the client side of
    the floor does, so the time above the floor is the server's."""

    def __init__(self, url: str, payload: Payload, kind: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.kind = kind
        head, parts = self._request(f"{host}:{port}", payload, kind)
        self.request = np.empty(len(head) + sum(len(p) for p in parts), dtype=np.uint8)
        view, at = memoryview(self.request), len(head)
        view[:at] = head
        for part in parts:
            view[at:at + len(part)] = part
            at += len(part)
        self.reply = np.ones(payload.reply_bytes + (1 << 20), dtype=np.uint8)  # pre-touched, with room for headers
        self.address = (host, int(port))
        self.sock: socket.socket | None = None
        self.used = 0.0
        self.length = 0

    def connect(self) -> None:
        """A fresh connection when the last one sat idle (uvicorn closes keep-alives after 5 s)."""
        if self.sock is not None and time.monotonic() - self.used < 2.0:
            return
        if self.sock is not None:
            self.sock.close()
        self.sock = socket.create_connection(self.address, timeout=120)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @staticmethod
    def _request(host: str, payload: Payload, kind: str) -> tuple[bytes, list]:
        from moegrad import FRAMES_MEDIA_TYPE, encode_body, encode_frames, encode_tensor

        fields = {"grad_expanded_x": encode_tensor(payload.grad_expanded_x),
                  "expanded_row_idx": encode_tensor(payload.expanded_row_idx), "top_k": payload.top_k}
        if kind == "v1":
            parts, path, extra = [encode_body(fields)], "/v1/moe_init_routing_v2_grad", "Content-Type: application/msgpack\r\n"
        elif kind == "frames":
            parts, _ = encode_frames(fields)
            path = "/v1/moe_init_routing_v2_grad"
            extra = f"Content-Type: {FRAMES_MEDIA_TYPE}\r\nAccept: {FRAMES_MEDIA_TYPE}\r\n"
        else:
            from moegrad import dtype_name

            names = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16"}
            grad, idx = payload.grad_expanded_x, payload.expanded_row_idx
            header = json.dumps({"inputs": [
                {"name": "grad_expanded_x", "datatype": names[dtype_name(grad.dtype)], "shape": list(grad.shape),
                 "parameters": {"binary_data_size": grad.nbytes}},
                {"name": "expanded_row_idx", "datatype": "INT32", "shape": list(idx.shape),
                 "parameters": {"binary_data_size": idx.nbytes}}],
                "outputs": [{"name": "grad_x", "parameters": {"binary_data": True}}],
                "parameters": {"top_k": payload.top_k}}).encode()
            parts = [header, memoryview(grad.reshape(-1).view(np.uint8)), memoryview(idx.view(np.uint8))]
            path = f"/v2/models/{MODEL}/infer"
            extra = f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {len(header)}\r\n"
        length = sum(len(p) for p in parts)
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Length: {length}\r\n\r\n").encode()
        return head, parts

    def __call__(self) -> None:
        self.connect()
        assert self.sock is not None
        self.sock.sendall(memoryview(self.request))
        view, filled = memoryview(self.reply), 0
        while True:
            got = self.sock.recv_into(view[filled:])
            if not got:
                raise RuntimeError("the server closed the connection")
            filled += got
            end = bytes(view[:min(filled, 4096)]).find(b"\r\n\r\n")
            if end >= 0:
                break
        head = bytes(view[:end])
        if not head.startswith(b"HTTP/1.1 200 "):
            raise RuntimeError(f"the server answered {head.splitlines()[0]!r}")
        self.start, self.length = end + 4, _content_length(head)
        while filled < self.start + self.length:
            filled += self.sock.recv_into(view[filled:self.start + self.length])
        self.used = time.monotonic()

    def result(self) -> np.ndarray:
        """grad_x of the last reply (decoded after the timing)."""
        from moegrad import decode_body, decode_frames, decode_tensor

        body = bytes(memoryview(self.reply)[self.start:self.start + self.length])
        if self.kind == "v1":
            return decode_tensor(decode_body(body)["grad_x"], "grad_x")
        if self.kind == "frames":
            return decode_tensor(decode_frames(body)["grad_x"], "grad_x")
        header = json.loads(body[:body.index(b"}]}") + 3])
        output = header["outputs"][0]
        raw = body[len(json.dumps(header, separators=(",", ":")).encode()):]
        from moegrad import DTYPES

        names = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16"}
        return np.frombuffer(raw, dtype=DTYPES[names[output["datatype"]]]).reshape(output["shape"])

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def _same_bits(result: np.ndarray, payload: Payload, where: str) -> None:
    if result.dtype != payload.expected.dtype or result.shape != payload.expected.shape or not np.array_equal(
            result.view(np.uint16 if result.dtype.itemsize == 2 else np.uint32),
            payload.expected.view(np.uint16 if result.dtype.itemsize == 2 else np.uint32)):
        raise AssertionError(f"{where}: the {payload.name} reply differs from the in-process result")


WIRE_PATHS = ("raw -> v1 msgpack", "raw -> v1 frames", "raw -> v2 binary", "Client -> v1 (msgpack)",
              "Client -> v1 (auto: frames)")


def wire_measure(url: str, pid: int, payload: Payload, rounds: int) -> dict[str, Any]:
    """Interleaved rounds of the floor and then each path once, each reply checked bitwise once.

    First ``rounds`` back to back (each call right after the one before, as a caller's loop makes
    them), then ``rounds`` with 0.3 s of idle before each call (the floor's too), which also take
    the server's peak RSS growth per call (VmHWM after a reset, minus VmRSS before) and its RSS one
    second after the call. An idle 2-core VM wakes slower: both the floor and the paths take longer
    after the pause, the paths more (they wake more threads).
    """
    from moegrad import Client

    floor = LoopbackFloor(payload.request_bytes, payload.reply_bytes)
    raws = {"raw -> v1 msgpack": RawWire(url, payload, "v1"), "raw -> v1 frames": RawWire(url, payload, "frames"),
            "raw -> v2 binary": RawWire(url, payload, "v2")}
    clients = {"Client -> v1 (msgpack)": Client(url, retries=0, timeout_s=300.0, wire="msgpack"),
               "Client -> v1 (auto: frames)": Client(url, retries=0, timeout_s=300.0)}
    args = (payload.grad_expanded_x, payload.expanded_row_idx, payload.top_k)
    times: dict[str, list[float]] = {name: [] for name in ("floor", *WIRE_PATHS)}
    idle_times: dict[str, list[float]] = {name: [] for name in ("floor", *WIRE_PATHS)}
    growth: dict[str, list[float]] = {name: [] for name in WIRE_PATHS}
    after: dict[str, list[float]] = {name: [] for name in WIRE_PATHS}
    calls: dict[str, Callable[[], Any]] = {**raws, **{name: (lambda c=c: c.moe_init_routing_v2_grad(*args))
                                                      for name, c in clients.items()}}

    def timed(name: str, call: Callable[[], Any]) -> float:
        if name in raws:
            raws[name].connect()
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    try:
        floor.round_trip_s()
        for name, raw in raws.items():  # warm-up and the bitwise check, outside the timing
            raw()
            _same_bits(raw.result(), payload, name)
        for name, client in clients.items():
            _same_bits(client.moe_init_routing_v2_grad(*args), payload, name)
        for _ in range(rounds):
            times["floor"].append(floor.round_trip_s())
            for name, call in calls.items():
                times[name].append(timed(name, call))
        for _ in range(rounds):
            time.sleep(0.3)
            idle_times["floor"].append(floor.round_trip_s())
            for name, call in calls.items():
                time.sleep(0.3)
                before = status_kib(pid, "VmRSS")
                reset_peak_rss(pid)
                idle_times[name].append(timed(name, call))
                growth[name].append((status_kib(pid, "VmHWM") - before) * 1024 / (payload.request_bytes
                                                                                  + payload.reply_bytes))
                time.sleep(1.0)
                after[name].append(status_kib(pid, "VmRSS") / 1024)
    finally:
        floor.close()
        for raw in raws.values():
            raw.close()
        for client in clients.values():
            client.close()
    return {"times": times, "idle_times": idle_times, "growth": growth, "after_mib": after}


#: Batches of each size a round's server CPU is read over.
CPU_BATCHES = 10


def batch_measure(url: str, pid: int, calls: int, rounds: int) -> dict[str, list[float]]:
    """``calls`` S1 calls: one after another with the sync Client, and in one ``Client.batch``; interleaved.

    Also the server's CPU seconds (all its threads, /proc) per batch of ``calls`` and per batch of one
    (each the mean over CPU_BATCHES batches).
    """
    from moegrad import Client, GradResult, MoeInitRoutingV2GradCall

    payload = s1()
    call = MoeInitRoutingV2GradCall(grad_expanded_x=payload.grad_expanded_x,
                                    expanded_row_idx=payload.expanded_row_idx, top_k=payload.top_k)
    out: dict[str, list[float]] = {"sequential": [], "batch": [], "batch_cpu": [], "one_cpu": []}
    pids = descendants(pid)
    with Client(url, retries=0, timeout_s=300.0) as client:
        client.run(call)
        client.batch([call] * 10)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                client.run(call)
            out["sequential"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            answers = client.batch([call] * calls)
            out["batch"].append(time.perf_counter() - t0)
            for answer in answers:
                if not isinstance(answer, GradResult):
                    raise AssertionError(f"a batch item failed: {answer!r}")
                check(answer.grad_x, payload, "Client.batch")
            # the server's CPU per batch, over CPU_BATCHES of each size (its clock ticks are 10 ms)
            cpu0 = cpu_s(pids)
            for _ in range(CPU_BATCHES):
                client.batch([call])
            out["one_cpu"].append((cpu_s(pids) - cpu0) / CPU_BATCHES)
            cpu0 = cpu_s(pids)
            for _ in range(CPU_BATCHES):
                client.batch([call] * calls)
            out["batch_cpu"].append((cpu_s(pids) - cpu0) / CPU_BATCHES)
    return out


MIXED_CALLS = 10_000  #: calls of a mixed batch: H = 1 .. MIXED_CALLS (N = K = 1, float32): 200 MB a body


def mixed_batches(url: str, rounds: int) -> float:
    """Send ``rounds`` batches of MIXED_CALLS calls of distinct shapes (each tensor under glibc's mmap
    threshold, so it comes from the heap); returns the seconds of the slowest."""
    from moegrad import Client, GradResult, MoeInitRoutingV2GradCall

    rng = np.random.default_rng(3)
    calls = [MoeInitRoutingV2GradCall(grad_expanded_x=rng.standard_normal((1, hidden), dtype=np.float32),
                                      expanded_row_idx=np.zeros(1, dtype=np.int32), top_k=1)
             for hidden in range(1, MIXED_CALLS + 1)]
    slowest = 0.0
    with Client(url, retries=0, timeout_s=600.0) as client:
        for _ in range(rounds):
            t0 = time.perf_counter()
            answers = client.batch(calls)
            slowest = max(slowest, time.perf_counter() - t0)
            for call, answer in zip(calls, answers, strict=True):  # K = 1, index 0: grad_x is the row itself
                if not isinstance(answer, GradResult) or not np.array_equal(
                        answer.grad_x.view(np.uint32), call.grad_expanded_x.view(np.uint32)):
                    raise AssertionError(f"a mixed batch item is wrong: {answer!r}")
            del answers
    return slowest


def wire_speed(*, s2_rounds: int = 5, sl_rounds: int = 2, batch_calls: int = 1000, batch_rounds: int = 3,
               mixed_rounds: int = 3, server_pythonpath: str | None = None) -> str:
    """Measure large calls against the loopback floor (S2 and SL), the server's memory per call and
    idle (after S2, SL and ``mixed_rounds`` batches of calls of distinct shapes), and the batch
    speedup; return the markdown tables."""
    results: dict[str, Any] = {}
    with moegrad_server(pythonpath=server_pythonpath) as server:
        log(f"moegrad at {server.url} (pid {server.pid})")
        from moegrad import Client

        with Client(server.url, retries=0) as client:
            small = s1()
            for _ in range(20):
                client.moe_init_routing_v2_grad(small.grad_expanded_x, small.expanded_row_idx, small.top_k)
        time.sleep(1.0)
        results["start_mib"] = status_kib(server.pid, "VmRSS") / 1024
        log("batches: S1 sequential vs one batch")
        results["batch"], results["batch_calls"] = batch_measure(server.url, server.pid, batch_calls, batch_rounds), batch_calls
        log("S2: every path against the floor")
        results["S2"] = wire_measure(server.url, server.pid, s2(), s2_rounds)
        results["settled_mib"] = idle_rss_mib(server.pid)
        if sl_rounds:
            log("SL: building the payload (448 MiB, and its expected result)")
            large = sl()
            log("SL: every path against the floor")
            results["SL"] = wire_measure(server.url, server.pid, large, sl_rounds)
            del large
        time.sleep(1.0)
        results["kept_mib"] = status_kib(server.pid, "VmRSS") / 1024
        results["end_mib"] = idle_rss_mib(server.pid)
        if mixed_rounds:
            log(f"mixed: {mixed_rounds} batches of {MIXED_CALLS:,} calls of distinct shapes")
            results["mixed_s"] = mixed_batches(server.url, mixed_rounds)
            results["mixed_rounds"] = mixed_rounds
            results["mixed_mib"] = idle_rss_mib(server.pid)
    return _wire_tables(results)


def idle_rss_mib(pid: int) -> float:
    """The server's RSS (MiB) once it has been idle long enough to give up its kept receive buffers
    (receive_keep_s, the default, and a second and a half)."""
    from moegrad_service.settings import Settings

    time.sleep(Settings.model_fields["receive_keep_s"].default + 1.5)
    return status_kib(pid, "VmRSS") / 1024


def _wire_tables(r: dict[str, Any]) -> str:
    load = os.getloadavg()
    lines = [f"Load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min; 2 cores, shared).", ""]
    payloads = [name for name in ("S2", "SL") if name in r]
    runs = [(name, kind) for name in payloads for kind in ("times", "idle_times")]
    heading = {"times": "back to back", "idle_times": "after 0.3 s idle"}
    lines += ["Medians in ms (x the floor measured in the same rounds):", "",
              "| path | " + " | ".join(f"{name} {heading[kind]}" for name, kind in runs) + " |",
              "|---|" + "---:|" * len(runs)]
    floors = {run: statistics.median(r[run[0]][run[1]]["floor"]) for run in runs}
    lines.append("| loopback floor | " + " | ".join(ms(floors[run]) for run in runs) + " |")
    for path in WIRE_PATHS:
        cells = []
        for run in runs:
            median = statistics.median(r[run[0]][run[1]][path])
            cells.append(f"{ms(median)} ({median / floors[run]:.2f}x)")
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    lines += ["", "Server peak RSS growth per call, as a multiple of request + reply bytes (median), and its RSS "
              "1 s after the call (MiB, median; the call's receive buffer is still kept then, for the next "
              "body of its size):", "",
              "| path | " + " | ".join(f"{name} growth | {name} RSS after" for name in payloads) + " |",
              "|---|" + "---:|---:|" * len(payloads)]
    for path in WIRE_PATHS:
        cells = []
        for name in payloads:
            cells.append(f"{statistics.median(r[name]['growth'][path]):.2f}x")
            cells.append(f"{statistics.median(r[name]['after_mib'][path]):.0f}")
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    lines += ["", f"Server RSS: {r['start_mib']:.0f} MiB after warm-up, {r['settled_mib']:.0f} MiB idle after the S2 "
              f"rounds, {r['kept_mib']:.0f} MiB 1 s after the last round (its receive buffers kept), "
              f"{r['end_mib']:.0f} MiB idle after every round (SL included; receive_keep_s passed) "
              f"({(r['end_mib'] / r['settled_mib'] - 1) * 100:+.0f}% of the settled value)."]
    if "mixed_mib" in r:
        lines[-1] += (f" After {r['mixed_rounds']} batches of {MIXED_CALLS:,} calls of distinct shapes (N = K = 1, "
                      f"float32, H = 1 .. {MIXED_CALLS:,}: 200 MB a body; the slowest {r['mixed_s']:.1f} s; every "
                      f"answer checked bitwise): {r['mixed_mib']:.0f} MiB idle "
                      f"({(r['mixed_mib'] / r['settled_mib'] - 1) * 100:+.0f}% of the settled value).")
    lines.append("")
    batch = r["batch"]
    if not batch["batch"]:  # --batch-rounds 0
        return "\n".join(lines) + "\n"
    seq, one = statistics.median(batch["sequential"]), statistics.median(batch["batch"])
    calls = r["batch_calls"]
    lines += [f"| {calls:,} S1 calls | median (ms) | per call (us) |", "|---|---:|---:|",
              f"| sequential `Client.run` | {ms(seq)} | {seq / calls * 1e6:.0f} |",
              f"| one `Client.batch` | {ms(one)} | {one / calls * 1e6:.0f} |",
              f"| speedup | {seq / one:.1f}x | |", "",
              f"Server CPU (all threads, /proc) per call inside the batch: "
              f"{(statistics.median(batch['batch_cpu']) - statistics.median(batch['one_cpu'])) / (calls - 1) * 1e6:.0f} us "
              f"(a {calls:,}-call batch less a 1-call batch, each over {CPU_BATCHES} batches; clock ticks of 10 ms, "
              f"so about +-{2e4 / calls / CPU_BATCHES:.0f} us)."]
    return "\n".join(lines) + "\n"


# --- the run ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _protocol_calls(url: str):
    """``{"v1": call(payload), "v2": call(payload)}``: the sync Client (msgpack) and sync tritonclient."""
    from moegrad import Client

    with Client(url, retries=0, timeout_s=120.0) as client:
        triton_caller = TritonCaller(url)
        try:
            yield {"v1": lambda p: client.moe_init_routing_v2_grad(p.grad_expanded_x, p.expanded_row_idx, p.top_k),
                   "v2": triton_caller}
        finally:
            triton_caller.close()


_STARTED = time.monotonic()


def log(message: str) -> None:
    """Progress on stdout, with the seconds since this module was imported."""
    print(f"bench.service [{time.monotonic() - _STARTED:5.0f} s]: {message}", flush=True)


#: What a quick run still needs after the venv step: this module's measurements (about 2 minutes on
#: the 2-core machine) and the shortened soak that bench.run runs after it.
QUICK_RESERVE_S = 170.0
#: A build given less time than this is not started (it took 3 to 5 minutes here).
MIN_BUILD_S = 90.0


def _peer(mode: Mode, budget_s: float | None) -> tuple[Any | None, str]:
    """The PyTriton venv, or None and why not.

    ``budget_s``: the seconds quick mode has left for this module and what follows it (None: no
    budget); a missing venv is built only when that leaves enough time.
    """
    from bench.pytriton_peer import venv

    found = venv.find()
    if found is not None:
        return found, "found in bench/_out/pytriton-venv"
    limit_s = mode.venv_limit_s if budget_s is None else min(mode.venv_limit_s, budget_s - QUICK_RESERVE_S)
    if limit_s < MIN_BUILD_S:
        return None, (f"the PyTriton venv (bench/_out/pytriton-venv) is not built, and quick mode's 5-minute "
                      f"budget leaves {max(limit_s, 0):.0f} s for building it (it takes minutes); build it once with "
                      "`.venv/bin/python -m bench.pytriton_peer.venv`, or run `make bench BENCH_ARGS=--full`")
    started = time.monotonic()
    log(f"PyTriton venv: building (limit {limit_s:.0f} s)")
    found = venv.ensure(limit_s)
    if isinstance(found, str):
        return None, found
    return found, f"built in this run ({time.monotonic() - started:.0f} s)"


def main(*, quick: bool = True, write: bool = True, server_pythonpath: str | None = None,
         budget_s: float | None = None) -> dict[str, str]:
    """Measure the service and the memory sections; return (and with ``write``, store) the ``service`` and ``memory`` sections.

    ``budget_s``: seconds left of quick mode's 5-minute budget (bench.run passes it); None in full
    mode. It only decides whether a missing PyTriton venv may be built in this run.
    """
    global _STARTED
    _STARTED = time.monotonic()
    mode = QUICK if quick else FULL
    machine_line = machine()
    command = f"`python -m bench.run{' --full' if not quick else ''}` (this part alone: " \
              f"`python -m bench.service{' --full' if not quick else ''}`)"
    small, large = s1(), s2()
    results: dict[str, Any] = {}
    if quick and budget_s is None:
        budget_s = QUICK_BUDGET_S  # run alone: the whole budget is this module's
    peer_venv, peer_note = _peer(mode, budget_s if quick else None)
    log(f"PyTriton peer: {peer_note}")

    with contextlib.ExitStack() as servers:
        moegrad = servers.enter_context(moegrad_server(pythonpath=server_pythonpath))
        log(f"moegrad at {moegrad.url} (pid {moegrad.pid}, ready in {moegrad.startup_s:.1f} s)")
        peer = None
        if peer_venv is not None:
            try:
                peer = servers.enter_context(pytriton_server(peer_venv))
                log(f"PyTriton at {peer.url} (ready in {peer.startup_s:.1f} s)")
            except RuntimeError as exc:
                peer_note = f"the PyTriton server did not start: {str(exc).splitlines()[0]}"
                log(f"{peer_note}")
        time.sleep(1.0)  # let start-up work settle

        log("S1 sequential (sync Client) vs GET /health/live")
        results["s1_seq"] = s1_sequential(moegrad.url, small, mode.s1_calls, moegrad.pid, mode.s1_max_s)

        log("S1, 16 concurrent requests from a load process")
        targets = [("moegrad v1", "moegrad", moegrad), ("moegrad v1 (threads)", "moegrad-threads", moegrad),
                   ("moegrad v1 (plain sockets)", "raw", moegrad), ("moegrad v2", "triton", moegrad)]
        if peer is not None:
            targets.append(("PyTriton", "triton", peer))
        rounds: dict[str, list[dict]] = {label: [] for label, _, _ in targets}
        loads = {label: LoadProcess(kind, server.url, "s1", mode.s1_window_s) for label, kind, server in targets}
        try:
            for load in loads.values():
                load.wait_ready()
            for _ in range(mode.s1_rounds):
                for label, _, server in targets:
                    rounds[label].append(loads[label].window(descendants(server.pid)))
                    log(f"  {label}: {rounds[label][-1]['rate']:.0f} req/s")
        finally:
            for load in loads.values():
                load.close()
        results["s1_conc"] = rounds

        log("S2 in-process vs end to end vs raw loopback")
        results["s2"] = s2_measure(moegrad.url, large, mode.s2_calls)

        callers = {"moegrad v2": TritonCaller(moegrad.url)}
        if peer is not None:
            callers["PyTriton"] = TritonCaller(peer.url)
        try:
            log("tritonclient: S1 sequential, S2 sequential")
            results["peer_s1"] = triton_sequential(callers, small, mode.peer_s1_calls, block=50,
                                                   max_s=mode.peer_s1_max_s)
            results["peer_s2"] = triton_sequential(callers, large, mode.s2_calls, block=1)
        finally:
            for caller in callers.values():
                caller.close()
        results["peer_cpu_idle"] = None
        if peer is not None:
            pids = descendants(peer.pid)
            before = cpu_s(pids)
            time.sleep(1.0)
            results["peer_cpu_idle"] = (cpu_s(pids) - before) / 1.0
        peer_startup_s = peer.startup_s if peer is not None else math.nan

    log("servers stopped")
    log(f"memory: one-call peaks on fresh servers, then S2 for {mode.memory_s:.0f} s")
    results["peaks"] = {}
    for protocol in ("v1", "v2"):
        with moegrad_server(pythonpath=server_pythonpath) as fresh, _protocol_calls(fresh.url) as calls:
            calls[protocol](small)  # imports and first-call set-up, on a payload too small to matter
            calls[protocol](small)
            time.sleep(0.5)
            idle_mib = status_kib(fresh.pid, "VmRSS") / 1024
            cold = one_call_peaks(fresh.pid, {protocol: lambda: calls[protocol](large)}, repeats=1)[protocol]
            warm = one_call_peaks(fresh.pid, {protocol: lambda: calls[protocol](large)}, repeats=3)[protocol]
            results["peaks"][protocol] = {"idle_mib": idle_mib, "cold": cold[0], "warm": warm}
            if protocol == "v2":  # the same server then serves S2 again and again, both protocols in turn
                calls["v1"](large)
                calls["v1"](large)
                results["rss_run"] = rss_run(fresh.pid, [lambda: calls["v1"](large), lambda: calls["v2"](large)],
                                             mode.memory_s)

    log("wire speed: S2" + (" and SL" if not quick else "") + " against the floor, memory per call, batches")
    wire_rounds = {"s2_rounds": 3, "sl_rounds": 0, "batch_rounds": 2, "mixed_rounds": 1} if quick else \
        {"s2_rounds": 5, "sl_rounds": 2, "batch_rounds": 3, "mixed_rounds": 3}
    wire_tables = wire_speed(**wire_rounds, server_pythonpath=server_pythonpath)
    log("done")
    sections = {
        "service": _service_section(results, mode, machine_line, command, small, large, peer_venv, peer_note,
                                    peer_startup_s),
        "memory": _memory_section(results, mode, machine_line, command, large),
        "wire": wire_section(wire_tables, wire_rounds, machine_line,
                             f"{command}; SL as well: `python -m bench.service wire --write` "
                             f"({'quick mode skips SL' if quick else 'full mode includes SL'})"),
    }
    if write:
        for name, body in sections.items():
            write_section(name, body)
    return sections


# --- reporting --------------------------------------------------------------------------------


def wire_section(wire_tables: str, rounds: dict[str, int], machine_line: str, command: str) -> str:
    """The "wire" section of bench/RESULTS.md around :func:`wire_speed`'s tables."""
    return "\n".join([
        "## Large calls at wire speed, and batches", "",
        f"Machine: {machine_line}. Command: {command}. One server (reference backend, "
        f"2 streams); rounds interleaved ({rounds}: the floor, then each path once), first back to back, "
        "then with 0.3 s of idle before each call (these also measure memory); medians; each path's reply checked bitwise "
        "against the in-process result. The floor is raw TCP on loopback moving the same request and "
        "reply bytes between pre-touched buffers; the raw callers send prebuilt requests and receive "
        "into pre-touched buffers the same way. Targets: raw -> v1 frames and raw -> v2 at most 1.5x the "
        "floor, `Client` -> v1 at most 2x (v1 msgpack copies every tensor out of the body as it decodes; "
        "frames are v1's zero-copy form).", "", wire_tables])


def _service_section(r: dict, mode: Mode, machine_line: str, command: str, small: Payload, large: Payload,
                     peer_venv: Any, peer_note: str, peer_startup_s: float) -> str:
    seq = r["s1_seq"]
    p50, p99 = percentile(seq["grad"], 50), percentile(seq["grad"], 99)
    l50, l99 = percentile(seq["live"], 50), percentile(seq["live"], 99)
    conc = r["s1_conc"]
    rate = {label: statistics.median(x["rate"] for x in runs) for label, runs in conc.items()}

    def cpu_per_req(runs: list[dict]) -> str:
        values = [x["server_cpu_s"] / x["requests"] for x in runs if x["requests"]]
        return ms(statistics.median(values)) if values else "n/a"

    def load_cpu(runs: list[dict]) -> str:
        shares = statistics.median(x["client_cpu_s"] / x["window_s"] for x in runs)
        per_req = [x["client_cpu_s"] / x["requests"] for x in runs if x["requests"]]
        return f"{shares * 100:.0f}% ({ms(statistics.median(per_req)) if per_req else 'n/a'} ms/req)"

    errors = {label: sum(x["errors"] for x in runs) for label, runs in conc.items()}
    s2r = r["s2"]
    inproc = {k: statistics.median(step[k] for step in s2r["in_process"]) for k in s2r["in_process"][0]}
    e2e = statistics.median(s2r["e2e"])
    floor = statistics.median(s2r["floor"])
    moved = large.request_bytes + large.reply_bytes
    ratio_s2 = e2e / inproc["total"]
    peer_s1, peer_s2 = r["peer_s1"], r["peer_s2"]
    v2 = "moegrad v2"
    v2_e2e = statistics.median(peer_s2[v2]["wall"])
    have_peer = "PyTriton" in peer_s2

    lines = [
        "## Service on loopback",
        "",
        f"Command: {command}; {mode.name} mode. Machine: {machine_line}.",
        "",
        f"Server: `{moegrad_command()}` (one uvicorn worker, the reference backend), 127.0.0.1 only. "
        "Every reply was checked bitwise against a result computed independently in the bench. CPU columns "
        "are user + system seconds from /proc (server: its process; client: the measuring process), which "
        "the machine's load inflates less than wall time.",
        "",
        f"### S1 sequential, sync `moegrad.Client` ({len(seq['grad'])} calls)",
        "",
        "Floors, the same S1 request bytes on one keep-alive connection each: bare `httpx.Client.post` "
        "(the client library the target names, without moegrad's code: no validation, no encoding) and a "
        "plain socket (no client library: the server's and the kernel's time alone); and `GET /health/live` "
        "with the same `moegrad.Client`. All four take turns in blocks of 100 so they see the same machine "
        f"load (up to {mode.s1_calls} calls each, fewer when {mode.s1_max_s:.0f} s have passed); every S1 "
        "reply is checked bitwise, outside the timing.",
        "",
        "| | S1, `moegrad.Client` | floor: bare httpx | floor: plain socket | GET /health/live | target | result |",
        "|---|---:|---:|---:|---:|---:|---|",
        f"| p50 latency, ms | {ms(p50)} | {ms(percentile(seq['httpx'], 50))} | {ms(percentile(seq['raw'], 50))} "
        f"| {ms(l50)} | <= 1 ms | {verdict(p50 <= 1e-3)} |",
        f"| p99 latency, ms | {ms(p99)} | {ms(percentile(seq['httpx'], 99))} | {ms(percentile(seq['raw'], 99))} "
        f"| {ms(l99)} | <= 3 ms | {verdict(p99 <= 3e-3)} |",
        f"| server CPU per request, ms | {ms(seq['server_cpu_per_grad_s'])} | {ms(seq['server_cpu_per_httpx_s'])} "
        f"| {ms(seq['server_cpu_per_raw_s'])} | {ms(seq['server_cpu_per_live_s'])} | | |",
        f"| client CPU per request, ms | {ms(seq['client_cpu_per_grad_s'])} | {ms(seq['client_cpu_per_httpx_s'])} "
        f"| {ms(seq['client_cpu_per_raw_s'])} | {ms(seq['client_cpu_per_live_s'])} | | |",
        "",
        f"Where the S1 time goes (p50): the server and the kernel {ms(percentile(seq['raw'], 50))} ms (plain socket); "
        f"httpx adds {ms(percentile(seq['httpx'], 50) - percentile(seq['raw'], 50))} ms (bare httpx); moegrad's "
        f"client code (validation, encoding, checks) {ms(p50 - percentile(seq['httpx'], 50))} ms more. "
        f"httpx's own CPU per POST here ({ms(seq['client_cpu_per_httpx_s'] - seq['client_cpu_per_raw_s'])} ms "
        "over the plain socket's) is the largest part of the client's share.",
        "",
        f"### S1 with {CONCURRENCY} concurrent requests",
        "",
        f"Load: one separate process per row (`python -m bench.service load ...`), kept for all rounds: "
        f"{CONCURRENCY} asyncio tasks "
        f"or {CONCURRENCY} threads, each sending S1 back to back (one connection each); {mode.s1_rounds} rounds of a "
        f"{mode.s1_window_s:g} s window (after 0.5 s of warm-up), the servers taking turns; replies completed "
        "inside the window over its length, median of the rounds. The load process shares the 2 cores with "
        "the server.",
        "",
        "| server | load (one process) | requests/s (median) | rounds | server CPU per request, ms "
        "| load process CPU | errors | target | result |",
        "|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    clients = {"moegrad v1": f"moegrad.AsyncClient, {CONCURRENCY} asyncio tasks",
               "moegrad v1 (threads)": f"moegrad.Client, {CONCURRENCY} threads",
               "moegrad v1 (plain sockets)": f"prebuilt HTTP/1.1 request on {CONCURRENCY} asyncio connections",
               "moegrad v2": f"tritonclient.http.aio, {CONCURRENCY} asyncio tasks",
               "PyTriton": f"tritonclient.http.aio, {CONCURRENCY} asyncio tasks"}
    for label, runs in conc.items():
        judged = label.startswith("moegrad v1")
        target = ">= 1000" if judged else ""
        result = verdict(rate[label] >= 1000) if judged else ""
        lines.append(f"| {label} | {clients[label]} | {rate[label]:.0f} | "
                     f"{', '.join('%.0f' % x['rate'] for x in runs)} | {cpu_per_req(runs)} | {load_cpu(runs)} | "
                     f"{errors[label]} | {target} | {result} |")
    v1_cpu = [x["server_cpu_s"] / x["requests"] for label in conc if label.startswith("moegrad v1")
              for x in conc[label] if x["requests"]]
    if v1_cpu:
        lines += [
            "",
            f"One event loop (and one GIL) serves every request: 1000 requests/s needs at most 1 ms of server CPU "
            f"per S1 request, and the load needs its own share of the 2 cores; the server spent "
            f"{ms(statistics.median(v1_cpu))} ms per v1 request here (median over the v1 windows). The plain-socket "
            "row is the server's capacity with a load that costs little CPU; the client rows add what moegrad's "
            "own clients cost on the same 2 cores (their CPU per request is in the load column).",
        ]
    lines += [
        "",
        f"### S2 (N=1024, K=2, H=4096 float32: {large.request_bytes / MIB:.1f} MiB in, "
        f"{large.reply_bytes / MIB:.0f} MiB out), {len(s2r['e2e'])} calls, medians",
        "",
        "In-process: the same steps without HTTP, in this process: build and validate the call and pack it "
        "(encode), unpack and validate it again as the server does (validate), the reference kernel "
        "(compute), pack the reply and unpack it into an owned array (decode). Floor: raw TCP on "
        "127.0.0.1 moving the same request and reply bytes once, buffers pre-touched. The three take "
        "turns call by call.",
        "",
        "| path | ms | / in-process | target | result |",
        "|---|---:|---:|---:|---|",
        f"| in-process total | {ms(inproc['total'])} | 1.00x | | |",
        f"| - encode / validate / compute / reply encode / decode | {ms(inproc['encode'])} / {ms(inproc['validate'])} "
        f"/ {ms(inproc['compute'])} / {ms(inproc['reply_encode'])} / {ms(inproc['decode'])} | | | |",
        f"| end to end, `moegrad.Client` -> v1 (msgpack) | {ms(e2e)} | {ratio_s2:.2f}x | <= 2x | "
        f"{verdict(ratio_s2 <= 2.0)} |",
        f"| end to end, tritonclient -> v2 (binary tensors; peer table's calls) | {ms(v2_e2e)} "
        f"| {v2_e2e / inproc['total']:.2f}x | | |",
        f"| floor: raw TCP loopback, {moved / MIB:.0f} MiB once | {ms(floor)} ({moved / floor / 1e9:.2f} GB/s) "
        f"| {floor / inproc['total']:.2f}x | | |",
        "",
        "Copies of the payload on the server: the memory section (peak RSS growth over one S2 call on a fresh "
        "server, and the buffers of each protocol's code path).",
        "",
        "### Peer: PyTriton serving the naive NumPy function, same client (tritonclient[http], v2 protocol)",
        "",
    ]
    if not have_peer:
        lines += [f"**Skipped**: {peer_note}. moegrad's v2 numbers (tritonclient) stand alone below.", ""]
    else:
        lines += [
            f"PyTriton {peer_venv.pytriton_version} (`bench/pytriton_peer/server.py`, Python 3.12 venv "
            f"{peer_note}; ready in {peer_startup_s:.0f} s; `batching=False`, HTTP only on 127.0.0.1) serving "
            "`grad_expanded_x.astype(np.float32)[idx.reshape(N, K)].sum(1)` cast back to the input dtype; "
            f"idle CPU of its process tree {r['peer_cpu_idle'] * 100:.0f}% of a core. Same tritonclient "
            "requests (binary tensor data both ways, `top_k` as a request parameter) to both servers; "
            "S1 throughput from the concurrency table above, the sequential calls in turns (S1 in blocks of "
            "50, S2 call by call).",
            "",
        ]

    def median_of(name: str, payload: str, key: str = "wall") -> float | None:
        table = peer_s1 if payload == "s1" else peer_s2
        return statistics.median(table[name][key]) if name in table else None

    rows = [
        ("S1 throughput, 16 concurrent (aio), requests/s", rate.get(v2), rate.get("PyTriton"), 2.0, True),
        ("S2 throughput, sequential (sync), calls/s", 1 / median_of(v2, "s2"),
         1 / median_of("PyTriton", "s2") if have_peer else None, 5.0, True),
        ("S1 latency p50, sequential (sync), ms", percentile(peer_s1[v2]["wall"], 50) * 1e3,
         percentile(peer_s1["PyTriton"]["wall"], 50) * 1e3 if have_peer else None, None, False),
        ("S2 latency median, sequential (sync), ms", median_of(v2, "s2") * 1e3,
         median_of("PyTriton", "s2") * 1e3 if have_peer else None, None, False),
        ("S2 client CPU per call (tritonclient's own share), ms", median_of(v2, "s2", "client_cpu") * 1e3,
         median_of("PyTriton", "s2", "client_cpu") * 1e3 if have_peer else None, None, None),
    ]
    lines += ["| measure | moegrad v2 | PyTriton | ratio | target | result |",
              "|---|---:|---:|---:|---:|---|"]
    for name, ours, theirs, target, higher_better in rows:
        goal = ">= %gx" % target if target else ""
        if theirs is None:
            lines.append(f"| {name} | {ours:.1f} | skipped | | {goal} | {'n/a' if target else ''} |")
            continue
        if higher_better is None:
            lines.append(f"| {name} | {ours:.1f} | {theirs:.1f} | | | |")
            continue
        ratio = ours / theirs if higher_better else theirs / ours
        label = "moegrad / PyTriton" if higher_better else "PyTriton / moegrad"
        result = verdict(ratio >= target) if target else ""
        lines.append(f"| {name} | {ours:.1f} | {theirs:.1f} | {ratio:.2f}x ({label}) | {goal} | {result} |")
    if have_peer:
        client_s = statistics.median(peer_s2[v2]["client_cpu"] + peer_s2["PyTriton"]["client_cpu"])
        ceiling = median_of("PyTriton", "s2") / client_s
        lines += [
            "",
            f"The client bounds the S2 ratio: tritonclient's own CPU per S2 call ({client_s * 1e3:.0f} ms, the "
            f"same whichever server answers) caps moegrad / PyTriton at about {ceiling:.1f}x (PyTriton's time over "
            "the client's CPU time) even for a server that took no time at all; less on a loaded machine, where "
            "the client also waits for a core.",
        ]
    return "\n".join(lines)


def _memory_section(r: dict, mode: Mode, machine_line: str, command: str, large: Payload) -> str:
    run: RssRun = r["rss_run"]
    payload_mib = large.request_bytes / MIB
    reply_mib = large.reply_bytes / MIB
    lines = [
        "## Server memory (and the copies of the S2 payload)",
        "",
        f"Command: {command}; {mode.name} mode. Machine: {machine_line}.",
        "",
        f"Servers: `{moegrad_command()}`; RSS is VmRSS from /proc/<pid>/status.",
        "",
        f"### One S2 call: the server's peak RSS growth ({payload_mib:.1f} MiB request, {reply_mib:.0f} MiB reply)",
        "",
        "A fresh server per protocol, warmed up with two S1 calls (imports, first-call set-up); then VmHWM is "
        "reset through /proc/<pid>/clear_refs, one S2 call made, and VmHWM minus the VmRSS before the call "
        "taken. The first S2 call (cold) finds no freed memory to reuse, so its growth is the sum of the "
        "buffers alive at the peak; later calls (warm) partly reuse memory the allocator kept.",
        "",
        "| protocol | idle RSS, MiB | cold peak growth, MiB (/ request) | warm peak growth, MiB (3 calls) "
        "| buffers alive at the peak, by the code path | expected, MiB | request copies | target | result |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    code_path = {  # (what is alive at the peak, MiB expected, copies of the request among them)
        "v1": ("while decoding: body bytearray (read_body) + msgpack `bin` bytes (decode_body; the call's "
               "arrays view them); the body is then freed; after the compute: the `bin` bytes + grad_x + the "
               "packed reply (msgpack's buffer, sent as is); the larger of the two",
               max(2 * payload_mib, payload_mib + 2 * reply_mib), 2),
        "v2": ("body bytearray (read_body; binary data lands 16-byte aligned, the call's arrays view it) "
               "+ grad_x + the reply (JSON header joined with grad_x's bytes)", payload_mib + 2 * reply_mib, 1),
    }
    names = {"v1": "v1 (msgpack, moegrad.Client)", "v2": "v2 (binary tensors, tritonclient)"}
    for protocol, peaks in r["peaks"].items():
        buffers, expected_mib, copies = code_path[protocol]
        consistent = peaks["cold"] <= expected_mib * 1.1
        lines.append(
            f"| {names[protocol]} | {peaks['idle_mib']:.0f} | {peaks['cold']:.0f} "
            f"({peaks['cold'] / payload_mib:.2f}x) | {', '.join('%.0f' % x for x in peaks['warm'])} | {buffers} "
            f"| {expected_mib:.0f} | {copies} | <= 2 | {verdict(copies <= 2 and consistent)} |")
    lines += [
        "",
        "Pass: the code path holds at most two copies of the request at once and the measured cold growth is "
        "within 10% of what that code path accounts for (so nothing unaccounted is alive). Not counted: "
        "uvicorn's receive chunks (each freed once appended to the body), socket buffers, and the few MiB "
        "of allocator slack.",
        "",
        f"### S2 served again and again for {mode.memory_s:.0f} s ({run.calls} calls, v1 and v2 in turn, one client)",
        "",
        "The v2 server above, after two more v1 calls. After-call RSS: read as soon as each reply has "
        "arrived (the server is idle between calls). Settled: the median after-call RSS of the run's second "
        "quarter. Pass: the last quarter's median and the final RSS (1 s after the last call) are both within "
        "10% of settled. Peaks: the largest RSS sampled every 50 ms, during calls too.",
        "",
        "| settled, MiB | last quarter, MiB | final, MiB | max (2nd quarter / last quarter), MiB | deviation "
        "| target | result |",
        "|---:|---:|---:|---:|---:|---:|---|",
        f"| {run.settled_mib:.0f} | {run.last_quarter_mib:.0f} | {run.final_mib:.0f} | "
        f"{run.peak_mib(1):.0f} / {run.peak_mib(3):.0f} | {run.deviation * 100:.1f}% | <= 10% | "
        f"{verdict(run.deviation <= 0.10)} |",
    ]
    return "\n".join(lines)


# --- command line -----------------------------------------------------------------------------


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    wire = sub.add_parser("wire", help="large calls vs the loopback floor (S2, SL), memory per call, batches")
    wire.add_argument("--s2-rounds", type=int, default=5)
    wire.add_argument("--sl-rounds", type=int, default=2, help="0 skips SL (~2 GB of RAM per process)")
    wire.add_argument("--batch-rounds", type=int, default=3, help="0 skips the batch table")
    wire.add_argument("--mixed-rounds", type=int, default=3,
                      help="batches of 10,000 calls of distinct shapes before the last idle RSS (0 skips them)")
    wire.add_argument("--write", action="store_true", help="also write the tables to bench/RESULTS.md (section 'wire')")
    load = sub.add_parser("load", help="(internal) the load-generating process")
    load.add_argument("--client", choices=["moegrad", "moegrad-threads", "raw", "triton"], required=True)
    load.add_argument("--url", required=True)
    load.add_argument("--payload", choices=sorted(PAYLOADS), default="s1")
    load.add_argument("--concurrency", type=int, default=CONCURRENCY)
    load.add_argument("--duration-s", type=float, default=3.0)
    load.add_argument("--warmup-s", type=float, default=0.5)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True)
    mode.add_argument("--full", dest="quick", action="store_false")
    parser.add_argument("--server-pythonpath", metavar="DIR", help="run the moegrad server from DIR/client, DIR/service")
    args = parser.parse_args(argv)
    if args.command == "load":
        if not args.url.startswith("http://127.0.0.1:"):
            parser.error("the load process only targets http://127.0.0.1:PORT")
        payload = PAYLOADS[args.payload]()
        if args.client == "moegrad-threads":
            _load_threads(args.url, payload, args.concurrency, args.duration_s, args.warmup_s)
        else:
            asyncio.run(_load_async(args.client, args.url, payload, args.concurrency, args.duration_s,
                                    args.warmup_s))
        return 0
    if args.command == "wire":
        rounds = {"s2_rounds": args.s2_rounds, "sl_rounds": args.sl_rounds, "batch_rounds": args.batch_rounds,
                  "mixed_rounds": args.mixed_rounds}
        tables = wire_speed(**rounds, server_pythonpath=args.server_pythonpath)
        print(tables)
        if args.write:
            command = (f"`python -m bench.service wire --s2-rounds {args.s2_rounds} --sl-rounds {args.sl_rounds} "
                       f"--batch-rounds {args.batch_rounds} --mixed-rounds {args.mixed_rounds} --write`")
            write_section("wire", wire_section(tables, rounds, machine(), command))
        return 0
    sections = main(quick=args.quick, write=True, server_pythonpath=args.server_pythonpath)
    for body in sections.values():
        print(body, end="\n\n")
    return 0


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(_cli())
