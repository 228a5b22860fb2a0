"""moegrad for PyTorch: the Ascend kernel's backward as a torch operator, and the forward routing it pairs with.

Install with ``pip install 'moegrad[torch]'``; ``import moegrad`` never imports torch, this module does.

- ``torch.ops.moegrad.moe_init_routing_grad`` (also :func:`moe_init_routing_grad`): the schema of
  Huawei's PyTorch binding of aclnnMoeInitRoutingV2Grad,
  ``(Tensor grad_expanded_x, Tensor expanded_row_idx, int top_k, int drop_pad_mode=0,
  int active_num=0) -> Tensor``, registered with ``torch.library``: a fake kernel (shapes only) for
  ``torch.compile`` and FakeTensor, and one kernel for every device. It returns grad_x [N, H] with
  the bits of the device profile chosen by :func:`set_order` (default ``"ascend910b@9.1"``).
- ``torch.ops.moegrad.moe_init_routing_grad_ordered``: the same with a trailing ``str order`` (a
  profile name; docs/semantics.md).
- ``torch.ops.moegrad.moe_init_routing_v2`` (and :func:`moe_init_routing_v2`): the forward routing,
  aclnnMoeInitRoutingV2 (:mod:`moegrad.numerics._routing`); :class:`MoeInitRoutingV2` pairs it with the
  backward op, so ``expanded_x.backward(...)`` puts the device's bits in ``x.grad``.

Where the work runs: on the CPU the embedded emulation reads and writes the tensors' own memory
(no copy: a bfloat16 tensor is viewed as 2-byte words); a tensor on another device is copied to
host memory and the result back to that device. With :func:`set_service` (a :class:`moegrad.Client`)
every call of the backward op goes to that service instead, e.g. a server with an Ascend NPU.

Bad input raises :class:`moegrad.InvalidArgument` with the aclnn code and the field, as the NumPy
functions do. :func:`to_numpy` and :func:`to_torch` are the conversions at moegrad's edges (a CPU
tensor's memory viewed, bfloat16 as 2-byte words), for code that times or checks the op.
"""

from __future__ import annotations

import contextlib
import math
import threading
import typing
from collections.abc import Iterator

import torch

from moegrad._errors import AclnnStatus, InvalidArgument
from moegrad._tensors import to_numpy, to_torch
from moegrad.http._client import Client
from moegrad.numerics._reference import moe_init_routing_v2_grad as _grad_numpy
from moegrad.numerics._routing import MoeInitRoutingV2Result
from moegrad.numerics._routing import moe_init_routing_v2 as _routing_numpy
from moegrad.operator._profiles import DEFAULT_PROFILE, resolve_profile

__all__ = [
    "MoeInitRoutingV2",
    "moe_init_routing_grad",
    "moe_init_routing_grad_ordered",
    "moe_init_routing_v2",
    "set_order",
    "set_service",
    "to_numpy",
    "to_torch",
    "using_order",
    "using_service",
]

_GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_lock = threading.Lock()
_order: str = DEFAULT_PROFILE
_service: Client | None = None


# --------------------------------------------------------------------------------------------------
# Configuration: process-wide, so that autograd's device threads see it too
# --------------------------------------------------------------------------------------------------


def _check_order(order: object) -> str:
    """The canonical name of the profile ``order`` names (the client's own table, moegrad.PROFILES)."""
    try:
        if not isinstance(order, str):
            raise ValueError(f"{order!r} is not a profile name (a str)")
        return resolve_profile(order).name
    except ValueError as exc:
        raise InvalidArgument(
            f"order: {exc}", aclnn_status=AclnnStatus.ACLNN_ERR_PARAM_INVALID, field="order"
        ) from None


