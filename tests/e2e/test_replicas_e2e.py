"""Sweeps over three real servers on loopback: replicas, a lost replica, an interrupted sweep, shards.

One module-scoped set of three reference-backend servers (started together: each start costs
seconds); the SIGKILL and SIGTERM tests stop a fourth of their own, so the tests run in any order.
The SIGTERM test's transport (httpx's, its request body held back) sends the signal while a batch
is on its way to that server, so the server answers it as a draining one does, every item 503,
on every run. The cases are tests/oracle.py's
float32 K=2 calls, whose device result is one float32 add (``device_k2``), so every expected status
comes from the oracle's own figures (``float32_statuses``), never from moegrad; an oversized case
is refused by the servers' ``max_elements`` (413, a check the client cannot make), and a wire
document with a bad ``top_k`` by their validation (422). The requests each server saw are read off
its /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest

import moegrad
from moegrad import accuracy
from moegrad.cli._console import replica_notes
from moegrad.cli._main import main
from moegrad.cli._sweep import sweep_status
from support.launch import moegrad_server
from support.oracle import device_k2, float32_statuses, golden_and_scale, oracle_call, oracle_candidate

MAX_ELEMENTS = 1 << 16  # the servers' limit per tensor; the oversized case's grad_expanded_x has 2 x 40000
FAILURES = re.compile(r'^moegrad_inference_request_failure_total\{endpoint="[^"]*",reason="[^"]*"\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three reference servers, started at once; whatever is still running is stopped at the end."""
    log_dir = tmp_path_factory.mktemp("replicas")
    with ThreadPoolExecutor(3) as pool:
        started = list(pool.map(lambda i: moegrad_server(log_dir, settings={"max_elements": MAX_ELEMENTS},
                                                          name=f"replica{i}", ready_within_s=120.0), range(3)))
    try:
        yield started
    finally:
        for server in started:
            server.stop()


def expected_status(call, candidate) -> str:
    """The oracle's verdict (tests/oracle.py): fail when a tolerance standard fails, else pass."""
    golden, scale = golden_and_scale(call)
    statuses = float32_statuses(candidate, device_k2(call), golden, scale)
    return "fail" if any(status == "fail" for name, status in statuses.items() if name != "bitwise") else "pass"


def write_cases(folder: Path, count: int, *, tokens: int = 8, hidden: int = 16, scaled: bool = True) -> dict[str, str]:
    """``count`` case files (with ``scaled``, every 7th scaled by 1 + 2^-12; the others the device
    itself) -> expected status."""
    folder.mkdir(parents=True, exist_ok=True)
    expected = {}
    for i in range(count):
        call = oracle_call(seed=i, tokens=tokens, hidden=hidden)
        candidate = oracle_candidate("scaled_up" if scaled and i % 7 == 3 else "device", device_k2(call))
        accuracy.save_case(folder / f"case{i:04d}.npz", grad_expanded_x=call.grad_expanded_x,
                           expanded_row_idx=call.expanded_row_idx, top_k=2, candidate=candidate)
        expected[f"case{i:04d}"] = expected_status(call, candidate)
    assert set(expected.values()) == ({"pass", "fail"} if scaled else {"pass"})
    return expected


def oversized(folder: Path) -> None:
    """A case whose grad_expanded_x [80000, 1] passes every local check but not the servers' max_elements."""
    call = oracle_call(seed=99, tokens=40000, hidden=1)
    accuracy.save_case(folder / "oversized.npz", grad_expanded_x=call.grad_expanded_x,
                       expanded_row_idx=call.expanded_row_idx, top_k=2, candidate=device_k2(call))


