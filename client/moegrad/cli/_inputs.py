"""What the ``moegrad`` commands read and write: .npy files, the call's flags, the client's flags.

Shared by the commands of :mod:`moegrad.cli._main` and :mod:`moegrad.cli._explain`; a file that
cannot be read or written is a :class:`~moegrad.cli._parser.UsageError` (exit 2) naming the flag.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import ml_dtypes
import numpy as np

from moegrad import Client
from moegrad.cli._parser import UsageError, index_as_int32, with_flags

__all__ = [
    "TENSOR_FIELDS",
    "call_fields",
    "check_writable",
    "load_npy",
    "open_client",
    "read_npy",
    "save_npy",
    "write_npy",
]


# --------------------------------------------------------------------------------------------------
# .npy in and out
# --------------------------------------------------------------------------------------------------


def load_npy(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an array saved with ``numpy.save``; a raw 2-byte ``|V2`` array is read as bfloat16.

    ``numpy.save`` of an ``ml_dtypes.bfloat16`` array writes the dtype descriptor ``'<V2'`` (NumPy
    does not know the type), so ``numpy.load`` gives back untyped 2-byte words; they are viewed as
    ``ml_dtypes.bfloat16`` here, which restores the array bit for bit.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a single-array .npy file (pickled objects are refused).
    """
    array = np.load(os.fspath(path), allow_pickle=False)
    if not isinstance(array, np.ndarray):  # an .npz archive
        array.close()
        raise ValueError(f"{os.fspath(path)} is an .npz archive; save one array with numpy.save")
    if array.dtype.kind == "V" and array.dtype.itemsize == 2 and array.dtype.fields is None:
        array = array.view(ml_dtypes.bfloat16)
    return array


def save_npy(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Write ``array`` to exactly ``path`` with ``numpy.save`` (bfloat16 is stored as ``|V2``, see :func:`load_npy`)."""
    with open(os.fspath(path), "wb") as file:
        np.save(file, array, allow_pickle=False)


# --------------------------------------------------------------------------------------------------
# The client's and the call's flags
# --------------------------------------------------------------------------------------------------


def open_client(args: argparse.Namespace) -> Client:
    try:
        return Client(
            args.url[0] if len(args.url) == 1 else args.url,
            timeout_s=args.timeout,
            retries=args.retries,
            token=args.token,
            verify=args.cacert if args.cacert else True,
        )
    except (TypeError, ValueError) as exc:  # e.g. a --url that is not an http(s) URL
        raise UsageError(with_flags(str(exc))) from None


def read_npy(path: str, flag: str) -> np.ndarray:
    try:
        return load_npy(path)
    # EOFError: an empty file; MemoryError: a header that claims more bytes than the machine has
    except (OSError, ValueError, EOFError, MemoryError) as exc:
        raise UsageError(f"cannot read {flag} {path}: {exc}") from None


TENSOR_FIELDS = ("grad_expanded_x", "expanded_row_idx")


def call_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name in TENSOR_FIELDS:
        fields[name] = read_npy(getattr(args, name), f"--{name.replace('_', '-')}")
    fields["expanded_row_idx"] = index_as_int32(fields["expanded_row_idx"], "--expanded-row-idx", args.expanded_row_idx)
    fields.update(
        top_k=args.top_k,
        drop_pad_mode=args.drop_pad_mode,
        active_num=args.active_num,
        allow_duplicate_indices=args.allow_duplicate_indices,
    )
    if args.order is not None:
        fields["order"] = args.order
    return fields


def check_writable(path: str) -> None:
    """Refuse an output path whose folder does not exist, before any work is done."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write -o {path}: the folder {folder} does not exist")


def write_npy(path: str, grad_x: np.ndarray) -> None:
    try:
        save_npy(path, grad_x)
    except OSError as exc:
        raise UsageError(f"cannot write -o {path}: {exc}") from None
