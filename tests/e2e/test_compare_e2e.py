"""Accuracy comparisons end to end: a real moegrad-service (uvicorn), the Client, the AsyncClient and
the ``moegrad compare`` command, in all three modes. Against the server the command runs as a
subprocess, as a user runs it; ``--local`` runs in this process (``moegrad.cli._main.main``), which
spares a process start per case.

Most of these tests check **transport only**: the expected report is :func:`moegrad.compare` of the
same call and candidate, the very function the server runs, and the device result is
:func:`moegrad.moe_init_routing_v2_grad` (the emulation the reference backend serves), so they prove
that the numbers arrive intact, not that they are right. The numbers are proven by the oracles in
tests/unit/accuracy/test_accuracy.py and tests/service/test_compare.py (tests/support/oracle.py), and
``test_cli_json_exit_code_follows_the_independent_verdicts`` here takes its expected exit code and
statuses from that oracle. Exit codes are the ones ``moegrad --help`` documents: 0 pass (a warning
passes), 1 a failed standard, 2 usage, 3 rejected input, 4 server or transport failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import moegrad
from moegrad.cli._main import main
from support import routing
from support.oracle import (
    ALL_STANDARDS,
    device_k2,
    float32_statuses,
    golden_and_scale,
    oracle_call,
    oracle_candidate,
)

MODES = ("dropless", "active", "drop_pad")
TOLERANCE = ("dual_thousandth", "threshold", "benchmark", "accumulative")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Runs the command with matplotlib made unimportable, as on a host without the ``plot`` extra.
WITHOUT_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.figure'] = None; "
                      "from moegrad.cli._main import main; sys.exit(main(sys.argv[1:]))")


def make_call(mode: str, dtype=np.float32, *, tokens: int = 20, top_k: int = 4, hidden: int = 24, seed: int = 0):
    rng = np.random.default_rng(seed)
    r = routing.route(rng, tokens, top_k, 6, mode)
    grad = rng.standard_normal(r.grad_shape(hidden)).astype(dtype)
    return moegrad.MoeInitRoutingV2GradCall(grad_expanded_x=grad, **r.kwargs())


def arguments(call) -> dict:
    return {"grad_expanded_x": call.grad_expanded_x, "expanded_row_idx": call.expanded_row_idx, "top_k": call.top_k,
            "drop_pad_mode": call.drop_pad_mode, "active_num": call.active_num}


def statuses(report: moegrad.ComparisonReport) -> dict[str, str]:
    return {v.standard: v.status for v in report.verdicts}


def corrupted(device: np.ndarray, row: int) -> np.ndarray:
    candidate = device.copy()
    candidate[row] = (candidate[row].astype(np.float32) + 1.0).astype(device.dtype)
    return candidate


# ---- Client and AsyncClient ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_client_device_result_passes_and_the_report_is_the_in_process_one(server_url, mode):
    call = make_call(mode)
    device = moegrad.moe_init_routing_v2_grad(call)
    with moegrad.Client(server_url) as client:
        result = client.compare(**arguments(call), candidate=device, return_grad_x=True)
    assert result.passed and result.report.verdict == "pass" and result.report.exact.bit_exact
    assert statuses(result.report) == dict.fromkeys(moegrad.DEFAULT_STANDARDS, "pass")
    assert result.report.to_dict() == moegrad.compare(call, device).to_dict()
    np.testing.assert_array_equal(result.grad_x.view(np.uint32), device.view(np.uint32))
    assert (result.backend, result.order, result.device) == ("reference", "ascend910b@9.1", None)
    assert set(result.timings_ms) == {"queue", "compute", "golden", "compare", "total"}


@pytest.mark.parametrize("mode", MODES)
def test_client_sequential_golden_passes_and_fails_only_when_exactness_is_required(server_url, mode):
    call = make_call(mode, top_k=6, seed=6)
    device = moegrad.moe_init_routing_v2_grad(call)
    sequential = moegrad.moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
    differing = int(np.count_nonzero(sequential.view(np.uint32) != device.view(np.uint32)))
    with moegrad.Client(server_url) as client:
        result = client.compare(**arguments(call), candidate=sequential)
        required = client.compare(**arguments(call), candidate=sequential, require_exact=True)
    assert statuses(result.report) == dict.fromkeys(TOLERANCE, "pass") and result.passed
    assert result.report.exact.mismatched == differing > 0
    assert not required.passed and required.report.exact.required


@pytest.mark.parametrize("mode", MODES)
def test_client_corrupted_row_is_the_worst(server_url, mode):
    call = make_call(mode, np.float16, seed=2)
    device = moegrad.moe_init_routing_v2_grad(call)
    with moegrad.Client(server_url) as client:
        result = client.compare(**arguments(call), candidate=corrupted(device, 11))
    assert result.report.verdict == "fail"
    assert result.report.candidate_vs_golden.worst.row == 11
    assert result.report.candidate_vs_device.worst.row == 11


def test_client_server_side_validation(server_url):
    call = make_call("dropless")
    device = moegrad.moe_init_routing_v2_grad(call)
    with moegrad.Client(server_url, validate=False) as client:
        with pytest.raises(moegrad.InvalidArgument) as caught:
            client.compare(**arguments(call), candidate=device[:-1])
        assert (caught.value.aclnn_status, caught.value.field) == (161002, "candidate")
        with pytest.raises(moegrad.InvalidArgument) as caught:
            client.compare(**arguments(call), candidate=None)
        assert (caught.value.aclnn_status, caught.value.field) == (161001, "candidate")
        with pytest.raises(moegrad.InvalidArgument) as caught:
            client.compare(**arguments(call), candidate=device, standards=["exact"])
        assert (caught.value.aclnn_status, caught.value.field) == (161002, "standards")


def test_async_client_all_modes_concurrently(server_url):
    calls = [make_call(mode, ml_dtypes.bfloat16, seed=i) for i, mode in enumerate(MODES)]
    candidates = [moegrad.moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"})) for call in calls]

    async def run():
        async with moegrad.AsyncClient(server_url) as client:
            return await asyncio.gather(*(client.compare(**arguments(call), candidate=candidate)
                                          for call, candidate in zip(calls, candidates)))

    results = asyncio.run(run())
    for call, candidate, result in zip(calls, candidates, results):
        assert result.report.to_dict() == moegrad.compare(call, candidate).to_dict()


# ---- the moegrad compare command -----------------------------------------------------------------


def moegrad_cli(*argv: str, without_matplotlib: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", WITHOUT_MATPLOTLIB] if without_matplotlib else [sys.executable, "-m", "moegrad"]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MOEGRAD_")}
    return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=120, env=environment)


def run_cli(where: str, server_url: str, capsys, *argv: str, without_matplotlib: bool = False,
            monkeypatch=None) -> subprocess.CompletedProcess:
    """``moegrad *argv`` against the server (a subprocess) or with ``--local`` (in this process)."""
    if where == "server":
        return moegrad_cli(*argv, "--url", server_url, without_matplotlib=without_matplotlib)
    if without_matplotlib:
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
        monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code = main([*argv, "--local"])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def save_case(directory: Path, call, candidate: np.ndarray) -> list[str]:
    """Write the call's tensors and the candidate as .npy; the command line that names them."""
    np.save(directory / "x.npy", call.grad_expanded_x)  # bfloat16 is written as '<V2'
    np.save(directory / "idx.npy", call.expanded_row_idx)
    np.save(directory / "candidate.npy", candidate)
    return ["compare", "--grad-expanded-x", str(directory / "x.npy"), "--expanded-row-idx", str(directory / "idx.npy"),
            "--top-k", str(call.top_k), "--drop-pad-mode", str(call.drop_pad_mode), "--active-num", str(call.active_num),
            "--candidate", str(directory / "candidate.npy")]


