"""One call as the device takes it: the chip an SoC is, the arguments on the host, and what phase
one's status means on the device's profile.

- :data:`SOC_CHIPS`: the SoC name -> chip table (the chips of moegrad.operator.CHIPS);
- :func:`marshal`: a validated call's arguments as ``aclnnMoeInitRoutingV2GradGetWorkspaceSize``
  takes them (attributes as C integers, tensors as contiguous little-endian host arrays with their
  aclDataType, the grad_x buffer the device copy lands in), after the order check;
- :func:`phase_one_error`: a nonzero phase-one status as the caller's error (InvalidArgument) or the
  installation's (DeviceFault with a hint), by the codes the device's profile documents.
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
    Profile,
    dtype_name,
    resolve_profile,
)
from moegrad_service.engine.ascend._abi import ACL_DATA_TYPES, code_name
from moegrad_service.engine.ascend._buffers import host_array

#: SoC name (``aclrtGetSocName``) prefix -> the chip (a key of moegrad.operator.CHIPS): Atlas A2
#: (Ascend910B*), Atlas A3 (Ascend910_93*) and Ascend 950PR/950DT (Ascend950*). The A2 and A3 run
#: the same kernel (docs/semantics.md, section 3), the 950 the arch35 one (section 7). The one
#: table of its kind; an SoC not in it is no chip moegrad has a profile for.
SOC_CHIPS: tuple[tuple[str, str], ...] = (
    ("Ascend910B", "ascend910b"),
    ("Ascend910_93", "ascend910_93"),
    ("Ascend950", "ascend950"),
)


def chip_of_soc(soc_name: str | None) -> str | None:
    """The chip the SoC named ``soc_name`` is, or None for an SoC not in :data:`SOC_CHIPS`."""
    if not soc_name:
        return None
    return next((chip for prefix, chip in SOC_CHIPS if soc_name.startswith(prefix)), None)


#: The code of a phase-one attribute or shape failure on a device whose profile is unknown: the
#: 8.x code. (561103 answers them from 9.1, but it is also an internal fault, so it is not the
#: caller's unless the profile says so.)
UNKNOWN_PROFILE_ATTRIBUTE_STATUS = AclnnStatus.ACLNN_ERR_INNER_TILING_ERROR


def caller_statuses(profile: Profile | None) -> frozenset[int]:
    """Phase-one codes that answer the call's input on ``profile``: the documented checks (161001 null
    tensor, 161002 dtype, and the profile's attribute and shape code: 561002 before CANN 9.1, 561103
    from 9.1; 561002 when the profile is unknown). moegrad validates inputs before phase one, so any
    other code is the installation's or the runtime's: a DeviceFault (HTTP 500), never a 422."""
    attribute = UNKNOWN_PROFILE_ATTRIBUTE_STATUS if profile is None else profile.attribute_status
    return frozenset({AclnnStatus.ACLNN_ERR_PARAM_NULLPTR, AclnnStatus.ACLNN_ERR_PARAM_INVALID, attribute})


#: What a phase-one code that is not the caller's (:func:`caller_statuses`) most likely means, and what to do.
PHASE_ONE_HINTS = {
    361001: "a runtime call inside the operator failed; check the device with npu-smi and the plog",
    561003: "no kernel binary of the operator for this SoC was found: install the operator package "
    "(ops-transformer) built for this CANN and SoC, and check ASCEND_OPP_PATH",
    561103: "an internal null pointer; from CANN 9.1 this code also answers shape and attribute errors "
    "(561002 before), which moegrad's own validation answers before the device",
    561107: "ASCEND_OPP_PATH is not set in this process: source CANN's set_env.sh before starting the service",
    561108: "the operator's kernel description (JSON) under ASCEND_OPP_PATH could not be loaded",
    561112: "the operator's binary kernel package was not found under ASCEND_OPP_PATH: install it",
}


def phase_one_error(status: int, message: str | None, device: str, profile: Profile | None) -> MoegradError:
    """The error a nonzero status of aclnnMoeInitRoutingV2GradGetWorkspaceSize stands for on ``profile``.

    Returns:
        InvalidArgument for the documented input checks (:func:`caller_statuses`: 161001, 161002,
        and 561002 or, from CANN 9.1, 561103); DeviceFault with the library's message and a hint for
        every other code (an installation or runtime fault).
    """
    text = f"aclnnMoeInitRoutingV2GradGetWorkspaceSize: {code_name(status)}" + (f": {message}" if message else "")
    if status in caller_statuses(profile):
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


def marshal(
    call: MoeInitRoutingV2GradCall, into: np.ndarray | None, *, device: str, profile: Profile | None
) -> Arguments:
    """``call``'s arguments for the device named ``device``, whose results are ``profile``'s bits.

    The call's arrays may be non-contiguous, read-only or big-endian: they are copied to contiguous
    host buffers when needed. ``into`` is used for grad_x when it is a writeable C-contiguous [N, H]
    array of the call's dtype (N = len(expanded_row_idx) / top_k, H = grad_expanded_x's last dim).

    Raises:
        InvalidArgument: ``call.order`` names no device profile (the ``"sequential"`` CPU golden, or
            a name moegrad.operator does not know; 161002), an attribute is not an integer (the
            profile's attribute code: 561002, or 561103 from CANN 9.1), or a tensor is not an ndarray
            or has a dtype with no aclDataType (161002).
    """
    if _named_chip(call.order) is None:  # "sequential" is a CPU golden no device computes
        computes = profile.name if profile is not None else "a profile moegrad does not know"
        raise InvalidArgument(
            f"order={call.order!r}: {device} computes {computes}, not {call.order!r}; name its profile or "
            "none, or call a server with backend=reference for the CPU golden",
            aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID,
            field="order",
        )
    status = UNKNOWN_PROFILE_ATTRIBUTE_STATUS if profile is None else profile.attribute_status
    top_k, drop_pad_mode, active_num = (_attribute(call, n, status) for n in ("top_k", "drop_pad_mode", "active_num"))
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


def _named_chip(order: object) -> str | None:
    """The chip of the profile ``order`` names (an alias too), or None: the golden, or no profile name."""
    try:
        return resolve_profile(order).chip if isinstance(order, str) else None
    except ValueError:
        return None


def _attribute(call: MoeInitRoutingV2GradCall, name: str, status: int) -> int:
    try:
        return operator.index(getattr(call, name))
    except TypeError:
        raise InvalidArgument(
            f"{name}={getattr(call, name)!r} must be an integer", aclnn_status=status, field=name
        ) from None
