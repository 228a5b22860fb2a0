"""The moegrad command with no server: `local`, `compare --local`, .npy handling (bfloat16), usage errors, exit codes.

Expected values come from the operator documentation's example, from plain float32 adds here, or
(for `compare`) from the independent float64 computation of tests/support/oracle.py: the exit code a
candidate must get is derived from the oracle's statuses, never from ``moegrad.compare``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from moegrad.cli._main import load_npy, main, save_npy
from support.docexample import DOC_GRAD as EXAMPLE_X
from support.docexample import DOC_IDX as EXAMPLE_IDX
from support.docexample import DOC_RESULT_BITS as EXAMPLE_BITS
from support.oracle import (
    ALL_STANDARDS,
    ORACLE_CASES,
    device_k2,
    float32_statuses,
    golden_and_scale,
    oracle_call,
    oracle_candidate,
)


@pytest.fixture
def example_files(tmp_path):
    x, idx = tmp_path / "x.npy", tmp_path / "idx.npy"
    np.save(x, EXAMPLE_X)
    np.save(idx, EXAMPLE_IDX)
    return x, idx, tmp_path / "out.npy"


def local_args(x, idx, out, *extra, top_k="2"):
    return ["local", "--grad-expanded-x", str(x), "--expanded-row-idx", str(idx), "--top-k", top_k, "-o", str(out), *extra]


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there once the socket is closed


def test_local_example(example_files, capsys):
    x, idx, out = example_files
    assert main(local_args(x, idx, out)) == 0
    grad_x = np.load(out)
    assert grad_x.dtype == np.float32 and grad_x.shape == (2, 2)
    np.testing.assert_array_equal(grad_x.view(np.uint32), EXAMPLE_BITS)
    assert str(out) in capsys.readouterr().out


def test_local_writes_exactly_the_named_path(example_files):
    x, idx, out = example_files
    target = out.with_suffix(".bin")
    assert main(local_args(x, idx, target)) == 0
    assert target.exists() and not target.with_name(target.name + ".npy").exists()


def test_local_bfloat16_round_trip(tmp_path):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 5)).astype(ml_dtypes.bfloat16)
    idx = np.array([4, 1, 0, 5, 3, 2], dtype=np.int32)
    np.save(tmp_path / "x.npy", x)  # numpy writes '<V2' for bfloat16
    np.save(tmp_path / "idx.npy", idx)
    assert np.load(tmp_path / "x.npy").dtype.kind == "V"
    out = tmp_path / "out.npy"
    assert main(local_args(tmp_path / "x.npy", tmp_path / "idx.npy", out)) == 0
    # K=2, dropless: each token is one float32 add of two bf16 rows widened exactly, rounded once to bf16
    wide = x.astype(np.float32)
    expected = np.stack([wide[idx[2 * i]] + wide[idx[2 * i + 1]] for i in range(3)]).astype(ml_dtypes.bfloat16)
    raw = np.load(out)
    assert raw.dtype == np.dtype("V2")  # written the way numpy.save writes bf16
    grad_x = load_npy(out)
    assert grad_x.dtype == np.dtype(ml_dtypes.bfloat16) and grad_x.shape == (3, 5)
    np.testing.assert_array_equal(grad_x.view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(raw.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16, np.int32, ">f4"])
def test_save_and_load_npy_round_trip(tmp_path, dtype):
    array = np.arange(12).reshape(3, 4).astype(dtype)
    save_npy(tmp_path / "a.npy", array)
    back = load_npy(tmp_path / "a.npy")
    assert back.dtype == np.dtype(dtype) and back.shape == (3, 4)
    assert back.tobytes() == array.tobytes()


def test_load_npy_refuses_pickles_and_archives(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):
        load_npy(tmp_path / "obj.npy")
    np.savez(tmp_path / "z.npz", a=EXAMPLE_X)
    with pytest.raises(ValueError):
        load_npy(tmp_path / "z.npz")


def test_local_order_and_active_mode(tmp_path):
    # active mode, K=3: rows >= A are skipped; token 0 uses rows 0, 2 (4 skipped), token 1 rows 1, 3, 5 (skipped)
    x = np.array([[1.0], [2.0], [3.0], [4.0]], dtype=np.float32)
    idx = np.array([0, 4, 2, 1, 3, 5], dtype=np.int32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "idx.npy", idx)
    out = tmp_path / "o.npy"
    assert main(local_args(tmp_path / "x.npy", tmp_path / "idx.npy", out, "--active-num", "4",
                           "--order", "sequential", top_k="3")) == 0
    np.testing.assert_array_equal(np.load(out), np.array([[4.0], [6.0]], dtype=np.float32))


def test_local_names_the_profile_and_takes_the_950_at_9_1s_zero_rows(tmp_path, capsys):
    # Huawei's 950 binding sends -1 in dropless mode: a +0.0 row on ascend950@9.1 (the bare chip), refused before
    x = np.array([[1.0], [2.0], [3.0], [4.0]], dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "idx.npy", np.array([0, -1, 2, 3], dtype=np.int32))
    out = tmp_path / "o.npy"
    assert main(local_args(tmp_path / "x.npy", tmp_path / "idx.npy", out, "--order", "ascend950")) == 0
    assert "in-process, order ascend950@9.1" in capsys.readouterr().out
    np.testing.assert_array_equal(np.load(out), np.array([[1.0], [7.0]], dtype=np.float32))
    assert main(local_args(tmp_path / "x.npy", tmp_path / "idx.npy", out, "--order", "ascend950@9.0")) == 3
    err = capsys.readouterr().err
    assert "161002" in err and "ascend950@9.1 accepts it" in err


def test_the_order_help_lists_every_profile_and_what_each_alias_means(capsys):
    with pytest.raises(SystemExit):
        main(["local", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "ascend950@2025-12 = ascend950@8.5" in text and "ascend950 = ascend950@9.1" in text
    for profile in ("ascend910b@8.5", "ascend910_93@9.0", "ascend950@9.1", "sequential"):
        assert profile in text


@pytest.mark.parametrize(
    ("top_k", "extra", "idx", "code", "field"),
    [
        ("3", [], EXAMPLE_IDX, "561103", "expanded_row_idx"),        # 4 % 3 != 0; CANN 9.1's code (the default)
        ("3", ["--order", "ascend910b@9.0"], EXAMPLE_IDX, "561002", "expanded_row_idx"),  # before 9.1
        ("0", [], EXAMPLE_IDX, "561103", "top_k"),
        ("2", ["--drop-pad-mode", "2"], EXAMPLE_IDX, "561103", "drop_pad_mode"),
        ("2", ["--drop-pad-mode", "2", "--order", "ascend950@8.5"], EXAMPLE_IDX, "561002", "drop_pad_mode"),
        ("2", [], np.array([2, 0, 1, 2**31], np.int64), "161002", "expanded_row_idx"),  # int64 past int32
        ("2", [], np.array([2, 0, 2, 3], np.int32), "161002", "expanded_row_idx"),  # a duplicate
    ],
)
def test_rejected_input_exits_3_naming_field_and_code(tmp_path, capsys, top_k, extra, idx, code, field):
    np.save(tmp_path / "x.npy", EXAMPLE_X)
    np.save(tmp_path / "idx.npy", idx)
    out = tmp_path / "o.npy"
    assert main(local_args(tmp_path / "x.npy", tmp_path / "idx.npy", out, *extra, top_k=top_k)) == 3
    err = capsys.readouterr().err
    assert code in err and field in err
    assert not out.exists()


def test_duplicates_accepted_with_flag(tmp_path):
    np.save(tmp_path / "x.npy", EXAMPLE_X)
    np.save(tmp_path / "idx.npy", np.array([2, 0, 2, 3], np.int32))
    out = tmp_path / "o.npy"
    assert main(local_args(tmp_path / "x.npy", tmp_path / "idx.npy", out, "--allow-duplicate-indices")) == 0
    expected = np.stack([EXAMPLE_X[2] + EXAMPLE_X[0], EXAMPLE_X[2] + EXAMPLE_X[3]])
    np.testing.assert_array_equal(np.load(out).view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nope"],
        ["local", "--expanded-row-idx", "i.npy", "--top-k", "2", "-o", "o.npy"],  # no --grad-expanded-x
        ["local", "--grad-expanded-x", "x.npy", "--expanded-row-idx", "i.npy", "--top-k", "two", "-o", "o.npy"],
        ["local", "--grad-expanded-x", "x.npy", "--expanded-row-idx", "i.npy", "--top-k", "2", "-o", "o.npy",
         "--order", "fastest"],
        ["grad", "--grad-expanded-x", "x.npy", "--expanded-row-idx", "i.npy", "--top-k", "2", "-o", "o.npy",
         "--timeout", "-1"],
        ["info", "--retries", "-2"],
        ["local", "--url", "http://x"],  # local takes no server
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_unreadable_input_or_output_exits_2(example_files, tmp_path, capsys):
    x, idx, out = example_files
    assert main(local_args(tmp_path / "missing.npy", idx, out)) == 2
    assert "missing.npy" in capsys.readouterr().err
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    assert main(local_args(tmp_path / "junk.npy", idx, out)) == 2
    assert main(local_args(x, idx, tmp_path / "no-such-dir" / "o.npy")) == 2
    assert "no-such-dir" in capsys.readouterr().err


def test_bad_url_exits_2(capsys):
    assert main(["info", "--url", "ftp://example.org"]) == 2
    assert "http" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["info"], ["example"]])
def test_unreachable_server_exits_4(command, capsys):
    assert main([*command, "--url", closed_port_url(), "--retries", "0", "--timeout", "10"]) == 4
    assert "TransportError" in capsys.readouterr().err


def test_grad_rejects_locally_before_connecting(example_files, tmp_path, capsys):
    x, idx, out = example_files
    grad = ["grad", "--url", closed_port_url(), "--expanded-row-idx", str(idx), "-o", str(out), "--retries", "0"]
    # a call that names its profile is checked on it: a shape failure is 561103 from CANN 9.1, 561002 before
    for order, code in (("ascend910b@9.1", "561103"), ("ascend910b@9.0", "561002")):
        assert main([*grad, "--grad-expanded-x", str(x), "--top-k", "3", "--order", order]) == 3  # not 4: never sent
        assert code in capsys.readouterr().err
    # one that names none is the server's to judge, but a float64 grad is refused alike by every profile (161002)
    np.save(wide := tmp_path / "x64.npy", EXAMPLE_X.astype(np.float64))
    assert main([*grad, "--grad-expanded-x", str(wide), "--top-k", "2"]) == 3
    assert "161002" in capsys.readouterr().err
    # a shape failure's code is the server's profile's: with no server to ask, the call is not judged
    assert main([*grad, "--grad-expanded-x", str(x), "--top-k", "3"]) == 4
    assert "TransportError" in capsys.readouterr().err


def test_url_defaults_to_env(monkeypatch, capsys):
    url = closed_port_url()
    monkeypatch.setenv("MOEGRAD_URL", url)
    assert main(["info", "--retries", "0"]) == 4
    assert url.split("//")[1] in capsys.readouterr().err


def test_help_describes_every_command_and_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    top = capsys.readouterr().out
    for word in ("grad", "local", "example", "info", "exit status", "bfloat16", "MOEGRAD_URL"):
        assert word in top
    with pytest.raises(SystemExit):
        main(["grad", "--help"])
    grad = capsys.readouterr().out
    for flag in ("--url", "--grad-expanded-x", "--expanded-row-idx", "--top-k", "--drop-pad-mode", "--active-num",
                 "--order", "--timeout", "--token", "--output", "seconds", "int32"):
        assert flag in grad


def run_module(*argv, **env):
    return subprocess.run([sys.executable, "-m", "moegrad", *argv], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_python_dash_m_moegrad(example_files):
    x, idx, out = example_files
    done = run_module(*local_args(x, idx, out))
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(np.load(out).view(np.uint32), EXAMPLE_BITS)
    assert run_module("--help").returncode == 0
    assert run_module("local").returncode == 2


def test_grad_with_an_unwritable_output_exits_2_before_contacting_the_server(example_files, tmp_path, capsys):
    x, idx, _ = example_files
    argv = ["grad", "--url", closed_port_url(), "--retries", "0", "--grad-expanded-x", str(x),
            "--expanded-row-idx", str(idx), "--top-k", "2", "-o", str(tmp_path / "no-such-dir" / "o.npy")]
    assert main(argv) == 2  # an attempted connection would have been a TransportError, exit 4
    assert "does not exist" in capsys.readouterr().err


# ---- compare --local -----------------------------------------------------------------------------


def compare_args(tmp_path, call, candidate, *extra):
    np.save(tmp_path / "x.npy", call.grad_expanded_x)
    np.save(tmp_path / "idx.npy", call.expanded_row_idx)
    np.save(tmp_path / "candidate.npy", candidate)
    return ["compare", "--local", "--grad-expanded-x", str(tmp_path / "x.npy"), "--expanded-row-idx",
            str(tmp_path / "idx.npy"), "--top-k", str(call.top_k), "--candidate", str(tmp_path / "candidate.npy"), *extra]


@pytest.mark.parametrize("case", ORACLE_CASES)
def test_compare_exit_code_follows_the_independent_verdicts(tmp_path, capsys, case):
    call = oracle_call(seed=3)
    device = device_k2(call)
    candidate = oracle_candidate(case, device)
    expected = float32_statuses(candidate, device, *golden_and_scale(call))
    standards = [arg for name in ALL_STANDARDS for arg in ("--standard", name)]
    code = main(compare_args(tmp_path, call, candidate, *standards))
    out = capsys.readouterr().out
    assert code == (1 if "fail" in expected.values() else 0)
    table = {words[0]: words[1].lower() for words in (line.split() for line in out.splitlines())
             if len(words) >= 2 and words[0] in ALL_STANDARDS}
    assert table == expected


def test_compare_a_rejected_candidate_exits_3(tmp_path, capsys):
    call = oracle_call()
    assert main(compare_args(tmp_path, call, device_k2(call)[:-1])) == 3
    err = capsys.readouterr().err
    assert "candidate" in err and "161002" in err


def test_compare_a_rejected_call_exits_3(tmp_path, capsys):
    call = oracle_call()
    argv = compare_args(tmp_path, call, device_k2(call))
    argv[argv.index("--top-k") + 1] = "3"  # 64 slots are not a multiple of K=3: a shape error (561103 from 9.1)
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "expanded_row_idx" in err and "561103" in err


def test_compare_an_unreadable_candidate_exits_2(tmp_path, capsys):
    call = oracle_call()
    argv = compare_args(tmp_path, call, device_k2(call))
    (tmp_path / "candidate.npy").write_bytes(b"not numpy")
    assert main(argv) == 2
    assert "--candidate" in capsys.readouterr().err


def test_compare_against_an_unreachable_server_exits_4(tmp_path, capsys):
    call = oracle_call()
    argv = [arg for arg in compare_args(tmp_path, call, device_k2(call)) if arg != "--local"]
    assert main([*argv, "--url", closed_port_url(), "--retries", "0", "--timeout", "10"]) == 4
    assert "TransportError" in capsys.readouterr().err


def test_a_reader_that_leaves_early_does_not_change_the_exit_status(tmp_path, monkeypatch, capsys):
    """`moegrad compare ... | head`: the pipe closes before the verdict is printed; the status is the
    verdict's (1, a standard failed) all the same, and nothing is raised."""
    call = oracle_call(seed=3)
    device = device_k2(call)
    candidate = oracle_candidate("scaled_up", device)
    assert "fail" in float32_statuses(candidate, device, *golden_and_scale(call)).values()
    standards = [arg for name in ALL_STANDARDS for arg in ("--standard", name)]
    argv = compare_args(tmp_path, call, candidate, *standards)
    reader, writer = os.pipe()
    os.close(reader)  # the reader has gone: every write to the pipe fails (EPIPE)
    closed = os.fdopen(writer, "w", buffering=1)  # line-buffered: the first line printed meets it
    monkeypatch.setattr(sys, "stdout", closed)
    try:
        assert main(argv) == 1
    finally:
        monkeypatch.undo()
        closed.close()  # its fd is os.devnull's now: closing it loses nothing


