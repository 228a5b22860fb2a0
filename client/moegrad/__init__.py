"""moegrad: aclnnMoeInitRoutingV2Grad (the backward of MoE token routing) from any host.

``grad_x[i] = sum over t < K of grad_expanded_x[expanded_row_idx[i*K + t]]``

- :class:`Client` / :class:`AsyncClient` call a moegrad service (the NPU, or its bit-exact emulation);
- :func:`moe_init_routing_v2_grad` computes the same result in-process, in the device's order;
- :class:`MoeInitRoutingV2GradCall` validates a call exactly as the operator's phase one does.
- :func:`compare` (and ``Client.compare`` on a service) judges a candidate implementation's grad_x
  against the device and a float64 golden; :mod:`moegrad.accuracy` holds the standards and the
  report writers (docs/accuracy.md).
"""

from moegrad._client import AsyncClient, Client
from moegrad._errors import (
    AclnnStatus,
    DeadlineExceeded,
    DeviceBusy,
    DeviceFault,
    InvalidArgument,
    MalformedRequest,
    MoegradError,
    PayloadTooLarge,
    ServiceError,
    TransportError,
    Unauthorized,
)
from moegrad._reference import (
    accumulation_schedule,
    bin_count,
    moe_init_routing_v2_grad,
    moe_init_routing_v2_grad_golden,
    warm_up,
)
from moegrad._results import CompareResult, GradResult
from moegrad._spec import GRAD_DTYPES, ORDERS, MoeInitRoutingV2GradCall
from moegrad._version import __version__
from moegrad._wire import DTYPES, decode_body, decode_tensor, dtype_name, encode_body, encode_tensor
from moegrad.accuracy import (
    DEFAULT_STANDARDS,
    DTYPE_LIMITS,
    STANDARDS,
    THRESHOLDS,
    ComparisonReport,
    Criterion,
    CriterionResult,
    DtypeLimits,
    ExactMatch,
    Metrics,
    StandardVerdict,
    WorstElement,
    ZeroRowCheck,
    check_compare_arguments,
    compare,
    compare_arrays,
    metrics,
    skipped_rows,
    summand_magnitude,
)

__all__ = [
    "DEFAULT_STANDARDS",
    "DTYPES",
    "DTYPE_LIMITS",
    "GRAD_DTYPES",
    "ORDERS",
    "STANDARDS",
    "THRESHOLDS",
    "AclnnStatus",
    "AsyncClient",
    "Client",
    "CompareResult",
    "ComparisonReport",
    "Criterion",
    "CriterionResult",
    "DeadlineExceeded",
    "DeviceBusy",
    "DeviceFault",
    "DtypeLimits",
    "ExactMatch",
    "GradResult",
    "InvalidArgument",
    "MalformedRequest",
    "Metrics",
    "MoeInitRoutingV2GradCall",
    "MoegradError",
    "PayloadTooLarge",
    "ServiceError",
    "StandardVerdict",
    "TransportError",
    "Unauthorized",
    "WorstElement",
    "ZeroRowCheck",
    "__version__",
    "accumulation_schedule",
    "bin_count",
    "check_compare_arguments",
    "compare",
    "compare_arrays",
    "decode_body",
    "decode_tensor",
    "dtype_name",
    "encode_body",
    "encode_tensor",
    "metrics",
    "moe_init_routing_v2_grad",
    "moe_init_routing_v2_grad_golden",
    "skipped_rows",
    "summand_magnitude",
    "warm_up",
]
