"""A case file's archive, read within its size limit whatever the file claims (docs/accuracy.md, "Bulk checking").

A case file is a zip archive (``numpy.savez``) of ``.npy`` members (NumPy's format, NEP 1). A
compressed member of a few MiB can inflate to gigabytes, a zip can state sizes its data does not
keep, and NumPy reads a member that is not an ``.npy`` array whole, as bytes. So a case is read only
when, in this order:

1. the file is at most ``limit`` plus :data:`ARCHIVE_OVERHEAD_BYTES` long, and its last bytes hold
   a zip end record, both checked before the rest is read (its bytes are read whole to be digested:
   a sparse file over the limit is refused by its length, one with no archive at its end by that);
2. its central directory, as the end record states it (PKWARE's APPNOTE.TXT 4.3.16, and 4.3.14
   for ZIP64), holds at most :data:`MAX_MEMBERS` entries in at most :data:`MAX_DIRECTORY_BYTES`
   (zipfile builds an object per entry);
3. every member is ``<key>.npy`` with ``key`` one of a case's, at most once;
4. each member's ``.npy`` header (read alone; NumPy's own parser, at most 10,000 bytes) is version
   1.0 or 2.0, its shape times its item size plus the header is exactly the member's declared
   uncompressed size, and the arrays together take at most ``limit`` bytes.

Each array is then read by ``numpy.lib.format.read_array`` (``allow_pickle=False``) from its
member, which zipfile ends at the declared size; reading on to the member's end checks its CRC-32,
so a member whose data inflates past what it declares is refused, never read past it.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from typing import Any

import numpy as np

__all__ = [
    "ARCHIVE_OVERHEAD_BYTES",
    "MAX_DIRECTORY_BYTES",
    "MAX_MEMBERS",
    "archive_names",
    "read_arrays",
    "read_case_file",
]

#: The bytes a case file may hold beyond its arrays: the .npy headers and the zip's own records.
ARCHIVE_OVERHEAD_BYTES = 1 << 20
#: The most entries a case archive's central directory may list (a case has 8 keys at most).
MAX_MEMBERS = 16
#: The most bytes that central directory may take (an entry of a case takes well under 200).
MAX_DIRECTORY_BYTES = 64 << 10
_END = b"PK\x05\x06"  # end of central directory record (APPNOTE.TXT 4.3.16), 22 bytes + a comment
_ZIP64_LOCATOR = b"PK\x06\x07"  # 20 bytes, just before the end record (4.3.15)
_ZIP64_END = b"PK\x06\x06"  # ZIP64 end of central directory record (4.3.14)
_TAIL = 22 + 0xFFFF  # the end record and the longest comment


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.1f} MiB"


def _too_long(path: str, size: int, limit: int) -> ValueError:
    return ValueError(
        f"{path} is {size} bytes long, more than a case of at most {_gib(limit)} ({limit} bytes) of "
        f"arrays can be (plus {ARCHIVE_OVERHEAD_BYTES} bytes of headers); split the case, or set "
        "MOEGRAD_MAX_CASE_BYTES to a larger number of bytes"
    )


def read_case_file(path: str, limit: int) -> bytes:
    """A case file's bytes, when it is at most ``limit`` + ARCHIVE_OVERHEAD_BYTES long and ends
    with a zip directory within the bounds (both checked before the rest is read).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is longer (measured before reading, and while reading: a file that grows),
            or its last bytes hold no zip end record, or one over the directory's bounds.
    """
    most = limit + ARCHIVE_OVERHEAD_BYTES
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > most:
            raise _too_long(path, size, limit)
        file.seek(max(0, size - _TAIL))
        tail = file.read(_TAIL)
        if _directory(tail) is None:
            raise ValueError(f"{path} is not an .npz archive (numpy.savez writes one; docs/accuracy.md)")
        _check_directory(tail, path)
        file.seek(0)
        data = file.read(size + 1)  # a byte more: a file that grew since is seen to
    if len(data) > most:
        raise _too_long(path, len(data), limit)
    return data


def _directory(tail: bytes) -> tuple[int, int] | None:
    """(entries, bytes) of the central directory that a zip's last bytes state, found as zipfile
    finds them (the end record at the very end, else the last one in the tail; a ZIP64 record just
    before its locator overrides it), or None when there is no end record (zipfile then says why)."""
    end = len(tail) - 22
    if not (end >= 0 and tail[end : end + 4] == _END and tail[-2:] == b"\0\0"):
        end = tail.rfind(_END)
        if end < 0 or end + 22 > len(tail):
            return None
    entries, size = struct.unpack_from("<HI", tail, end + 10)
    locator, record = end - 20, end - 20 - 56
    if record >= 0 and tail[locator : locator + 4] == _ZIP64_LOCATOR and tail[record : record + 4] == _ZIP64_END:
        entries, size = struct.unpack_from("<QQ", tail, record + 32)
    return entries, size


def _check_directory(tail: bytes, path: str) -> None:
    directory = _directory(tail)
    if directory is not None and (directory[0] > MAX_MEMBERS or directory[1] > MAX_DIRECTORY_BYTES):
        raise ValueError(
            f"{path}: its zip directory lists {directory[0]} entries in {directory[1]} bytes; a case "
            f"archive holds at most {MAX_MEMBERS} in {MAX_DIRECTORY_BYTES} bytes"
        )


def archive_names(path: str) -> list[str] | None:
    """The member names of a case file's archive (its directory read, no member), or None when it
    is not a readable case archive (not a zip, or a directory over the bounds)."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            file.seek(max(0, size - _TAIL))
            _check_directory(file.read(_TAIL), path)
            with zipfile.ZipFile(file) as archive:
                return archive.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return None


