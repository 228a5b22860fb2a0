"""What moegrad.shrink costs on a 448 MiB call: candidate calls, smaller calls kept, and time.

Run: ``.venv/bin/python -m bench.shrink_speed [--repeats R]``

The call is DeepSeek-V3's routing backward (bench.kernel's W1: N=4096, K=8, H=7168 bfloat16
dropless, 256 experts; grad_expanded_x 448 MiB), with fresh standard-normal gradients. The candidate
is the ascend910b@9.1 emulation with one planted fault: the last token's slot 5 is left out (an
off-by-one in a tail tile), so exactly one row of grad_x differs. Timed side by side in this
process: one candidate call and one ``moegrad.explain`` of its result on the whole call (what each
shrink test costs at the start), then ``moegrad.shrink`` (median of R runs, the candidate's own
time shown apart), and the reproducer it saves, run as a script in a subprocess (it must exit 1:
the fault reproduces). The first shrink also prints the smaller calls it kept.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import moegrad
from bench.kernel import WORKLOADS, routed_index

FAULTY_SLOT = 5


class TailDrop:
    """The ascend910b@9.1 emulation, the last token's slot 5 left out; sums the seconds spent inside."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
        start = time.perf_counter()
        try:
            grad_x = moegrad.moe_init_routing_v2_grad(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode,
                                                      active_num)
            if top_k > FAULTY_SLOT:
                last = expanded_row_idx.size // top_k - 1
                rows = grad_expanded_x[expanded_row_idx[last * top_k:(last + 1) * top_k]]  # dropless: a copy
                rows[FAULTY_SLOT] = 0  # left out: +0.0 in its place
                grad_x[last] = moegrad.moe_init_routing_v2_grad(rows, np.arange(top_k, dtype=np.int32), top_k)[0]
            return grad_x
        finally:
            self.seconds += time.perf_counter() - start


def build_call() -> moegrad.MoeInitRoutingV2GradCall:
    """W1 with fresh standard-normal gradients (every row its own values)."""
    workload = WORKLOADS[0]
    rng = np.random.default_rng(0)
    index = routed_index(rng, workload)
    grad = np.empty((workload.tokens * workload.top_k, workload.hidden), dtype=workload.dtype)
    for start in range(0, grad.shape[0], 1024):
        block = grad[start:start + 1024]
        block[...] = rng.standard_normal(block.shape, dtype=np.float32).astype(workload.dtype)
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=index, top_k=workload.top_k)


def one_test_ms(call: moegrad.MoeInitRoutingV2GradCall) -> tuple[float, float]:
    """(one candidate call, one explain of its result) on the whole call, in ms, warm."""
    candidate = moegrad.Candidate(TailDrop(), accepts="numpy")
    grad_x = candidate(call)
    moegrad.explain(call, grad_x)
    start = time.perf_counter()
    grad_x = candidate(call)
    middle = time.perf_counter()
    explanation = moegrad.explain(call, grad_x)
    end = time.perf_counter()
    assert explanation.differing_rows == 1 and explanation.rows[0].label == "missing", explanation
    return (middle - start) * 1e3, (end - middle) * 1e3


def run_reproducer(result: moegrad.ShrinkResult) -> tuple[float, int]:
    """Save the reproducer, run its script; (seconds, exit status)."""
    with tempfile.TemporaryDirectory() as folder:
        _, script = result.save(folder)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
        return time.perf_counter() - start, done.returncode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.shrink_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    call = build_call()
    size = call.grad_expanded_x.nbytes / 2**20
    candidate_ms, explain_ms = one_test_ms(call)
    runs = []
    for _ in range(args.repeats):
        timed = TailDrop()
        result = moegrad.shrink(call, moegrad.Candidate(timed, accepts="numpy"))
        assert (result.label, result.call.num_tokens) == ("missing", 1), result
        runs.append((result, timed.seconds))
    first = runs[0][0]
    script_s, status = run_reproducer(first)
    assert status == 1, f"the reproducer exited {status}, not 1 (the fault reproduces)"
    seconds = statistics.median(result.seconds for result, _ in runs)
    inside = statistics.median(inside for _, inside in runs)
    print(f"Call: {first.original} ({size:.0f} MiB); candidate: the ascend910b@9.1 emulation with the last "
          f"token's slot {FAULTY_SLOT} left out. Median of {args.repeats} shrinks. A candidate call includes the "
          "fresh copy of the inputs moegrad.Candidate hands a callable; the shrink's candidate calls count its "
          "first, on the whole call, and its final check.\n")
    print("| one candidate call, whole call | one explain, whole call | shrink: candidate calls | smaller calls kept "
          "| shrink wall s (inside the candidate) | shrunk call | reproducer script s (exit) |")
    print("|---:|---:|---:|---:|---|---|---|")
    print(f"| {candidate_ms:.0f} ms | {explain_ms:.0f} ms | {first.tests} | {len(first.history)} | {seconds:.2f} "
          f"({inside:.2f}) | {first.size}, row {first.row} {first.label} slot {first.slot} | {script_s:.2f} "
          f"({status}) |")
    print("\nThe smaller calls kept by the first shrink (candidate calls made so far, then the call):\n")
    for step in first.history:
        print(f"- {step.phase}: {step.tests} calls, {step.size}")


if __name__ == "__main__":
    main()
