"""``moegrad compare --merge`` with a shard file missing: the file expected is named first, with the
number of its cases, before any single case.

Oracles: the shard rule as docs/accuracy.md states it (SHA-256 of the case name, its first 8 bytes
big-endian, modulo N), computed here with hashlib; the file name the Indexed Job writes
(deploy/sweep: ``shard-I.jsonl``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from moegrad import accuracy
from moegrad.cli._main import main
from support.oracle import device_k2, oracle_call

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
