"""moegrad: aclnnMoeInitRoutingV2Grad (the backward of MoE token routing) from any host.

``grad_x[i] = sum over t < K of grad_expanded_x[expanded_row_idx[i*K + t]]``

- :class:`Client` / :class:`AsyncClient` call a moegrad service (the NPU, or its bit-exact emulation),
  or several replicas of it (``client.stats``: a :class:`ReplicaStats` per replica);
- :func:`moe_init_routing_v2_grad` computes the same result in-process, in the device's order
  (:func:`warm_up` compiles its kernel now, or loads it from numba's cache: :func:`kernel_cache`
  says which);
- :class:`MoeInitRoutingV2GradCall` validates a call exactly as the operator's phase one does;
- :data:`PROFILES` names every device profile (a chip at one CANN release, :class:`Profile`) whose
  bits and rules a call's ``order`` selects; :func:`resolve_profile` reads a name or an alias;
- :func:`identify` tells which device profiles (a chip at one CANN release) give a grad_x's bits;
- :func:`moe_init_routing_v2` emulates the forward routing that makes a valid expanded_row_idx;
  ``moegrad.torch`` (extra ``torch``) wraps both as torch operators;
- :func:`compare` (and ``Client.compare`` on a service) judges a candidate implementation's grad_x
  against the device and a float64 golden, and :func:`explain` says why each differing row
  differs; :mod:`moegrad.accuracy` holds the standards and the report writers (docs/accuracy.md);
- the candidate on the bench (:class:`Candidate`: a callable, ``package.module:function`` or a v2
  URL): :func:`probe_order` reveals its tree of adds, :func:`order_free_inputs` builds calls every
  order of adds sums to the golden's bits, :func:`check_determinism` counts its results per row,
  :func:`shrink` finds the smallest call that keeps a fault and writes a reproducer.
"""

from moegrad._dtypes import DTYPES, brief, dtype_name
from moegrad._errors import (
    AclnnStatus,
    DeadlineExceeded,
    DeviceBusy,
    DeviceFault,
    InvalidArgument,
    MalformedRequest,
    MoegradError,
    PayloadTooLarge,
    ReplicaWarning,
    ServiceError,
    TransportError,
    Unauthorized,
)
from moegrad._version import __version__
from moegrad.accuracy import (
    DEFAULT_STANDARDS,
    DTYPE_LIMITS,
    ORDER_FREE_LIMITS,
    PROBE_LIMITS,
    STANDARDS,
    THRESHOLDS,
    Candidate,
    CandidateError,
    ComparisonReport,
    Criterion,
    CriterionResult,
    DeterminismCheck,
    DtypeLimits,
    ExactMatch,
    Explanation,
    InconsistentOrder,
    Metrics,
    MultiTermOrder,
    NothingToShrink,
    OrderProbe,
    OrderProbeError,
    ShrinkError,
    ShrinkResult,
    StandardVerdict,
    WorstElement,
    ZeroRowCheck,
    any_order_bound,
    as_candidate,
    check_compare_arguments,
    check_determinism,
    check_explain_arguments,
    compare,
    compare_arrays,
    explain,
    explain_peak_bytes,
    metrics,
    order_free_inputs,
    probe_order,
    shrink,
    skipped_rows,
    summand_magnitude,
)
from moegrad.http._answers import CompareResult, ExplainResult, GradResult
from moegrad.http._async_client import AsyncClient
from moegrad.http._client import Client
from moegrad.http._documents import BatchCompare
from moegrad.http._replicas import ReplicaStats
from moegrad.numerics._ascend950 import Ascend950Tiling, ascend950_tiling
from moegrad.numerics._fast import KernelCache, kernel_cache
from moegrad.numerics._identify import Identification, ProfileMatch, identify
from moegrad.numerics._reference import moe_init_routing_v2_grad, moe_init_routing_v2_grad_golden, warm_up
from moegrad.numerics._reference_many import moe_init_routing_v2_grad_group, moe_init_routing_v2_grad_many
from moegrad.numerics._routing import (
    MoeInitRoutingV2Result,
    expanded_row_idx_layout,
    invert_expanded_row_idx,
    moe_init_routing_v2,
)
from moegrad.numerics._schedules import accumulation_schedule, bin_count
from moegrad.operator._call import GRAD_DTYPES, ORDERS, CallGroup, MoeInitRoutingV2GradCall
from moegrad.operator._profiles import PROFILES, Profile, resolve_profile
from moegrad.wire._bodies import decode_batch, decode_body
from moegrad.wire._codec import (
    decode_tensor,
    encode_batch,
    encode_body,
    encode_body_view,
    encode_tensor,
)
from moegrad.wire._frames import FRAMES_MEDIA_TYPE, decode_frames, encode_frames
from moegrad.wire._limits import MAX_BATCH_CALLS, MAX_RANK, REQUEST_LIMITS, StructureLimits

__all__ = [
    "DEFAULT_STANDARDS",
    "DTYPES",
    "DTYPE_LIMITS",
    "FRAMES_MEDIA_TYPE",
    "GRAD_DTYPES",
    "MAX_BATCH_CALLS",
    "MAX_RANK",
    "ORDERS",
    "ORDER_FREE_LIMITS",
    "PROBE_LIMITS",
    "PROFILES",
    "REQUEST_LIMITS",
    "STANDARDS",
    "THRESHOLDS",
    "AclnnStatus",
    "Ascend950Tiling",
    "AsyncClient",
    "BatchCompare",
    "CallGroup",
    "Candidate",
    "CandidateError",
    "Client",
    "CompareResult",
    "ComparisonReport",
    "Criterion",
    "CriterionResult",
    "DeadlineExceeded",
    "DeterminismCheck",
    "DeviceBusy",
    "DeviceFault",
    "DtypeLimits",
    "ExactMatch",
    "ExplainResult",
    "Explanation",
    "GradResult",
    "Identification",
    "InconsistentOrder",
    "InvalidArgument",
    "KernelCache",
    "MalformedRequest",
    "Metrics",
    "MoeInitRoutingV2GradCall",
    "MoeInitRoutingV2Result",
    "MoegradError",
    "MultiTermOrder",
    "NothingToShrink",
    "OrderProbe",
    "OrderProbeError",
    "PayloadTooLarge",
    "Profile",
    "ProfileMatch",
    "ReplicaStats",
    "ReplicaWarning",
    "ServiceError",
    "ShrinkError",
    "ShrinkResult",
    "StandardVerdict",
    "StructureLimits",
    "TransportError",
    "Unauthorized",
    "WorstElement",
    "ZeroRowCheck",
    "__version__",
    "accumulation_schedule",
    "any_order_bound",
    "as_candidate",
    "ascend950_tiling",
    "bin_count",
    "brief",
    "check_compare_arguments",
    "check_determinism",
    "check_explain_arguments",
    "compare",
    "compare_arrays",
    "decode_batch",
    "decode_body",
    "decode_frames",
    "decode_tensor",
    "dtype_name",
    "encode_batch",
    "encode_body",
    "encode_body_view",
    "encode_frames",
    "encode_tensor",
    "expanded_row_idx_layout",
    "explain",
    "explain_peak_bytes",
    "identify",
    "invert_expanded_row_idx",
    "kernel_cache",
    "metrics",
    "moe_init_routing_v2",
    "moe_init_routing_v2_grad",
    "moe_init_routing_v2_grad_golden",
    "moe_init_routing_v2_grad_group",
    "moe_init_routing_v2_grad_many",
    "order_free_inputs",
    "probe_order",
    "resolve_profile",
    "shrink",
    "skipped_rows",
    "summand_magnitude",
    "warm_up",
]
