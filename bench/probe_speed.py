"""What the order probe costs: candidate calls and time per K and dtype (moegrad.probe_order).

Run: ``.venv/bin/python -m bench.probe_speed [--repeats R]``

The candidate is the in-process emulation of the default profile (``moegrad.moe_init_routing_v2_grad``,
ascend910b@9.1), wrapped to time its own calls, so each cell splits the probe's wall time into the
candidate's share and the harness's (building probes, rebuilding and checking the tree, naming the
profiles). Two shapes: the harness's default (H = 64, N just large enough that all K(K-1)/2 pairs
fit one call), and a fixed small shape [N = 4, H = 16] (64 pairs per call), as when a caller asks
for the shape its kernel tiles by. Every probe must name ascend910b@9.1; the median of R runs is
shown (the first, which compiles and caches, is not counted).
"""

from __future__ import annotations

import argparse
import statistics
import time

import moegrad
from moegrad import Candidate, probe_order

KS = [2, 3, 4, 7, 8, 16, 17, 32, 33, 64, 65, 127, 128, 129, 130]
DTYPES = ["float32", "float16", "bfloat16"]
SMALL = {"num_tokens": 4, "hidden_size": 16}


class Timed:
    """The emulation as a candidate, summing the seconds spent inside it."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, grad_expanded_x, expanded_row_idx, top_k, *, drop_pad_mode=0, active_num=0):
        start = time.perf_counter()
        try:
            return moegrad.moe_init_routing_v2_grad(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num)
        finally:
            self.seconds += time.perf_counter() - start


def measure(top_k: int, dtype: str, repeats: int, **shape) -> tuple[int, float, float, int]:
    """(candidate calls, median wall ms, median ms inside the candidate, N) of ``repeats`` probes."""
    walls, inside, calls, tokens = [], [], 0, 0
    for attempt in range(repeats + 1):
        timed = Timed()
        candidate = Candidate(timed, accepts="numpy")
        start = time.perf_counter()
        probe = probe_order(candidate, top_k, dtype, **shape)
        wall = time.perf_counter() - start
        assert "ascend910b@9.1" in probe.profiles, probe
        calls, tokens = probe.calls, probe.num_tokens
        if attempt:  # the first run warms caches (the kernel's compilation, the profiles' trees)
            walls.append(wall * 1e3)
            inside.append(timed.seconds * 1e3)
    return calls, statistics.median(walls), statistics.median(inside), tokens


def cell(calls: int, wall_ms: float, inside_ms: float, tokens: int = 0) -> str:
    return f"{calls}, {wall_ms:.1f} ({inside_ms:.1f})"


def table(repeats: int) -> str:
    lines = [
        f"Candidate: the ascend910b@9.1 emulation in-process; median of {repeats} probes after one warm-up. Each "
        "cell: candidate calls, probe wall time in ms (of which inside the candidate).",
        "",
        "| K | pairs | default shape [N, 64] | float32 | float16 | bfloat16 | [4, 16] float32 |",
        "|---:|---:|---|---|---|---|---|",
    ]
    for top_k in KS:
        measured = [measure(top_k, dtype, repeats) for dtype in DTYPES]
        small = cell(*measure(top_k, "float32", repeats, **SMALL))
        lines.append(f"| {top_k} | {top_k * (top_k - 1) // 2} | [{measured[0][3]}, 64] | "
                     + " | ".join(cell(*each) for each in measured) + f" | {small} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.probe_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(table(args.repeats), end="")


if __name__ == "__main__":
    main()
