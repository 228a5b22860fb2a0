"""The numerics: each device profile's arithmetic emulated bit for bit (NumPy, or the compiled
kernel), the goldens, the schedules of adds, the Ascend 950 tiling, the forward routing, and which
profile made a grad_x (docs/semantics.md).

The public face of :mod:`moegrad.numerics`; the service and the benchmarks import these names from here.
"""

from moegrad.numerics._ascend950 import UB_SIZE_BYTES, VECTOR_CORE_COUNT, Ascend950Tiling, ascend950_tiling
from moegrad.numerics._fast import KernelCache, kernel_cache
from moegrad.numerics._fast import available as compiled_kernel_available
from moegrad.numerics._identify import Identification, ProfileMatch, identify, profiles_matching
from moegrad.numerics._reference import (
    accumulate,
    kernel_threads,
    moe_init_routing_v2_grad,
    moe_init_routing_v2_grad_golden,
    warm_up,
)
from moegrad.numerics._reference_many import moe_init_routing_v2_grad_group, moe_init_routing_v2_grad_many
from moegrad.numerics._routing import (
    MoeInitRoutingV2Result,
    expanded_row_idx_layout,
    invert_expanded_row_idx,
    moe_init_routing_v2,
)
from moegrad.numerics._schedules import accumulation_schedule, bin_count

__all__ = [
    "UB_SIZE_BYTES",
    "VECTOR_CORE_COUNT",
    "Ascend950Tiling",
    "Identification",
    "KernelCache",
    "MoeInitRoutingV2Result",
    "ProfileMatch",
    "accumulate",
    "accumulation_schedule",
    "ascend950_tiling",
    "bin_count",
    "compiled_kernel_available",
    "expanded_row_idx_layout",
    "identify",
    "invert_expanded_row_idx",
    "kernel_cache",
    "kernel_threads",
    "moe_init_routing_v2",
    "moe_init_routing_v2_grad",
    "moe_init_routing_v2_grad_golden",
    "moe_init_routing_v2_grad_group",
    "moe_init_routing_v2_grad_many",
    "profiles_matching",
    "warm_up",
]
