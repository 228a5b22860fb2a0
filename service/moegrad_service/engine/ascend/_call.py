"""One call as the device takes it: the order a chip computes, the arguments on the host, and what
phase one's status means.

- :data:`SOC_ORDERS`: the SoC name -> accumulation order table (docs/semantics.md, sections 3 and 7);
- :func:`marshal`: a validated call's arguments as ``aclnnMoeInitRoutingV2GradGetWorkspaceSize``
  takes them (attributes as C integers, tensors as contiguous little-endian host arrays with their
  aclDataType, the grad_x buffer the device copy lands in), after the order check;
- :func:`phase_one_error`: a nonzero phase-one status as the caller's error (InvalidArgument) or the
  installation's (DeviceFault with a hint).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from moegrad import (
    DTYPES,
    AclnnStatus,
    DeviceFault,
    InvalidArgument,
    MoegradError,
    MoeInitRoutingV2GradCall,
    dtype_name,
)
from moegrad_service.engine.ascend._abi import ACL_DATA_TYPES, code_name
from moegrad_service.engine.ascend._buffers import host_array

#: SoC name (``aclrtGetSocName``) prefix -> the accumulation order that SoC's kernel computes:
#: Atlas A2 (Ascend910B*) and A3 (Ascend910_93*) run the A2/A3 kernel, Ascend 950PR/950DT the arch35
#: one (docs/semantics.md, sections 3 and 7). The one table of its kind; an SoC not in it has no order.
SOC_ORDERS: tuple[tuple[str, str], ...] = (
    ("Ascend910B", "ascend910b"),
    ("Ascend910_93", "ascend910b"),
    ("Ascend950", "ascend950"),
)
#: The orders a device computes; the others ("sequential") are CPU goldens.
DEVICE_ORDERS = frozenset(order for _, order in SOC_ORDERS)


def order_of_soc(soc_name: str | None) -> str | None:
    """The accumulation order the SoC named ``soc_name`` computes, or None for an SoC not in :data:`SOC_ORDERS`."""
    if not soc_name:
        return None
    return next((order for prefix, order in SOC_ORDERS if soc_name.startswith(prefix)), None)


#: Phase-one codes that answer the call's input: the documented checks (161001 null tensor, 161002
#: dtype, 561002 attributes and shapes). moegrad validates inputs before phase one, so any other
#: code is the installation's or the runtime's: a DeviceFault (HTTP 500), never a 422.
CALLER_STATUSES = frozenset(
    {AclnnStatus.ACLNN_ERR_PARAM_NULLPTR, AclnnStatus.ACLNN_ERR_PARAM_INVALID, AclnnStatus.ACLNN_ERR_INNER_TILING_ERROR}
)
#: What a phase-one code other than :data:`CALLER_STATUSES` most likely means, and what to do.
PHASE_ONE_HINTS = {
    361001: "a runtime call inside the operator failed; check the device with npu-smi and the plog",
    561003: "no kernel binary of the operator for this SoC was found: install the operator package "
    "(ops-transformer) built for this CANN and SoC, and check ASCEND_OPP_PATH",
    561103: "an internal null pointer; on the 2026 entry point this code also answers shape and attribute "
    "errors (561002 on CANN 8.x), which moegrad's own validation answers before the device",
    561107: "ASCEND_OPP_PATH is not set in this process: source CANN's set_env.sh before starting the service",
    561108: "the operator's kernel description (JSON) under ASCEND_OPP_PATH could not be loaded",
    561112: "the operator's binary kernel package was not found under ASCEND_OPP_PATH: install it",
}


def phase_one_error(status: int, message: str | None, device: str) -> MoegradError:
    """The error a nonzero status of aclnnMoeInitRoutingV2GradGetWorkspaceSize stands for.

    Returns:
        InvalidArgument for the documented input checks (161001, 161002, 561002); DeviceFault with
        the library's message and a hint for every other code (an installation or runtime fault).
    """
    text = f"aclnnMoeInitRoutingV2GradGetWorkspaceSize: {code_name(status)}" + (f": {message}" if message else "")
    if status in CALLER_STATUSES:
        return InvalidArgument(f"the NPU rejected the call ({text})", aclnn_status=status, field=None)
    hint = PHASE_ONE_HINTS.get(status, "the operator failed for a reason that is not the call's input")
    return DeviceFault(f"phase one failed on {device} ({text}); {hint}", aclnn_status=status, device_message=message)


@dataclass(frozen=True, eq=False)
class Arguments:
    """One call's arguments as phase one takes them, on the host.

    Attributes:
        inputs: (grad_expanded_x, its aclDataType) and (expanded_row_idx, its aclDataType), each
            array C-contiguous and little-endian (or None, with type 0, when the call has none).
        top_k, drop_pad_mode, active_num: the call's attributes as C integers.
        result: the [N, H] host array grad_x is copied into from the device, in the call's dtype:
            the caller's ``out`` when it fits, else a fresh one.
        result_type: the aclDataType of ``result``.
    """

    inputs: tuple[tuple[np.ndarray | None, int], tuple[np.ndarray | None, int]]
    top_k: int
    drop_pad_mode: int
    active_num: int
    result: np.ndarray
    result_type: int


def marshal(call: MoeInitRoutingV2GradCall, into: np.ndarray | None, *, device: str, order: str | None) -> Arguments:
    """``call``'s arguments for the device named ``device``, whose chip computes ``order``.

    The call's arrays may be non-contiguous, read-only or big-endian: they are copied to contiguous
    host buffers when needed. ``into`` is used for grad_x when it is a writeable C-contiguous [N, H]
    array of the call's dtype (N = len(expanded_row_idx) / top_k, H = grad_expanded_x's last dim).

    Raises:
        InvalidArgument: ``call.order`` is a CPU golden no device computes (``"sequential"``; 161002),
            an attribute is not an integer (561002), or a tensor is not an ndarray or has a dtype
            with no aclDataType (161002).
    """
    if call.order not in DEVICE_ORDERS:  # "sequential" is a CPU golden no device computes
        raise InvalidArgument(
            f"order={call.order!r}: {device} computes in the device's own order "
            f"({order or 'unknown for this SoC'}); the {call.order!r} golden is only "
            "served by the reference backend",
            aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID,
            field="order",
        )
    top_k, drop_pad_mode, active_num = (_attribute(call, n) for n in ("top_k", "drop_pad_mode", "active_num"))
    grad = idx = None
    grad_type = idx_type = 0
    if call.grad_expanded_x is not None:
        grad, grad_type = host_array(call.grad_expanded_x, "grad_expanded_x")
    if call.expanded_row_idx is not None:
        idx, idx_type = host_array(call.expanded_row_idx, "expanded_row_idx")
    tokens = idx.shape[0] // top_k if idx is not None and idx.ndim >= 1 and top_k > 0 else 0
    hidden = grad.shape[-1] if grad is not None and grad.ndim >= 1 else 0
    dtype = DTYPES["float32"] if grad is None else grad.dtype
    if (
        into is not None
        and into.shape == (tokens, hidden)
        and into.dtype == dtype
        and into.flags.c_contiguous
        and into.flags.writeable
    ):
        result = into  # the device copy lands in the caller's buffer
    else:
        result = np.empty((tokens, hidden), dtype=dtype)
    result_type = dtype_name(result.dtype)
    assert result_type is not None  # the result has the call's validated wire dtype
    return Arguments(
        inputs=((grad, grad_type), (idx, idx_type)),
        top_k=top_k,
        drop_pad_mode=drop_pad_mode,
        active_num=active_num,
        result=result,
        result_type=ACL_DATA_TYPES[result_type],
    )


def _attribute(call: MoeInitRoutingV2GradCall, name: str) -> int:
    try:
        return operator.index(getattr(call, name))
    except TypeError:
        raise InvalidArgument(
            f"{name}={getattr(call, name)!r} must be an integer",
            aclnn_status=AclnnStatus.ACLNN_ERR_INNER_TILING_ERROR,
            field=name,
        ) from None
