"""A module of two tiny numba kernels for the tests of numba's on-disk cache counters
(:class:`moegrad.KernelCache`), which compile in about a second where moegrad's own take minutes.

``add_one`` is cached on disk (``cache=True``) and calls ``_double``, which is not; run as a
script (``python -m support.tiny_kernels``, NUMBA_CACHE_DIR set), it warms the module up through
the service's start-up logging and prints the log line: a first run in an empty cache folder
compiles, the next loads from the folder.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
from numba import njit

__all__ = ["add_one", "warm_up"]


@njit
def _double(x):
    return x * 2


@njit(cache=True)
def add_one(values):
    """``2 * values + 1``, elementwise (float64)."""
    out = np.empty_like(values)
    for i in range(values.size):
        out[i] = _double(values[i]) + 1.0
    return out


def warm_up() -> bool:
    """Call the kernel once (compiling it, or loading it from numba's cache); True."""
    assert add_one(np.arange(3.0)).tolist() == [1.0, 3.0, 5.0]
    return True


if __name__ == "__main__":
    from moegrad.numerics._fast import CompiledModule
    from moegrad_service.engine.compiling import warm_up_logged

    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    module = CompiledModule(__name__)
    module.load()
    warm_up_logged(logging.getLogger("tiny"), "the tiny kernel", warm_up, module.cache, waiting="a second")
    print(module.cache())
