"""One run of the service benchmark: the servers, the measurements in order, the sections written."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

from bench._results import QUICK_BUDGET_S, machine, write_section

from .clients import TritonCaller
from .common import FULL, QUICK, Mode, log, restart_clock
from .load import LoadProcess
from .measure import one_call_peaks, rss_run, s1_sequential, s2_measure, triton_sequential
from .payloads import s1, s2
from .procs import cpu_s, descendants, moegrad_server, pytriton_server, status_kib
from .report import memory_section, service_section, wire_section
from .wire import wire_speed

__all__ = ["MIN_BUILD_S", "QUICK_RESERVE_S", "main"]


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
    """Measure the service, memory and wire sections; return them (and with ``write``, store them).

    ``budget_s``: seconds left of quick mode's 5-minute budget (bench.run passes it); None in full
    mode. It only decides whether a missing PyTriton venv may be built in this run.
    """
    restart_clock()
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
        "service": service_section(results, mode, machine_line, command, small, large, peer_venv, peer_note,
                                    peer_startup_s),
        "memory": memory_section(results, mode, machine_line, command, large),
        "wire": wire_section(wire_tables, wire_rounds, machine_line,
                             f"{command}; SL as well: `python -m bench.service wire --write` "
                             f"({'quick mode skips SL' if quick else 'full mode includes SL'})"),
    }
    if write:
        for name, body in sections.items():
            write_section(name, body)
    return sections
