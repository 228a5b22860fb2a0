"""Tenants of one service: ``python -m bench.tenancy [--quick] [--baseline DIR]``.

Four tables, each measured on real ``moegrad-service`` processes (reference backend, loopback):

1. **Memory per worst shape** (support.attacks.worst): each request alone on a server with room to
   spare: its body, what the documented rules say it holds, what the server reserved for it before
   (twice the body; five times a batch's) and the RSS it grew by (VmHWM over the settled RSS).
   Then four at once against a 64 MiB budget: what was answered and the RSS growth.
2. **Uploads at 16 B/s** holding most of a 64 MiB budget: when another tenant's 4 MiB call gets through.
3. **Compares abandoned while judged**: the server's CPU time after their clients hung up, against
   the same compares answered.
4. **A small call under another tenant's flood**: the documentation's example (tenant B) alone, then
   while tenant A floods compares on keep-alive connections from another process (prebuilt bodies
   on raw sockets, so the load generator is not the bottleneck), p50 and p99: with two bearer
   tokens (two tenants, turns in the queues), and with none (one tenant, first come first served).

``--baseline DIR`` runs every measurement a second time, side by side, on the code of an older
checkout (DIR/client and DIR/service through PYTHONPATH; ``git worktree add DIR 5d11258``), so
that each figure has its before in the same run (the floods: with no tokens and with two, labelled
with DIR's commit). ``--quick`` shortens the flood and repeats less; ``--flood grad`` measures only
the flood of large calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from support.attacks import ATTACK_SETTINGS, Probes, example_call
from support.attacks.probes import reset_peak, rss_bytes, settled_rss
from support.attacks.tenancy import abandoned_compares, flood_latency, stalled_large_uploads, worst_shape
from support.attacks.wire import MIB, exchange, request_head
from support.attacks.worst import BATCH_PATH, INFER_PATH, SHAPES
from support.launch import moegrad_server

__all__ = ["main"]

BUDGET = int(ATTACK_SETTINGS["max_inflight_bytes"])


def _env(baseline: Path | None) -> dict[str, str] | None:
    if baseline is None:
        return None
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(baseline / "client"), str(baseline / "service")])}


def memory_alone(log_dir: Path, env: dict[str, str] | None) -> dict[str, tuple[float, float, float, int]]:
    """Each worst shape at 5/8 of the 64 MiB budget, alone, on a server with a 2 GiB budget:
    name -> (body MiB, held by the rules MiB, RSS growth MiB, status)."""
    settings = {"max_inflight_bytes": 2 << 30, "max_body_bytes": 1 << 30, "receive_keep_s": 0, "warm_up": "true"}
    rows = {}
    with moegrad_server(log_dir, settings=settings, name="memory", ready_within_s=300, env=env) as server:
        example_call(server.port, timeout_s=120)
        for name, build in SHAPES.items():
            path, media_type, body, peak = build(BUDGET * 5 // 8)
            head = request_head("POST", path, {"Content-Type": media_type}, len(body))
            exchange(server.port, head, body, timeout_s=120)  # the first of a shape pays its one-time costs
            before = settled_rss(server.pid, within_s=10.0)
            reset_peak(server.pid)
            answer = exchange(server.port, head, body, timeout_s=120)
            rows[name] = (len(body) / MIB, peak / MIB, (rss_bytes(server.pid, "VmHWM") - before) / MIB,
                          answer.status or 0)
    return rows


def memory_together(log_dir: Path, env: dict[str, str] | None) -> dict[str, tuple[str, float]]:
    """Each worst shape at 5/8 of the budget, four at once, against the 64 MiB budget: name ->
    (answers, RSS growth MiB)."""
    rows = {}
    with moegrad_server(log_dir, settings=ATTACK_SETTINGS, name="together", env=env) as server, \
            Probes(server.port, log_dir) as probes:
        example_call(server.port, timeout_s=120)
        for name in SHAPES:
            outcome = worst_shape(server, probes, name, BUDGET, count=4)
            answers = ", ".join(f"{n}x {s}" for s, n in sorted(outcome.statuses.items(), key=str))
            rows[name] = (answers, outcome.figures["growth_mib"])
    return rows


def _reserved_before(name: str, body_mib: float) -> float:
    path = SHAPES[name](BUDGET * 5 // 8)[0]
    return body_mib * (5 if path == BATCH_PATH else 2)


def memory_table(log_dir: Path, baseline: Path | None) -> str:
    now_alone, now_together = memory_alone(log_dir, None), memory_together(log_dir, None)
    then_alone = memory_alone(log_dir, _env(baseline)) if baseline else None
    then_together = memory_together(log_dir, _env(baseline)) if baseline else None
    lines = ["| shape | body | held by the rules | reserved before | RSS growth alone: before / now "
             "| 4 at once, 64 MiB budget: before | now |", "|---|---|---|---|---|---|---|"]
    for name in SHAPES:
        body, peak, growth, _ = now_alone[name]
        before_growth = f"{then_alone[name][2]:.0f}" if then_alone else "-"
        before_together = (f"{then_together[name][0]}, RSS +{then_together[name][1]:.0f} MiB"
                           if then_together else "-")
        answers, together = now_together[name]
        reserved = (f"{_reserved_before(name, body):.1f} MiB" if SHAPES[name](1)[0] != INFER_PATH
                    else f"{2 * body:.1f} MiB")
        lines.append(f"| {name} | {body:.2f} MiB | {peak:.0f} MiB | {reserved} | {before_growth} / {growth:.0f} MiB "
                     f"| {before_together} | {answers}, RSS +{together:.0f} MiB |")
    return "\n".join(lines)


def stalled_table(log_dir: Path, baseline: Path | None) -> str:
    lines = ["| code | the two uploads | another tenant's 4 MiB call |", "|---|---|---|"]
    runs = [("before", _env(baseline))] if baseline else []
    for label, env in [*runs, ("now", None)]:
        outcome = stalled_large_uploads(log_dir, quick=False, env=env)
        through = outcome.figures["through_s"]
        uploads = ", ".join(f"{n}x {s}" for s, n in sorted(outcome.statuses.items(), key=str))
        lines.append(f"| {label} | {uploads} (of all answers) after {outcome.figures['stalled_s']:.1f} s | "
                     + (f"through after {through:.1f} s |" if through != float("inf") else "never within 40 s |"))
    return "\n".join(lines)


def abandoned_table(log_dir: Path, baseline: Path | None, repeats: int) -> str:
    lines = ["| code | 2 compares of H = 1, 512K tokens: CPU-s answered | CPU-s after their clients hung up "
             "(0.5 s after sending), median of runs |", "|---|---|---|"]
    runs = [("before", _env(baseline))] if baseline else []
    settings = {"max_inflight_bytes": 1 << 30, "max_queue": 16, "warm_up": "true"}
    for label, env in [*runs, ("now", None)]:
        answered, abandoned = [], []
        with moegrad_server(log_dir, settings=settings, name="abandoned", ready_within_s=300, env=env) as server:
            example_call(server.port, timeout_s=120)
            for _ in range(repeats):
                outcome = abandoned_compares(server, 2, 1 << 19)
                answered.append(outcome.figures["answered_cpu_s"])
                abandoned.append(outcome.figures["abandoned_cpu_s"])
        lines.append(f"| {label} | {statistics.median(answered):.2f} ({', '.join(f'{v:.2f}' for v in answered)}) | "
                     f"{statistics.median(abandoned):.2f} ({', '.join(f'{v:.2f}' for v in abandoned)}) |")
    return "\n".join(lines)


#: The floods: kind -> (its words, connections, tokens, hidden) (support.attacks.tenancy.flood_main).
FLOODS = {
    "compare": ("8 connections of compares of 16384 x 64, top_k 2 (12 MiB each)", 8, 16384, 64),
    "grad": ("16 connections of calls of 4096 tokens x 64 slots from 1024 rows of 256 (2 MiB each, a "
             "4 MiB grad_x: 67M adds)", 16, 4096, 256),
}


def _commit(baseline: Path) -> str:
    """The baseline checkout's commit (short), or its folder's name where git cannot say."""
    try:
        done = subprocess.run(["git", "-C", str(baseline), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
    except OSError:
        return baseline.name
    return done.stdout.strip() if done.returncode == 0 else baseline.name


def flood_table(log_dir: Path, baseline: Path | None, seconds: float, kind: str, repeats: int) -> str:
    """Each configuration ``repeats`` times, the configurations interleaved (the machine's load
    drifts); each figure the median of its runs, every run's p50 after it. With ``baseline``, its
    code with no tokens and with two."""
    runs = []
    if baseline is not None:
        before = f"before ({_commit(baseline)})"
        runs += [(f"{before}, no tokens", _env(baseline), False), (f"{before}, two tokens", _env(baseline), True)]
    runs += [("now, no tokens (one tenant)", None, False), ("now, two tokens (two tenants)", None, True)]
    _, connections, tokens, hidden = FLOODS[kind]
    results: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
    for _ in range(repeats):
        for label, env, authenticated in runs:
            results[label].append(flood_latency(log_dir, seconds=seconds, connections=connections, tokens=tokens,
                                                hidden=hidden, authenticated=authenticated, env=env, kind=kind))
    lines = ["| code, tenants | alone p50 / p99 | under the flood p50 / p99 | p50 ratio | flood p50 of each run "
             "| waiting for a worker under the flood p50 / p99 | flood answers |", "|---|---|---|---|---|---|---|"]
    for label, figures in results.items():
        def median(key: str, figures: list[dict] = figures) -> float:
            return statistics.median(f[key] for f in figures)

        each = ", ".join(f"{f['flood_p50_ms']:.0f}" for f in figures)
        answers = " ".join(str(f["flood_answers"]) for f in figures)
        lines.append(f"| {label} | {median('alone_p50_ms'):.1f} / {median('alone_p99_ms'):.1f} ms | "
                     f"{median('flood_p50_ms'):.1f} / {median('flood_p99_ms'):.1f} ms | "
                     f"{median('flood_p50_ms') / median('alone_p50_ms'):.1f}x | {each} ms | "
                     f"{median('flood_queue_p50_ms'):.1f} / {median('flood_queue_p99_ms'):.1f} ms | {answers} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tenancy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter flood and fewer repeats")
    parser.add_argument("--baseline", type=Path, help="an older checkout, measured side by side (its client/ and "
                        "service/ through PYTHONPATH)")
    parser.add_argument("--only", choices=["memory", "stalled", "abandoned", "flood"], action="append",
                        help="run only these tables (repeatable)")
    parser.add_argument("--flood", choices=sorted(FLOODS), action="append",
                        help="only these floods (repeatable; default: both, or the compare flood with --quick)")
    args = parser.parse_args(argv)
    if args.baseline is not None and not (args.baseline / "service" / "moegrad_service").is_dir():
        parser.error(f"--baseline {args.baseline}: no service/moegrad_service there")
    only = set(args.only or ["memory", "stalled", "abandoned", "flood"])
    seconds, repeats = (6.0, 1) if args.quick else (12.0, 3)
    with tempfile.TemporaryDirectory(prefix="moegrad-tenancy-") as log_dir:
        logs = Path(log_dir)
        if "memory" in only:
            print("### Memory per worst shape\n\n" + memory_table(logs, args.baseline) + "\n", flush=True)
        if "stalled" in only:
            print("### Uploads at 16 B/s holding 2 x 28 of a 64 MiB budget (body_min_bytes_per_s 64 KiB/s, "
                  "body_grace_s 1 s, body_timeout_s 30 s)\n\n" + stalled_table(logs, args.baseline) + "\n", flush=True)
        if "abandoned" in only:
            print("### Compares abandoned while judged\n\n" + abandoned_table(logs, args.baseline, repeats) + "\n",
                  flush=True)
        if "flood" in only:
            for kind in args.flood or (("compare",) if args.quick else tuple(FLOODS)):
                print(f"### A small call under another tenant's flood: {FLOODS[kind][0]}, {seconds:.0f} s\n\n"
                      + flood_table(logs, args.baseline, seconds, kind, repeats) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
