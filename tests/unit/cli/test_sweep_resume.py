"""Sweeps in this process (``--local``): shards, the results file, resume, the lock, merge.

Oracles: the shard rule as docs/accuracy.md states it (SHA-256 of the name, its first 8 bytes
big-endian, modulo N) computed here with hashlib; each case's expected status from tests/oracle.py
(the device result of a K=2 float32 call is one float32 add; ``float32_statuses`` judges it);
a file's digest with hashlib; what a rerun skips, from the lines the first run wrote.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

import moegrad
import moegrad.cli._console as cli_console
from moegrad import DeviceFault, accuracy
from moegrad.accuracy._cases import shard_of
from moegrad.accuracy._ledger import SweepFile, SweepHeader
from moegrad.accuracy._merge import merge_sweeps
from moegrad.cli._main import main
from support.oracle import device_k2, float32_statuses, golden_and_scale, oracle_call, oracle_candidate


def expected_status(call, candidate) -> str:
    golden, scale = golden_and_scale(call)
    statuses = float32_statuses(candidate, device_k2(call), golden, scale)
    return "fail" if any(status == "fail" for name, status in statuses.items() if name != "bitwise") else "pass"


def save(folder: Path, name: str, seed: int, kind: str = "device") -> str:
    call = oracle_call(seed=seed, tokens=8, hidden=8)
    candidate = oracle_candidate(kind, device_k2(call))
    accuracy.save_case(folder / f"{name}.npz", grad_expanded_x=call.grad_expanded_x,
                       expanded_row_idx=call.expanded_row_idx, top_k=2, candidate=candidate)
    return expected_status(call, candidate)


@pytest.fixture
def cases(tmp_path) -> tuple[Path, dict[str, str]]:
    """12 cases (every 4th scaled by 1 + 2^-12) -> the oracle's status."""
    folder = tmp_path / "cases"
    folder.mkdir()
    expected = {f"c{i:02d}": save(folder, f"c{i:02d}", i, "scaled_up" if i % 4 == 1 else "device") for i in range(12)}
    assert set(expected.values()) == {"pass", "fail"}
    return folder, expected


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def case_lines(path: Path) -> list[dict]:
    return [line for line in lines(path) if line["kind"] == "case"]


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there once the socket is closed


def sweep(folder: Path, *flags: str) -> int:
    return main(["compare", "--local", "--cases", str(folder), "--no-progress", *flags])


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_shards_follow_the_documented_rule_and_are_disjoint_and_covering(count):
    names = [f"case-{i:05d}" for i in range(500)]
    shards = [[n for n in names if shard_of(n, count) == index] for index in range(count)]
    for name in names:
        want = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % count
        assert shard_of(name, count) == want
    assert sorted(n for shard in shards for n in shard) == names  # each name in exactly one shard
    assert all(shards) and (count == 1) == (len(shards[0]) == 500)


def test_the_output_records_each_judged_case_with_its_file_digest(cases, tmp_path, capsys):
    folder, expected = cases
    assert sweep(folder, "--output", str(tmp_path / "out" / "run.jsonl")) == 1  # a case failed
    written = lines(tmp_path / "out" / "run.jsonl")
    assert written[0]["kind"] == "header" and written[0]["shard"] == {"index": 0, "count": 1}
    assert written[0]["cases"] == 12 and written[0]["standards"] == list(accuracy.DEFAULT_STANDARDS)
    assert {line["case"]: line["status"] for line in written[1:]} == expected
    for line in written[1:]:
        data = (folder / f"{line['case']}.npz").read_bytes()
        assert line["digest"] == "sha256:" + hashlib.sha256(data).hexdigest()
        assert set(line["verdicts"]) == set(accuracy.DEFAULT_STANDARDS) and line["error"] is None
    # every sweep writes a summary: with --output, beside FILE (the cases' folder may be read-only)
    assert not (folder / "summary.csv").exists()
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"run.jsonl", "run.summary.csv", "run.summary.md"}
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'out' / 'run.summary'}.csv and " in out and "12 cases written to" in out


def test_a_rerun_skips_what_is_recorded_and_judges_a_changed_case_again(cases, tmp_path, capsys):
    folder, expected = cases
    output = tmp_path / "run.jsonl"
    sweep(folder, "--output", str(output))
    expected["c00"] = save(folder, "c00", 0, "scaled_up")  # other bytes: judged again
    assert expected["c00"] == "fail"
    capsys.readouterr()
    assert sweep(folder, "--output", str(output), "--summary", str(tmp_path / "s")) == 1
    out = capsys.readouterr().out
    assert f"skipped 11 of 12 cases already judged in {output}" in out and "\n1 case written to" in out
    assert "12 cases against in-process emulation" in out  # the skipped ones' recorded results count
    assert [line["case"] for line in case_lines(output)].count("c00") == 2
    merged = merge_sweeps([output], accuracy.find_cases(folder))
    assert {r.name: r.status for r in merged.results} == expected  # the last line wins
    assert merged.stale == 0 and not merged.missing