def _header(member: Any, name: str, path: str) -> tuple[int, tuple[int, ...], np.dtype[Any]]:
    """(header bytes, shape, dtype) of an ``.npy`` member, read from its first bytes alone.

    Raises:
        ValueError: not an .npy header of version 1.0 or 2.0, naming the array.
    """
    try:
        version = np.lib.format.read_magic(member)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"format version {version[0]}.{version[1]}; a case is written with 1.0 or 2.0")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(member)
    except Exception as exc:  # damaged bytes: what NumPy's parser and zipfile raise is no one type
        raise ValueError(f"{path}: the array {name!r} cannot be read ({type(exc).__name__}: {exc})") from None
    return member.tell(), shape, dtype


def _check_names(archive: zipfile.ZipFile, path: str, known: frozenset[str], required: tuple[str, ...]) -> None:
    """Every member is ``<key>.npy`` of a known key, once; every required key is there (rule 3).

    Raises:
        ValueError: naming the member or key and the file.
    """
    seen: set[str] = set()
    for info in archive.infolist():
        name = info.filename.removesuffix(".npy")
        if name not in known:
            raise ValueError(f"{path}: unknown key {name!r}; a case holds {', '.join(sorted(known))}")
        if not info.filename.endswith(".npy"):
            raise ValueError(f"{path}: the member {info.filename!r} is not an .npy array ({name}.npy is)")
        if name in seen:
            raise ValueError(f"{path}: the array {name!r} is in the archive twice")
        seen.add(name)
    missing = [name for name in required if name not in seen]
    if missing:
        raise ValueError(f"{path}: missing {missing[0]!r} (a case holds {', '.join(required[:-1])} and {required[-1]})")


def _check_sizes(archive: zipfile.ZipFile, path: str, limit: int) -> None:
    """Each array's bytes once read, from its .npy header: together at most ``limit``, and each
    with its header the member's declared size (rule 4).

    Raises:
        ValueError: a header that is not one, arrays over the limit, or a header whose size is not
            its member's (naming the file, the array and the sizes).
    """
    sizes: dict[str, int] = {}
    declared: dict[str, tuple[int, int]] = {}  # name -> (header bytes, declared bytes)
    for info in archive.infolist():
        name = info.filename.removesuffix(".npy")
        with archive.open(info) as member:
            length, shape, dtype = _header(member, name, path)
        sizes[name], declared[name] = math.prod(shape) * dtype.itemsize, (length, info.file_size)
    total = sum(sizes.values())
    if total > limit:
        largest = max(sizes, key=lambda name: sizes[name])
        raise ValueError(
            f"{path}: its arrays would take {_gib(total)} ({total} bytes) once read ({largest} "
            f"{_gib(sizes[largest])}), over the limit of {_gib(limit)} ({limit} bytes); split the "
            "case, or set MOEGRAD_MAX_CASE_BYTES to a larger number of bytes"
        )
    for name, (length, size) in declared.items():
        if length + sizes[name] != size:
            raise ValueError(
                f"{path}: the array {name!r} is declared {size} bytes, and its .npy header says "
                f"{length} + {sizes[name]}"
            )


def read_arrays(
    data: bytes, path: str, limit: int, known: frozenset[str], required: tuple[str, ...]
) -> dict[str, np.ndarray]:
    """The arrays of a case file's bytes, each read within the bounds above.

    Args:
        data: the file's bytes (:func:`read_case_file`).
        path: the file, named in messages.
        limit: the most bytes its arrays may take once read, together.
        known: the keys a case may hold.
        required: the keys it must hold.

    Returns:
        Key -> the array, as NumPy reads it.

    Raises:
        ValueError: the file is not a zip archive, or breaks a bound (the message names the file
            and what is wrong: the member, the size and the limit), or an array cannot be read.
    """
    if len(data) > limit + ARCHIVE_OVERHEAD_BYTES:
        raise _too_long(path, len(data), limit)
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise ValueError(f"{path} is not an .npz archive (numpy.savez writes one; docs/accuracy.md)")
    _check_directory(data[-_TAIL:], path)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            _check_names(archive, path, known, required)
            _check_sizes(archive, path, limit)
            return {info.filename.removesuffix(".npy"): _read(archive, info, path) for info in archive.infolist()}
    except zipfile.BadZipFile as exc:
        raise ValueError(f"{path} is not a valid .npz archive: {exc}") from None


def _read(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: str) -> np.ndarray:
    """One member's array, its member then read to its end (zipfile checks the CRC-32 there).

    Raises:
        ValueError: NumPy or zipfile cannot read it (naming the file and the array): damaged
            compressed bytes, a CRC mismatch, an object array (``allow_pickle=False``), a short member.
    """
    name = info.filename.removesuffix(".npy")
    try:
        with archive.open(info) as member:
            array = np.lib.format.read_array(member, allow_pickle=False)
            if member.read(1):
                raise ValueError("bytes after the array")
    except MemoryError:
        raise
    except Exception as exc:  # what NumPy and zipfile raise for damaged bytes is no one type
        raise ValueError(f"{path}: the array {name!r} cannot be read ({type(exc).__name__}: {exc})") from None
    return array
