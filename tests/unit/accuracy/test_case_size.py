"""A case file's arrays are sized from their .npy headers before any is read: over the cap (2 GiB,
or MOEGRAD_MAX_CASE_BYTES) the case is invalid (a sweep's exit 3), naming the file, the size and
the limit, and nothing is inflated.

Oracles: the .npy format as NumPy's format document (NEP 1) defines it, written by hand here (magic,
version 1.0, a little-endian uint16 header length, a dict literal padded to 64 bytes); the size of
each array computed here as its shape's product times its item size; save_case's 0-d int64 values.
"""

from __future__ import annotations

import io
import math
import zipfile

import numpy as np
import pytest

from moegrad import accuracy
from moegrad.cli._main import main
from support.oracle import device_k2, oracle_call

GIB = 1 << 30


def npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """A version 1.0 .npy header (NEP 1), padded with spaces and a newline to a multiple of 64 bytes."""
    header = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode("latin1")
    pad = 64 - (10 + len(header) + 1) % 64
    header += b" " * (pad % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header


def archive(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name + ".npy", data)
    return buffer.getvalue()


def npy(array: np.ndarray) -> bytes:
    return npy_header(array.dtype.str, array.shape) + array.tobytes()


def test_a_header_that_claims_4_gib_is_refused_before_reading(tmp_path):
    shape = (1 << 20, 1 << 10)  # float32: 4 GiB claimed, 16 bytes present
    claimed = math.prod(shape) * 4
    members = {
        "grad_expanded_x": npy_header("<f4", shape) + bytes(16),
        "expanded_row_idx": npy(np.arange(4, dtype=np.int32)),
        "candidate": npy(np.zeros((2, 2), np.float32)),
        "top_k": npy(np.array(2, np.int64)),
    }
    path = tmp_path / "huge.npz"
    path.write_bytes(archive(members))
    total = claimed + 16 + 16 + 8
    with pytest.raises(ValueError) as error:
        accuracy.load_case(path)
    message = str(error.value)
    assert str(path) in message and f"({total} bytes)" in message and "4.00 GiB" in message
    assert f"{2 * GIB} bytes" in message and "MOEGRAD_MAX_CASE_BYTES" in message and "grad_expanded_x" in message


def save_small_case(folder):
    call = oracle_call(seed=5, tokens=8, hidden=8)
    candidate = device_k2(call)  # the device's own result: a pass
    accuracy.save_case(folder / "c.npz", grad_expanded_x=call.grad_expanded_x, expanded_row_idx=call.expanded_row_idx,
                       top_k=2, candidate=candidate)
    # save_case writes top_k, drop_pad_mode and active_num as 0-d int64 values: 8 bytes each
    return call.grad_expanded_x.nbytes + call.expanded_row_idx.nbytes + candidate.nbytes + 3 * 8


def sweep(folder) -> int:
    return main(["compare", "--local", "--cases", str(folder), "--no-progress", "--summary", str(folder / "s")])


def test_the_limit_from_the_environment_makes_a_sweep_exit_3_naming_the_case(tmp_path, capsys, monkeypatch):
    size = save_small_case(tmp_path)
    monkeypatch.setenv("MOEGRAD_MAX_CASE_BYTES", str(size - 1))
    assert sweep(tmp_path) == 3
    out = capsys.readouterr().out
    assert "invalid" in out and "c.npz" in out and f"({size} bytes)" in out and f"({size - 1} bytes)" in out
    monkeypatch.setenv("MOEGRAD_MAX_CASE_BYTES", str(size))  # exactly at the limit: read and judged
    assert sweep(tmp_path) == 0


def test_a_compressed_case_is_sized_inflated(tmp_path):
    zeros = np.zeros((1024, 4096), np.float32)  # 16 MiB that deflate to some KiB
    members = {"grad_expanded_x": npy(zeros), "expanded_row_idx": npy(np.arange(1024, dtype=np.int32)),
               "candidate": npy(zeros[:512]), "top_k": npy(np.array(2, np.int64))}
    data = archive(members, zipfile.ZIP_DEFLATED)
    inflated = zeros.nbytes + 1024 * 4 + zeros.nbytes // 2 + 8
    limit = 1 << 20
    assert len(data) < limit < inflated
    (tmp_path / "z.npz").write_bytes(data)
    expected = rf"\({inflated} bytes\) once read .* over the limit of 1.0 MiB \({limit} bytes\)"
    with pytest.raises(ValueError, match=expected):
        accuracy.load_case(tmp_path / "z.npz", max_bytes=limit)
    fields, candidate = accuracy.load_case(tmp_path / "z.npz", max_bytes=inflated)
    assert candidate.shape == (512, 4096) and fields["top_k"] == 2


@pytest.mark.parametrize("value", ["lots", "0", "-5"])
def test_a_bad_limit_in_the_environment_is_named(tmp_path, monkeypatch, value):
    save_small_case(tmp_path)
    monkeypatch.setenv("MOEGRAD_MAX_CASE_BYTES", value)
    with pytest.raises(ValueError, match=r"MOEGRAD_MAX_CASE_BYTES=.* must be a whole number of bytes >= 1"):
        accuracy.load_case(tmp_path / "c.npz")