def test_after_a_resume_the_progress_line_counts_the_skipped_cases_findings_as_the_summary_does(cases, tmp_path,
                                                                                               capsys):
    folder, expected = cases
    output = tmp_path / "run.jsonl"
    (folder / "broken.npz").write_bytes(b"not an npz")  # invalid: not recorded, judged again on the resume
    sweep(folder, "--output", str(output))
    expected["c00"] = save(folder, "c00", 0, "scaled_up")  # judged again: one failure of this run
    failed = sum(status == "fail" for status in expected.values())
    capsys.readouterr()
    assert sweep(folder, "--output", str(output), "--progress") == 3
    captured = capsys.readouterr()
    last = captured.err.rstrip().split("\r")[-1]  # the progress line as it was drawn last
    assert "] 13/13 cases, " in last and last.endswith(f" cases/s, {failed} failed, 1 invalid, 0 errors")
    assert f"13 cases against in-process emulation: {12 - failed} pass, {failed} fail, 1 invalid" in captured.out


def test_every_file_a_sweep_writes_has_its_folder_created_and_one_that_cannot_be_is_exit_2(cases, tmp_path, capsys):
    folder, _ = cases
    where = tmp_path / "new" / "deeper"
    assert sweep(folder, "--summary", str(where / "s"), "--reports", str(where / "reports"), "--plots", "none",
                 "--output", str(where / "out" / "run.jsonl")) == 1
    assert {p.name for p in where.iterdir()} == {"s.csv", "s.md", "reports", "out"}
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    capsys.readouterr()
    for flags in (["--summary", str(blocker / "s")], ["--reports", str(blocker / "r")]):
        assert sweep(folder, *flags) == 2, flags
        err = capsys.readouterr().err
        assert f"cannot write {flags[0]} {flags[1]}" in err or f"cannot create {flags[0]} {flags[1]}" in err, err
    assert not (folder / "summary.csv").exists()  # refused before any case was judged


def test_a_torn_last_line_is_cut_with_a_warning_and_its_case_judged_again(cases, tmp_path, capsys):
    folder, expected = cases
    output = tmp_path / "run.jsonl"
    sweep(folder, "--output", str(output))
    whole = output.read_bytes()
    output.write_bytes(whole[: whole.rstrip(b"\n").rfind(b"\n") + 1] + b'{"kind": "case", "case": "c1')
    capsys.readouterr()
    sweep(folder, "--output", str(output))
    captured = capsys.readouterr()
    assert "cut a torn last line" in captured.err and "skipped 11 of 12" in captured.out
    assert sorted(line["case"] for line in case_lines(output)) == sorted(expected)


def test_a_file_written_for_another_sweep_is_refused_and_left_as_it_is(cases, tmp_path, capsys):
    folder, _ = cases
    output = tmp_path / "run.jsonl"
    sweep(folder, "--shard", "1/3", "--output", str(output))
    before = output.read_bytes()
    others = (["--shard", "2/3"], ["--shard", "1/3", "--require-exact"], ["--shard", "1/3", "--standard", "bitwise"])
    for flags in others:
        assert sweep(folder, *flags, "--output", str(output)) == 2, flags
        assert "choose another --output" in capsys.readouterr().err
    assert output.read_bytes() == before



@pytest.mark.parametrize("bad_line", [
    b"[" * 100_000 + b"]" * 100_000,  # JSON nested past Python's recursion limit
    b'{"kind": "header", "format": "moegrad-sweep/1", "shard": {"index": 1e400, "count": 1}, "cases": 1, '
    b'"standards": [], "require_exact": false}',  # a shard index that no integer is
])
def test_a_corrupt_results_file_is_refused_as_not_a_sweeps_and_left_as_it_is(cases, tmp_path, capsys, bad_line):
    folder, _ = cases
    output = tmp_path / "run.jsonl"
    sweep(folder, "--output", str(output))
    output.write_bytes(output.read_bytes() + bad_line + b"\n")
    before = output.read_bytes()
    capsys.readouterr()
    assert sweep(folder, "--output", str(output)) == 2
    assert "is not a line of a moegrad-sweep/1 results file" in capsys.readouterr().err
    assert output.read_bytes() == before
    assert main(["compare", "--merge", str(output)]) == 2


