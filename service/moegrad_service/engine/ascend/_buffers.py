"""Host arrays in the layout the device wants, and the device buffers a worker keeps between calls."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from moegrad import DTYPES, AclnnStatus, InvalidArgument, dtype_name
from moegrad_service.engine.ascend._abi import ACL_DATA_TYPES

#: Device buffers are sized in multiples of this many bytes (CANN pads allocations to 32 bytes).
ALIGN_BYTES = 32


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN_BYTES`."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def host_array(array: object, field_name: str) -> tuple[np.ndarray, int]:
    """A C-contiguous little-endian copy (or the array itself when it already is one) and its aclDataType.

    Raises:
        InvalidArgument: not an ndarray, or a dtype outside :data:`ACL_DATA_TYPES` (161002).
    """
    if not isinstance(array, np.ndarray):
        raise InvalidArgument(
            f"{field_name} must be a numpy.ndarray, got {type(array).__name__}",
            aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID,
            field=field_name,
        )
    name = dtype_name(array.dtype)
    if name is None:
        raise InvalidArgument(
            f"{field_name}.dtype={array.dtype} has no aclDataType in this binding (one of {', '.join(ACL_DATA_TYPES)})",
            aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID,
            field=field_name,
        )
    return np.ascontiguousarray(array, dtype=DTYPES[name]), ACL_DATA_TYPES[name]


class BufferCache:
    """Free device buffers of one stream, by size (least recently returned size evicted first)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.bytes = 0
        self._free: OrderedDict[int, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return sum(map(len, self._free.values()))

    def take(self, size: int) -> int | None:
        pointers = self._free.get(size)
        if not pointers:
            return None
        pointer = pointers.pop()
        if not pointers:
            del self._free[size]
        self.bytes -= size
        return pointer

    def give(self, size: int, pointer: int) -> list[int]:
        """Keep ``pointer``; returns the buffers evicted to stay under the limit (the caller frees them)."""
        self._free.setdefault(size, []).append(pointer)
        self._free.move_to_end(size)
        self.bytes += size
        evicted = []
        while self.bytes > self.limit_bytes:
            oldest, pointers = next(iter(self._free.items()))
            evicted.append(pointers.pop(0))
            self.bytes -= oldest
            if not pointers:
                del self._free[oldest]
        return evicted

    def drain(self) -> list[int]:
        pointers = [p for ps in self._free.values() for p in ps]
        self._free.clear()
        self.bytes = 0
        return pointers


@dataclass(eq=False)
class Retired:
    """A stream whose kernel missed its deadline, and the device memory that kernel may still use."""

    stream: int
    pointers: list[int]


@dataclass(eq=False)
class Lease:
    """The device buffers one call holds: (size, pointer) pairs; ``retired`` once its stream is set aside."""

    blocks: list[tuple[int, int]] = field(default_factory=list)
    retired: bool = False