def set_order(order: str) -> str:
    """Set the device profile ``moe_init_routing_grad`` computes as, for the whole process.

    Args:
        order: any name of :data:`moegrad.ORDERS`: ``"<chip>@<release>"`` (e.g.
            ``"ascend950@9.1"``), a bare chip (its newest release), ``"sequential"`` (Huawei's test
            golden) or an older alias; kept as the profile's canonical name. The default is
            ``"ascend910b@9.1"`` (the Atlas A2 at CANN 9.1).

    Returns:
        The profile set before (its canonical name).

    Raises:
        InvalidArgument: an unknown name (161002, field ``order``).
    """
    global _order
    with _lock:
        previous, _order = _order, _check_order(order)
    return previous


def set_service(client: Client | None) -> Client | None:
    """Send every call of the backward op to a moegrad service (None: compute in-process again).

    Args:
        client: a :class:`moegrad.Client`; its errors (TransportError, DeviceBusy, ...) surface from
            the op. The order sent is the op's (see :func:`set_order`).

    Returns:
        The client set before, or None.
    """
    global _service
    if client is not None and not isinstance(client, Client):
        raise TypeError(f"client must be a moegrad.Client or None, got {type(client).__name__}")
    with _lock:
        previous, _service = _service, client
    return previous


@contextlib.contextmanager
def using_order(order: str) -> Iterator[None]:
    """:func:`set_order` for the duration of a ``with`` block (then the previous order again)."""
    previous = set_order(order)
    try:
        yield
    finally:
        set_order(previous)


@contextlib.contextmanager
def using_service(client: Client | None) -> Iterator[None]:
    """:func:`set_service` for the duration of a ``with`` block."""
    previous = set_service(client)
    try:
        yield
    finally:
        set_service(previous)


# --------------------------------------------------------------------------------------------------
# The backward: aclnnMoeInitRoutingV2Grad
# --------------------------------------------------------------------------------------------------


def _fail(status: AclnnStatus, field: str, message: str) -> InvalidArgument:
    return InvalidArgument(message, aclnn_status=status, field=field)


def _check_meta(grad: torch.Tensor, idx: torch.Tensor, top_k: int, drop_pad_mode: int, order: str) -> None:
    """The shape and dtype rules the fake kernel can check on the profile ``order`` (values need the
    data: the real kernel checks them); an empty grad_x from CANN 9.1 skips them but top_k's."""
    invalid, tiling = AclnnStatus.ACLNN_ERR_PARAM_INVALID, resolve_profile(order).attribute_status
    empty_out = idx.dim() == 1 and grad.dim() >= 1 and (idx.shape[0] == 0 or grad.shape[-1] == 0)
    if resolve_profile(order).empty_out_skips_checks and empty_out:
        if top_k <= 0:
            raise _fail(tiling, "top_k", f"top_k={top_k} must be greater than 0")
        return
    if grad.dtype not in _GRAD_DTYPES:
        raise _fail(
            invalid,
            "grad_expanded_x",
            f"grad_expanded_x.dtype={grad.dtype} is not one of float16, "
            "bfloat16, float32; cast it first, e.g. .float()",
        )
    if idx.dtype != torch.int32:
        raise _fail(
            invalid, "expanded_row_idx", f"expanded_row_idx.dtype={idx.dtype} is not int32; cast it first, e.g. .int()"
        )
    if drop_pad_mode not in (0, 1):
        raise _fail(
            tiling, "drop_pad_mode", f"drop_pad_mode={drop_pad_mode} must be 0 (dropless/active) or 1 (drop/pad)"
        )
    if top_k <= 0:
        raise _fail(tiling, "top_k", f"top_k={top_k} must be greater than 0")
    if grad.dim() != (3 if drop_pad_mode == 1 else 2) or idx.dim() != 1:
        raise _fail(
            tiling,
            "grad_expanded_x" if idx.dim() == 1 else "expanded_row_idx",
            f"grad_expanded_x {list(grad.shape)} / expanded_row_idx {list(idx.shape)}: the ranks must be "
            f"{3 if drop_pad_mode == 1 else 2} and 1 for drop_pad_mode={drop_pad_mode}",
        )


