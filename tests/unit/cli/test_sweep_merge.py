"""``moegrad compare --merge``: a shard file missing (named first, with the number of its cases,
before any single case); a case file rewritten after it was judged (missing until judged again,
its old line left out); one case with two digests in two files (not one sweep).

Oracles: the shard rule as docs/accuracy.md states it (SHA-256 of the case name, its first 8 bytes
big-endian, modulo N), computed here with hashlib; a case file's digest with hashlib; each case's
status from tests/support/oracle.py; the file name the Indexed Job writes (deploy/sweep:
``shard-I.jsonl``); the rules of docs/accuracy.md, "Sweeps" (a case is judged with its current
bytes; two digests for one case are refused, exit 2; a missing case is exit 4).
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest

from moegrad import accuracy
from moegrad.accuracy import MergeError, merge_sweeps
from moegrad.cli._main import main
from support.oracle import device_k2, float32_statuses, golden_and_scale, oracle_call, oracle_candidate

COUNT = 3


def shard(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % COUNT


def save(folder: Path, name: str, seed: int) -> None:
    call = oracle_call(seed=seed, tokens=8, hidden=8)
    accuracy.save_case(folder / f"{name}.npz", grad_expanded_x=call.grad_expanded_x,
                       expanded_row_idx=call.expanded_row_idx, top_k=2, candidate=device_k2(call))


@pytest.fixture
def swept(tmp_path):
    """12 cases; shards 0 and 2 of 3 swept into shards/, shard 1 not."""
    folder, shards = tmp_path / "cases", tmp_path / "shards"
    folder.mkdir()
    names = [f"c{i:02d}" for i in range(12)]
    for seed, name in enumerate(names):
        save(folder, name, seed)
    assert {shard(name) for name in names} == {0, 1, 2}
    for index in (0, 2):
        argv = ["compare", "--local", "--cases", str(folder), "--no-progress", "--shard", f"{index}/{COUNT}",
                "--output", str(shards / f"shard-{index}.jsonl")]
        assert main(argv) == 0
    return folder, shards, names


def missing_lines(err: str) -> list[str]:
    prefix = "moegrad: missing: "
    return [line.removeprefix(prefix) for line in err.splitlines() if line.startswith(prefix)]


def test_with_the_cases_the_missing_file_is_named_instead_of_its_cases(swept, tmp_path, capsys):
    folder, shards, names = swept
    save(folder, "late", 99)  # added after the sweep: its shard's file has no line for it
    capsys.readouterr()
    argv = ["compare", "--merge", str(shards), "--cases", str(folder), "--summary", str(tmp_path / "m")]
    assert main(argv) == 4
    missing = missing_lines(capsys.readouterr().err)
    in_one = sum(1 for name in names if shard(name) == 1) + (shard("late") == 1)
    plural = "case is" if in_one == 1 else "cases are"
    assert missing[0] == f"shard 1 (no file): expected {shards / 'shard-1.jsonl'}; its {in_one} {plural} not judged"
    assert not any(name in missing for name in names)  # shard 1's cases are not listed one by one
    assert missing[1:] == ([] if shard("late") == 1 else ["late"])


def test_the_merged_summary_says_first_what_is_missing_and_lists_each_missing_case(swept, tmp_path, capsys):
    folder, shards, names = swept
    unjudged = sorted(name for name in names if shard(name) == 1)
    argv = ["compare", "--merge", str(shards), "--cases", str(folder), "--summary", str(tmp_path / "m")]
    assert main(argv) == 4
    assert f"{len(names)} cases against 2 shard files of 3: {len(names) - len(unjudged)} pass, " \
        f"{len(unjudged)} missing" in capsys.readouterr().out
    lines = (tmp_path / "m.md").read_text().splitlines()
    assert lines[2] == f"**Not complete: {len(unjudged)} cases were not judged** (the exit status is 4)."
    assert lines[4] == f"- shard 1 (no file): expected {shards / 'shard-1.jsonl'}; its {len(unjudged)} cases are " \
        "not judged"
    assert lines[5] == "- the cases not judged: " + ", ".join(unjudged)
    assert lines[7].startswith(f"{len(names)} cases: ") and lines[7].endswith(f", {len(unjudged)} missing")
    with open(tmp_path / "m.csv", encoding="utf-8-sig", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [(row["API Name"], row["moegrad_status"]) for row in rows[:len(unjudged)]] == [
        (name, "missing") for name in unjudged]
    assert {row["Message"] for row in rows[:len(unjudged)]} == {"not judged: shard 1 has no file"}
    assert len(rows) == len(names)


def test_without_the_cases_the_merged_summary_says_which_shard_is_missing(swept, capsys):
    _, shards, _ = swept
    assert main(["compare", "--merge", str(shards)]) == 4
    lines = (shards / "summary.md").read_text().splitlines()
    assert lines[2] == "**Not complete: some cases were not judged** (the exit status is 4)."
    assert lines[4] == f"- shard 1 (no file): expected {shards / 'shard-1.jsonl'}"


def test_without_the_cases_the_missing_file_is_named(swept, capsys):
    _, shards, _ = swept
    capsys.readouterr()
    assert main(["compare", "--merge", str(shards)]) == 4
    assert missing_lines(capsys.readouterr().err) == [f"shard 1 (no file): expected {shards / 'shard-1.jsonl'}"]


def test_files_named_one_by_one_say_which_shard_has_none(swept, capsys):
    _, shards, _ = swept
    capsys.readouterr()
    assert main(["compare", "--merge", str(shards / "shard-0.jsonl"), str(shards / "shard-2.jsonl")]) == 4
    assert missing_lines(capsys.readouterr().err) == ["shard 1 (no file): none of the files given is shard 1's"]


# ---- the case files' digests (issue 38: mutants no test caught) ------------------------------------


def save_kind(folder: Path, name: str, seed: int, kind: str) -> str:
    """A case file whose candidate is the device's own result or it scaled by 1 + 2^-12; its status by
    the oracle (tests/support/oracle.py)."""
    call = oracle_call(seed=seed, tokens=8, hidden=8)
    candidate = oracle_candidate(kind, device_k2(call))
    accuracy.save_case(folder / f"{name}.npz", grad_expanded_x=call.grad_expanded_x,
                       expanded_row_idx=call.expanded_row_idx, top_k=2, candidate=candidate)
    golden, scale = golden_and_scale(call)
    statuses = float32_statuses(candidate, device_k2(call), golden, scale)
    return "fail" if any(status == "fail" for name, status in statuses.items() if name != "bitwise") else "pass"


@pytest.fixture
def passing(tmp_path):
    """Nine passing cases, every shard of 3 swept into shards/."""
    folder, shards = tmp_path / "cases", tmp_path / "shards"
    folder.mkdir()
    names = [f"p{i}" for i in range(9)]
    assert {save_kind(folder, name, seed, "device") for seed, name in enumerate(names)} == {"pass"}
    for index in range(COUNT):
        argv = ["compare", "--local", "--cases", str(folder), "--no-progress", "--shard", f"{index}/{COUNT}",
                "--output", str(shards / f"shard-{index}.jsonl")]
        assert main(argv) == 0
    return folder, shards, names


def digest(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_case_rewritten_after_it_was_judged_is_missing_not_judged_by_its_old_line(passing, tmp_path, capsys):
    folder, shards, names = passing
    old = digest(folder / "p4.npz")
    assert save_kind(folder, "p4", 4, "scaled_up") == "fail"  # other bytes now, and failing
    assert digest(folder / "p4.npz") != old
    merged = merge_sweeps([shards], accuracy.find_cases(folder))
    assert merged.missing == ["p4"] and merged.stale == 1
    assert sorted(result.name for result in merged.results) == sorted(set(names) - {"p4"})
    capsys.readouterr()
    argv = ["compare", "--merge", str(shards), "--cases", str(folder), "--summary", str(tmp_path / "m")]
    assert main(argv) == 4  # not complete: p4 as it is now was never judged
    captured = capsys.readouterr()
    assert missing_lines(captured.err) == ["p4"] and "left out 1 line of cases" in captured.out
    # Its shard run again judges it (the resume skips only a name with the same digest); then it fails.
    argv = ["compare", "--local", "--cases", str(folder), "--no-progress", "--shard", f"{shard('p4')}/{COUNT}",
            "--output", str(shards / f"shard-{shard('p4')}.jsonl")]
    assert main(argv) == 1
    merged = merge_sweeps([shards], accuracy.find_cases(folder))
    assert merged.missing == [] and merged.stale == 0  # within a file the last line for a case wins
    assert {result.name: result.status for result in merged.results}["p4"] == "fail"


def _copy_line(shards: Path, name: str, into: int, digest_: str | None = None) -> None:
    """Append ``name``'s line from its own shard file to shard ``into``'s file (its digest replaced)."""
    lines = (shards / f"shard-{shard(name)}.jsonl").read_text().splitlines()
    (line,) = [json.loads(text) for text in lines if json.loads(text).get("case") == name]
    with open(shards / f"shard-{into}.jsonl", "a", encoding="utf-8") as file:
        file.write(json.dumps({**line, "digest": digest_ or line["digest"]}) + "\n")


def test_one_case_with_two_digests_in_two_files_is_not_one_sweep(passing, capsys):
    folder, shards, _ = passing
    other = (shard("p2") + 1) % COUNT
    _copy_line(shards, "p2", other, "sha256:" + "0" * 64)
    with pytest.raises(MergeError, match="digest conflict: case p2 is sha256:"):
        merge_sweeps([shards])
    with pytest.raises(MergeError, match="digest conflict: case p2"):
        merge_sweeps([shards], accuracy.find_cases(folder))
    capsys.readouterr()
    assert main(["compare", "--merge", str(shards), "--cases", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "digest conflict: case p2" in err and f"shard-{other}.jsonl" in err


def test_one_case_with_one_digest_in_two_files_counts_once(passing, capsys):
    folder, shards, names = passing
    _copy_line(shards, "p2", (shard("p2") + 1) % COUNT)
    merged = merge_sweeps([shards], accuracy.find_cases(folder))
    assert sorted(result.name for result in merged.results) == sorted(names) and merged.missing == []
    capsys.readouterr()
    assert main(["compare", "--merge", str(shards), "--cases", str(folder)]) == 0
    assert f"{len(names)} cases against 3 shard files of 3" in capsys.readouterr().out
