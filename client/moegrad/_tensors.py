"""torch tensors at moegrad's edges: to NumPy on the way in, back to torch on the way out.

moegrad computes and travels on NumPy arrays. A ``torch.Tensor`` handed to a public function is
turned into an array here, and the result is turned back into a tensor on the input's device:

- a CPU tensor becomes an array over the same memory (no copy, any strides); a tensor on another
  device is copied to host memory first (``Tensor.cpu()``);
- bfloat16, which ``Tensor.numpy()`` refuses, is viewed as int16 and then as ``ml_dtypes.bfloat16``
  (the same 2-byte words, still no copy);
- a tensor that requires grad is detached (moegrad computes values, not graphs).

torch is never imported here: a value is a tensor only if the ``torch`` module the caller already
imported says so, so ``import moegrad`` stays free of torch.
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["is_tensor", "to_numpy", "to_torch"]

_BF16 = np.dtype(ml_dtypes.bfloat16)


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.Tensor`` (False whenever torch was never imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def to_numpy(value: Any) -> Any:
    """A NumPy array over a tensor's values (zero-copy for CPU tensors); anything else unchanged."""
    if not is_tensor(value):
        return value
    import torch

    tensor = value.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.is_conj() or tensor.is_neg():  # lazily conjugated/negated views: materialise them
        tensor = tensor.resolve_conj().resolve_neg()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_BF16)
    return tensor.numpy()


def to_torch(array: np.ndarray, like: Any) -> Any:
    """``array`` as a tensor on ``like``'s device when ``like`` is a tensor (zero-copy on the CPU), else ``array``."""
    if not is_tensor(like):
        return array
    import torch

    if array.dtype == _BF16:
        tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array)
    return tensor if like.device.type == "cpu" else tensor.to(like.device)
