"""moegrad's bench functions for MindStudio msprobe: npu_moe_token_permute and npu_moe_init_routing_v2.

msprobe (PyPI ``mindstudio-probe`` >= 26.2.0) checks an NPU API by running a *bench function* on the
CPU with the dumped inputs and comparing its outputs, and through autograd its input gradients,
with the NPU's. It has none for these two operators. ``python -m moegrad.msprobe register`` installs
the four functions below into an installed msprobe; docs/msprobe.md says what msprobe concludes
with them on each product line, and gives the sources.

The functions (torch_npu's signatures; outputs are CPU tensors):

- ``npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False)`` ->
  ``(permuted_tokens, sorted_indices)``: tokens [N, H] float16 / bfloat16 / float32 (float32 /
  float64 as msprobe passes them, see "Dtypes"), indices [N, K] or [N] (K = 1) int32 / int64 expert
  ids; ``sorted_indices`` [N*K] int32 holds each slot's row (slot ``i*K + t`` -> row), and
  ``permuted_tokens[sorted_indices[s]] = tokens[s // K]`` for the first R rows, R = N*K when
  ``num_out_tokens`` is None or 0, else ``len(range(N*K)[:num_out_tokens])`` (aclnnMoeTokenPermute's
  documentation, "计算公式" and numOutTokens; the slots of one expert keep slot order, the stable
  sort of MindSpeed's eager equivalent). Differentiable in tokens, through
  ``npu_moe_token_permute_grad``. ``padded_mode=True`` raises NotImplementedError.
- ``npu_moe_token_permute_grad(tokens, grad_permuted_tokens, indices, sorted_indices,
  padded_mode=False)`` -> grad_tokens [N, H], grad's dtype: ``sum over t < K of
  grad_permuted_tokens[sorted_indices[i*K + t]]``, skipping rows >= R (aclnnMoeTokenPermuteGrad).
- ``npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1,
  expert_capacity=-1, expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
  expert_tokens_num_flag=False, quant_mode=0, active_expert_range=(), row_idx_type=0)`` ->
  ``(expanded_x [N*K, H], expanded_row_idx [N*K] int32)`` and, when ``expert_tokens_num_flag``,
  ``expert_tokens_count_or_cumsum`` [end - start] int64 (counts, or their running sum for
  ``expert_tokens_num_type=0``, of the experts in ``active_expert_range = [start, end)``). torch_npu
  runs aclnnMoeInitRoutingV3 here; moegrad emulates its dropless, unquantized case, every id inside
  the range (the default () means every expert): ``row_idx_type=0`` gives the slot -> row index
  (aclnnMoeInitRoutingV2's layout), 1 its inverse. The fourth output, expanded_scale, is undefined
  without ``scale`` and is not returned (msprobe then compares the first outputs only). A quantized
  call, a ``scale``, drop/pad mode, key_value counts or an id outside the range raise
  NotImplementedError. Differentiable in x, through ``npu_moe_init_routing_v2_grad``.
- ``npu_moe_init_routing_v2_grad(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=0,
  active_num=0)`` -> grad_x [N, H]: aclnnMoeInitRoutingV2Grad (docs/semantics.md), slot -> row index.

Profiles. ``MOEGRAD_MSPROBE_ORDER`` names the device profile (a chip at one CANN release,
:data:`moegrad.PROFILES`) whose bits the backwards reproduce (default ``ascend910b@9.1``; a bare
chip means its newest release, and ``ascend950@2025-12`` is ``ascend950@8.5``, as everywhere in
moegrad); :data:`PROFILES` maps it to the profile each backward computes as:

| profile | npu_moe_token_permute_grad | npu_moe_init_routing_v2_grad |
|---|---|---|
| ``ascend910b@R``, ``ascend910_93@R`` (A2/A3) | ``sequential``: MoeTokenPermuteGrad, a slot-order chain | the profile |
| ``ascend950@R`` (950PR/950DT) | the profile: aclnnMoeInitRoutingV2Grad, active_num = R | the profile |
| ``sequential`` | ``sequential`` | ``sequential`` |

On A2/A3 the permute backward's kernel (MoeTokenPermuteGrad, which runs MoeTokenUnpermute's without
probs) starts its chain from the first slot's row where the sequential order starts from +0.0: the
bits are the same except a row whose summands are all -0.0 (-0.0 there, +0.0 here).

Where it runs: in-process by default (the 950 profiles read ``MOEGRAD_ASCEND950_UB_SIZE_BYTES`` and
``MOEGRAD_ASCEND950_VECTOR_CORE_COUNT`` as the service does); with ``MOEGRAD_MSPROBE_URL`` set,
every backward goes to that moegrad service through :class:`moegrad.Client` (bearer token from
``MOEGRAD_MSPROBE_TOKEN``). The forwards always run in-process (they move rows, no arithmetic).

Dtypes. msprobe raises a bench call's floating tensors (float16 / bfloat16 -> float32, float32 ->
float64; ``generate_cpu_params`` in its acc_check). Each backward narrows its grad back exactly to
the dtype the device computed in: float64 -> float32; float32 -> bfloat16 if every value is a
bfloat16 value, else float16 if every value is a float16 value, else float32
(``MOEGRAD_MSPROBE_DTYPE=bfloat16|float16|float32`` fixes it: float16 data whose values all fit
bfloat16 would otherwise be taken for bfloat16, rounding the result the other way). moegrad computes
in that dtype (the 950's order depends on it) and the result is widened back to the grad's dtype:
its values are the device's bits. Nothing is narrowed that is not exact (ValueError otherwise).

Errors: :class:`moegrad.InvalidArgument` for a call the operator rejects (aclnn 161001 / 161002 /
561002, 561103 from CANN 9.1), NotImplementedError for a case moegrad does not emulate, ValueError for a bad setting;
the service's errors (TransportError, ...) through ``MOEGRAD_MSPROBE_URL``. msprobe records any of
them as the API's skip reason.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

try:
    import torch
except ImportError as _missing:
    if __name__ == "__main__":  # python -m moegrad.msprobe: --help needs no torch; the commands say what to install
        from moegrad._msprobe_install import main as _install_main

        raise SystemExit(_install_main()) from None
    from moegrad._msprobe_install import TORCH_HINT

    raise ImportError(f"moegrad.msprobe needs torch: {TORCH_HINT}") from _missing

from moegrad._msprobe_install import DTYPE_ENV, ORDER_ENV, TOKEN_ENV, URL_ENV
from moegrad._tensors import to_numpy, to_torch
from moegrad.http._client import Client
from moegrad.numerics._ascend950 import UB_SIZE_BYTES, VECTOR_CORE_COUNT
from moegrad.numerics._reference import moe_init_routing_v2_grad
from moegrad.numerics._routing import MoeInitRoutingV2Result, expert_range, invert_expanded_row_idx, moe_init_routing_v2
from moegrad.operator._profiles import DEFAULT_PROFILE, resolve_profile
from moegrad.operator._profiles import PROFILES as _DEVICE_PROFILES

__all__ = [
    "DTYPE_ENV",
    "ORDER_ENV",
    "PROFILES",
    "TOKEN_ENV",
    "URL_ENV",
    "Profile",
    "current_profile",
    "main",
    "npu_moe_init_routing_v2",
    "npu_moe_init_routing_v2_grad",
    "npu_moe_token_permute",
    "npu_moe_token_permute_grad",
]


@dataclass(frozen=True)
class Profile:
    """A device profile as msprobe's backwards see it: the profile (a name of
    :data:`moegrad.PROFILES`) each backward computes as.

    Attributes:
        name: the device profile's name, a key of :data:`PROFILES` (``"ascend910b@9.1"``...).
        permute_order: the profile of npu_moe_token_permute's backward on that device.
        routing_order: the profile of aclnnMoeInitRoutingV2Grad on that device.
    """

    name: str
    permute_order: str
    routing_order: str


def _msprobe_profile(name: str) -> Profile:
    chip = _DEVICE_PROFILES[name].chip
    # A2/A3 run MoeTokenPermuteGrad for the permute backward: the chain of the sequential golden
    return Profile(name, "sequential" if chip in ("ascend910b", "ascend910_93") else name, name)


#: Profiles by device profile name (module docstring, "Profiles"; docs/msprobe.md gives the sources).
PROFILES: dict[str, Profile] = {name: _msprobe_profile(name) for name in _DEVICE_PROFILES}

_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
_NARROW = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
_clients: dict[tuple[str, str | None], Client] = {}
_clients_lock = threading.Lock()


def current_profile() -> Profile:
    """The profile ``MOEGRAD_MSPROBE_ORDER`` names (``ascend910b@9.1`` when unset; any name of
    :data:`moegrad.ORDERS`, an alias read as the profile it names), read at each call.

    Raises:
        ValueError: a name that is not a device profile or an alias.
    """
    name = os.environ.get(ORDER_ENV) or DEFAULT_PROFILE
    try:
        return PROFILES[resolve_profile(name).name]
    except ValueError as exc:
        raise ValueError(f"{ORDER_ENV}={name!r}: {exc}") from None


# --------------------------------------------------------------------------------------------------
# Dtypes: msprobe's raised tensors back to the device's dtype, and results back to msprobe's
# --------------------------------------------------------------------------------------------------


def _exactly(array: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """``array`` in ``dtype`` when every value survives the round trip (NaN for NaN), else None."""
    with np.errstate(all="ignore"):  # an overflow to inf is a failed round trip, not a warning
        narrow = array.astype(dtype)
        same = np.array_equal(narrow.astype(array.dtype), array, equal_nan=True)
    return narrow if same else None


def _device_array(tensor: torch.Tensor, field: str) -> np.ndarray:
    """A floating tensor's values in the dtype the device computed in (module docstring, "Dtypes")."""
    array = to_numpy(tensor)
    if array.dtype == np.float64:
        narrow = _exactly(array, np.dtype(np.float32))
        if narrow is None:
            raise ValueError(
                f"{field} is float64 with values that are not float32 values; msprobe passes "
                "float64 only for a float32 call, whose values are all float32 values"
            )
        return narrow
    if array.dtype != np.float32:
        return array  # float16 / bfloat16 as they are; anything else is the operator's to reject
    choice = os.environ.get(DTYPE_ENV) or "auto"
    if choice not in _DTYPE_CHOICES:
        raise ValueError(f"{DTYPE_ENV}={choice!r} is not one of {', '.join(_DTYPE_CHOICES)}")
    if choice == "float32":
        return array
    for name in ("bfloat16", "float16") if choice == "auto" else (choice,):
        narrow = _exactly(array, _NARROW[name])
        if narrow is not None:
            return narrow
    if choice != "auto":
        raise ValueError(f"{DTYPE_ENV}={choice}, but {field} has values that are not {choice} values")
    return array


