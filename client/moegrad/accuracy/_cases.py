"""Bulk checking's files: one ``.npz`` file per case, and each case's result.

The run over the cases (it never stops on a bad one) is :mod:`moegrad.accuracy._sweep`'s; the
summary of their results, :mod:`moegrad.accuracy._summary`'s.

A case file (:func:`save_case`, :func:`load_case`; docs/accuracy.md, "Bulk checking") is a NumPy
``.npz`` archive holding the call and the candidate:

    grad_expanded_x   [N*K, H] / [A, H] / [E, C, H], float16, bfloat16 or float32
    expanded_row_idx  [N*K] int32
    candidate         [N, H], the call's dtype or float32
    top_k             0-d integer
    drop_pad_mode, active_num, order, allow_duplicate_indices   optional 0-d values

``numpy.savez`` stores a bfloat16 array as raw 2-byte words (``|V2``): :func:`load_case` reads any
such array back as ``ml_dtypes.bfloat16``, bit for bit. Archives are read with
``allow_pickle=False``, and only when their arrays take at most :data:`MAX_CASE_BYTES` together
(``MOEGRAD_MAX_CASE_BYTES`` changes it), by the file's length, each member's declared size and its
.npy header, before any array is read (:mod:`moegrad.accuracy._case_archive`): a compressed archive
of a few MiB can otherwise inflate to gigabytes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ml_dtypes
import numpy as np

from moegrad.accuracy._case_archive import archive_names, read_arrays, read_case_file
from moegrad.accuracy._results import ComparisonReport

__all__ = [
    "MAX_CASE_BYTES",
    "MAX_CASE_BYTES_ENV",
    "CaseResult",
    "CaseStatus",
    "case_digest",
    "case_from_bytes",
    "case_names_order",
    "fields_digest",
    "find_cases",
    "load_case",
    "max_case_bytes",
    "read_case_bytes",
    "save_case",
    "shard_of",
]

CaseStatus = Literal["pass", "warning", "fail", "invalid", "error"]
_TENSORS = ("grad_expanded_x", "expanded_row_idx", "candidate")
_INTEGERS = ("top_k", "drop_pad_mode", "active_num")
_KNOWN = frozenset({*_TENSORS, *_INTEGERS, "order", "allow_duplicate_indices"})

#: The most bytes a case file's arrays may take once read, together: 2 GiB, the service's default
#: largest request body (``MOEGRAD_MAX_BODY_BYTES``), which a larger case could not be sent in.
MAX_CASE_BYTES = 2 << 30
#: The environment variable that replaces :data:`MAX_CASE_BYTES` (a number of bytes >= 1).
MAX_CASE_BYTES_ENV = "MOEGRAD_MAX_CASE_BYTES"


@dataclass(frozen=True)
class CaseResult:
    """One case of a bulk run.

    Attributes:
        name: the case's name (the file's stem).
        status: ``"pass"``, ``"warning"``, ``"fail"`` (the report's verdict), ``"invalid"`` (the
            file or the call was rejected: no comparison ran) or ``"error"`` (the service failed).
        report: the comparison, or None when there is none.
        error: why there is no report (the exception's type and message), else None.
        path: the case file, when the case came from one.
    """

    name: str
    status: CaseStatus
    report: ComparisonReport | None
    error: str | None = None
    path: str | None = None


def _array(value: np.ndarray) -> np.ndarray:
    if value.dtype.kind == "V" and value.dtype.itemsize == 2 and value.dtype.fields is None:
        return value.view(ml_dtypes.bfloat16)
    return value


def save_case(
    path: str | os.PathLike[str],
    *,
    grad_expanded_x: np.ndarray,
    expanded_row_idx: np.ndarray,
    top_k: int,
    candidate: np.ndarray,
    drop_pad_mode: int = 0,
    active_num: int = 0,
    order: str | None = None,
    allow_duplicate_indices: bool = False,
) -> None:
    """Write one case file (an uncompressed ``.npz``; bfloat16 is stored as ``|V2``, see :func:`load_case`).

    Raises:
        OSError: the file cannot be written.
    """
    fields: dict[str, Any] = {
        "grad_expanded_x": grad_expanded_x,
        "expanded_row_idx": expanded_row_idx,
        "candidate": candidate,
        "top_k": np.int64(top_k),
        "drop_pad_mode": np.int64(drop_pad_mode),
        "active_num": np.int64(active_num),
    }
    if order is not None:
        fields["order"] = np.str_(order)
    if allow_duplicate_indices:
        fields["allow_duplicate_indices"] = np.bool_(True)
    with open(os.fspath(path), "wb") as file:
        np.savez(file, **fields)


def load_case(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> tuple[dict[str, Any], np.ndarray]:
    """Read one case file: the call's keyword arguments and the candidate.

    Args:
        path: the ``.npz`` case file.
        max_bytes: the most bytes its arrays may take once read, together (None: :func:`max_case_bytes`).

    Returns:
        ``(fields, candidate)``: ``fields`` as :class:`moegrad.MoeInitRoutingV2GradCall` takes them.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not an ``.npz`` archive, lacks a required array, holds an unknown key, a
            member that is not an ``.npy`` array or a value of the wrong kind (the message names the
            key), or it is longer, or its arrays would take more, than ``max_bytes`` allows (the
            message names the file, the size and the limit; nothing is read past it);
            ``MOEGRAD_MAX_CASE_BYTES`` that is not a whole number >= 1.
    """
    return case_from_bytes(read_case_bytes(path, max_bytes=max_bytes), os.fspath(path), max_bytes=max_bytes)


def read_case_bytes(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> bytes:
    """A case file's bytes (to digest and read), when its length fits ``max_bytes`` of arrays
    (None: :func:`max_case_bytes`) and their headers; measured before it is read.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is longer (naming the file, its length and the limit).
    """
    return read_case_file(os.fspath(path), max_case_bytes() if max_bytes is None else max_bytes)


def max_case_bytes() -> int:
    """The most bytes a case file's arrays may take once read: ``$MOEGRAD_MAX_CASE_BYTES``, else
    :data:`MAX_CASE_BYTES` (2 GiB).

    Raises:
        ValueError: the variable is set to something other than a whole number >= 1.
    """
    text = os.environ.get(MAX_CASE_BYTES_ENV, "").strip()
    if not text:
        return MAX_CASE_BYTES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{MAX_CASE_BYTES_ENV}={text!r} must be a whole number of bytes >= 1 (e.g. 4294967296)")
    return value


def case_digest(data: bytes) -> str:
    """A case file's digest, as a sweep's results file records it: ``"sha256:"`` and the hex
    SHA-256 of its bytes (a file written again, even with the same arrays, has another)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def fields_digest(fields: Mapping[str, Any], candidate: np.ndarray) -> str:
    """A case given as arrays (not a file): ``"sha256:"`` and the hex SHA-256 of each field's name
    and value (an array's dtype, shape and C-order bytes), in the order of the names."""
    digest = hashlib.sha256()
    for name, value in sorted({**fields, "candidate": candidate}.items()):
        digest.update(name.encode() + b"\0")
        if isinstance(value, np.ndarray):
            digest.update(f"{value.dtype.str}{list(value.shape)}".encode() + np.ascontiguousarray(value).tobytes())
        else:
            digest.update(repr(value).encode())
        digest.update(b"\0")
    return "sha256:" + digest.hexdigest()


def case_from_bytes(data: bytes, path: str, *, max_bytes: int | None = None) -> tuple[dict[str, Any], np.ndarray]:
    """:func:`load_case` of a case file's bytes (``path`` names it in messages).

    Raises:
        ValueError: as :func:`load_case`.
    """
    limit = max_case_bytes() if max_bytes is None else max_bytes
    arrays = read_arrays(data, path, limit, _KNOWN, (*_TENSORS, "top_k"))
    fields: dict[str, Any] = {name: _array(arrays[name]) for name in _TENSORS}
    for name in _INTEGERS:
        if name in arrays:
            value = arrays[name]
            if value.shape != () or value.dtype.kind not in "iu":
                raise ValueError(f"{path}: {name} must be a 0-d integer, got {value.dtype} {list(value.shape)}")
            fields[name] = int(value)
    if "order" in arrays:
        order = arrays["order"]
        if order.shape != () or order.dtype.kind != "U":
            raise ValueError(f"{path}: order must be a 0-d string")
        fields["order"] = str(order)
    if "allow_duplicate_indices" in arrays:
        fields["allow_duplicate_indices"] = bool(arrays["allow_duplicate_indices"])
    candidate = fields.pop("candidate")
    return fields, candidate


def case_names_order(case: str | os.PathLike[str] | tuple[str, Mapping[str, Any], Any]) -> bool:
    """Whether a case names its device profile: a ``(name, fields, candidate)`` case whose fields
    hold an ``order`` that is not None, or a case file holding an ``order`` array (its archive's
    names are read, not its arrays). A file that cannot be read counts as naming one: it is not
    sent, it is an invalid case."""
    if isinstance(case, tuple):
        return case[1].get("order") is not None
    names = archive_names(os.fspath(case))
    return names is None or "order.npy" in names


def shard_of(name: str, count: int) -> int:
    """The shard of ``count`` (>= 1) that the case called ``name`` belongs to: the first 8 bytes of
    the SHA-256 of its UTF-8 name, big-endian, modulo ``count``. Shards are disjoint and cover any
    list of cases, and a case keeps its shard when others are added or removed."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % count


def find_cases(directory: str | os.PathLike[str]) -> list[Path]:
    """The ``*.npz`` files directly in ``directory``, sorted by name.

    Raises:
        NotADirectoryError, FileNotFoundError: ``directory`` is not a folder.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder of .npz cases")
    return sorted(p for p in folder.iterdir() if p.suffix == ".npz" and p.is_file())
