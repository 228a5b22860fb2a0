"""How long MoeInitRoutingV2GradCall takes to validate a 100M-element int32 index (rule 7 dominates).

Run: ``.venv/bin/python bench/validate_index.py [--elements N] [--repeat R]``

Three indices of the same length, all valid dropless inputs (a permutation of [0, N*K)):
- ``routing``: what a forward routing produces (tokens' slots grouped by expert, E streams);
- ``sorted``: the identity (the best case for memory locality);
- ``random``: a uniformly random permutation (the worst case: every write misses the cache).
grad_expanded_x is [N*K, 0] float32 so that no memory goes to it; validation never reads its data.
Prints the best of ``repeat`` runs per index, in seconds, and the machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from moegrad import MoeInitRoutingV2GradCall


def routing_index(tokens: int, top_k: int, experts: int, rng: np.random.Generator) -> np.ndarray:
    """expanded_row_idx of a dropless forward routing: slot i*K+t -> its rank in the stable expert sort."""
    expert_ids = np.empty((tokens, top_k), dtype=np.int32)
    for t in range(top_k):  # distinct experts per token: offsets into a random shift, no [N, E] table
        expert_ids[:, t] = t
    expert_ids += rng.integers(0, experts, size=(tokens, 1), dtype=np.int32)
    expert_ids %= experts
    order = np.argsort(expert_ids.reshape(-1), kind="stable")  # expanded position p holds flat slot order[p]
    index = np.empty(order.size, dtype=np.int32)
    index[order] = np.arange(order.size, dtype=np.int32)
    return index


def best_of(repeat: int, grad: np.ndarray, index: np.ndarray, top_k: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        MoeInitRoutingV2GradCall(grad_expanded_x=grad, expanded_row_idx=index, top_k=top_k)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=100_000_000, help="len(expanded_row_idx); a multiple of 8")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    top_k, experts = 8, 64
    count = args.elements - args.elements % top_k
    rng = np.random.default_rng(0)
    grad = np.empty((count, 0), dtype=np.float32)
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, numpy {np.__version__}")
    print(f"index: {count} int32 elements, top_k={top_k}, dropless")
    for name, make in (
        ("routing", lambda: routing_index(count // top_k, top_k, experts, rng)),
        ("sorted", lambda: np.arange(count, dtype=np.int32)),
        ("random", lambda: rng.permutation(count).astype(np.int32)),
    ):
        index = make()
        seconds = best_of(args.repeat, grad, index, top_k)
        print(f"{name:8s} validate {seconds:.3f} s  ({count / seconds / 1e6:.0f} M elements/s)")
        del index


if __name__ == "__main__":
    main()
