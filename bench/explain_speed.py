"""moegrad.explain's time beside the comparison and the grad call it explains, on W1-W4, side by side.

For each workload of :data:`bench.kernel.WORKLOADS` (W1-W4 by default) it builds the call as the
kernel bench routes it, with gradients spread over binades (standard-normal values times 2^e, e
uniform in [-4, 4] for float32, [-10, 8] for float16, [-20, 20] for bfloat16), so that orders of adds
round differently there too; then, all
warm, in this process, alternating ``repeats`` times:

- ``grad``: ``moegrad.moe_init_routing_v2_grad(call)``;
- ``compare``: ``moegrad.compare(call, few, device_result=device)``, ``few`` the device's result with
  0.5% of its rows changed (every other one the sequential order's row, the others a slot left out,
  subtracted in float32);
- ``explain few``: ``moegrad.explain(call, few, device_result=device)`` (target: at most 1.5x compare);
- ``explain order``: the same on the sequential order's grad_x, every row that differs by order
  (target: at most 15x the grad call), and on the float64 sum rounded once (no known schedule:
  each row checked against the any-order bound), reported beside it.

Then, once each with tracemalloc, the traced peak of ``explain order`` against
``moegrad.accuracy.explain_peak_bytes(call, device_result=True)``. Prints Markdown tables of the
medians; the exit status is 1 when a target is missed.

``--write`` also puts the tables into bench/RESULTS.md (section ``explain``).

``--collector`` measures instead what Python's cyclic garbage collector costs explain where it
builds the most objects: every row of a 65,536-token call differing (K = 8, H = 16, float32, the
sequential order), explain timed with the collector on (as it runs) and off (``gc.disable`` around
the call, here only), alternating; with ``--write``, section ``explain-collector``.

    python -m bench.explain_speed [--workload W1 ...] [--repeats 5] [--collector] [--write]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc

import numpy as np

import moegrad
from bench._results import machine, write_section
from bench.kernel import WORKLOADS, Workload, routed_index

__all__ = ["main"]

FEW_TARGET = 1.5
ORDER_TARGET = 15.0


def wide_call(workload: Workload, seed: int = 0) -> moegrad.MoeInitRoutingV2GradCall:
    """The workload's call with gradients over many binades (a 4 Mi-value block, repeated)."""
    rng = np.random.default_rng(seed)
    index = routed_index(rng, workload)
    rows = (workload.experts, workload.capacity) if workload.capacity else (workload.active_num or workload.tokens * workload.top_k,)
    # float32 sums round in any order; the narrow types need values over many binades to round in float32
    low, high = {"float16": (-10, 8), "bfloat16": (-20, 20)}.get(workload.dtype.name, (-4, 4))
    block = rng.standard_normal(1 << 22) * np.exp2(rng.integers(low, high + 1, 1 << 22))
    grad = np.resize(block.astype(np.float32).astype(workload.dtype), (*rows, workload.hidden))
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=index, top_k=workload.top_k,
                                            drop_pad_mode=1 if workload.capacity else 0, active_num=workload.active_num)


def candidates(call: moegrad.MoeInitRoutingV2GradCall, device: np.ndarray) -> dict[str, np.ndarray]:
    """``few`` (0.5% of the rows changed), ``sequential`` and ``float64`` (every row by order)."""
    sequential = moegrad.moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
    float64 = moegrad.moe_init_routing_v2_grad_golden(call).astype(device.dtype)
    few = device.copy()
    rows = np.arange(0, call.num_tokens, 200)
    few[rows[::2]] = sequential[rows[::2]]
    index = call.expanded_row_idx.reshape(-1, call.top_k)
    grad = call.grad_expanded_x.reshape(-1, call.hidden_size)
    for i in rows[1::2]:
        t = int(np.flatnonzero((index[i] >= 0) & (index[i] < grad.shape[0]))[0])
        few[i] = (device[i].astype(np.float32) - grad[index[i, t]].astype(np.float32)).astype(device.dtype)
    return {"few": few, "sequential": sequential, "float64": float64}


