"""The markdown of the three bench/RESULTS.md sections this benchmark writes: service, memory, wire."""

from __future__ import annotations

import statistics
from typing import Any

from .common import CONCURRENCY, MIB, Mode, ms, percentile, verdict
from .measure import RssRun
from .payloads import Payload
from .procs import moegrad_command

__all__ = ["memory_section", "service_section", "wire_section"]


def wire_section(wire_tables: str, rounds: dict[str, int], machine_line: str, command: str) -> str:
    """The "wire" section of bench/RESULTS.md around :func:`wire_speed`'s tables."""
    return "\n".join([
        "## Large calls at wire speed, and batches", "",
        f"Machine: {machine_line}. Command: {command}. One server (reference backend, "
        f"2 streams); rounds interleaved ({rounds}: the floor, then each path once), first back to back, "
        "then with 0.3 s of idle before each call (these also measure memory); medians; each path's reply checked "
        "bitwise "
        "against the in-process result. The floor is raw TCP on loopback moving the same request and "
        "reply bytes between pre-touched buffers; the raw callers send prebuilt requests and receive "
        "into pre-touched buffers the same way; `msgpack + http.client` is a plain client of the documented "
        "msgpack protocol (msgpack-python and the standard library, nothing of moegrad), timed end to end "
        "(packing and unpacking included). Targets: every raw "
        "path at most 1.5x the floor, `Client` -> v1 and the plain msgpack client at most 2x, and the server's "
        "peak RSS growth for one msgpack call from idle at most 1.15x request + reply (issue 31: large tensors "
        "are viewed in the received body and grad_x is sent from its own buffer, in msgpack as in frames).",
        "", wire_tables])


def service_section(r: dict, mode: Mode, machine_line: str, command: str, small: Payload, large: Payload,
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


def memory_section(r: dict, mode: Mode, machine_line: str, command: str, large: Payload) -> str:
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
        "v1": ("while decoding: body bytearray (Intake.read) + msgpack `bin` bytes (decode_body; the call's "
               "arrays view them); the body is then freed; after the compute: the `bin` bytes + grad_x + the "
               "packed reply (msgpack's buffer, sent as is); the larger of the two",
               max(2 * payload_mib, payload_mib + 2 * reply_mib), 2),
        "v2": ("body bytearray (Intake.read; binary data lands 16-byte aligned, the call's arrays view it) "
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