def table_statuses(stdout: str) -> dict[str, str]:
    """standard -> status from the command's standards table."""
    found = {}
    for line in stdout.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in moegrad.STANDARDS:
            found[words[0]] = words[1].lower()
    return found


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["server", "local"])
def test_cli_pass_is_exit_0_and_prints_the_table(server_url, tmp_path, capsys, mode, where):
    call = make_call(mode, seed=4)
    device = moegrad.moe_init_routing_v2_grad(call)
    done = run_cli(where, server_url, capsys, *save_case(tmp_path, call, device))
    assert done.returncode == 0, done.stderr
    assert "verdict: PASS" in done.stdout
    assert table_statuses(done.stdout) == dict.fromkeys(moegrad.DEFAULT_STANDARDS, "pass")
    assert ("reference" in done.stdout) == (where == "server")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["server", "local"])
def test_cli_fail_is_exit_1_and_names_the_worst_row(server_url, tmp_path, capsys, mode, where):
    call = make_call(mode, seed=5)
    candidate = corrupted(moegrad.moe_init_routing_v2_grad(call), 13)
    done = run_cli(where, server_url, capsys, *save_case(tmp_path, call, candidate))
    assert done.returncode == 1, done.stderr
    assert "verdict: FAIL" in done.stdout
    expected = statuses(moegrad.compare(call, candidate))
    assert table_statuses(done.stdout) == expected and expected["threshold"] == "fail"
    assert "bit-exact: no" in done.stdout
    worst = [line.split() for line in done.stdout.splitlines() if line.startswith("candidate_vs_golden ")]
    assert worst and worst[-1][1] == "13"  # the worst-elements table: comparison, row, column, ...


