"""moegrad.torch's operator on the CPU: its cost over the NumPy call, and torch's own ways to sum the rows.

Run: ``python -m bench.torch_op [--repeats N] [--workloads W1,W2,...]``; prints a markdown table.

For each workload W1-W4 (bench/kernel.py builds the same inputs), in turns so that every method
sees the same machine load, best time of ``--repeats``:

- ``numpy``: ``moegrad.moe_init_routing_v2_grad`` on the arrays (validation + the compiled kernel);
- ``op``: ``torch.ops.moegrad.moe_init_routing_grad`` on tensors over the same memory (the same
  work plus the tensor <-> array views); overhead = op / numpy - 1, target at most 10%;
- ``index_add_``: torch's scatter-add, ``grad_x.index_add_(0, token_of_row, rows)``, with the row ->
  token map and the used rows' index made beforehand (not bit-exact: torch's order of adds);
- ``gather-sum``: ``rows[idx.view(N, K)].sum(1)``, skipped slots pointed at row 0 beforehand (it
  times the gather and the sum only; not bit-exact either).

torch runs with its default intra-op threads, moegrad with its own pool; both are printed.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import moegrad
import moegrad.torch  # noqa: F401  (registers torch.ops.moegrad)
from bench.kernel import WORKLOADS, build
from moegrad.torch import to_numpy, to_torch
from moegrad.numerics import kernel_threads

__all__ = ["main"]


def _times(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure(workload, repeats: int) -> dict:
    call = build(workload)
    grad_np, idx_np = call.grad_expanded_x, call.expanded_row_idx
    k, mode, active = call.top_k, call.drop_pad_mode, call.active_num
    grad = to_torch(grad_np, torch.empty(0))  # the same memory, as a tensor
    idx = torch.from_numpy(idx_np)
    rows = grad.reshape(-1, grad.shape[-1])
    used = (idx >= 0) & (idx < rows.shape[0])
    slots = torch.arange(idx.numel())
    used_rows, token_of_row = idx[used].long(), slots[used] // k
    safe = torch.where(used, idx, 0).long().view(-1, k)
    out = torch.zeros(call.num_tokens, rows.shape[1], dtype=rows.dtype)
    methods = {
        "numpy": lambda: moegrad.moe_init_routing_v2_grad(grad_np, idx_np, k, mode, active),
        "op": lambda: torch.ops.moegrad.moe_init_routing_grad(grad, idx, k, mode, active),
        "index_add_": lambda: out.zero_().index_add_(0, token_of_row, rows.index_select(0, used_rows)),
        "gather-sum": lambda: rows[safe].sum(1),
    }
    want = methods["numpy"]()
    same_bits = bool(np.array_equal(to_numpy(methods["op"]()).view(np.uint8), want.view(np.uint8)))
    samples: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for rep in range(repeats):  # in turns: every method sees the same load; numpy and op swap places each turn
        for name in (names if rep % 2 == 0 else [names[1], names[0], *names[2:]]):
            samples[name] += _times(methods[name], 1)
    best = {name: min(values) for name, values in samples.items()}
    return {"workload": workload, "best": best, "same_bits": same_bits}


def fixed_cost_us(calls: int = 300) -> tuple[float, float]:
    """Best per-call time of a tiny call (N=4, K=2, H=8 float32), NumPy vs op: the op's own fixed cost."""
    grad_np = np.ones((8, 8), np.float32)
    idx_np = np.arange(8, dtype=np.int32)
    grad, idx = torch.from_numpy(grad_np), torch.from_numpy(idx_np)
    numpy_s = min(_times(lambda: moegrad.moe_init_routing_v2_grad(grad_np, idx_np, 2), calls))
    op_s = min(_times(lambda: torch.ops.moegrad.moe_init_routing_grad(grad, idx, 2), calls))
    return numpy_s * 1e6, op_s * 1e6


def table(results: list[dict]) -> str:
    lines = [
        "| workload | shape | moegrad NumPy call (ms) | moegrad.torch op (ms) | op overhead | torch index_add_ (ms) "
        "| torch gather-sum (ms) | op bits = NumPy bits |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        b, w = r["best"], r["workload"]
        lines.append(
            f"| {w.name} | {w.describe()} | {b['numpy'] * 1e3:.1f} | {b['op'] * 1e3:.1f} | "
            f"{(b['op'] / b['numpy'] - 1) * 100:+.1f}% | {b['index_add_'] * 1e3:.1f} | {b['gather-sum'] * 1e3:.1f} | "
            f"{'yes' if r['same_bits'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.torch_op", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="turns per workload (best time is kept; default 5)")
    parser.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS),
                        help="comma-separated workload names (default: all)")
    args = parser.parse_args(argv)
    chosen = [w for w in WORKLOADS if w.name in args.workloads.split(",")]
    compiled = moegrad.warm_up()
    results = [measure(w, args.repeats) for w in chosen]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; moegrad pool "
          f"{kernel_threads()} threads, compiled kernel: {'yes' if compiled else 'no (NumPy path)'}; "
          f"{len(os.sched_getaffinity(0))} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
          f"best of {args.repeats}\n")
    print(table(results))
    numpy_us, op_us = fixed_cost_us()
    print(f"\nFixed cost per call (N=4 K=2 H=8 float32, best of 300): NumPy {numpy_us:.0f} us, op {op_us:.0f} us.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
