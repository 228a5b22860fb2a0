"""moegrad: aclnnMoeInitRoutingV2Grad (the backward of MoE token routing) from any host.

``grad_x[i] = sum over t < K of grad_expanded_x[expanded_row_idx[i*K + t]]``

- :class:`Client` / :class:`AsyncClient` call a moegrad service (the NPU, or its bit-exact emulation);
- :func:`moe_init_routing_v2_grad` computes the same result in-process, in the device's order;
- :class:`MoeInitRoutingV2GradCall` validates a call exactly as the operator's phase one does.
"""

from moegrad._client import AsyncClient, Client, GradResult
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
)
from moegrad._spec import GRAD_DTYPES, ORDERS, MoeInitRoutingV2GradCall
from moegrad._version import __version__
from moegrad._wire import DTYPES, decode_body, decode_tensor, dtype_name, encode_body, encode_tensor

__all__ = [
    "DTYPES",
    "GRAD_DTYPES",
    "ORDERS",
    "AclnnStatus",
    "AsyncClient",
    "Client",
    "DeadlineExceeded",
    "DeviceBusy",
    "DeviceFault",
    "GradResult",
    "InvalidArgument",
    "MalformedRequest",
    "MoeInitRoutingV2GradCall",
    "MoegradError",
    "PayloadTooLarge",
    "ServiceError",
    "TransportError",
    "Unauthorized",
    "__version__",
    "accumulation_schedule",
    "bin_count",
    "decode_body",
    "decode_tensor",
    "dtype_name",
    "encode_body",
    "encode_tensor",
    "moe_init_routing_v2_grad",
    "moe_init_routing_v2_grad_golden",
]
