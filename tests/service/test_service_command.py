"""``moegrad-service``: the install hint without the service extra, and a taken port refused before any warm-up."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

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
