"""A case file is bounded before anything is inflated: its length, its zip directory, each member's
declared size and .npy header, and the bytes actually inflated.

Attacks built here in a tmp dir: a zip bomb hidden in a member that is not an .npy array (NumPy
would read it whole, as bytes), a member that states a smaller size than its data inflates to, a
sparse file, a directory of a thousand entries, a key twice. Each is an invalid case (a sweep's
exit 3) naming the file, and costs the reader little memory (tracemalloc's peak of the Python heap,
which NumPy's buffers are traced in too).

Oracles: the zip format as PKWARE's APPNOTE.TXT lays it out (the local header's and the central
directory's uncompressed-size fields, patched here by offset) and NumPy's .npy format (NEP 1),
written by hand; the sizes computed here.
"""

from __future__ import annotations

import io
import os
import struct
import tracemalloc
import warnings
import zipfile

import numpy as np
import pytest

from moegrad import accuracy
from moegrad.accuracy._cases import case_names_order
from moegrad.cli._main import main

MIB = 1 << 20


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, version=(1, 0))
    return buffer.getvalue()


def good_members() -> dict[str, bytes]:
    return {
        "grad_expanded_x.npy": npy(np.ones((4, 2), np.float32)),
        "expanded_row_idx.npy": npy(np.arange(4, dtype=np.int32)),
        "candidate.npy": npy(np.ones((2, 2), np.float32)),
        "top_k.npy": npy(np.array(2, np.int64)),
    }


def write_zip(path, members: dict[str, bytes], compression=zipfile.ZIP_DEFLATED) -> None:
    with zipfile.ZipFile(path, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def zeros_member(archive: zipfile.ZipFile, name: str, size: int) -> None:
    """A deflated member of ``size`` zero bytes, written a MiB at a time (about size / 1000 on disk)."""
    with archive.open(name, "w", force_zip64=True) as member:
        block = bytes(MIB)
        for _ in range(size // MIB):
            member.write(block)


def peak_while(action) -> int:
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def refused(path, *words) -> str:
    with pytest.raises(ValueError) as error:
        accuracy.load_case(path)
    message = str(error.value)
    assert str(path) in message and all(word in message for word in words), message
    return message


def test_a_zip_bomb_in_a_member_that_is_not_an_npy_array_is_refused_unread(tmp_path):
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in good_members().items():
            if name != "candidate.npy":
                archive.writestr(name, data)
        zeros_member(archive, "candidate", 256 * MIB)  # NumPy reads a member without .npy as bytes, whole
    assert path.stat().st_size < 2 * MIB
    peak = peak_while(lambda: refused(path, "'candidate'", "not an .npy array"))
    assert peak < 8 * MIB, f"refusing the bomb took {peak} bytes"
    assert main(["compare", "--local", "--cases", str(tmp_path), "--no-progress"]) == 3


def patch_sizes(data: bytes, name: bytes, size: int) -> bytes:
    """The archive with ``name``'s uncompressed size stated as ``size`` in its local header (offset
    22) and its central directory entry (offset 24), APPNOTE.TXT 4.3.7 and 4.3.12."""
    data = bytearray(data)
    local = data.find(b"PK\x03\x04")
    while local >= 0:
        (length,) = struct.unpack_from("<H", data, local + 26)
        if data[local + 30 : local + 30 + length] == name:
            struct.pack_into("<I", data, local + 22, size)
        local = data.find(b"PK\x03\x04", local + 4)
    central = data.find(b"PK\x01\x02")
    while central >= 0:
        (length,) = struct.unpack_from("<H", data, central + 28)
        if data[central + 46 : central + 46 + length] == name:
            struct.pack_into("<I", data, central + 24, size)
        central = data.find(b"PK\x01\x02", central + 4)
    return bytes(data)


def test_a_member_that_inflates_past_its_declared_size_is_refused_and_not_read_past_it(tmp_path):
    members = good_members()
    header_and_array = members["grad_expanded_x.npy"]
    members["grad_expanded_x.npy"] = header_and_array + bytes(64 * MIB)  # inflates 64 MiB past its array
    buffer = io.BytesIO()
    write_zip(buffer, members)
    path = tmp_path / "liar.npz"
    path.write_bytes(patch_sizes(buffer.getvalue(), b"grad_expanded_x.npy", len(header_and_array)))
    with zipfile.ZipFile(path) as archive:  # what zipfile itself now believes
        assert archive.getinfo("grad_expanded_x.npy").file_size == len(header_and_array)
    peak = peak_while(lambda: refused(path, "'grad_expanded_x'", "cannot be read", "CRC"))
    assert peak < 8 * MIB


def test_a_sparse_file_is_refused_by_its_length_before_it_is_read(tmp_path):
    path = tmp_path / "sparse.npz"
    write_zip(path, good_members())
    os.truncate(path, 8 << 30)  # 8 GiB, almost all of it a hole
    message = refused(path, f"is {8 << 30} bytes long", f"({2 << 30} bytes)", "MOEGRAD_MAX_CASE_BYTES")
    assert "arrays" in message
    assert main(["compare", "--local", "--cases", str(tmp_path), "--no-progress"]) == 3


def test_a_sparse_file_over_a_small_limit_costs_no_memory(tmp_path, monkeypatch):
    path = tmp_path / "sparse.npz"
    write_zip(path, good_members())
    os.truncate(path, 64 * MIB)
    monkeypatch.setenv("MOEGRAD_MAX_CASE_BYTES", str(MIB))
    peak = peak_while(lambda: refused(path, f"is {64 * MIB} bytes long"))
    assert peak < 8 * MIB


def test_a_sparse_file_within_the_limit_but_with_no_archive_at_its_end_is_not_read(tmp_path):
    path = tmp_path / "hole.npz"
    write_zip(path, good_members())
    with open(path, "r+b") as file:  # the archive moved behind a 64 MiB hole's end: no end record last
        data = file.read()
        file.seek(0)
        file.write(bytes(len(data)))
    os.truncate(path, 64 * MIB)
    peak = peak_while(lambda: refused(path, "is not an .npz archive"))
    assert peak < 8 * MIB


def test_a_directory_of_a_thousand_entries_is_refused(tmp_path):
    path = tmp_path / "crowd.npz"
    write_zip(path, {**good_members(), **{f"x{i}.npy": b"" for i in range(1000)}})
    refused(path, "lists 1004 entries")
    assert case_names_order(path)  # unreadable: counted as naming a profile, not sent


def test_a_key_twice_or_a_header_that_disagrees_with_its_member_is_refused(tmp_path):
    members = good_members()
    path = tmp_path / "twice.npz"
    with zipfile.ZipFile(path, "w") as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile warns of the duplicate name it writes
        for name, data in [*members.items(), ("top_k.npy", members["top_k.npy"])]:
            archive.writestr(name, data)
    refused(path, "'top_k' is in the archive twice")
    members["candidate.npy"] += bytes(16)  # 16 bytes after the array its header describes
    write_zip(tmp_path / "longer.npz", members)
    refused(tmp_path / "longer.npz", "'candidate' is declared", "says 128 + 16")


def test_a_good_case_compressed_or_not_is_read_as_written(tmp_path):
    for compression in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        write_zip(tmp_path / "good.npz", good_members(), compression)
        fields, candidate = accuracy.load_case(tmp_path / "good.npz")
        assert fields["top_k"] == 2 and fields["expanded_row_idx"].tolist() == [0, 1, 2, 3]
        assert candidate.shape == (2, 2)