def test_an_internal_error_is_one_line_and_exit_70(monkeypatch, capsys):
    import moegrad.cli._main as cli

    def broken(args):
        raise RuntimeError("an invariant does not hold")

    monkeypatch.setitem(cli._COMMANDS, "info", broken)  # no command fails so today: a stand-in for a bug
    assert main(["info"]) == 70  # EX_SOFTWARE (sysexits.h), which no verdict uses
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "internal error: RuntimeError: an invariant does not hold" in err and "please report it" in err


@pytest.mark.parametrize("content", ["empty", "huge header"])
@pytest.mark.parametrize("command", ["local", "identify"])
def test_an_unreadable_npy_file_is_a_usage_error(example_files, capsys, command, content):
    """An empty .npy file (numpy raises EOFError) and one whose header declares 10**11 float32 over a
    few bytes (MemoryError when numpy allocates) are files that cannot be read: exit 2 naming the
    flag and the file, not exit 70 (a bug)."""
    x, idx, out = example_files
    if content == "empty":
        x.write_bytes(b"")
    else:
        header = "{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000,), }"
        header += " " * (63 - (10 + len(header)) % 64) + "\n"
        x.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + b"\0" * 64)
    argv = local_args(x, idx, out) if command == "local" else [
        "identify", "--grad-expanded-x", str(x), "--expanded-row-idx", str(idx), "--top-k", "2", "--grad-x", str(x)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot read --grad-expanded-x {x}" in err