def test_a_case_whose_candidate_is_all_nan_is_written_and_read_back(tmp_path, capsys):
    # No finite element: the shares over finite elements are NaN, which JSON has no number for
    folder = tmp_path / "cases"
    folder.mkdir()
    call = oracle_call(seed=3, tokens=8, hidden=8)
    accuracy.save_case(folder / "nan.npz", grad_expanded_x=call.grad_expanded_x,
                       expanded_row_idx=call.expanded_row_idx, top_k=2, candidate=np.full((8, 8), np.nan, np.float32))
    output = tmp_path / "run.jsonl"
    assert sweep(folder, "--output", str(output)) == 1
    [line] = case_lines(output)
    assert line["status"] == "fail" and line["report"]["candidate_vs_golden"]["ulp_error_above_1_share"] == "nan"
    capsys.readouterr()
    assert sweep(folder, "--output", str(output)) == 1
    assert "skipped 1 of 1" in capsys.readouterr().out

def test_a_file_locked_by_another_run_is_exit_4_and_left_as_it_is(cases, tmp_path, capsys):
    folder, _ = cases
    output = tmp_path / "run.jsonl"
    output.write_bytes(b"")
    with subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); "
         "fcntl.lockf(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)", str(output)],
        stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout.readline() == "locked\n"
            assert sweep(folder, "--output", str(output)) == 4
            assert "being written by another run" in capsys.readouterr().err
        finally:
            holder.kill()
    assert output.read_bytes() == b""


def test_a_case_the_service_did_not_judge_is_not_written_and_a_rerun_judges_it(tmp_path):
    folder = tmp_path / "cases"
    folder.mkdir()
    expected = {name: save(folder, name, seed) for seed, name in enumerate(("a", "b", "c"))}
    judge = accuracy.compare_in_process()

    def flaky(name, fields, candidate):
        if name == "b":
            raise DeviceFault("the device fell over", aclnn_status=None, device_message=None)
        return judge(name, fields, candidate)

    files = accuracy.find_cases(folder)
    header = SweepHeader.of(cases=3, standards=None, require_exact=False)
    seen = []
    with SweepFile(tmp_path / "run.jsonl", header) as output:
        first = accuracy.compare_cases(files, flaky, output=output, on_result=seen.append, concurrency=2)
    assert [r.status for r in first] == [expected["a"], "error", expected["c"]] and len(seen) == 3
    assert sorted(line["case"] for line in case_lines(tmp_path / "run.jsonl")) == ["a", "c"]
    stream, seen = io.StringIO(), []
    with SweepFile(tmp_path / "run.jsonl", header) as output:
        second = accuracy.compare_cases(files, judge, output=output, on_result=seen.append, progress=True,
                                        progress_stream=stream)
        assert output.skipped == 2 and output.written == 1
    assert {r.name: r.status for r in second} == expected and [r.name for r in seen] == ["b"]
    assert "3/3 cases" in stream.getvalue() and "cases/s" in stream.getvalue()


def test_merge_names_what_is_missing_and_leaves_stale_lines_out(cases, tmp_path, capsys):
    folder, expected = cases
    shards = tmp_path / "shards"
    for index in (0, 2):
        sweep(folder, "--shard", f"{index}/3", "--output", str(shards / f"shard-{index}.jsonl"))
    capsys.readouterr()
    assert main(["compare", "--merge", str(shards)]) == 4
    assert "missing: shard 1 (no file)" in capsys.readouterr().err
    sweep(folder, "--shard", "1/3", "--output", str(shards / "shard-1.jsonl"))
    os.remove(folder / "c03.npz")
    del expected["c03"]
    capsys.readouterr()
    assert main(["compare", "--merge", str(shards), "--cases", str(folder), "--summary", str(tmp_path / "m")]) == 1
    out = capsys.readouterr().out
    assert "left out 1 line of cases" in out and "11 cases against 3 shard files of 3" in out
    with open(tmp_path / "m.csv", encoding="utf-8-sig") as file:
        assert sorted(row.split(",")[0] for row in file.read().splitlines()[1:]) == sorted(expected)


def test_a_resumed_run_writes_no_second_header_and_a_changed_folder_one_with_its_count(cases, tmp_path):
    folder, expected = cases
    output = tmp_path / "run.jsonl"
    sweep(folder, "--output", str(output))
    sweep(folder, "--output", str(output))  # every case recorded: nothing to add
    assert [line["kind"] for line in lines(output)].count("header") == 1
    assert save(folder, "c12", 12) == "pass"  # a 13th case: the merge reads a shard's count from its last header
    sweep(folder, "--output", str(output))
    headers = [line for line in lines(output) if line["kind"] == "header"]
    assert [header["cases"] for header in headers] == [12, 13]
    assert len(case_lines(output)) == 13
    merged = merge_sweeps([output])
    assert not merged.missing and {r.name: r.status for r in merged.results} == {**expected, "c12": "pass"}


