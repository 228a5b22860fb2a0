"""How many grad_x elements differ between the device profiles' arithmetic, per K.

Run: ``.venv/bin/python -m bench.order_differences [--tokens N] [--hidden H] [--seed S] [--write]``

Standard-normal float32 gradients (and the same values rounded to bfloat16), a random dropless
permutation index, the 950's default platform (UB 253952 bytes, 64 vector cores). Every profile of
:data:`moegrad.PROFILES` is computed for every K and dtype; profiles whose bits are identical on
every one of these inputs are one group (they share their arithmetic here, and the output says so).
Prints a Markdown table: per K, the 950 template and K chunk, and for each pair of groups the count
(and share) of float32 elements whose bits differ, plus the most any pair differs in bfloat16.
``--write`` also puts the output into docs/semantics.md, between its ``order-differences`` markers.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import ml_dtypes
import numpy as np

from bench._results import write_section
from moegrad import PROFILES, ascend950_tiling, moe_init_routing_v2_grad

KS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 127, 128, 129, 130, 256]
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
SEMANTICS = Path(__file__).resolve().parent.parent / "docs" / "semantics.md"
_UINT = {2: np.uint16, 4: np.uint32}


def differing(a: np.ndarray, b: np.ndarray) -> int:
    """Elements whose bits differ (NaN never occurs with these inputs)."""
    return int((a.view(_UINT[a.itemsize]) != b.view(_UINT[b.itemsize])).sum())


def _groups(results: dict[str, list[np.ndarray]]) -> list[list[str]]:
    """Profiles whose results are bit-identical on every input, in PROFILES order."""
    groups: list[list[str]] = []
    for name, arrays in results.items():
        for group in groups:
            if all(differing(a, b) == 0 for a, b in zip(arrays, results[group[0]], strict=True)):
                group.append(name)
                break
        else:
            groups.append([name])
    return groups


def _label(group: list[str]) -> str:
    return group[0] if len(group) == 1 else f"{group[0]} (+{len(group) - 1})"


def table(tokens: int, hidden: int, seed: int) -> str:
    """The whole output: the groups, then the table."""
    rng = np.random.default_rng(seed)
    size = tokens * hidden
    results: dict[str, list[np.ndarray]] = {name: [] for name in PROFILES}
    for top_k in KS:
        values = rng.standard_normal((tokens * top_k, hidden)).astype(np.float32)
        idx = rng.permutation(tokens * top_k).astype(np.int32)
        for dtype in DTYPES.values():
            grad = values.astype(dtype)
            for name in PROFILES:
                results[name].append(moe_init_routing_v2_grad(grad, idx, top_k, order=name))
    groups = _groups(results)
    pairs = list(itertools.combinations(groups, 2))
    lines = [
        f"N = {tokens} tokens, H = {hidden}, standard-normal values, seed {seed}; {size} elements per cell.",
        "",
        "Profiles with bit-identical results on every input here (one column group each): "
        + "; ".join("{" + ", ".join(group) + "}" for group in groups)
        + ".",
        "",
        "| K | 950 template (K chunk) | "
        + " | ".join(f"float32: {_label(a)} vs {_label(b)}" for a, b in pairs)
        + " | bfloat16: most of any pair |",
        "|---|---|" + "---|" * (len(pairs) + 1),
    ]
    for step, top_k in enumerate(KS):
        tiling = ascend950_tiling("float32", tokens, top_k, hidden)
        f32, bf16 = 2 * step, 2 * step + 1
        cells = [differing(results[a[0]][f32], results[b[0]][f32]) for a, b in pairs]
        most_bf16 = max((differing(results[a[0]][bf16], results[b[0]][bf16]) for a, b in pairs), default=0)
        shown = [f"{count} ({100 * count / size:.1f}%)" for count in [*cells, most_bf16]]
        lines.append(f"| {top_k} | {tiling.template} ({tiling.k_chunk}) | " + " | ".join(shown) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.order_differences", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="also write the output into docs/semantics.md")
    args = parser.parse_args(argv)
    output = table(args.tokens, args.hidden, args.seed)
    print(output, end="")
    if args.write:
        command = "python -m bench.order_differences" + (
            "" if (args.tokens, args.hidden, args.seed) == (1024, 64, 0)
            else f" --tokens {args.tokens} --hidden {args.hidden} --seed {args.seed}"
        )
        write_section("order-differences", f"Generated with `{command} --write`:\n\n{output}", path=SEMANTICS)


if __name__ == "__main__":
    main()
