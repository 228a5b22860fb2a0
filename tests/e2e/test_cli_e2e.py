"""The moegrad command (a subprocess, as a user runs it) against a real moegrad-service.

Expected values: the documentation's example (float32 0.3 and 0.70000005) and, for random calls,
``moegrad local`` / the in-process reference, bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import moegrad
from support.docexample import DOC_GRAD as EXAMPLE_X
from support.docexample import DOC_IDX as EXAMPLE_IDX
from support.docexample import DOC_RESULT_BITS as EXAMPLE_BITS


def moegrad_cli(*argv: str, console_script: bool = False, **env: str) -> subprocess.CompletedProcess:
    """Run ``moegrad`` (the installed console script) or ``python -m moegrad``."""
    script = Path(sys.executable).parent / "moegrad"
    command = [str(script)] if console_script else [sys.executable, "-m", "moegrad"]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MOEGRAD_")}
    return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=120, env={**environment, **env})


def grad_args(url: str, x: Path, idx: Path, out: Path, top_k: int, *extra: str) -> list[str]:
    return ["grad", "--url", url, "--grad-expanded-x", str(x), "--expanded-row-idx", str(idx), "--top-k", str(top_k),
            "-o", str(out), *extra]


@pytest.mark.skipif(not (Path(sys.executable).parent / "moegrad").exists(),
                    reason="the moegrad console script is not installed beside this Python")
def test_example_command(server_url):
    done = moegrad_cli("example", "--url", server_url, console_script=True)
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert "[[0.3, 0.3], [0.70000005, 0.70000005]]" in lines["result"]
    assert "[[0.3, 0.3], [0.70000005, 0.70000005]]" in lines["expected"]
    assert "bit-exact match: yes" in done.stdout


def test_example_command_with_env_url(server_url):
    done = moegrad_cli("example", MOEGRAD_URL=server_url)
    assert done.returncode == 0, done.stderr
    assert "bit-exact match: yes" in done.stdout


def test_grad_command_example(server_url, tmp_path):
    np.save(tmp_path / "x.npy", EXAMPLE_X)
    np.save(tmp_path / "idx.npy", EXAMPLE_IDX)
    done = moegrad_cli(*grad_args(server_url, tmp_path / "x.npy", tmp_path / "idx.npy", tmp_path / "out.npy", 2))
    assert done.returncode == 0, done.stderr
    grad_x = np.load(tmp_path / "out.npy")
    assert grad_x.dtype == np.float32
    np.testing.assert_array_equal(grad_x.view(np.uint32), EXAMPLE_BITS)
    assert "reference" in done.stdout


@pytest.mark.parametrize(
    ("dtype", "uint"), [(np.float16, np.uint16), (ml_dtypes.bfloat16, np.uint16), (np.float32, np.uint32)])
def test_grad_command_matches_local_and_reference(server_url, tmp_path, dtype, uint):
    rng = np.random.default_rng(11)
    tokens, top_k, hidden = 9, 5, 24
    x = (rng.standard_normal((tokens * top_k, hidden)) * 3).astype(dtype)
    idx = rng.permutation(tokens * top_k).astype(np.int32)
    np.save(tmp_path / "x.npy", x)  # bfloat16 is written as '<V2'
    np.save(tmp_path / "idx.npy", idx)
    remote = moegrad_cli(*grad_args(server_url, tmp_path / "x.npy", tmp_path / "idx.npy", tmp_path / "r.npy", top_k,
                                    "--order", "ascend910b"))
    assert remote.returncode == 0, remote.stderr
    local = moegrad_cli("local", "--grad-expanded-x", str(tmp_path / "x.npy"), "--expanded-row-idx",
                        str(tmp_path / "idx.npy"), "--top-k", str(top_k), "-o", str(tmp_path / "l.npy"))
    assert local.returncode == 0, local.stderr
    want = moegrad.moe_init_routing_v2_grad(x, idx, top_k)
    for name in ("r.npy", "l.npy"):
        got = np.load(tmp_path / name)
        assert got.dtype.itemsize == want.dtype.itemsize and got.shape == want.shape
        np.testing.assert_array_equal(got.view(uint), want.view(uint))


def test_drop_pad_grad_command(server_url, tmp_path):
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)  # [E=2, C=3, H=4]
    idx = np.array([5, -1, 0, 2, -1, -1], dtype=np.int32)          # K=2, N=3; -1 dropped
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "idx.npy", idx)
    done = moegrad_cli(*grad_args(server_url, tmp_path / "x.npy", tmp_path / "idx.npy", tmp_path / "o.npy", 2,
                                  "--drop-pad-mode", "1"))
    assert done.returncode == 0, done.stderr
    rows = x.reshape(6, 4)
    expected = np.stack([rows[5], rows[0] + rows[2], np.zeros(4, np.float32)])  # an all-dropped token is +0.0
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), expected)


def test_info_command(server_url):
    done = moegrad_cli("info", "--url", server_url)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["backend"] == "reference" and info["version"] == moegrad.__version__


def test_rejected_input_exits_3(server_url, tmp_path):
    np.save(tmp_path / "x.npy", EXAMPLE_X)
    np.save(tmp_path / "idx.npy", np.array([2, 0, 2, 3], np.int32))  # a duplicate index
    done = moegrad_cli(*grad_args(server_url, tmp_path / "x.npy", tmp_path / "idx.npy", tmp_path / "o.npy", 2))
    assert done.returncode == 3
    assert "expanded_row_idx" in done.stderr and "161002" in done.stderr
    assert not (tmp_path / "o.npy").exists()


def test_payload_too_large_from_the_server_exits_3(server_factory, tmp_path):
    url = server_factory(max_body_bytes=4096)
    np.save(tmp_path / "x.npy", np.zeros((64, 32), np.float32))
    np.save(tmp_path / "idx.npy", np.arange(64, dtype=np.int32))
    done = moegrad_cli(*grad_args(url, tmp_path / "x.npy", tmp_path / "idx.npy", tmp_path / "o.npy", 2))
    assert done.returncode == 3, done.stderr
    assert "PayloadTooLarge" in done.stderr


def test_wrong_token_exits_4_and_right_token_works(server_factory):
    url = server_factory(auth_tokens="cli-token")
    done = moegrad_cli("info", "--url", url)
    assert done.returncode == 4 and "Unauthorized" in done.stderr
    assert moegrad_cli("info", "--url", url, "--token", "cli-token").returncode == 0
    assert moegrad_cli("example", "--url", url, MOEGRAD_TOKEN="cli-token").returncode == 0
