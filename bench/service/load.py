"""The load-generating process (``python -m bench.service load``) and :class:`LoadProcess`, its parent's handle.

The child keeps ``concurrency`` requests in flight (asyncio tasks over one client, or threads with a
sync Client each) and reports one JSON line per event on stdout; the parent reads the server's CPU
time from /proc when a window starts and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from support.launch import log_tail

from .clients import content_length, grad_request, grad_x_of_reply, triton_inputs
from .common import CONCURRENCY, MODEL, OUT_DIR, ROOT
from .payloads import Payload, check
from .procs import cpu_s

__all__ = ["LoadProcess", "load_async", "load_threads"]


def _commands() -> Iterator[None]:
    """One item per ``go`` line on stdin; ends at ``quit`` or end of input (the parent's control)."""
    for line in sys.stdin:
        if line.strip() != "go":
            return
        yield None


def _event(name: str, **fields: Any) -> None:
    print(json.dumps({"event": name, **fields}), flush=True)


async def load_async(kind: str, url: str, payload: Payload, concurrency: int, duration_s: float,
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
                body = await reader.readexactly(content_length(head))
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


def load_threads(url: str, payload: Payload, concurrency: int, duration_s: float, warmup_s: float) -> None:
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