def metrics_of(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def failures_seen(urls) -> float:
    """The calls the servers answered with an error (batch items included), summed over ``urls``."""
    return sum(float(value) for url in urls for value in FAILURES.findall(metrics_of(url)))


def case_lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    lines = [json.loads(line) for line in text.splitlines()]  # every line whole
    return [line for line in lines if line["kind"] == "case"]


def test_calls_spread_over_the_replicas_and_a_4xx_is_never_retried(servers):
    urls = [server.url for server in servers]
    call = oracle_call(seed=5)
    with moegrad.Client(urls) as client:
        for _ in range(30):
            assert np.array_equal(client.run(call).grad_x.view(np.uint32), device_k2(call).view(np.uint32))
        assert all(stats.served > 0 for stats in client.stats) and sum(s.served for s in client.stats) == 30
    bad = {"grad_expanded_x": moegrad.encode_tensor(call.grad_expanded_x),
           "expanded_row_idx": moegrad.encode_tensor(call.expanded_row_idx), "top_k": 3}  # 64 slots: not N*3
    before = failures_seen(urls)
    with moegrad.Client(urls, validate=False) as client:
        with pytest.raises(moegrad.InvalidArgument) as info:
            client.run(bad)
        assert sum(s.failures for s in client.stats) == 0
    assert info.value.aclnn_status == 561103 and failures_seen(urls) - before == 1  # one request, one answer


def test_a_dns_name_s_addresses_are_the_replicas(servers):
    """``dns+http://localhost:PORT``: the name's addresses (127.0.0.1, and ::1 where the resolver
    gives it, where nothing listens: set aside) are the replicas, each request naming the host."""
    port = servers[0].port
    call = oracle_call(seed=6)
    with moegrad.Client(f"dns+http://localhost:{port}", retries=3) as client:
        for _ in range(10):
            assert np.array_equal(client.run(call).grad_x.view(np.uint32), device_k2(call).view(np.uint32))
        stats = {s.url: s for s in client.stats}
    assert stats[f"http://127.0.0.1:{port}"].served == 10
    assert all(s.served == 0 for url, s in stats.items() if url != f"http://127.0.0.1:{port}")


def test_a_sweep_reports_a_refused_case_once_and_the_async_client_judges_alike(servers, tmp_path):
    urls = [server.url for server in servers]
    expected = write_cases(tmp_path / "cases", 60)
    oversized(tmp_path / "cases")
    files = accuracy.find_cases(tmp_path / "cases")
    before = failures_seen(urls)
    with moegrad.Client(urls) as client:
        results = client.compare_many(files, progress=False)
        assert all(stats.served > 0 for stats in client.stats)
    by_name = {result.name: result for result in results}
    refused = by_name.pop("oversized")
    assert refused.status == "invalid" and "PayloadTooLarge" in refused.error
    assert {name: result.status for name, result in by_name.items()} == expected
    assert failures_seen(urls) - before == 1  # the 413 item was answered once and never sent again

    async def sweep():
        async with moegrad.AsyncClient(urls) as client:
            return await client.compare_many(files, progress=False, concurrency=3)

    assert [(r.name, r.status) for r in asyncio.run(sweep())] == [(r.name, r.status) for r in results]


def test_shards_are_disjoint_cover_the_cases_and_merge_into_a_single_runs_summary(servers, tmp_path, capsys):
    expected = write_cases(tmp_path / "cases", 40)
    cases, urls = str(tmp_path / "cases"), [arg for server in servers[:2] for arg in ("--url", server.url)]
    assert main(["compare", "--cases", cases, *urls, "--output", str(tmp_path / "all.jsonl"),
                 "--summary", str(tmp_path / "single"), "--no-progress"]) == 1  # every case judged, some failed
    shards = []
    for index in range(3):
        main(["compare", "--cases", cases, *urls, "--shard", f"{index}/3", "--no-progress",
              "--output", str(tmp_path / "shards" / f"shard-{index}.jsonl")])
        shards.append({line["case"] for line in case_lines(tmp_path / "shards" / f"shard-{index}.jsonl")})
    assert sum(len(shard) for shard in shards) == len(set().union(*shards)) == 40  # disjoint, covering
    assert set().union(*shards) == set(expected)
    capsys.readouterr()
    assert main(["compare", "--merge", str(tmp_path / "shards"), "--cases", cases]) == 1
    assert "40 cases against 3 shard files of 3" in capsys.readouterr().out
    assert (tmp_path / "shards" / "summary.csv").read_bytes() == (tmp_path / "single.csv").read_bytes()
    assert (tmp_path / "shards" / "summary.md").read_text() == (tmp_path / "single.md").read_text()
    single = {line["case"]: line["status"] for line in case_lines(tmp_path / "all.jsonl")}
    assert single == expected
    # a case judged in two shard files with other bytes: not one sweep
    other = json.loads((tmp_path / "shards" / "shard-0.jsonl").read_text().splitlines()[1])
    with open(tmp_path / "shards" / "shard-1.jsonl", "a") as file:
        file.write(json.dumps({**other, "digest": "sha256:" + "0" * 64}) + "\n")
    assert main(["compare", "--merge", str(tmp_path / "shards")]) == 2
    assert "digest conflict: case " + other["case"] in capsys.readouterr().err


def test_the_command_names_a_lost_replica_once_on_the_console_and_in_the_summary(servers, tmp_path, capsys):
    """Two of the module's servers and a third URL where nothing listens (a replica that died): every
    case is judged by the two, and the dead one is named once, lost, with its failed attempts and the
    calls moved off it (none when it was set aside for the whole sweep after its /v1/info failed;
    the SIGKILL test below catches calls moving)."""
    expected = write_cases(tmp_path / "cases", 40)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens once the socket is closed
    urls = [servers[0].url, servers[1].url, dead]
    argv = ["compare", "--cases", str(tmp_path / "cases"), "--no-progress", "--verbose",
            "--output", str(tmp_path / "out" / "run.jsonl"), *(arg for url in urls for arg in ("--url", url))]
    assert main(argv) == 1  # every case judged; some fail
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if line.startswith("moegrad: replica ")]
    assert len(notes) == 1 and notes[0].startswith(f"moegrad: replica {dead} lost (no answer since it failed): ")
    failed, moved = map(int, re.search(r": (\d+) failed attempts?, (\d+) calls? moved to other replicas$",
                                       notes[0]).groups())
    assert failed >= 1  # its /v1/info, asked before anything is sent, at least
    summary = (tmp_path / "out" / "run.summary.md").read_text()
    assert f"- replica {dead} lost (no answer since it failed): " in summary
    assert {line["case"]: line["status"] for line in case_lines(tmp_path / "out" / "run.jsonl")} == expected
    listed = captured.out[captured.out.index("replicas:"):].splitlines()[1:]  # --verbose: every replica's counters
    assert [line.split()[0] for line in listed] == urls
    assert re.search(rf"^  {re.escape(dead)} .*served 0, failures {failed}, moved {moved}$", "\n".join(listed), re.M)


