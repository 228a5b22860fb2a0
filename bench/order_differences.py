"""How many grad_x elements differ between the A2/A3 order and the Ascend 950 order, per K.

Run: ``.venv/bin/python bench/order_differences.py [--tokens N] [--hidden H] [--seed S]``

Standard-normal float32 gradients (and the same values rounded to bfloat16), a random dropless
permutation index, the 950's default platform (UB 253952 bytes, 64 vector cores). Prints a Markdown
table: per K, the 950 template and K chunk, and for each dtype the count (and share) of elements
whose bits differ between ``order="ascend910b"`` and ``order="ascend950"``, plus, for reference,
between ``"ascend950"`` and ``"sequential"``. docs/semantics.md section 7.6 shows its output.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from moegrad import ascend950_tiling, moe_init_routing_v2_grad

KS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 127, 128, 129, 130, 256]
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_UINT = {2: np.uint16, 4: np.uint32}


def differing(a: np.ndarray, b: np.ndarray) -> int:
    """Elements whose bits differ (NaN never occurs with these inputs)."""
    return int((a.view(_UINT[a.itemsize]) != b.view(_UINT[b.itemsize])).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    size = args.tokens * args.hidden
    print(f"N = {args.tokens} tokens, H = {args.hidden}, standard-normal values, seed {args.seed}; "
          f"{size} elements per cell\n")
    print("| K | 950 template (K chunk) | float32: 910b vs 950 | bfloat16: 910b vs 950 | float32: 950 vs sequential |")
    print("|---|---|---|---|---|")
    for top_k in KS:
        values = rng.standard_normal((args.tokens * top_k, args.hidden)).astype(np.float32)
        idx = rng.permutation(args.tokens * top_k).astype(np.int32)
        tiling = ascend950_tiling("float32", args.tokens, top_k, args.hidden)
        cells = []
        for dtype in DTYPES.values():
            grad = values.astype(dtype)
            a2 = moe_init_routing_v2_grad(grad, idx, top_k)
            a950 = moe_init_routing_v2_grad(grad, idx, top_k, order="ascend950")
            count = differing(a2, a950)
            cells.append(f"{count} ({100 * count / size:.1f}%)")
        a950 = moe_init_routing_v2_grad(values, idx, top_k, order="ascend950")
        count = differing(a950, moe_init_routing_v2_grad(values, idx, top_k, order="sequential"))
        cells.append(f"{count} ({100 * count / size:.1f}%)")
        print(f"| {top_k} | {tiling.template} ({tiling.k_chunk}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