def _run_grad(
    grad_expanded_x: torch.Tensor,
    expanded_row_idx: torch.Tensor,
    top_k: int,
    drop_pad_mode: int,
    active_num: int,
    order: str,
) -> torch.Tensor:
    service = _service
    if service is not None:
        # Client takes and returns torch tensors (moegrad._tensors); its annotations name the NumPy form
        run_grad: typing.Any = service.moe_init_routing_v2_grad
        result: torch.Tensor = run_grad(
            grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, order=order
        )
        return result
    grad_x = _grad_numpy(
        to_numpy(grad_expanded_x), to_numpy(expanded_row_idx), top_k, drop_pad_mode, active_num, order=order
    )
    return to_torch(grad_x, grad_expanded_x)


@torch.library.custom_op(
    "moegrad::moe_init_routing_grad",
    mutates_args=(),
    schema=(
        "(Tensor grad_expanded_x, Tensor expanded_row_idx, int top_k, int drop_pad_mode=0, int active_num=0) -> Tensor"
    ),
)
def moe_init_routing_grad(
    grad_expanded_x: torch.Tensor,
    expanded_row_idx: torch.Tensor,
    top_k: int,
    drop_pad_mode: int = 0,
    active_num: int = 0,
) -> torch.Tensor:
    """gradX of aclnnMoeInitRoutingV2Grad, as the device profile :func:`set_order` chose computes it.

    ``grad_x[i] = sum over t < K of grad_expanded_x[expanded_row_idx[i*K + t]]``, skipping -1 in
    drop/pad mode and indices >= active_num in active mode (on ``ascend950@9.1`` also any negative
    index, and a dropless index >= N*K; docs/semantics.md section 2).

    Args:
        grad_expanded_x: [N*K, H] (dropless), [A, H] (active) or [E, C, H] (drop/pad); float16,
            bfloat16 or float32; any device.
        expanded_row_idx: [N*K] int32, slot -> row (the layout aclnnMoeInitRoutingV2 returns).
        top_k: K > 0.
        drop_pad_mode: 0 dropless/active, 1 drop/pad.
        active_num: A; 0 dropless, > 0 active.

    Returns:
        grad_x, [N, H], grad_expanded_x's dtype and device.

    Raises:
        InvalidArgument: a documented constraint is broken (161001 / 161002 / 561002, 561103 from CANN 9.1).
    """
    return _run_grad(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, _order)


@torch.library.custom_op(
    "moegrad::moe_init_routing_grad_ordered",
    mutates_args=(),
    schema=(
        "(Tensor grad_expanded_x, Tensor expanded_row_idx, int top_k, int drop_pad_mode=0, int active_num=0, "
        f'str order="{DEFAULT_PROFILE}") -> Tensor'
    ),
)
def moe_init_routing_grad_ordered(
    grad_expanded_x: torch.Tensor,
    expanded_row_idx: torch.Tensor,
    top_k: int,
    drop_pad_mode: int = 0,
    active_num: int = 0,
    order: str = DEFAULT_PROFILE,
) -> torch.Tensor:
    """:func:`moe_init_routing_grad` with the device profile as an argument (any name of :data:`moegrad.ORDERS`)."""
    return _run_grad(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, _check_order(order))


