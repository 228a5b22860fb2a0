"""Bulk checking: case files, a run over a generated directory that never stops, the summary worst first.

Oracles: each case's expected status comes from tests/support/oracle.py (float64 figures and the thresholds
of docs/accuracy.md) or from the documented rules for invalid input; never from the comparison.
"""

from __future__ import annotations

import csv
import io
import zipfile

import ml_dtypes
import numpy as np
import pytest

from moegrad import accuracy
from moegrad.cli._main import main
from support.oracle import device_k2, float32_statuses, golden_and_scale, oracle_call, oracle_candidate

BF16 = np.dtype(ml_dtypes.bfloat16)


def fields_of(call) -> dict:
    return {"grad_expanded_x": call.grad_expanded_x, "expanded_row_idx": call.expanded_row_idx, "top_k": call.top_k,
            "drop_pad_mode": call.drop_pad_mode, "active_num": call.active_num}


@pytest.fixture
def cases(tmp_path):
    """good (the device itself), subtly bad (every value 1 + 2^-12 too large), grossly bad (one element off
    by 1.0), invalid (a candidate of the wrong shape), broken (not an archive), incomplete (no top_k)."""
    folder = tmp_path / "cases"
    folder.mkdir()
    call = oracle_call(seed=11)
    device = device_k2(call)
    for name in ("device", "scaled_up", "one_gross_element"):
        accuracy.save_case(folder / f"{name}.npz", **fields_of(call), candidate=oracle_candidate(name, device))
    accuracy.save_case(folder / "wrong_shape.npz", **fields_of(call), candidate=device[:-1])
    (folder / "broken.npz").write_bytes(b"not an archive")
    np.savez(folder / "no_top_k.npz", grad_expanded_x=call.grad_expanded_x, expanded_row_idx=call.expanded_row_idx,
             candidate=device)
    golden, scale = golden_and_scale(call)
    oracle = {name: float32_statuses(oracle_candidate(name, device), device, golden, scale)
              for name in ("device", "scaled_up", "one_gross_element")}
    expected = {name: "fail" if "fail" in [s for k, s in v.items() if k != "bitwise"] else "pass"
                for name, v in oracle.items()}
    expected.update(wrong_shape="invalid", broken="invalid", no_top_k="invalid")
    assert expected["device"] == "pass" and expected["scaled_up"] == expected["one_gross_element"] == "fail"
    return folder, expected


def test_a_case_file_round_trips_bfloat16_bit_for_bit(tmp_path):
    x = np.arange(8, dtype=np.float32).reshape(4, 2).astype(BF16)
    accuracy.save_case(tmp_path / "c.npz", grad_expanded_x=x, expanded_row_idx=np.arange(4, dtype=np.int32), top_k=2,
                       candidate=x[:2], order="sequential", active_num=0)
    fields, candidate = accuracy.load_case(tmp_path / "c.npz")
    assert fields["grad_expanded_x"].dtype == BF16 and candidate.dtype == BF16
    np.testing.assert_array_equal(fields["grad_expanded_x"].view(np.uint16), x.view(np.uint16))
    assert (fields["top_k"], fields["order"], fields["drop_pad_mode"]) == (2, "sequential", 0)


def test_load_case_names_what_is_wrong(tmp_path):
    np.savez(tmp_path / "extra.npz", grad_expanded_x=np.zeros((2, 2)), expanded_row_idx=np.zeros(2, np.int32),
             candidate=np.zeros((1, 2)), top_k=np.int64(2), topk=np.int64(2))
    with pytest.raises(ValueError, match="unknown key 'topk'"):
        accuracy.load_case(tmp_path / "extra.npz")
    np.savez(tmp_path / "float_k.npz", grad_expanded_x=np.zeros((2, 2)), expanded_row_idx=np.zeros(2, np.int32),
             candidate=np.zeros((1, 2)), top_k=np.float64(2))
    with pytest.raises(ValueError, match="top_k must be a 0-d integer"):
        accuracy.load_case(tmp_path / "float_k.npz")



def corrupt_archives(folder) -> dict[str, str]:
    """Case files that are zip archives whose members NumPy cannot read -> what the error names."""
    arrays = {"grad_expanded_x": np.ones((64, 64), np.float32), "expanded_row_idx": np.arange(64, dtype=np.int32),
              "top_k": np.int64(2), "candidate": np.ones((32, 64), np.float32)}
    with zipfile.ZipFile(folder / "bad_header.npz", "w") as archive:  # an .npy header that is not a dict literal
        archive.writestr("grad_expanded_x.npy", b"\x93NUMPY\x01\x00\x10\x00{'descr': 'zz'}  \n")
        for name in ("expanded_row_idx", "candidate", "top_k"):
            archive.writestr(f"{name}.npy", b"x")
    np.savez_compressed(folder / "bad_deflate.npz", **arrays)  # a compressed member's bytes overwritten
    data = bytearray((folder / "bad_deflate.npz").read_bytes())
    start = data.find(b"grad_expanded_x.npy") + 100
    data[start : start + 40] = bytes(byte ^ 0x5A for byte in data[start : start + 40])
    (folder / "bad_deflate.npz").write_bytes(bytes(data))
    return {"bad_header": "grad_expanded_x", "bad_deflate": "grad_expanded_x"}


