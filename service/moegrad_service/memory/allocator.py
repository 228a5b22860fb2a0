"""The C library's allocator settings that the server fixes at startup (``moegrad-service serve``)."""

from __future__ import annotations

import ctypes
import os

__all__ = ["MMAP_THRESHOLD_BYTES", "map_large_allocations"]

#: Allocations from this size up get pages of their own, given back to the OS when freed (glibc's
#: M_MMAP_THRESHOLD, fixed: by default glibc raises it after each large free, up to 32 MiB, so that
#: request bodies and tensors end up in the heap, whose freed pages stay resident).
MMAP_THRESHOLD_BYTES = 4 << 20
_M_MMAP_THRESHOLD = -3  # malloc.h


def map_large_allocations() -> None:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES (not when MALLOC_MMAP_THRESHOLD_ is set,
    nor on a C library without ``mallopt``): RSS returns to its settled size after large calls."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