def test_cli_a_warning_passes(server_url, tmp_path):
    # bfloat16 keeps 8 significant bits: the device's own result warns on dual_thousandth (docs/accuracy.md)
    call = make_call("drop_pad", ml_dtypes.bfloat16, seed=1)
    device = moegrad.moe_init_routing_v2_grad(call)
    assert moegrad.compare(call, device).verdict == "warning"  # the precondition, computed in-process
    done = moegrad_cli(*save_case(tmp_path, call, device), "--url", server_url)
    assert done.returncode == 0, done.stderr
    assert "verdict: WARNING" in done.stdout
    assert table_statuses(done.stdout)["dual_thousandth"] == "warning"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["server", "local"])
def test_cli_json_is_the_report(server_url, tmp_path, capsys, mode, where):
    """Transport only: the printed JSON is the in-process report of the same inputs."""
    call = make_call(mode, np.float16, top_k=3, seed=8)
    candidate = moegrad.moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
    done = run_cli(where, server_url, capsys, *save_case(tmp_path, call, candidate), "--json", "--standard",
                   "threshold", "--standard", "bitwise")
    assert done.returncode in (0, 1), done.stderr
    printed = json.loads(done.stdout)
    context = printed.pop("context")  # the command records the call; compare() alone does not
    assert context["top_k"] == 3 and context["shapes"]["candidate"] == list(candidate.shape)
    assert printed.pop("profiles_matching") == list(moegrad.identify(call, candidate).matching)  # the command asks
    # where the error lives: against the device result the server sent back (the emulation, on this backend)
    assert printed.pop("row_errors") == moegrad.accuracy.row_errors(call, candidate).to_dict()
    expected = moegrad.compare(call, candidate, standards=["bitwise", "threshold"]).to_dict()
    assert printed == {k: v for k, v in expected.items() if k not in ("context", "profiles_matching", "row_errors")}


@pytest.mark.parametrize("case", ["one_ulp_noise", "scaled_up"])
@pytest.mark.parametrize("where", ["server", "local"])
def test_cli_json_exit_code_follows_the_independent_verdicts(server_url, tmp_path, capsys, case, where):
    call = oracle_call(seed=4)
    device = device_k2(call)
    candidate = oracle_candidate(case, device)
    expected = float32_statuses(candidate, device, *golden_and_scale(call))
    standards = [arg for name in ALL_STANDARDS for arg in ("--standard", name)]
    done = run_cli(where, server_url, capsys, *save_case(tmp_path, call, candidate), "--json", *standards)
    assert done.returncode == (1 if "fail" in expected.values() else 0), done.stderr
    assert {v["standard"]: v["status"] for v in json.loads(done.stdout)["verdicts"]} == expected


def test_cli_order_is_sent(server_url, tmp_path):
    call = make_call("active", top_k=5)
    sequential = moegrad.moe_init_routing_v2_grad(call.model_copy(update={"order": "sequential"}))
    done = moegrad_cli(*save_case(tmp_path, call, sequential), "--url", server_url, "--order", "sequential",
                       "--standard", "bitwise")
    assert done.returncode == 0, done.stdout + done.stderr
    assert table_statuses(done.stdout) == {"bitwise": "pass"}