def test_an_archive_whose_arrays_cannot_be_read_is_an_invalid_case_not_a_crash(tmp_path, capsys):
    named = corrupt_archives(tmp_path)
    for name, member in named.items():
        with pytest.raises(ValueError, match=member):
            accuracy.load_case(tmp_path / f"{name}.npz")
    results = accuracy.compare_cases(accuracy.find_cases(tmp_path), accuracy.compare_in_process())
    assert {r.name: r.status for r in results} == dict.fromkeys(named, "invalid")
    assert main(["compare", "--local", "--cases", str(tmp_path), "--no-progress"]) == 3


def test_an_empty_case_is_judged_and_its_tensors_digested_as_no_bytes(tmp_path):
    # N = 0 is a call the operator's documentation allows: its report says pass (nothing differs)
    empty = {"grad_expanded_x": np.zeros((0, 4), np.float32), "expanded_row_idx": np.zeros(0, np.int32), "top_k": 2}
    accuracy.save_case(tmp_path / "empty.npz", **empty, candidate=np.zeros((0, 4), np.float32))
    results = accuracy.compare_cases(accuracy.find_cases(tmp_path), accuracy.compare_in_process())
    assert [(r.name, r.status, r.error) for r in results] == [("empty", "pass", None)]
    sha256_of_nothing = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert set(results[0].report.context.sha256.values()) == {sha256_of_nothing}

def test_a_bulk_run_gives_one_row_per_case_and_never_stops(cases, tmp_path):
    folder, expected = cases
    stream = io.StringIO()
    results = accuracy.compare_cases(accuracy.find_cases(folder), accuracy.compare_in_process(), progress=True,
                                     progress_stream=stream)
    assert {r.name: r.status for r in results} == expected
    assert "6/6" in stream.getvalue()
    by_name = {r.name: r for r in results}
    assert "candidate" in by_name["wrong_shape"].error and "161002" in by_name["wrong_shape"].error
    assert "top_k" in by_name["no_top_k"].error
    assert "not an .npz archive" in by_name["broken"].error
    assert by_name["one_gross_element"].report.candidate_vs_golden.worst.row == 5
    assert by_name["device"].report.context.case == "device"
    ordered = accuracy.write_summary(results, tmp_path / "s.csv", tmp_path / "s.md")
    statuses = [r.status for r in ordered]
    assert statuses == sorted(statuses, key=["invalid", "fail", "warning", "pass"].index)
    with open(tmp_path / "s.csv", encoding="utf-8-sig", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["API Name"] for row in rows] == [r.name for r in ordered]
    assert {row["API Name"]: row["比对结果"] for row in rows} == {
        name: {"pass": "pass", "fail": "error", "invalid": "error"}[status] for name, status in expected.items()}
    gross = next(row for row in rows if row["API Name"] == "one_gross_element")
    assert (gross["bit_exact"], gross["bitwise_mismatches"], gross["worst_row"]) == ("false", "1", "5")
    assert "6 cases: 1 pass, 2 fail, 3 invalid" in (tmp_path / "s.md").read_text()


def test_the_command_runs_a_directory_of_cases(cases, tmp_path, capsys):
    folder, expected = cases
    reports = tmp_path / "reports"
    code = main(["compare", "--local", "--cases", str(folder), "--reports", str(reports), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 3  # a case was invalid, which decides before a failed one (docs/accuracy.md, "Sweeps")
    assert "6 cases against in-process emulation: 1 pass, 2 fail, 3 invalid" in out
    assert (folder / "summary.csv").exists() and (folder / "summary.md").exists()
    for name, status in expected.items():
        if status != "invalid":
            assert {p.suffix for p in reports.glob(f"{name}.*")} >= {".md", ".json", ".csv"}, name
            assert accuracy.read_json_report(reports / f"{name}.json").verdict == status


def test_the_command_passes_a_directory_of_good_cases(tmp_path, capsys):
    call = oracle_call(seed=12)
    for i in range(3):
        accuracy.save_case(tmp_path / f"good{i}.npz", **fields_of(call), candidate=device_k2(call))
    assert main(["compare", "--local", "--cases", str(tmp_path), "--summary", str(tmp_path / "out"),
                 "--require-exact"]) == 0
    assert "3 cases against in-process emulation: 3 pass" in capsys.readouterr().out
    assert (tmp_path / "out.csv").exists()


def test_the_command_needs_a_call_or_cases(capsys):
    assert main(["compare", "--local", "--top-k", "2"]) == 2
    assert "--cases" in capsys.readouterr().err
