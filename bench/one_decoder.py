"""The v1 msgpack decoder before and after issue 36's "one v1 decoder", side by side in one run.

Before: the service's own in-place reader, ``decode_call_body`` of
``service/moegrad_service/api/v1/msgpack_view.py`` at a commit that still had it (read with
``git show``, default 52d9293). After: the client package's :func:`moegrad.wire.decode_body` with
``min_view_bytes=VIEW_MIN_BYTES``, as the v1 route calls it. The same body (kept in a bytearray, as
the server's receive buffer) is decoded by each in turn, interleaved; medians in microseconds.

    python -m bench.one_decoder [--before 52d9293] [--rounds 400]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np

from moegrad import REQUEST_LIMITS
from moegrad.wire import VIEW_MIN_BYTES, decode_body

OLD_PATH = "service/moegrad_service/api/v1/msgpack_view.py"
CASES = {"S1 N=8 K=2 H=16": (8, 2, 16), "S2 N=1024 K=8 H=1024": (1024, 8, 1024),
         "DeepSeek N=4096 K=8 H=7168": (4096, 8, 7168)}  # fmt: skip


def old_decoder(commit: str):
    """``decode_call_body`` of the service at ``commit``."""
    source = subprocess.run(["git", "show", f"{commit}:{OLD_PATH}"], check=True, capture_output=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_msgpack_view.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("old_msgpack_view", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode_call_body


def body(tokens: int, top_k: int, hidden: int) -> bytearray:
    """A bfloat16 call's msgpack body (zero grad, a permutation of the slots)."""
    index = np.random.default_rng(0).permutation(tokens * top_k).astype("<i4")
    document = {"grad_expanded_x": {"dtype": "bfloat16", "shape": [tokens * top_k, hidden],
                                    "data": bytes(tokens * top_k * hidden * 2)},
                "expanded_row_idx": {"dtype": "int32", "shape": [tokens * top_k], "data": index.tobytes()},
                "top_k": top_k}  # fmt: skip
    return bytearray(msgpack.packb(document, use_bin_type=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="52d9293", help="a commit whose service still had msgpack_view.py")
    parser.add_argument("--rounds", type=int, default=400, help="rounds per small body (large bodies: 50)")
    args = parser.parse_args()
    before = old_decoder(args.before)
    print(f"before: {OLD_PATH} at {args.before}; after: moegrad.wire.decode_body; Python {sys.version.split()[0]}")
    print("| body | bytes | before (us) | after (us) | after / before |\n|---|---|---|---|---|")
    for name, shape in CASES.items():
        data = body(*shape)
        rounds = args.rounds if len(data) < 1 << 20 else 50
        after = functools.partial(decode_body, min_view_bytes=VIEW_MIN_BYTES)
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(rounds):
            for spent, decode in zip(times, (before, after), strict=True):
                start = time.perf_counter()
                decode(data, REQUEST_LIMITS)
                spent.append(time.perf_counter() - start)
        old, new = (statistics.median(spent) * 1e6 for spent in times)
        print(f"| {name} | {len(data):,} | {old:.1f} | {new:.1f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
