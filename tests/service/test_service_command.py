"""``moegrad-service``: the install hint without the service extra, and a taken port refused before any warm-up."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moegrad_service.app
from moegrad_service.__main__ import main


def test_without_the_service_extra_it_says_what_to_install():
    # pydantic_settings as a client-only install lacks it: a None entry makes its import fail.
    code = ("import sys; sys.modules['pydantic_settings'] = None\n"
            "from moegrad_service.__main__ import main; sys.exit(main(['serve']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "pip install 'moegrad[service]'" in result.stderr and "pydantic_settings" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_taken_port_fails_before_the_app_is_built(monkeypatch, capsys):
    built = []
    monkeypatch.setattr(moegrad_service.app, "create_app", lambda *a, **k: built.append(a))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        status = main(["serve", "--host", "127.0.0.1", "--port", str(port), "--backend", "reference"])
        elapsed_s = time.monotonic() - started
    assert status == 1 and not built and elapsed_s < 10
    error = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in error and "--port / MOEGRAD_PORT" in error


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serve_passes_only_the_flags_given():
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT", "BACKEND")}

    def serve_line(*assignments: str) -> str:
        result = subprocess.run(["make", "-n", "serve", *assignments], cwd=root, env=env, capture_output=True,
                                text=True, timeout=60, check=True)
        return [line for line in result.stdout.splitlines() if "moegrad-service serve" in line][-1]

    assert "--" not in serve_line()  # MOEGRAD_HOST / MOEGRAD_PORT / MOEGRAD_BACKEND then apply
    line = serve_line("PORT=9000")
    assert "--port 9000" in line and "--host" not in line and "--backend" not in line
    assert "--host 0.0.0.0" in serve_line("HOST=0.0.0.0") and "--backend reference" in serve_line("BACKEND=reference")


def test_the_main_guard_is_the_modules_last_statement():
    """``python -m moegrad_service`` runs main() at the guard: anything defined after it does not exist
    yet while the server runs (a protocol factory placed there made the SIGTERM backlog path raise
    NameError and exit 1)."""
    import ast
    import inspect

    import moegrad_service.__main__ as entry

    body = ast.parse(inspect.getsource(entry)).body
    guard = body[-1]
    assert isinstance(guard, ast.If) and "__main__" in ast.unparse(guard.test), ast.unparse(guard)[:80]
    assert not any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in body[:-1])


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"]])
def test_help_is_plain_text_not_restructuredtext(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "moegrad-service" in text and "``" not in text