def _report_case(tmp_path: Path) -> tuple[list[str], moegrad.ComparisonReport]:
    call = make_call("drop_pad", seed=9)
    candidate = corrupted(moegrad.moe_init_routing_v2_grad(call), 3)
    return [*save_case(tmp_path, call, candidate), "--report", str(tmp_path / "out.md")], moegrad.compare(call, candidate)


@pytest.mark.parametrize("where", ["server", "local"])
def test_cli_report_with_matplotlib(server_url, tmp_path, capsys, where):
    pytest.importorskip("matplotlib", reason="the optional 'plot' extra (matplotlib) is not installed here")
    argv, expected = _report_case(tmp_path)
    done = run_cli(where, server_url, capsys, *argv)
    assert done.returncode == 1, done.stderr
    markdown = (tmp_path / "out.md").read_text()
    assert "![" in markdown and "(out.png)" in markdown and "Histogram skipped" not in markdown
    assert (tmp_path / "out.png").read_bytes().startswith(PNG_SIGNATURE)
    for verdict in expected.verdicts:
        assert f"| {verdict.standard} | {verdict.status.upper() if verdict.status != 'pass' else 'pass'} |" in markdown
    assert f"| candidate_vs_golden | {expected.candidate_vs_golden.worst.row} |" in markdown
    assert "out.png" in done.stdout


@pytest.mark.parametrize("where", ["server", "local"])
def test_cli_report_without_matplotlib(server_url, tmp_path, capsys, monkeypatch, where):
    argv, expected = _report_case(tmp_path)
    done = run_cli(where, server_url, capsys, *argv, without_matplotlib=True, monkeypatch=monkeypatch)
    assert done.returncode == 1, done.stderr
    markdown = (tmp_path / "out.md").read_text()
    assert "Histogram skipped" in markdown and "matplotlib is not installed" in markdown
    assert "![" not in markdown
    assert not (tmp_path / "out.png").exists()
    assert f"| candidate_vs_golden | {expected.candidate_vs_golden.worst.row} |" in markdown
    assert "histogram skipped" in done.stdout


@pytest.mark.parametrize("where", ["server", "local"])
def test_cli_rejected_candidate_is_exit_3(server_url, tmp_path, capsys, where):
    call = make_call("dropless")
    device = moegrad.moe_init_routing_v2_grad(call)
    done = run_cli(where, server_url, capsys, *save_case(tmp_path, call, device[:, :-1]))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "candidate" in done.stderr and "161002" in done.stderr


def test_cli_unreadable_candidate_is_exit_2(server_url, tmp_path, capsys):
    call = make_call("dropless")
    argv = save_case(tmp_path, call, moegrad.moe_init_routing_v2_grad(call))
    (tmp_path / "candidate.npy").write_bytes(b"not an npy file")
    done = run_cli("local", server_url, capsys, *argv)
    assert done.returncode == 2
    assert "--candidate" in done.stderr


def test_cli_unreachable_server_is_exit_4(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens once the socket is closed
    call = make_call("dropless")
    done = moegrad_cli(*save_case(tmp_path, call, moegrad.moe_init_routing_v2_grad(call)), "--url", url,
                       "--retries", "0")
    assert done.returncode == 4, done.stdout + done.stderr


def test_cli_cases_against_the_server(server_url, tmp_path):
    """Bulk checking through the service: statuses from the oracle (tests/support/oracle.py), one row per case."""
    call = oracle_call(seed=13)
    device = device_k2(call)
    fields = {"grad_expanded_x": call.grad_expanded_x, "expanded_row_idx": call.expanded_row_idx, "top_k": 2}
    for name in ("device", "scaled_up"):
        moegrad.accuracy.save_case(tmp_path / f"{name}.npz", **fields, candidate=oracle_candidate(name, device))
    moegrad.accuracy.save_case(tmp_path / "bad.npz", **fields, candidate=device[:, :-1])
    done = moegrad_cli("compare", "--cases", str(tmp_path), "--url", server_url, "--no-progress")
    assert done.returncode == 3, done.stderr  # an invalid case decides before a failed one (docs/accuracy.md)
    assert "3 cases against" in done.stdout and "1 pass, 1 fail, 1 invalid" in done.stdout
    summary = (tmp_path / "summary.csv").read_text(encoding="utf-8-sig").splitlines()
    assert [line.split(",")[0] for line in summary[1:]] == ["bad", "scaled_up", "device"]  # worst first