def _like(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """``array`` as a CPU tensor of ``like``'s dtype (widening is exact)."""
    target = to_numpy(like[:0].detach()).dtype
    return to_torch(np.ascontiguousarray(array.astype(target, copy=False)), like.detach().cpu())


def _narrow_forward(tensor: torch.Tensor, field: str) -> np.ndarray:
    """A forward input for moegrad's routing: float64 narrowed exactly to float32, the rest as it is."""
    array = to_numpy(tensor)
    if array.dtype == np.float64:
        narrow = _exactly(array, np.dtype(np.float32))
        if narrow is None:
            raise ValueError(f"{field} is float64 with values that are not float32 values")
        return narrow
    return array


# --------------------------------------------------------------------------------------------------
# The backward: aclnnMoeInitRoutingV2Grad in the profile's order, in-process or on a service
# --------------------------------------------------------------------------------------------------


def _client(url: str) -> Client:
    token = os.environ.get(TOKEN_ENV) or None
    with _clients_lock:
        client = _clients.get((url, token))
        if client is None:
            client = _clients[(url, token)] = Client(url, token=token)
    return client


@atexit.register
def _close_clients() -> None:
    with _clients_lock:
        clients = list(_clients.values())
        _clients.clear()
    for client in clients:
        client.close()


def _platform(name: str, default: int) -> int:
    raw = os.environ.get(name)
    try:
        return default if not raw else int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _grad(
    grad: torch.Tensor, index: torch.Tensor, top_k: int, drop_pad_mode: int, active_num: int, order: str
) -> torch.Tensor:
    """grad_x of one call in ``order``, as a tensor of grad's dtype (its values the device's bits)."""
    values = _device_array(grad, "grad")
    rows = to_numpy(index)
    if rows.dtype != np.int32:
        if rows.dtype.kind != "i" or (rows.size and (rows.min() < -(2**31) or rows.max() >= 2**31)):
            raise ValueError(f"the index must be int32 (or int64 values that fit), got {rows.dtype}")
        rows = rows.astype(np.int32)
    url = os.environ.get(URL_ENV)
    if url:
        result = _client(url).moe_init_routing_v2_grad(values, rows, top_k, drop_pad_mode, active_num, order=order)
    else:
        result = moe_init_routing_v2_grad(
            values,
            rows,
            top_k,
            drop_pad_mode,
            active_num,
            order=order,
            ub_size_bytes=_platform("MOEGRAD_ASCEND950_UB_SIZE_BYTES", UB_SIZE_BYTES),
            vector_core_count=_platform("MOEGRAD_ASCEND950_VECTOR_CORE_COUNT", VECTOR_CORE_COUNT),
        )
    return _like(np.asarray(result), grad)


def _refuse_padded(padded_mode: Any) -> None:
    if padded_mode:
        raise NotImplementedError("padded_mode=True is not emulated (aclnnMoeTokenPermute documents it as unsupported)")


def _permute_grad(grad: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    rows = grad.shape[0]
    if sorted_indices.shape[0] != num_tokens * top_k:
        raise ValueError(
            f"sorted_indices has {sorted_indices.shape[0]} entries; "
            f"tokens [{num_tokens}, H] and K={top_k} need {num_tokens * top_k}"
        )
    if rows == 0:  # every slot skipped: each row is +0.0
        return grad.new_zeros((num_tokens, grad.shape[-1])).detach()
    return _grad(grad, sorted_indices, top_k, 0, rows, current_profile().permute_order)


def npu_moe_token_permute_grad(
    tokens: torch.Tensor,
    grad_permuted_tokens: torch.Tensor,
    indices: torch.Tensor,
    sorted_indices: torch.Tensor,
    padded_mode: bool = False,
) -> torch.Tensor:
    """The backward of npu_moe_token_permute, in the profile's permute order (module docstring).

    Args:
        tokens: the forward's tokens [N, H] (only N is read).
        grad_permuted_tokens: [R, H] float16 / bfloat16 / float32, or msprobe's float32 / float64.
        indices: the forward's indices [N, K] or [N] (only K is read).
        sorted_indices: [N*K] int32, the forward's second output (slot -> row).
        padded_mode: must be False.

    Returns:
        grad_tokens [N, H], grad_permuted_tokens' dtype, on the CPU.
    """
    _refuse_padded(padded_mode)
    top_k = 1 if indices.dim() == 1 else int(indices.shape[1])
    return _permute_grad(grad_permuted_tokens, sorted_indices, int(tokens.shape[0]), top_k)


def npu_moe_init_routing_v2_grad(
    grad_expanded_x: torch.Tensor,
    expanded_row_idx: torch.Tensor,
    top_k: int,
    drop_pad_mode: int = 0,
    active_num: int = 0,
) -> torch.Tensor:
    """aclnnMoeInitRoutingV2Grad in the profile's routing order (module docstring; docs/semantics.md).

    Args:
        grad_expanded_x: [N*K, H] dropless, [A, H] active, [E, C, H] drop/pad; float16 / bfloat16 /
            float32, or msprobe's float32 / float64.
        expanded_row_idx: [N*K] int32, slot -> row (-1: dropped, drop/pad mode).
        top_k, drop_pad_mode, active_num: as :func:`moegrad.moe_init_routing_v2_grad` takes them.

    Returns:
        grad_x [N, H], grad_expanded_x's dtype, on the CPU.
    """
    return _grad(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, current_profile().routing_order)


# --------------------------------------------------------------------------------------------------
# The forwards: moegrad's routing, differentiable through the backwards above
# --------------------------------------------------------------------------------------------------


def _route(x: torch.Tensor, expert_idx: torch.Tensor, **attributes: Any) -> tuple[torch.Tensor, MoeInitRoutingV2Result]:
    result = moe_init_routing_v2(_narrow_forward(x, "x"), to_numpy(expert_idx), **attributes)
    return _like(result.expanded_x, x), result


def _int_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: Any) -> Any:
        ids = indices.reshape(-1, 1) if indices.dim() == 1 else indices
        expanded_x, routed = _route(tokens, ids)
        rows = len(range(expanded_x.shape[0])[: num_out_tokens or None])
        sorted_indices = _int_tensor(routed.expanded_row_idx, torch.int32)
        ctx.num_tokens, ctx.top_k = int(tokens.shape[0]), int(ids.shape[1])
        ctx.save_for_backward(sorted_indices)
        ctx.mark_non_differentiable(sorted_indices)
        return expanded_x[:rows].contiguous(), sorted_indices

    @staticmethod
    def backward(ctx: Any, grad_permuted_tokens: torch.Tensor, *unused: Any) -> Any:
        (sorted_indices,) = ctx.saved_tensors
        return _permute_grad(grad_permuted_tokens, sorted_indices, ctx.num_tokens, ctx.top_k), None, None


def npu_moe_token_permute(
    tokens: torch.Tensor,
    indices: torch.Tensor,
    num_out_tokens: int | None = None,
    padded_mode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu.npu_moe_token_permute, by moegrad's routing (module docstring; shapes and dtypes there).

    Raises:
        InvalidArgument: tokens of a dtype the routing does not take, or an id outside [0, 2**24) (161002).
        NotImplementedError: ``padded_mode=True``.
    """
    _refuse_padded(padded_mode)
    permuted_tokens, sorted_indices = _Permute.apply(tokens, indices, num_out_tokens)
    return permuted_tokens, sorted_indices


def _expert_range(active_expert_range: Sequence[int], expert_num: int, ids: np.ndarray) -> tuple[int, int]:
    """[start, end) of the active experts: the default () every expert, else the range as the
    routing's own :func:`moegrad.numerics._routing.expert_range` checks it (561002)."""
    if len(active_expert_range) == 0:
        return 0, max(expert_num, int(ids.max()) + 1 if ids.size else 0, 1)
    checked = expert_range(active_expert_range, max(expert_num, 0))
    assert checked is not None, "a range that is given comes back"
    return checked


class _Routing(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, expert_idx: torch.Tensor, options: tuple[int, int, int, bool, int]) -> Any:
        start, end, count_type, count_flag, row_idx_type = options
        ids = to_numpy(expert_idx)
        top = int(ids.max()) + 1 if ids.size else 0
        expanded_x, routed = _route(
            x,
            expert_idx,
            expert_num=max(end, top),
            expert_tokens_count_or_cumsum_flag=2,
            active_expert_range=(start, end),
        )
        if (routed.expanded_row_idx < 0).any():  # the routing's -1: a slot whose expert is outside the range
            raise NotImplementedError(
                f"expert ids outside active_expert_range [{start}, {end}): the NPU leaves their rows of "
                "expanded_x undefined, which moegrad does not emulate"
            )
        assert routed.expert_tokens_count_or_cumsum is not None, "flag 2 asks the routing for the counts"
        slot_to_row = _int_tensor(routed.expanded_row_idx, torch.int32)
        index = (
            slot_to_row
            if row_idx_type == 0
            else _int_tensor(invert_expanded_row_idx(routed.expanded_row_idx), torch.int32)
        )
        ctx.top_k = int(expert_idx.shape[1])
        ctx.save_for_backward(slot_to_row)
        outputs = [expanded_x, index]
        if count_flag:
            counts = routed.expert_tokens_count_or_cumsum.astype(np.int64)  # the range's experts
            outputs.append(_int_tensor(np.cumsum(counts) if count_type == 0 else counts, torch.int64))
        ctx.mark_non_differentiable(*outputs[1:])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, grad_expanded_x: torch.Tensor, *unused: Any) -> Any:
        (slot_to_row,) = ctx.saved_tensors
        order = current_profile().routing_order
        return _grad(grad_expanded_x, slot_to_row, ctx.top_k, 0, 0, order), None, None


def npu_moe_init_routing_v2(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = 0,
    active_expert_range: Sequence[int] = (),
    row_idx_type: int = 0,
) -> tuple[torch.Tensor, ...]:
    """torch_npu.npu_moe_init_routing_v2 (aclnnMoeInitRoutingV3), its dropless unquantized case, by moegrad's routing.

    Shapes, dtypes and outputs in the module docstring. ``active_num`` and ``expert_capacity`` are
    unused by the kernel (its documentation: activeNum must be N*K, expertCapacity is not read).

    Raises:
        NotImplementedError: a quantized call (``quant_mode != -1``), ``scale`` or ``offset``,
            ``drop_pad_mode=1``, ``expert_tokens_num_type=2`` (key_value) or an id outside
            ``active_expert_range``.
        ValueError: an attribute the operator rejects.
        InvalidArgument: a dtype or an id the routing rejects (161002), or an ``active_expert_range``
            it rejects (561002), as :func:`moegrad.moe_init_routing_v2`.
    """
    unsupported = {
        "quant_mode": quant_mode != -1,
        "scale": scale is not None,
        "offset": offset is not None,
        "drop_pad_mode": drop_pad_mode != 0,
        "expert_tokens_num_type": expert_tokens_num_type == 2,
    }
    named = [name for name, refused in unsupported.items() if refused]
    if named:
        raise NotImplementedError(
            f"moegrad emulates npu_moe_init_routing_v2 unquantized (quant_mode=-1), dropless, without scale or offset "
            f"and with count or cumsum counts; not {', '.join(named)}"
        )
    if expert_tokens_num_type not in (0, 1) or row_idx_type not in (0, 1):
        raise ValueError(
            f"expert_tokens_num_type={expert_tokens_num_type} and row_idx_type={row_idx_type} must be 0 or 1"
        )
    if expert_idx.dim() != 2:
        raise ValueError(f"expert_idx must be 2-D [N, K], got shape {list(expert_idx.shape)}")
    slots = expert_idx.shape[0] * expert_idx.shape[1]
    if active_num > 0 and active_num != slots:
        raise ValueError(f"active_num={active_num} must be N*K={slots} (or -1): the kernel checks it so")
    start, end = _expert_range(active_expert_range, expert_num, to_numpy(expert_idx))
    options = (start, end, expert_tokens_num_type, bool(expert_tokens_num_flag), row_idx_type)
    outputs: tuple[torch.Tensor, ...] = _Routing.apply(x, expert_idx, options)
    return outputs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m moegrad.msprobe``: register, unregister or show moegrad's bench functions in msprobe."""
    from moegrad._msprobe_install import main as install_main

    return install_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
