"""The commands that put a candidate's code on the bench: ``probe-order``, ``shrink``,
``determinism`` and ``compare --order-free``; each run once as a real process, the rest in-process;
each against a candidate imported by name and one served over protocol v2.

Oracles: the candidates of tests/support/triggers.py and tests/support/candidates.py (their orders
of adds and faults by definition: the A2/A3 bins' order of docs/semantics.md section 3.1, a
chain, one summand left out under a trigger), tests/support/v2server.py (a bare v2 server written
from docs/protocol.md), and the exit statuses README.md and each command's --help promise (0 ok,
1 a finding, 2 usage, 3 rejected input, 4 candidate or transport failure).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moegrad.cli._main import main
from support import routing, triggers
from support.candidates import bins_tree, chain_tree, expression_of, tree_candidate
from support.v2server import candidate_app, serving

TESTS = str(Path(__file__).resolve().parents[2])


def run_module(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "moegrad", *argv], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def call_files(tmp_path):
    """A routed dropless call (N=16, K=8, H=64 float32) as .npy files; the paths as flags."""
    rng = np.random.default_rng(0)
    routed = routing.route(rng, 16, 8, 12, "dropless")
    np.save(tmp_path / "g.npy", rng.standard_normal(routed.grad_shape(64)).astype(np.float32))
    np.save(tmp_path / "idx.npy", routed.expanded_row_idx)
    return ["--grad-expanded-x", str(tmp_path / "g.npy"), "--expanded-row-idx", str(tmp_path / "idx.npy"),
            "--top-k", "8"]


# ---- probe-order ---------------------------------------------------------------------------------------


def test_probe_order_as_a_process_names_the_tree_and_the_profiles(tmp_path):
    done = run_module("probe-order", "--candidate", "support.triggers:correct", "--top-k", "8", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert expression_of(bins_tree(8)) in done.stdout and "ascend910b@9.1" in done.stdout


def test_probe_order_refuses_a_value_dependent_order_with_exit_1(capsys):
    assert main(["probe-order", "--candidate", "support.candidates:sorted_by_magnitude", "--top-k", "6"]) == 1
    assert "no single order of adds" in capsys.readouterr().out


def test_probe_order_over_v2_as_json(capsys):
    with serving(candidate_app(tree_candidate(chain_tree(5)))) as url:
        assert main(["probe-order", "--candidate-url", url, "--top-k", "5", "--dtype", "bfloat16", "--json"]) == 0
    probe = json.loads(capsys.readouterr().out)
    assert probe["expression"] == expression_of(chain_tree(5)) and "sequential" in probe["profiles"]


# ---- shrink --------------------------------------------------------------------------------------------


def test_shrink_as_a_process_writes_a_reproducer_that_reproduces(tmp_path, call_files):
    done = run_module("shrink", "--candidate", "support.triggers:missing_odd_rows", *call_files, "-o", "out",
                      cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "-> N=2 K=1 H=2 float32 dropless [2, 2]" in done.stdout
    assert (tmp_path / "out" / "reproducer.npz").is_file()
    env = {**os.environ, "PYTHONPATH": TESTS}
    script = subprocess.run([sys.executable, "out/reproducer.py"], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=300)
    assert script.returncode == 1 and "the fault reproduces: missing at slot 0" in script.stdout, script.stderr


def test_shrink_a_case_served_over_v2_as_json(tmp_path, call_files, capsys):
    assert main(["compare", "--order-free", "--candidate", "support.triggers:missing_at_k8", "--top-k", "8",
                 "--tokens", "6", "--hidden", "8", "--save-case", str(tmp_path / "fault.npz")]) == 1
    capsys.readouterr()
    app = candidate_app(triggers.missing_at_k8)
    with serving(app) as url:
        status = main(["shrink", "--candidate-url", url, "--case", str(tmp_path / "fault.npz"),
                       "-o", str(tmp_path / "out"), "--name", "k8", "--json"])
    assert status == 1
    result = json.loads(capsys.readouterr().out)
    assert (result["label"], result["slot"]) == ("missing", 5)
    assert result["shrunk"].startswith("N=1 K=8 H=2 ") and result["tests"] == app.requests
    assert Path(result["script"]).name == "k8.py" and Path(result["case"]).is_file()


def test_shrink_of_a_correct_candidate_has_nothing_to_do(tmp_path, call_files, capsys):
    assert main(["shrink", "--candidate", "support.triggers:correct", *call_files, "-o", str(tmp_path)]) == 0
    assert "nothing to shrink" in capsys.readouterr().out
    assert not list(tmp_path.glob("reproducer.*"))


def test_shrink_refuses_an_output_it_cannot_write_before_calling_the_candidate(tmp_path, call_files, capsys):
    (tmp_path / "taken").write_text("")
    app = candidate_app(triggers.missing_odd_rows)
    with serving(app) as url:
        assert main(["shrink", "--candidate-url", url, *call_files, "-o", str(tmp_path / "taken")]) == 2
        with pytest.raises(SystemExit) as exit_info:  # argparse's own usage error
            main(["shrink", "--candidate-url", url, *call_files, "-o", str(tmp_path), "--name", "../up"])
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "it is a file, not a folder" in err and "plain file name" in err
    assert app.requests == 0


def test_shrink_rejects_an_invalid_call_with_exit_3(tmp_path, capsys):
    np.save(tmp_path / "g.npy", np.ones((4, 2), np.float32))
    np.save(tmp_path / "idx.npy", np.array([0, 0, 1, 2], np.int32))  # a repeated index
    argv = ["shrink", "--candidate", "support.triggers:correct", "--grad-expanded-x", str(tmp_path / "g.npy"),
            "--expanded-row-idx", str(tmp_path / "idx.npy"), "--top-k", "2", "-o", str(tmp_path)]
    assert main(argv) == 3
    assert "161002" in capsys.readouterr().err


# ---- determinism ---------------------------------------------------------------------------------------


def test_determinism_as_a_process_of_a_steady_candidate(tmp_path, call_files):
    done = run_module("determinism", "--candidate", "support.triggers:correct", *call_files, "--runs", "3",
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "the same bits in all 3 runs" in done.stdout


def test_determinism_flags_an_order_that_changes_between_runs(call_files, capsys):
    assert main(["determinism", "--candidate", "support.triggers:atomic_order", *call_files, "--json"]) == 1
    found = json.loads(capsys.readouterr().out)
    assert found["varying_rows"] == list(range(16)) and found["within_bound"]


def test_determinism_over_v2(call_files, capsys):
    app = candidate_app(triggers.correct)
    with serving(app) as url:
        assert main(["determinism", "--candidate-url", url, *call_files, "--runs", "3"]) == 0
    assert app.requests == 3 and "the same bits in all 3 runs" in capsys.readouterr().out


# ---- compare --order-free ------------------------------------------------------------------------------


def test_compare_order_free_as_a_process_says_clean(tmp_path):
    done = run_module("compare", "--order-free", "--candidate", "support.triggers:correct", "--top-k", "8",
                      "--dtype", "bfloat16", "--drop-pad-mode", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("clean: every row has the golden's bits")


def test_compare_order_free_says_fault_and_explains_it(capsys):
    assert main(["compare", "--order-free", "--candidate", "support.triggers:missing_odd_rows", "--top-k", "4",
                 "--tokens", "6"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("fault: 3 of 6 rows differ from the golden")
    assert "missing" in out


def test_compare_order_free_over_v2(capsys):
    with serving(candidate_app(tree_candidate(chain_tree(4)))) as url:
        assert main(["compare", "--order-free", "--candidate-url", url, "--top-k", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "clean"


# ---- usage, failures, help -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["probe-order", "--top-k", "4"], "--candidate package.module:function or --candidate-url"),
        (["probe-order", "--top-k", "4", "--candidate", "a:b", "--candidate-url", "http://h:1"], "(one)"),
        (["probe-order", "--top-k", "4", "--candidate", "no_such_module_here:f"], "cannot import --candidate"),
        (["probe-order", "--top-k", "4", "--candidate", "support.triggers:HIDDEN_THRESHOLD"], "not a callable"),
        (["probe-order", "--top-k", "4", "--candidate-url", "ftp://h"], "not an http(s) URL"),
        (["probe-order", "--top-k", "4", "--candidate-url", "http://h:1", "--accepts", "torch"], "--accepts"),
        (["probe-order", "--top-k", "4", "--candidate", "support.triggers:correct", "--candidate-parameter", "a=1"],
         "for --candidate-url"),
        (["probe-order", "--top-k", "9999", "--candidate", "support.triggers:correct"], "top_k=9999"),
        (["compare", "--candidate-url", "http://h:1"], "needs --order-free"),
        (["compare", "--order-free", "--top-k", "2"], "needs the candidate's code"),
        (["compare", "--order-free", "--candidate", "support.triggers:correct"], "needs --top-k"),
        (["compare", "--order-free", "--candidate", "support.triggers:correct", "--top-k", "2",
          "--grad-expanded-x", "g.npy"], "leave out --grad-expanded-x"),
        (["compare", "--order-free", "--candidate", "support.triggers:correct", "--top-k", "2", "--reports", "r",
          "--plots", "all", "--summary", "s"], "leave out --summary, --reports, --plots"),
        (["compare", "--order-free", "--candidate", "support.triggers:correct", "--top-k", "2", "--shard", "0/2",
          "--output", "o.jsonl", "--exit-zero-on-findings"], "leave out --shard, --output, --exit-zero-on-findings"),
        (["compare", "--order-free", "--candidate", "support.triggers:correct", "--top-k", "200", "--dtype",
          "bfloat16"], "K <= 128"),
        (["determinism", "--candidate", "support.triggers:correct", "--case", "x.npz", "--top-k", "2"],
         "leave out --top-k"),
        (["determinism", "--candidate", "support.triggers:correct", "--top-k", "2"], "needs --grad-expanded-x"),
    ],
)
def test_usage_errors_exit_2_and_say_what_to_do(argv, says, capsys):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_shrink_needs_an_output_folder(call_files, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["shrink", "--candidate", "support.triggers:correct", *call_files])
    assert exit_info.value.code == 2 and "--output" in capsys.readouterr().err


def test_an_unreachable_candidate_server_exits_4(capsys):
    assert main(["probe-order", "--top-k", "4", "--candidate-url", closed_port_url()]) == 4
    assert "could not be reached" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "statuses"),
    [
        ("probe-order", ["  0  the candidate's tree", "  1  no single tree", "  2  usage", "  4  the candidate"]),
        ("shrink", ["  0  the candidate gives the device's bits", "  1  a fault was shrunk", "  3  input rejected",
                    "  4  the candidate"]),
        ("determinism", ["  0  the same bits", "  1  some rows vary", "  3  input rejected", "  4  the candidate"]),
        ("compare", ["--order-free: clean", "--order-free: a fault", "--candidate-url URL", "--save-case"]),
    ],
)
def test_each_command_says_what_it_takes_and_its_exit_statuses(command, statuses, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for line in statuses:
        assert line in text, (command, line)


def test_the_top_level_help_lists_the_commands_and_their_findings(tmp_path):
    top = run_module("--help", cwd=tmp_path)
    for command in ("probe-order", "shrink", "determinism"):
        assert command in top.stdout
    assert "`shrink`: a fault shrunk" in top.stdout and "`compare --order-free`: a fault" in top.stdout
