"""The ``moegrad`` command's arguments and messages: each command's own epilog, ``--shard``'s range,
the flags named in rejections, int64 index files, ``--url`` ports, ``info`` over several replicas,
the server timings line and the plot extra's name.

Oracles: the exit-status table of docs/accuracy.md and README (which command can give which
status), the operator documentation's example (tests/support/docexample.py), pyproject.toml's
extras, and the JSON that the test's own small HTTP servers answer.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import moegrad
from moegrad.cli._main import _server_summary, main
from support.docexample import DOC_GRAD, DOC_IDX, DOC_RESULT_BITS

ROOT = Path(__file__).resolve().parents[3]


def help_text(capsys, *command: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


# ---- epilogs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "has", "lacks"),
    [
        ("local", ["  0  success", "  2  usage", "  3  input rejected", ".npy files"],
         ["  4  ", "server failed", "MOEGRAD_URL", "--cases", "  1  "]),
        ("grad", ["  0  success", "  3  input rejected", "  4  the server failed", "MOEGRAD_URL", ".npy files"],
         ["--cases", "  1  ", "MOEGRAD_MAX_CASE_BYTES"]),
        ("info", ["  0  success", "  4  the server failed", "MOEGRAD_URL"],
         [".npy files", "--cases", "  1  ", "  3  "]),
        ("example", ["  1  the result differs from the documentation's", "  4  the server failed"],
         [".npy files", "--cases", "  3  "]),
        ("compare", ["  1  a standard failed", "  3  input rejected", "  4  the server failed",
                     "`compare --cases` and `--merge`", "MOEGRAD_MAX_CASE_BYTES", ".npy files"],
         ["`example`"]),
    ],
)
def test_each_command_lists_only_its_own_exit_statuses(capsys, command, has, lacks):
    epilog = help_text(capsys, command).split("exit status:", 1)[1]
    for line in has:
        assert line in epilog, (command, line)
    for line in lacks:
        assert line not in epilog, (command, line)


def test_the_top_level_help_keeps_the_whole_table(capsys):
    epilog = help_text(capsys).split("exit status:", 1)[1]
    for status in ("  0  ", "  1  ", "  2  ", "  3  ", "  4  ", "130, 143", "--cases", "MOEGRAD_URL"):
        assert status in epilog


# ---- --shard ---------------------------------------------------------------------------------------


def test_shard_help_says_shards_count_from_0(capsys):
    assert "I counted from 0 (0 <= I < N" in " ".join(help_text(capsys, "compare").split())


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("-1/4", "I=-1 must be between 0 and N-1=3"),
        ("4/4", "I=4 must be between 0 and N-1=3"),
        ("0/0", "N=0 must be between 1 and 1000000"),
        ("0/-3", "N=-3 must be between 1 and 1000000"),
        (f"0/{10**20}", f"N={10**20} must be between 1 and 1000000"),
        ("0/1000001", "N=1000001 must be between 1 and 1000000"),
        ("2", "is not I/N"),
        ("a/b", "is not I/N"),
    ],
)
@pytest.mark.parametrize("joined", [False, True])
def test_a_shard_out_of_range_is_a_usage_error(tmp_path, capsys, value, says, joined):
    flag = [f"--shard={value}"] if joined else ["--shard", value]
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--local", "--cases", str(tmp_path), *flag])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --shard" in err and says in err and "expected one argument" not in err


@pytest.mark.parametrize("value", ["0/1", "999999/1000000", "3/8"])
def test_a_shard_in_range_runs(tmp_path, capsys, value):
    assert main(["compare", "--local", "--cases", str(tmp_path), "--shard", value, "--no-progress"]) == 0
    assert "0 cases" in capsys.readouterr().out


# ---- flags in messages, int64 index files -------------------------------------------------------------


def local_argv(tmp_path, idx, *extra):
    np.save(tmp_path / "x.npy", DOC_GRAD)
    np.save(tmp_path / "idx.npy", idx)
    return ["local", "--grad-expanded-x", str(tmp_path / "x.npy"), "--expanded-row-idx", str(tmp_path / "idx.npy"),
            "--top-k", "2", "-o", str(tmp_path / "out.npy"), *extra]


def test_a_rejection_names_the_flag_typed_and_the_field(tmp_path, capsys):
    assert main(local_argv(tmp_path, np.array([2, 0, 2, 3], np.int32))) == 3
    err = capsys.readouterr().err
    assert "--allow-duplicate-indices (allow_duplicate_indices)" in err
    assert "[field expanded_row_idx]" in err and "161002" in err  # the field and the code stay as they are


def test_an_attribute_rejection_names_the_flag_and_its_value(tmp_path, capsys):
    assert main([*local_argv(tmp_path, DOC_IDX), "--drop-pad-mode", "2"]) == 3
    err = capsys.readouterr().err
    assert "--drop-pad-mode 2 (drop_pad_mode)" in err and "[field drop_pad_mode]" in err and "561103" in err


def test_an_int64_index_whose_values_fit_is_read_as_int32_with_a_note(tmp_path, capsys):
    assert main(local_argv(tmp_path, DOC_IDX.astype(np.int64))) == 0
    assert "is int64; read as int32" in capsys.readouterr().err
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy").view(np.uint32), DOC_RESULT_BITS)


def test_an_int64_index_past_int32_is_left_to_the_dtype_rule(tmp_path, capsys):
    assert main(local_argv(tmp_path, np.array([2, 0, 1, 2**31], np.int64))) == 3
    err = capsys.readouterr().err
    assert "int64" in err and "161002" in err and "read as int32" not in err


# ---- --url ports -----------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://name:99999", "dns+http://name:99999", "http://name:0",
                                 "https://name:65536", "http://[::1]:70000"])
def test_a_port_outside_1_to_65535_is_refused(url, capsys):
    with pytest.raises(ValueError, match=r"port \d+ is outside 1\.\.65535"):
        moegrad.Client(url)
    assert main(["info", "--url", url]) == 2
    assert "outside 1..65535" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://name:1", "http://name:65535", "dns+http://name:8000", "http://name"])
def test_a_port_inside_the_range_is_taken(url):
    moegrad.Client(url).close()


# ---- info over several replicas ---------------------------------------------------------------------


class _Info(BaseHTTPRequestHandler):
    def do_GET(self):  # http.server's name
        order = {"order": self.server.order} if getattr(self.server, "order", None) else {}
        body = json.dumps({"backend": self.server.name, "version": "test", **order}).encode()
        self.send_response(200 if self.path == "/v1/info" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def info_servers():
    servers = []
    for name in ("first", "second"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Info)
        server.name = name
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield [f"http://127.0.0.1:{server.server_address[1]}" for server in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_info_with_several_urls_shows_each_replica(info_servers, capsys):
    first, second = info_servers
    assert main(["info", "--url", first, "--url", second]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == {first: {"backend": "first", "version": "test"}, second: {"backend": "second", "version": "test"}}


def test_info_with_a_replica_down_shows_the_others_and_exits_4(info_servers, capsys):
    down = closed_port_url()
    assert main(["info", "--url", info_servers[0], "--url", down, "--retries", "0"]) == 4
    captured = capsys.readouterr()
    shown = json.loads(captured.out)
    assert shown[info_servers[0]]["backend"] == "first" and "TransportError" in shown[down]["error"]
    assert down in captured.err


def test_info_with_one_url_prints_its_info_alone(info_servers, capsys):
    assert main(["info", "--url", info_servers[1]]) == 0
    assert json.loads(capsys.readouterr().out) == {"backend": "second", "version": "test"}


def test_info_says_when_the_replicas_run_different_profiles(capsys):
    servers = []
    for name, order in (("first", "ascend950@9.1"), ("second", "ascend910b@9.1")):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Info)
        server.name, server.order = name, order
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    first, second = (f"http://127.0.0.1:{server.server_address[1]}" for server in servers)
    try:
        assert main(["info", "--url", first, "--url", second]) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)[second]["order"] == "ascend910b@9.1"
        assert f"different device profiles: {first} ascend950@9.1, {second} ascend910b@9.1" in captured.err
        assert main(["info", "--url", first]) == 0 and "different" not in capsys.readouterr().err
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_info_over_a_dns_name_says_which_replica_answered(info_servers, capsys):
    port = info_servers[0].rsplit(":", 1)[1]
    assert main(["info", "--url", f"dns+http://localhost:{port}"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["backend"] == "first"
    named = f"moegrad: info of http://127.0.0.1:{port}, one of the replicas of dns+http://localhost:{port}"
    assert named in captured.err


# ---- the server's timings, the plot extra -----------------------------------------------------------


def test_the_timings_line_leaves_out_an_unmeasured_golden_and_keeps_small_times():
    result = SimpleNamespace(backend="reference", order="ascend910b", device=None,
                             timings_ms={"compute": 0.0123, "golden": 0.0, "compare": 12.5, "total": 13.25})
    line = _server_summary(result)
    assert "golden" not in line
    assert "compute 12.3 µs" in line and "compare 12.500 ms" in line and "total 13.250 ms" in line


def test_the_golden_is_shown_when_measured():
    result = SimpleNamespace(backend="b", order="o", device="d", timings_ms={"golden": 0.5})
    assert "golden 500.0 µs" in _server_summary(result)


def test_without_matplotlib_the_note_names_the_plot_extra(tmp_path, capsys, monkeypatch):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    extra = next(name for name, needs in extras.items() if any(need.startswith("matplotlib") for need in needs))
    for module in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    argv = local_argv(tmp_path, DOC_IDX)
    np.save(tmp_path / "candidate.npy", DOC_GRAD[:2])
    compare = ["compare", "--local", *argv[1:7], "--top-k", "2", "--candidate", str(tmp_path / "candidate.npy"),
               "--report", str(tmp_path / "r.md")]
    main(compare)
    out = capsys.readouterr().out
    assert f"pip install 'moegrad[{extra}]'" in out and "matplotlib is not installed" in out
    assert f"moegrad[{extra}]" in (tmp_path / "r.md").read_text()