@pytest.mark.parametrize(("written", "read"), [("false", False), ("true", True), ("False", False)])
def test_a_header_s_require_exact_is_a_json_boolean_and_an_earlier_string_reads_as_it_says(tmp_path, written, read):
    header = SweepHeader.of(cases=1, standards=None, require_exact=False).to_json()
    assert header["require_exact"] is False  # a JSON boolean, not the string "false"
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps({**header, "require_exact": written}) + "\n")
    [(old, _)] = accuracy._ledger.read_sweep_file(path)
    assert old.require_exact is read
    path.write_text(json.dumps({**header, "require_exact": 1}) + "\n")
    with pytest.raises(accuracy.SweepFileError, match="require_exact 1 is not a boolean"):
        accuracy._ledger.read_sweep_file(path)
    with pytest.raises(TypeError, match="require_exact must be a bool"):
        SweepHeader.of(cases=1, standards=None, require_exact="false")
    with moegrad.Client("http://moegrad.test", transport=httpx.MockTransport(lambda r: pytest.fail("no I/O"))) as c, \
            pytest.raises(TypeError, match="require_exact must be a bool"):
        c.compare_many([("a", {}, np.zeros(1))], require_exact="false")  # refused before any case is read


def test_the_progress_line_counts_failed_and_invalid_cases_apart(cases, tmp_path):
    folder, expected = cases
    (folder / "broken.npz").write_bytes(b"not an npz")
    (folder / "gone.npz").write_bytes(b"neither")
    stream = io.StringIO()
    results = accuracy.compare_cases(accuracy.find_cases(folder), accuracy.compare_in_process(), progress=True,
                                     progress_stream=stream)
    failed = sum(status == "fail" for status in expected.values())
    assert sum(r.status == "invalid" for r in results) == 2 and failed == 3
    last = stream.getvalue().rstrip().split("\r")[-1]  # the line as it was drawn last
    assert "] 14/14 cases, " in last and last.endswith(f" cases/s, {failed} failed, 2 invalid, 0 errors")


def test_the_console_lists_what_did_not_pass_and_verbose_lists_every_case(cases, capsys):
    folder, expected = cases
    (folder / "broken.npz").write_bytes(b"not an npz")
    assert sweep(folder) == 3
    listed = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")
              and not line.startswith("  (")]
    assert sorted(listed) == sorted(["broken", *(name for name, status in expected.items() if status == "fail")])
    assert sweep(folder, "--verbose") == 3
    out = capsys.readouterr().out
    every = sorted(line.split()[1] for line in out.splitlines() if line.startswith("  "))
    assert every == sorted([*expected, "broken"])


def test_a_sweep_no_replica_answers_says_so_once(cases, capsys):
    folder, _ = cases
    urls = [closed_port_url(), closed_port_url()]
    argv = ["compare", "--cases", str(folder), "--no-progress", "--retries", "0", "--timeout", "10"]
    assert main([*argv, *(arg for url in urls for arg in ("--url", url))]) == 4
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"moegrad: no replica reachable: {', '.join(urls)}; start a server or "
                                         "check --url"]
    assert "12 cases against" in captured.out and "12 cases not judged: no replica reachable" in captured.out


def test_ctrl_c_while_the_summary_is_written_is_exit_130_and_leaves_each_file_whole(cases, tmp_path, monkeypatch,
                                                                                    capsys):
    folder, _ = cases
    output = tmp_path / "run.jsonl"
    assert sweep(folder, "--output", str(output), "--summary", str(tmp_path / "s")) == 1
    before = (tmp_path / "s.csv").read_bytes(), (tmp_path / "s.md").read_bytes(), output.read_bytes()
    real = cli_console.write_summary

    def interrupted(results, csv_path, markdown_path, notes):  # Ctrl-C once the CSV is half written
        real(results, csv_path, markdown_path, notes)
        Path(csv_path).write_bytes(Path(csv_path).read_bytes()[:50])
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_console, "write_summary", interrupted)
    capsys.readouterr()
    assert sweep(folder, "--output", str(output), "--summary", str(tmp_path / "s")) == 130
    assert "interrupted while reporting; every case is written to" in capsys.readouterr().err
    assert ((tmp_path / "s.csv").read_bytes(), (tmp_path / "s.md").read_bytes(), output.read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cases", "run.jsonl", "s.csv", "s.md"]  # nothing partial
