"""``python -m moegrad.msprobe`` where torch is not installed: --help works, the commands say in one
line what to install, and docs/msprobe.md says the same.

torch is made unimportable in a subprocess by a None entry in ``sys.modules`` (``import torch``
then raises ImportError, as without the package). Oracles: pyproject.toml's extras and the
version pinned by the Makefile's tests (TORCH_TEST_PIN).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_WITHOUT_TORCH = (
    "import runpy, sys\n"
    "sys.modules['torch'] = None\n"
    "sys.argv = ['python -m moegrad.msprobe', *sys.argv[1:]]\n"
    "runpy.run_module('moegrad.msprobe', run_name='__main__', alter_sys=True)\n"
)


def without_torch(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *argv], capture_output=True, text=True, timeout=120)


def pinned_torch() -> str:
    return re.search(r"^TORCH_TEST_PIN := (torch==\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def test_help_needs_no_torch():
    done = without_torch("--help")
    assert done.returncode == 0, done.stderr
    assert "register" in done.stdout and "unregister" in done.stdout and "status" in done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["status", "register"])
def test_a_command_without_torch_says_in_one_line_what_to_install(command):
    done = without_torch(command)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "torch is not installed" in lines[0]
    assert f"pip install 'moegrad[msprobe]' {pinned_torch()}" in lines[0]
    assert "download.pytorch.org/whl/cpu" in lines[0]


def test_importing_the_bench_functions_without_torch_names_the_install():
    code = "import sys; sys.modules['torch'] = None\nimport moegrad.msprobe\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "ImportError: moegrad.msprobe needs torch" in done.stderr and "moegrad[msprobe]" in done.stderr


def test_the_docs_pin_the_tested_torch_and_name_the_real_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(need.startswith("torch") for need in extras["msprobe"])
    assert any(need.startswith("mindstudio-probe") for need in extras["msprobe"])
    text = (ROOT / "docs" / "msprobe.md").read_text()
    assert f"pip install 'moegrad[msprobe]' {pinned_torch()}" in text
    assert f".venv/bin/pip install -e '.[msprobe]' {pinned_torch()}" in text
    assert f"pip install {pinned_torch()} --index-url https://download.pytorch.org/whl/cpu" in text
