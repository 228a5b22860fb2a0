"""``moegrad compare --cases --exit-zero-on-findings``: a run that judged every case exits 0, whatever the verdicts.

deploy/sweep's Job passes it so that a pod with findings completes (docs/operations.md, "What each
exit status means to Kubernetes"): the findings stay in the results file, the console and the
merge's exit status; a run that could not judge a case still exits 4, a usage error 2.

Oracles: each case's status from tests/support/oracle.py (the device result of a K=2 float32 call
is one float32 add; ``float32_statuses`` judges it), the exit statuses as README.md and
docs/accuracy.md list them (4 not judged, 3 invalid, 1 failed, 0 passed, 2 usage).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from moegrad import accuracy
from moegrad.cli._main import main
from support.oracle import device_k2, float32_statuses, golden_and_scale, oracle_call, oracle_candidate

FLAG = "--exit-zero-on-findings"


def save(folder: Path, name: str, seed: int, kind: str) -> str:
    """A case file; its status by the oracle (fail when a tolerance standard fails, else pass)."""
    call = oracle_call(seed=seed, tokens=8, hidden=8)
    candidate = oracle_candidate(kind, device_k2(call))
    accuracy.save_case(folder / f"{name}.npz", grad_expanded_x=call.grad_expanded_x,
                       expanded_row_idx=call.expanded_row_idx, top_k=2, candidate=candidate)
    golden, scale = golden_and_scale(call)
    statuses = float32_statuses(candidate, device_k2(call), golden, scale)
    return "fail" if any(status == "fail" for name, status in statuses.items() if name != "bitwise") else "pass"


@pytest.fixture
def cases(tmp_path) -> Path:
    """Six cases, two of them failing a standard (scaled by 1 + 2^-12)."""
    folder = tmp_path / "cases"
    folder.mkdir()
    statuses = [save(folder, f"c{i}", i, "scaled_up" if i in (1, 4) else "device") for i in range(6)]
    assert statuses.count("fail") == 2 and statuses.count("pass") == 4
    return folder


def sweep(folder: Path, *flags: str) -> int:
    return main(["compare", "--local", "--cases", str(folder), "--no-progress", *flags])


def test_a_run_with_failed_cases_exits_0_with_the_flag_and_says_so(cases, tmp_path, capsys):
    assert sweep(cases, "--output", str(tmp_path / "a.jsonl")) == 1
    capsys.readouterr()
    assert sweep(cases, FLAG, "--output", str(tmp_path / "b.jsonl")) == 0
    captured = capsys.readouterr()
    assert "6 cases against" in captured.out and "2 fail" in captured.out  # the findings are still listed
    assert captured.err.splitlines() == ["moegrad: every case judged: exit 0, not 1 (--exit-zero-on-findings)"]
    # A finished shard run again (a retried pod) skips every case and exits 0 again.
    assert sweep(cases, FLAG, "--output", str(tmp_path / "b.jsonl")) == 0
    assert "skipped 6 of 6 cases" in capsys.readouterr().out


def test_an_invalid_case_exits_0_with_the_flag(cases, capsys):
    (cases / "broken.npz").write_bytes(b"not an npz")
    assert sweep(cases) == 3
    assert sweep(cases, FLAG) == 0
    assert "exit 0, not 3" in capsys.readouterr().err


def test_a_passing_run_says_nothing_more(tmp_path, capsys):
    folder = tmp_path / "cases"
    folder.mkdir()
    assert save(folder, "only", 0, "device") == "pass"
    assert sweep(folder, FLAG) == 0
    assert capsys.readouterr().err == ""


def test_a_case_not_judged_is_still_exit_4(cases, capsys):
    with socket.socket() as sock:  # a port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    argv = ["compare", "--cases", str(cases), "--url", url, "--no-progress", "--retries", "0", FLAG]
    assert main(argv) == 4
    assert "exit 0" not in capsys.readouterr().err


def test_the_merge_refuses_the_flag_and_reports_the_findings(cases, tmp_path, capsys):
    shards = tmp_path / "shards"
    for index in range(2):
        assert sweep(cases, FLAG, "--shard", f"{index}/2", "--output", str(shards / f"shard-{index}.jsonl")) == 0
    capsys.readouterr()
    assert main(["compare", "--merge", str(shards), "--cases", str(cases), FLAG]) == 2
    assert "--exit-zero-on-findings is for a sweep's runs, not --merge" in capsys.readouterr().err
    assert main(["compare", "--merge", str(shards), "--cases", str(cases)]) == 1


def test_the_flag_needs_cases(tmp_path, capsys):
    assert main(["compare", "--local", FLAG, "--grad-expanded-x", "g.npy"]) == 2
    assert "--exit-zero-on-findings need --cases DIR" in capsys.readouterr().err


def test_help_names_the_flag():
    import contextlib
    import io

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert FLAG in shown.getvalue() and "With --exit-zero-on-findings" in shown.getvalue()
