"""The invalid-slot boundaries of every device profile, written from the kernels' public sources.

The research table of issue 29 (docs/semantics.md's profile table cites the commits): the A2/A3
kernel (op_kernel/*.h, every release) and the 950 kernel before 9.1 (arch35 @ a5d6f9dc, 8c1f71ff)
skip -1 in drop/pad mode and an index >= A in active mode, and read any other index outside
[0, rows) outside their buffer (undefined: refused, 161002); the 950 at 9.1 (arch35 @ 49e0de82)
makes any negative index, an active index >= A and a dropless index >= N*K a row of +0.0
(accepted), and still reads a drop/pad index >= E*C outside its buffer. Nothing here imports
moegrad.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ACTIVE", "BASE", "BOUNDARIES", "CAPACITY", "EXPERTS", "HIDDEN", "LENIENT", "TOKENS", "TOP_K",
           "boundary_call"]

LENIENT = "ascend950@9.1"  # the one profile whose kernel defines the slots the others refuse
TOKENS, TOP_K, HIDDEN = 3, 2, 5  # N*K = 6
ACTIVE = 4  # A
EXPERTS, CAPACITY = 2, 4  # E*C = 8
BASE = {
    "dropless": [3, 0, 5, 1, 4, 2],
    "active": [3, 0, 5, 1, 4, 2],  # 4 and 5 are >= A: skipped on every profile
    "drop_pad": [0, -1, 7, 2, -1, 5],
}
#: (mode, boundary, the value in slot 2, accepted before 9.1 and on A2/A3, accepted on ascend950@9.1)
BOUNDARIES = [
    ("dropless", "-1", -1, False, True),
    ("dropless", "-5", -5, False, True),
    ("dropless", "N*K", 6, False, True),
    ("dropless", "N*K-1", 5, True, True),
    ("dropless", "int32 min", -(2**31), False, True),
    ("dropless", "int32 max", 2**31 - 1, False, True),
    ("active", "-1", -1, False, True),
    ("active", "-5", -5, False, True),
    ("active", "N*K", 6, False, True),
    ("active", "N*K-1", 5, True, True),
    ("active", "A", ACTIVE, True, True),
    ("active", "A-1", ACTIVE - 1, True, True),
    ("drop_pad", "-1", -1, True, True),
    ("drop_pad", "-5", -5, False, True),
    ("drop_pad", "E*C", 8, False, False),
    ("drop_pad", "E*C-1", 7, True, True),
    ("drop_pad", "int32 max", 2**31 - 1, False, False),
]


def boundary_call(mode: str, value: int, slot: int = 2, dtype=np.float32, seed: int = 0) -> dict:
    """The keyword arguments of the mode's base call with ``value`` in ``slot`` (swapped with the slot
    holding it, if any, so that no other index repeats); grad_expanded_x standard normal."""
    idx = np.array(BASE[mode], dtype=np.int64)
    if value in idx.tolist() and value >= 0:
        other = idx.tolist().index(value)
        idx[other] = idx[slot]
    idx[slot] = value
    rows = {"dropless": (TOKENS * TOP_K,), "active": (ACTIVE,), "drop_pad": (EXPERTS, CAPACITY)}[mode]
    rng = np.random.default_rng(seed)
    grad = rng.standard_normal((*rows, HIDDEN)).astype(dtype)
    return {"grad_expanded_x": grad, "expanded_row_idx": idx.astype(np.int32), "top_k": TOP_K,
            "drop_pad_mode": int(mode == "drop_pad"), "active_num": ACTIVE if mode == "active" else 0}
