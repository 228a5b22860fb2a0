"""The service's memory, in one place: what requests may hold, where bodies and results are kept.

- :mod:`~moegrad_service.memory.budget`: the in-flight byte budget (:class:`MemoryBudget`).
- :mod:`~moegrad_service.memory.buffers`: the receive buffers kept inside it for the next body of
  their size and lent for large results (:class:`ReceiveBuffers`).
- :mod:`~moegrad_service.memory.heap`: trimming the C heap once the service is quiet (:class:`HeapTrimmer`).
- :mod:`~moegrad_service.memory.allocator`: the C library's allocator settings (``mallopt``).
- :mod:`~moegrad_service.memory.peaks`: what answering one request holds at its peak, from its
  decoded shapes (:class:`Peak`, :func:`call_peak`, :func:`compare_peak`,
  :func:`explain_peak`, :func:`batch_peak`).
- :mod:`~moegrad_service.memory.admission`: the three together (:class:`Memory`, which the app builds
  and hands to the dataplane) and what one admitted request holds of them (:class:`Admission`).
"""

from moegrad_service.memory.admission import Admission, Memory
from moegrad_service.memory.allocator import MMAP_THRESHOLD_BYTES, map_large_allocations
from moegrad_service.memory.budget import MemoryBudget
from moegrad_service.memory.buffers import REUSE_MIN_BYTES, Loan, ReceiveBuffers
from moegrad_service.memory.heap import HeapTrimmer, trim_heap
from moegrad_service.memory.peaks import (
    JSON_HOLD_PER_BODY_BYTE,
    Peak,
    batch_peak,
    call_peak,
    compare_peak,
    explain_peak,
)

__all__ = [
    "JSON_HOLD_PER_BODY_BYTE",
    "MMAP_THRESHOLD_BYTES",
    "REUSE_MIN_BYTES",
    "Admission",
    "HeapTrimmer",
    "Loan",
    "Memory",
    "MemoryBudget",
    "Peak",
    "ReceiveBuffers",
    "batch_peak",
    "call_peak",
    "compare_peak",
    "explain_peak",
    "map_large_allocations",
    "trim_heap",
]
