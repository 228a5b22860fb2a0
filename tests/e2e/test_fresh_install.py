"""``pip install .`` with no extras, into a fresh virtual environment: the client works, the server says what it lacks.

A real ``python -m venv`` and ``pip install`` (pip's cache and the machine's configured indexes
allowed); the server it talks to is the e2e fixture's real uvicorn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support.docexample import DOC_GRAD, DOC_IDX

ROOT = Path(__file__).resolve().parents[2]
CLIENT_ONLY_ABSENT = ("fastapi", "uvicorn", "pydantic_settings", "prometheus_client", "numba", "torch")


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # only what pip installs
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=env)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(ROOT)],
                   check=True, timeout=600, env=env)
    return venv, env


def test_the_client_install_has_no_server_packages_and_calls_a_server(fresh_venv, server_url):
    venv, env = fresh_venv
    code = f"""
import importlib.util, json, sys
import numpy as np
import moegrad
grad = np.array({DOC_GRAD.tolist()!r}, dtype=np.float32)
with moegrad.Client({server_url!r}) as client:
    grad_x = client.moe_init_routing_v2_grad(grad, np.array({DOC_IDX.tolist()!r}, dtype=np.int32), top_k=2)
print(json.dumps({{"file": moegrad.__file__, "grad_x": grad_x.tolist(),
                  "absent": [m for m in {CLIENT_ONLY_ABSENT!r} if importlib.util.find_spec(m) is None]}}))
"""
    result = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120,
                            env=env, cwd=venv)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["file"].startswith(str(venv))
    assert answer["absent"] == list(CLIENT_ONLY_ABSENT)
    # The documentation's example: 0.1 + 0.2 and 0.3 + 0.4 in float32.
    assert answer["grad_x"] == [[float(np.float32(0.3))] * 2, [float(np.float32(0.3) + np.float32(0.4))] * 2]


def test_the_service_command_says_what_to_install(fresh_venv):
    venv, env = fresh_venv
    result = subprocess.run([str(venv / "bin" / "moegrad-service"), "serve"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 2
    assert "pip install 'moegrad[service]'" in result.stderr and "Traceback" not in result.stderr