def test_a_sweep_interrupted_by_sigint_resumes_and_judges_every_case_once(servers, tmp_path):
    expected = write_cases(tmp_path / "cases", 400, tokens=64, hidden=64)
    output = tmp_path / "out" / "sweep.jsonl"
    command = [sys.executable, "-m", "moegrad", "compare", "--cases", str(tmp_path / "cases"), "--url",
               servers[0].url, "--output", str(output), "--max-concurrency", "1", "--no-progress"]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (output.exists() and output.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()
        time.sleep(0.01)
    first.send_signal(signal.SIGINT)
    out, err = first.communicate(timeout=30)
    assert first.returncode == 130, out + err
    done = case_lines(output)
    assert 0 < len(done) < 400 and len({line["case"] for line in done}) == len(done)
    written = "1 case" if len(done) == 1 else f"{len(done)} cases"  # the interrupt can come after the first case
    assert f"{written} written to {output}, run again to resume" in err
    second = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert second.returncode == 1, second.stdout + second.stderr  # judged: some fail
    assert f"skipped {len(done)} of 400 cases already judged in {output}" in second.stdout
    final = case_lines(output)
    assert sorted(line["case"] for line in final) == sorted(expected)  # every case exactly once
    assert {line["case"]: line["status"] for line in final} == expected
    kinds = [json.loads(line)["kind"] for line in output.read_text().splitlines()]
    assert kinds.count("header") == 1  # the resumed run wrote no header of its own


def test_a_sweep_that_loses_a_replica_to_sigkill_judges_every_case_exactly_once(servers, tmp_path):
    """Two of the module's servers and a third of its own, killed a third of the way through."""
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(moegrad_server, tmp_path / "logs", settings={"max_elements": MAX_ELEMENTS},
                               name="victim", ready_within_s=120.0)
        expected = write_cases(tmp_path / "cases", 300)
        victim = starting.result()
    files = accuracy.find_cases(tmp_path / "cases")
    seen: list[str] = []
    killed_at: list[int] = []
    busy_at_kill: list[int] = []
    urls = [servers[0].url, servers[1].url, victim.url]
    client = moegrad.Client(urls)

    def kill_a_third_of_the_way(result) -> None:
        """SIGKILL once 100 cases are judged, at a moment the victim has a batch in flight (by 130
        cases at the latest, so that batches are still to come, which meet it dead)."""
        seen.append(result.name)
        in_flight = next(s.in_flight for s in client.stats if s.url == victim.url)
        if victim.process.poll() is None and ((100 <= len(seen) and in_flight) or len(seen) == 130):
            os.killpg(victim.pid, signal.SIGKILL)
            victim.process.wait(10)
            killed_at.append(len(seen))
            busy_at_kill.append(in_flight)

    try:
        with client:
            results = client.compare_many(files, progress=False, concurrency=9, on_result=kill_a_third_of_the_way,
                                          output=tmp_path / "sweep.jsonl")
            stats = {s.url: s for s in client.stats}
        assert victim.process.returncode == -signal.SIGKILL
    finally:
        victim.stop()
    assert killed_at and killed_at[0] <= 130  # mid-way: most of the sweep was still to come
    assert [r.name for r in results] == sorted(expected) and sorted(seen) == sorted(expected)
    assert {r.name: r.status for r in results} == expected  # no case lost to the dead replica
    lines = case_lines(tmp_path / "sweep.jsonl")
    assert sorted(line["case"] for line in lines) == sorted(expected)  # written exactly once each
    assert all(stats[url].served > 0 for url in urls[:2]), stats  # both survivors served
    if busy_at_kill[0]:  # killed with a batch in hand (killed idle at 130, every batch left may be in flight elsewhere)
        assert stats[victim.url].failures >= 1, stats  # its loss was seen, and its calls went elsewhere
        assert stats[victim.url].moved >= 1 and stats[victim.url].failures_in_a_row >= 1, stats
        # the note the command prints once, and writes in the summary
        [note] = replica_notes(list(stats.values()))
        assert note.startswith(f"replica {victim.url} lost (no answer since it failed): ")
    assert {line["server"] for line in lines} <= set(urls)


class Stopping(httpx.SyncByteStream):
    """A request body that stops ``victim`` with SIGTERM after its first byte is sent, and goes on
    once the server no longer admits calls (its readiness 503: it drains)."""

    def __init__(self, victim, body: bytes, stopped: threading.Event) -> None:
        self.victim, self.body, self.stopped = victim, body, stopped

    def __iter__(self):
        yield self.body[:1]  # the head and a byte of the body: the server's handler admits the batch
        time.sleep(1.0)
        self.victim.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(self.victim.url + "/health/ready", timeout=10).status_code == 200:
            assert time.monotonic() < deadline, "the server did not begin to drain"
            time.sleep(0.01)
        self.stopped.set()
        yield self.body[1:]


class StopsAServerMidBatch(httpx.HTTPTransport):
    """httpx's transport, which stops ``victim`` with SIGTERM while the body of its first batch sent
    after the first ``after`` batches is on its way to it (:class:`Stopping`), and notes the detail
    of each batch item any server answered 503.

    The server has then admitted the batch (its handler started on the request's head) but its calls
    meet a pool that no longer admits: the whole-batch 200 whose items are each 503 "shutting down"
    that a replica draining after SIGTERM answers. Until then a batch for another server waits
    before it is sent: the client's choice of the less busy replica turns to the victim."""

    def __init__(self, victim, *, after: int) -> None:
        super().__init__()
        self.victim, self.after, self.sent = victim, after, 0
        self.lock, self.stopping, self.stopped = threading.Lock(), False, threading.Event()
        self.refused: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/batch"):
            with self.lock:
                self.sent += 1
                stop = self.sent > self.after and not self.stopping and request.url.port == self.victim.port
                self.stopping = self.stopping or stop
            if stop:
                request.stream = Stopping(self.victim, b"".join(request.stream), self.stopped)
            elif self.sent > self.after and request.url.port != self.victim.port:
                assert self.stopped.wait(60), "no batch went to the victim"
        response = super().handle_request(request)
        if request.url.path.endswith("/batch") and response.status_code == 200:
            response.read()
            for item in msgpack.unpackb(response.content, raw=False)["results"]:
                if (item.get("problem") or {}).get("status") == 503:
                    self.refused.append(item["problem"]["detail"])
        return response


def test_a_sweep_that_loses_a_replica_to_sigterm_while_it_drains_judges_every_case_exactly_once(servers, tmp_path):
    """Two of the module's servers and a third of its own (draining for ``shutdown_drain_s`` after
    SIGTERM), stopped after the first wave of batches while a batch is on its way to it: that
    batch's items are each answered 503 "shutting down" and go to the other servers, and later
    requests to it meet 503s, then a closed port. Every case passes (the device's own result), so
    the sweep's exit status 0 means every case was judged."""
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(moegrad_server, tmp_path / "logs", name="draining", ready_within_s=120.0,
                               flags=("--backend", "reference", "--log-level", "info"),  # its stop, step by step
                               settings={"max_elements": MAX_ELEMENTS, "shutdown_drain_s": 2.0})
        expected = write_cases(tmp_path / "cases", 300, scaled=False)
        victim = starting.result()
    files = accuracy.find_cases(tmp_path / "cases")
    urls = [servers[0].url, servers[1].url, victim.url]
    concurrency = 9  # batches of 17 cases (about 2 per worker: 300 / 18), 9 sent at once
    transport = StopsAServerMidBatch(victim, after=concurrency)
    client = moegrad.Client(urls, transport=transport)
    seen: list[str] = []
    at_stop: list[int] = []

    def note(result) -> None:
        seen.append(result.name)
        if transport.stopped.is_set() and not at_stop:
            at_stop.append(len(seen))

    try:
        with client:
            results = client.compare_many(files, progress=False, concurrency=concurrency, on_result=note,
                                          output=tmp_path / "sweep.jsonl")
            stats = {s.url: s for s in client.stats}
        try:
            stopped = victim.process.wait(60)
        except subprocess.TimeoutExpired:
            stopped = None
        assert stopped == 0, victim.log()  # a drained stop is a clean one
    finally:
        victim.stop()
    assert transport.stopped.is_set() and at_stop and at_stop[0] < 250  # mid-way: much was still to come
    assert transport.refused and set(transport.refused) == {"the service is not ready or is shutting down"}
    assert [r.name for r in results] == sorted(expected) and sorted(seen) == sorted(expected)
    assert {r.name: r.status for r in results} == expected
    assert sweep_status(results) == 0  # the exit status of `moegrad compare --cases`: every case judged, passed
    lines = case_lines(tmp_path / "sweep.jsonl")
    assert sorted(line["case"] for line in lines) == sorted(expected)  # written exactly once each
    assert {line["server"] for line in lines} <= set(urls)
    assert all(stats[url].served > 0 for url in urls[:2]), stats  # both survivors served
    assert stats[victim.url].failures >= 1, stats  # its refusal was seen, and set it aside
