"""The PyTriton peer's own Python 3.12 venv under bench/_out/: found, or built once, lazily.

PyTriton 0.7 bundles a Triton server linked against libpython3.12, so it cannot run in moegrad's
venv (Python 3.11). :func:`ensure` makes ``bench/_out/pytriton-venv`` from the 3.12 interpreter that
pyenv provides, installs ``nvidia-pytriton`` into it, checks that the package imports, and marks the
venv ready with a stamp file; later calls find the stamp and return at once. A build that does not
finish within its time limit is stopped (its whole process group) and its partial venv removed, so
the next run starts clean; the caller reports the peer as skipped.

Build it ahead of a quick ``make bench`` (which allows the build only a short time)::

    .venv/bin/python -m bench.pytriton_peer.venv
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PYTRITON_REQUIREMENT", "PeerVenv", "ensure", "find", "find_python312"]

PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.0"
OUT_DIR = Path(__file__).resolve().parents[1] / "_out"
VENV_DIR = OUT_DIR / "pytriton-venv"
LOG_PATH = OUT_DIR / "pytriton-venv.log"
_STAMP = ".moegrad-bench-ready"


@dataclass(frozen=True)
class PeerVenv:
    """A ready venv: its interpreter and the folder that must be on LD_LIBRARY_PATH (libpython3.12.so)."""

    python: Path
    lib_dir: str
    pytriton_version: str

    def env(self) -> dict[str, str]:
        """The environment to run the peer's server in."""
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (self.lib_dir, env.get("LD_LIBRARY_PATH", "")) if p)
        env.pop("PYTHONPATH", None)  # nothing of moegrad's venv may leak into the peer
        return env


def find_python312() -> Path | None:
    """The newest ``versions/3.12.*/bin/python`` under ``pyenv root`` (or $PYENV_ROOT, ~/.pyenv)."""
    roots: list[Path] = []
    pyenv = shutil.which("pyenv")
    if pyenv:
        try:
            out = subprocess.run([pyenv, "root"], capture_output=True, text=True, timeout=30, check=True).stdout
            roots.append(Path(out.strip()))
        except (OSError, subprocess.SubprocessError):
            pass
    roots += [Path(os.environ["PYENV_ROOT"])] if os.environ.get("PYENV_ROOT") else []
    roots.append(Path.home() / ".pyenv")

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", path.parents[1].name))

    for root in roots:
        candidates = [p for p in (root / "versions").glob("3.12.*/bin/python") if p.exists()]
        if candidates:
            return max(candidates, key=version)
    return None


def _lib_dir(python: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()


def find() -> PeerVenv | None:
    """The venv when a finished build is there (its stamp file), else None; builds nothing."""
    return _ready()


def _ready() -> PeerVenv | None:
    stamp = VENV_DIR / _STAMP
    python = VENV_DIR / "bin" / "python"
    if not (stamp.is_file() and python.exists()):
        return None
    fields = dict(line.split("=", 1) for line in stamp.read_text().splitlines() if "=" in line)
    if "lib_dir" not in fields or not Path(fields["lib_dir"]).is_dir():
        return None
    return PeerVenv(python=python, lib_dir=fields["lib_dir"], pytriton_version=fields.get("pytriton", "?"))


def ensure(limit_s: float | None) -> PeerVenv | str:
    """The ready venv, building it if needed within ``limit_s`` seconds (None: no limit).

    Returns:
        the :class:`PeerVenv`, or a one-line reason why there is none (no 3.12 interpreter, the
        build failed, or it ran past the limit); the build's log is bench/_out/pytriton-venv.log.
    """
    found = _ready()
    if found is not None:
        return found
    python312 = find_python312()
    if python312 is None:
        return "no Python 3.12 interpreter under `pyenv root`/versions/3.12.*"
    lib_dir = _lib_dir(python312)
    if VENV_DIR.exists():  # a partial venv from an interrupted build
        shutil.rmtree(VENV_DIR)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    venv_python = VENV_DIR / "bin" / "python"
    check = "import pytriton.triton, tritonclient.http, importlib.metadata as m; print(m.version('nvidia-pytriton'))"
    script = " && ".join([
        f"{_q(python312)} -m venv {_q(VENV_DIR)}",
        f"{_q(venv_python)} -m pip install --disable-pip-version-check {_q(PYTRITON_REQUIREMENT)}",
        f"LD_LIBRARY_PATH={_q(lib_dir)} {_q(venv_python)} -c {_q(check)}",
    ])
    started = time.monotonic()
    with open(LOG_PATH, "w") as log:
        log.write(f"$ {script}\n")
        log.flush()
        process = subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _stop_group(process)
            shutil.rmtree(VENV_DIR, ignore_errors=True)
            return (f"building the PyTriton venv did not finish within {limit_s:.0f} s (log: {_rel(LOG_PATH)}); "
                    f"build it once with `.venv/bin/python -m bench.pytriton_peer.venv`")
        finally:
            if process.poll() is None:
                _stop_group(process)
    if process.returncode != 0:
        shutil.rmtree(VENV_DIR, ignore_errors=True)
        return f"building the PyTriton venv failed with exit code {process.returncode} (log: {_rel(LOG_PATH)})"
    lines = LOG_PATH.read_text(errors="replace").strip().splitlines()
    version = lines[-1].strip() if lines else "?"
    (VENV_DIR / _STAMP).write_text(f"lib_dir={lib_dir}\npytriton={version}\npython={python312}\n"
                                   f"build_s={time.monotonic() - started:.0f}\n")
    return PeerVenv(python=venv_python, lib_dir=lib_dir, pytriton_version=version)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the build's own process group (it was started in a new session)."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _q(value: object) -> str:
    import shlex

    return shlex.quote(str(value))


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the PyTriton peer's Python 3.12 venv under bench/_out/.")
    parser.add_argument("--limit-s", type=float, default=None, help="give up after this many seconds (default: none)")
    args = parser.parse_args(argv)
    result = ensure(args.limit_s)
    if isinstance(result, str):
        print(f"bench.pytriton_peer.venv: {result}", file=sys.stderr)
        return 1
    print(f"ready: {result.python} (nvidia-pytriton {result.pytriton_version}; LD_LIBRARY_PATH={result.lib_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