def _seconds(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def _peak(function) -> int:
    tracemalloc.start()
    try:
        function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure(workload: Workload, repeats: int) -> dict:
    call = wide_call(workload)
    device = moegrad.moe_init_routing_v2_grad(call)
    made = candidates(call, device)
    runs = {
        "grad": lambda: moegrad.moe_init_routing_v2_grad(call),
        "compare": lambda: moegrad.compare(call, made["few"], device_result=device),
        "explain few": lambda: moegrad.explain(call, made["few"], device_result=device),
        "explain order": lambda: moegrad.explain(call, made["sequential"], device_result=device),
        "explain float64": lambda: moegrad.explain(call, made["float64"], device_result=device),
    }
    for run in runs.values():
        run()  # warm
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(_seconds(run))
    medians = {name: statistics.median(values) for name, values in times.items()}
    shares = {name: moegrad.explain(call, made[name], device_result=device).differing_rows / call.num_tokens
              for name in ("few", "sequential", "float64")}
    peak = _peak(runs["explain order"])
    return {"call": call, "medians": medians, "shares": shares, "peak": peak,
            "reserved": moegrad.accuracy.explain_peak_bytes(call, device_result=True)}


def collector(repeats: int) -> str:
    """Explain of a call whose 65,536 rows all differ, with the collector on and off; a Markdown table."""
    rng = np.random.default_rng(0)
    tokens, top_k, hidden = 65536, 8, 16
    grad = (rng.standard_normal((tokens * top_k, hidden)) * np.exp2(rng.integers(-4, 4, (tokens * top_k, hidden))))
    call = moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad.astype(np.float32), top_k=top_k,
                                            expanded_row_idx=rng.permutation(tokens * top_k).astype(np.int32))
    device = moegrad.moe_init_routing_v2_grad(call)
    candidate = moegrad.moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
    moegrad.explain(call, candidate, device_result=device)  # warm
    times: dict[str, list[float]] = {"on": [], "off": []}
    collections: dict[str, int] = {"on": 0, "off": 0}
    for _ in range(repeats):
        for state in ("on", "off"):
            before = sum(generation["collections"] for generation in gc.get_stats())
            if state == "off":
                gc.disable()
            try:
                times[state].append(_seconds(lambda: moegrad.explain(call, candidate, device_result=device)))
            finally:
                gc.enable()
            collections[state] += sum(generation["collections"] for generation in gc.get_stats()) - before
            gc.collect()
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    rows = moegrad.explain(call, candidate, device_result=device).differing_rows
    return (
        "| collector | explain ms (median) | collections per explain |\n|---|---:|---:|\n"
        f"| on (as explain runs) | {on * 1e3:.0f} | {collections['on'] / repeats:.0f} |\n"
        f"| off (gc.disable around the call) | {off * 1e3:.0f} | {collections['off'] / repeats:.0f} |\n\n"
        f"{rows} of {tokens} rows differ (N = {tokens}, K = {top_k}, H = {hidden}, float32, the sequential order); "
        f"on / off = {on / off:.2f}; medians of {repeats} alternating rounds in one process."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.explain_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", choices=[w.name for w in WORKLOADS],
                        help="a workload to run (repeatable; default W1-W4)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the five runs per workload (default 5)")
    parser.add_argument("--collector", action="store_true",
                        help="measure the garbage collector's share instead (a 65,536-row call, every row differing)")
    parser.add_argument("--write", action="store_true", help="write bench/RESULTS.md's explain section")
    args = parser.parse_args(argv)
    if args.collector:
        moegrad.warm_up()
        text = collector(args.repeats)
        print(text)
        if args.write:
            write_section("explain-collector", "## moegrad.explain and Python's garbage collector\n\n"
                          f"`python -m bench.explain_speed --collector --repeats {args.repeats}` on {machine()}\n\n"
                          f"{text}")
        return 0
    names = args.workload or ["W1", "W2", "W3", "W4"]
    moegrad.warm_up()
    moegrad.accuracy.warm_up_compare()
    results = [(w, measure(w, args.repeats)) for w in WORKLOADS if w.name in names]
    met, lines = True, []
    lines.append("| workload | grad ms | compare ms | explain, 0.5% of rows differ: ms | / compare (<= 1.5) "
                 "| explain, the sequential order: ms (rows that differ) | / grad (<= 15) "
                 "| explain, the float64 sum: ms (rows that differ) | / grad |")
    lines.append("|---|---:|---:|---:|---|---:|---|---:|---:|")
    for workload, result in results:
        m, share = result["medians"], result["shares"]
        few = m["explain few"] / m["compare"]
        order = m["explain order"] / m["grad"]
        float64 = m["explain float64"] / m["grad"]
        ok_few, ok_order = few <= FEW_TARGET, order <= ORDER_TARGET
        met &= ok_few and ok_order
        lines.append(
            f"| {workload.name} ({workload.describe()}) | {m['grad'] * 1e3:.1f} | {m['compare'] * 1e3:.0f} | "
            f"{m['explain few'] * 1e3:.0f} | {few:.2f}x {'met' if ok_few else 'NOT met'} | "
            f"{m['explain order'] * 1e3:.0f} ({share['sequential']:.0%}) | {order:.1f}x {'met' if ok_order else 'NOT met'} | "
            f"{m['explain float64'] * 1e3:.0f} ({share['float64']:.0%}) | {float64:.1f}x |")
    lines.append(f"\nMedians of {args.repeats} rounds in one process, the five runs alternating; every explain is "
                 "given the device's result, as compare is. W2 has K = 2: no order of two adds differs.\n")
    lines.append("| workload | traced peak of explain, sequential order: MiB | explain_peak_bytes: MiB | within |")
    lines.append("|---|---:|---:|---|")
    for workload, result in results:
        within = result["peak"] <= result["reserved"]
        met &= within
        lines.append(f"| {workload.name} | {result['peak'] / 2**20:.1f} | {result['reserved'] / 2**20:.1f} | "
                     f"{'yes' if within else 'NO'} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        command = "python -m bench.explain_speed" + "".join(f" --workload {n}" for n in args.workload or []) + \
            f" --repeats {args.repeats}"
        write_section("explain", "## moegrad.explain beside compare and the grad call (targets: 1.5x compare, 15x "
                      f"the grad call)\n\n`{command}` on {machine()}\n\n{text}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