def _grad_fake(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=0, active_num=0, order=None):
    profile = _order if order is None else _check_order(order)
    _check_meta(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, profile)
    return grad_expanded_x.new_empty((expanded_row_idx.shape[0] // top_k, grad_expanded_x.shape[-1]))


moe_init_routing_grad.register_fake(_grad_fake)
moe_init_routing_grad_ordered.register_fake(_grad_fake)


def _grad_setup_context(ctx, inputs, output) -> None:
    grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num = inputs[:5]
    ctx.save_for_backward(expanded_row_idx)
    ctx.shape = tuple(grad_expanded_x.shape)
    ctx.top_k, ctx.drop_pad_mode, ctx.active_num = top_k, drop_pad_mode, active_num


def _grad_backward(ctx, grad_grad_x: torch.Tensor):
    """grad_x is linear in grad_expanded_x: each used row receives the gradient of its token's row."""
    (idx,) = ctx.saved_tensors
    rows = math.prod(ctx.shape[:-1])
    slots = torch.arange(idx.shape[0], device=idx.device)
    if ctx.drop_pad_mode == 1:
        used = idx >= 0
    elif ctx.active_num > 0:
        used = idx < ctx.active_num
    else:
        used = torch.ones_like(idx, dtype=torch.bool)
    target = torch.where(used, idx, rows).long()  # unused slots go to a spare row, dropped below
    source = grad_grad_x.index_select(0, slots // ctx.top_k)
    out = grad_grad_x.new_zeros((rows + 1, ctx.shape[-1])).index_copy(0, target, source)
    return (out[:rows].reshape(ctx.shape),) + (None,) * (len(ctx.needs_input_grad) - 1)


moe_init_routing_grad.register_autograd(_grad_backward, setup_context=_grad_setup_context)
moe_init_routing_grad_ordered.register_autograd(_grad_backward, setup_context=_grad_setup_context)


# --------------------------------------------------------------------------------------------------
# The forward: aclnnMoeInitRoutingV2, and its pairing with the backward
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "moegrad::moe_init_routing_v2",
    mutates_args=(),
    schema=(
        "(Tensor x, Tensor expert_idx, int active_num=0, int expert_capacity=0, int expert_num=0, int drop_pad_mode=0, "
        "int expert_tokens_count_or_cumsum_flag=0, bool expert_tokens_before_capacity_flag=False, "
        "int[]? active_expert_range=None) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
)
def _routing_op(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    active_num: int = 0,
    expert_capacity: int = 0,
    expert_num: int = 0,
    drop_pad_mode: int = 0,
    expert_tokens_count_or_cumsum_flag: int = 0,
    expert_tokens_before_capacity_flag: bool = False,
    active_expert_range: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    result = _routing_numpy(
        to_numpy(x),
        to_numpy(expert_idx),
        active_num,
        expert_capacity,
        expert_num,
        drop_pad_mode,
        expert_tokens_count_or_cumsum_flag,
        expert_tokens_before_capacity_flag,
        active_expert_range=active_expert_range,
    )
    return tuple(
        torch.empty(0, dtype=torch.int32, device=x.device) if value is None else to_torch(value, x) for value in result
    )  # type: ignore[return-value]


@_routing_op.register_fake
def _routing_fake(
    x,
    expert_idx,
    active_num=0,
    expert_capacity=0,
    expert_num=0,
    drop_pad_mode=0,
    expert_tokens_count_or_cumsum_flag=0,
    expert_tokens_before_capacity_flag=False,
    active_expert_range=None,
):
    slots = expert_idx.shape[0] * expert_idx.shape[1]
    if drop_pad_mode == 1:
        expanded_x = x.new_empty((expert_num, expert_capacity, x.shape[1]))
    else:
        rows = slots if active_num == 0 else min(active_num, slots)
        expanded_x = x.new_empty((rows, x.shape[1]))
    counts = drop_pad_mode == 0 and expert_tokens_count_or_cumsum_flag > 0
    before = drop_pad_mode == 1 and expert_tokens_before_capacity_flag
    int32 = {"dtype": torch.int32, "device": x.device}
    return (
        expanded_x,
        torch.empty(slots, **int32),
        torch.empty(
            (expert_num if not active_expert_range else active_expert_range[1] - active_expert_range[0])
            if counts
            else 0,
            **int32,
        ),
        torch.empty(expert_num if before else 0, **int32),
    )


class MoeInitRoutingV2(torch.autograd.Function):
    """The forward routing with aclnnMoeInitRoutingV2Grad as its backward.

    ``MoeInitRoutingV2.apply(x, expert_idx, active_num, expert_capacity, expert_num, drop_pad_mode,
    expert_tokens_count_or_cumsum_flag, expert_tokens_before_capacity_flag, active_expert_range)``
    returns the four
    outputs of ``torch.ops.moegrad.moe_init_routing_v2`` (an absent count output is an empty int32
    tensor); the gradient of expanded_x flows to x through ``moe_init_routing_grad_ordered`` with
    the order that was set when the forward ran. Only x is differentiable.
    """

    @staticmethod
    def forward(
        ctx,
        x,
        expert_idx,
        active_num=0,
        expert_capacity=0,
        expert_num=0,
        drop_pad_mode=0,
        expert_tokens_count_or_cumsum_flag=0,
        expert_tokens_before_capacity_flag=False,
        active_expert_range=None,
    ):
        outputs = torch.ops.moegrad.moe_init_routing_v2(
            x,
            expert_idx,
            active_num,
            expert_capacity,
            expert_num,
            drop_pad_mode,
            expert_tokens_count_or_cumsum_flag,
            expert_tokens_before_capacity_flag,
            None if active_expert_range is None else [int(value) for value in active_expert_range],
        )
        expanded_row_idx = outputs[1]
        ctx.save_for_backward(expanded_row_idx)
        ctx.top_k = expert_idx.shape[1]
        ctx.drop_pad_mode = drop_pad_mode
        # The backward's active_num is the row count of expanded_x: min(A, N*K) (0: dropless; ignored in drop/pad).
        ctx.active_num = outputs[0].shape[0] if drop_pad_mode == 0 and active_num > 0 else 0
        ctx.order = _order
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_expanded_x, *unused):
        (expanded_row_idx,) = ctx.saved_tensors
        grad_x = torch.ops.moegrad.moe_init_routing_grad_ordered(
            grad_expanded_x.contiguous(), expanded_row_idx, ctx.top_k, ctx.drop_pad_mode, ctx.active_num, ctx.order
        )
        return (grad_x,) + (None,) * 8


def moe_init_routing_v2(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    active_num: int = 0,
    expert_capacity: int = 0,
    expert_num: int = 0,
    drop_pad_mode: int = 0,
    expert_tokens_count_or_cumsum_flag: int = 0,
    expert_tokens_before_capacity_flag: bool = False,
    *,
    active_expert_range: typing.Sequence[int] | None = None,
) -> MoeInitRoutingV2Result:
    """aclnnMoeInitRoutingV2 on torch tensors, differentiable in x with the device's backward.

    Arguments, outputs and errors as :func:`moegrad.moe_init_routing_v2` (x [N, H] float16 /
    bfloat16 / float32, expert_idx [N, K] int32 or int64, on any device); the outputs are tensors on
    x's device, an absent count output is None. ``expanded_x.backward(g)`` sets ``x.grad`` to
    aclnnMoeInitRoutingV2Grad's result for g (through :class:`MoeInitRoutingV2`).

    With ``active_expert_range=(start, end)`` the slots of other experts get index -1, as Huawei's
    Ascend 950 binding (``cann_ops_transformer.moe_init_routing``) returns them; its backward, the
    operator in dropless mode with those -1 slots, is defined only on the 950 from CANN 9.1: set
    the order to ``"ascend950@9.1"`` (:func:`set_order`) before the forward, or the backward raises
    InvalidArgument (161002) naming that profile.
    """
    outputs = MoeInitRoutingV2.apply(
        x,
        expert_idx,
        active_num,
        expert_capacity,
        expert_num,
        drop_pad_mode,
        expert_tokens_count_or_cumsum_flag,
        expert_tokens_before_capacity_flag,
        active_expert_range,
    )
    expanded_x, expanded_row_idx, count_or_cumsum, before_capacity = outputs
    counts = drop_pad_mode == 0 and expert_tokens_count_or_cumsum_flag > 0
    before = drop_pad_mode == 1 and bool(expert_tokens_before_capacity_flag)
    return MoeInitRoutingV2Result(
        expanded_x, expanded_row_idx, count_or_cumsum if counts else None, before_capacity if before else None
    )
