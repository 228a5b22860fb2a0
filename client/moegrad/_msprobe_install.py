"""``python -m moegrad.msprobe register | unregister | status``: moegrad's bench functions in an installed msprobe.

mindstudio-probe 26.2.0 loads bench functions through ``msprobe/pytorch/dump/function_factory.py``:
``get_npu_custom_functions()`` keys each operator of ``bench_functions/fusion_operator_config.yaml``
to its ``forward`` function, ``get_npu_custom_grad_functions()`` keys each ``backward`` function by
its name, and both resolve the names as attributes of the ``msprobe.pytorch.bench_functions``
package, whose ``__init__`` imports every module of that folder and exposes its callables
(Ascend/msprobe commit 1f00e639; releases up to 26.1.0.post1 hard-code the list instead). So
``register`` writes three things, and ``unregister`` takes back exactly those:

1. ``bench_functions/moegrad_bench.py``: imports the four functions of :mod:`moegrad.msprobe` (and
   logs a warning instead of failing when moegrad cannot be imported there, so msprobe still loads
   its own functions); its second line is a manifest of what ``register`` added;
2. in ``fusion_operator_config.yaml``, a block between ``# >>> moegrad`` and ``# <<< moegrad`` at
   the end of ``operators:`` with the entries of npu_moe_token_permute and npu_moe_init_routing_v2;
   the rest of the file (other entries, comments) is left byte for byte;
3. in ``api_accuracy_checker/acc_check/torch_ut_setting.json``, ``{"grad_index": 0}`` for the two
   operators where no entry exists: acc_check runs the backward of an API that returns a tuple only
   when that file names the output to differentiate (``need_to_backward`` in acc_check.py).

Each file is checked before any is written (the YAML must parse to the same operators plus ours),
and written whole through a temporary file in the same folder.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moegrad._version import __version__
from moegrad.operator._profiles import DEFAULT_PROFILE

#: The environment variable naming the profile (a key of :data:`moegrad.msprobe.PROFILES`).
ORDER_ENV = "MOEGRAD_MSPROBE_ORDER"
#: The environment variable with a moegrad service's base URL: the backwards are computed there.
URL_ENV = "MOEGRAD_MSPROBE_URL"
#: The environment variable with the service's bearer token.
TOKEN_ENV = "MOEGRAD_MSPROBE_TOKEN"
#: The environment variable fixing the dtype a float32 grad is narrowed to (moegrad.msprobe's docstring, "Dtypes").
DTYPE_ENV = "MOEGRAD_MSPROBE_DTYPE"

__all__ = [
    "MIN_MSPROBE_VERSION",
    "MsprobeInstall",
    "MsprobeSetupError",
    "find_msprobe",
    "main",
    "register",
    "status",
    "unregister",
]

#: The first mindstudio-probe release with the YAML loader (26.1.0.post1 has none).
MIN_MSPROBE_VERSION = "26.2.0"
MODULE_NAME = "moegrad_bench.py"
#: operator -> (forward function, backward function, description), as the YAML names them.
OPERATORS: dict[str, tuple[str, str, str]] = {
    "npu_moe_token_permute": (
        "npu_moe_token_permute",
        "npu_moe_token_permute_grad",
        "MoE token permute, by moegrad's emulation (python -m moegrad.msprobe)",
    ),
    "npu_moe_init_routing_v2": (
        "npu_moe_init_routing_v2",
        "npu_moe_init_routing_v2_grad",
        "MoE init routing v2, by moegrad's emulation (python -m moegrad.msprobe)",
    ),
}
GRAD_INDEX = 0  # the output whose gradient acc_check sends back: permuted_tokens / expanded_x
_BEGIN = "# >>> moegrad"
_END = "# <<< moegrad"
_MANIFEST = "# moegrad-manifest: "


class MsprobeSetupError(Exception):
    """msprobe is missing, too old, not writable, or its files are not as ``register`` expects."""


@dataclass(frozen=True)
class MsprobeInstall:
    """An installed msprobe package, and the files ``register`` touches.

    Attributes:
        package_dir: the ``msprobe`` package folder.
        version: its version (``msprobe/_build_info.py`` or the distribution's metadata), or None.
    """

    package_dir: Path
    version: str | None

    @property
    def bench_dir(self) -> Path:
        return self.package_dir / "pytorch" / "bench_functions"

    @property
    def config_path(self) -> Path:
        return self.bench_dir / "fusion_operator_config.yaml"

    @property
    def module_path(self) -> Path:
        return self.bench_dir / MODULE_NAME

    @property
    def factory_path(self) -> Path:
        return self.package_dir / "pytorch" / "dump" / "function_factory.py"

    @property
    def ut_setting_path(self) -> Path:
        return self.package_dir / "pytorch" / "api_accuracy_checker" / "acc_check" / "torch_ut_setting.json"


def _version(package_dir: Path) -> str | None:
    build_info = package_dir / "_build_info.py"
    if build_info.is_file():
        found = re.search(r"^VERSION\s*=\s*['\"]([^'\"]+)['\"]", build_info.read_text(encoding="utf-8"), re.M)
        if found:
            return found.group(1)
    for metadata in sorted(package_dir.parent.glob("mindstudio_probe-*.dist-info/METADATA")):
        found = re.search(r"^Version:\s*(\S+)", metadata.read_text(encoding="utf-8"), re.M)
        if found:
            return found.group(1)
    return None


def find_msprobe(package_dir: str | os.PathLike[str] | None = None) -> MsprobeInstall:
    """The msprobe this Python imports (nothing is imported to find it), or the one at ``package_dir``.

    Raises:
        MsprobeSetupError: none is installed, or ``package_dir`` is not an msprobe package folder.
    """
    if package_dir is None:
        spec = importlib.util.find_spec("msprobe")
        if spec is None or not spec.submodule_search_locations:
            raise MsprobeSetupError(
                f"mindstudio-probe is not installed for {sys.executable}: "
                f"pip install 'mindstudio-probe>={MIN_MSPROBE_VERSION}' (or pass --msprobe-dir)"
            )
        folder = Path(next(iter(spec.submodule_search_locations)))
    else:
        folder = Path(package_dir)
    if not (folder / "__init__.py").is_file() or not (folder / "pytorch").is_dir():
        raise MsprobeSetupError(f"{folder} is not an msprobe package folder (no __init__.py and pytorch/ in it)")
    return MsprobeInstall(folder.resolve(), _version(folder))


def _check_loader(install: MsprobeInstall) -> None:
    factory = install.factory_path
    has_loader = factory.is_file() and "fusion_operator_config.yaml" in factory.read_text(encoding="utf-8")
    if not has_loader or not install.config_path.is_file():
        raise MsprobeSetupError(
            f"mindstudio-probe {install.version or '(version unknown)'} at {install.package_dir} has no "
            f"fusion-operator YAML loader (pytorch/dump/function_factory.py reading "
            f"bench_functions/fusion_operator_config.yaml); moegrad needs mindstudio-probe >= {MIN_MSPROBE_VERSION}: "
            f"pip install -U 'mindstudio-probe>={MIN_MSPROBE_VERSION}'"
        )


def _check_writable(install: MsprobeInstall) -> None:
    paths = (install.bench_dir, install.config_path, install.ut_setting_path.parent, install.ut_setting_path)
    for path in paths:
        if path.exists() and not os.access(path, os.W_OK):
            raise MsprobeSetupError(
                f"{path} is not writable by this user: run as a user who may change {install.package_dir} "
                "(or install mindstudio-probe in a virtual environment you own)"
            )


# --------------------------------------------------------------------------------------------------
# The three files
# --------------------------------------------------------------------------------------------------


#: What to install when torch is missing (one line; docs/msprobe.md says the same).
TORCH_HINT = (
    "pip install 'moegrad[msprobe]' torch==2.13.0 (CPU only: first pip install torch==2.13.0 "
    "--index-url https://download.pytorch.org/whl/cpu, else pip may pull a CUDA build)"
)


def _check_torch() -> None:
    """The bench functions need torch (msprobe's acc_check calls them with torch tensors).

    Raises:
        MsprobeSetupError: torch cannot be imported here, saying what to install.
    """
    try:
        import torch  # noqa: F401
    except ImportError:
        raise MsprobeSetupError(f"torch is not installed for {sys.executable}: {TORCH_HINT}") from None


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:  # msprobe depends on PyYAML, so this Python lacks msprobe's own dependencies
        raise MsprobeSetupError("PyYAML is not installed (msprobe depends on it): pip install pyyaml") from None
    return yaml


def _operators(text: str, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    document = _yaml().safe_load(text) or {}
    operators = document.get("operators") if isinstance(document, dict) else None
    if not isinstance(operators, dict):
        raise MsprobeSetupError(f"{path} has no 'operators:' mapping; it is not the file this moegrad knows")
    return document, operators


def _without_block(text: str) -> str:
    lines = text.splitlines(keepends=True)
    begin = [i for i, line in enumerate(lines) if line.strip().startswith(_BEGIN)]
    end = [i for i, line in enumerate(lines) if line.strip().startswith(_END)]
    if not begin and not end:
        return text
    if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
        raise MsprobeSetupError("moegrad's block in the YAML is damaged (its '# >>> moegrad' / '# <<< moegrad' lines)")
    return "".join(lines[: begin[0]] + lines[end[0] + 1 :])


def _with_block(text: str, path: Path) -> str:
    """``text`` with moegrad's block appended to the ``operators:`` mapping (which must be block style)."""
    lines = text.splitlines(keepends=True)
    top = [i for i, line in enumerate(lines) if re.match(r"operators\s*:\s*(#.*)?$", line.rstrip("\r\n"))]
    if len(top) != 1:
        raise MsprobeSetupError(f"{path}: no block-style 'operators:' line at the top level")
    start, end, indent = top[0] + 1, len(lines), None
    for i in range(start, len(lines)):
        line = lines[i].rstrip("\r\n")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():  # the next top-level key ends the mapping
            end = i
            break
        if indent is None:
            indent = line[: len(line) - len(line.lstrip())]
    indent = indent or "  "
    while end > start and (not lines[end - 1].strip() or not lines[end - 1][0].isspace()):
        end -= 1  # the block goes after the mapping's last entry line, before blank lines and comments
    block = [f"{indent}{_BEGIN}: entries written by `python -m moegrad.msprobe register` (unregister removes them)\n"]
    for operator, (forward, backward, description) in OPERATORS.items():
        block += [
            f"{indent}{operator}:\n",
            f"{indent}{indent}forward: {forward}\n",
            f"{indent}{indent}backward: {backward}\n",
            f'{indent}{indent}description: "{description}"\n',
        ]
    block.append(f"{indent}{_END}\n")
    head = lines[:end]
    if head and not head[-1].endswith("\n"):
        head[-1] += "\n"
    return "".join(head + block + lines[end:])


def _module_text(manifest: dict[str, Any]) -> str:
    forwards = sorted({name for pair in OPERATORS.values() for name in pair[:2]})
    imports = "".join(f"        {name},\n" for name in forwards)
    return (
        f"# Written by `python -m moegrad.msprobe register` (moegrad {__version__}); "
        "`python -m moegrad.msprobe unregister` removes it.\n"
        f"{_MANIFEST}{json.dumps(manifest, sort_keys=True)}\n"
        '"""moegrad\'s bench functions for npu_moe_token_permute and npu_moe_init_routing_v2 (moegrad.msprobe)."""\n'
        "\n"
        "try:\n"
        "    from moegrad.msprobe import (\n"
        f"{imports}"
        "    )\n"
        "except ImportError as _error:  # moegrad (or torch) is missing here: msprobe must still load its own\n"
        "    import logging\n"
        "\n"
        '    logging.getLogger("msprobe").warning("moegrad bench functions unavailable: %s", _error)\n'
    )


def _manifest(install: MsprobeInstall) -> dict[str, Any] | None:
    if not install.module_path.is_file():
        return None
    for line in install.module_path.read_text(encoding="utf-8").splitlines()[:5]:
        if line.startswith(_MANIFEST):
            try:
                value = json.loads(line[len(_MANIFEST) :])
            except ValueError:
                break
            return value if isinstance(value, dict) else None
    raise MsprobeSetupError(f"{install.module_path} exists but was not written by moegrad: move it away first")


def _ut_settings(install: MsprobeInstall) -> dict[str, Any]:
    """torch_ut_setting.json's mapping ({} when there is no such file)."""
    path = install.ut_setting_path
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    try:
        settings = json.loads(text)
    except ValueError as exc:
        raise MsprobeSetupError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(settings, dict):
        raise MsprobeSetupError(f"{path} is not a JSON object")
    return settings


def _write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` through a temporary file in its folder, keeping its permission bits."""
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _drop_bytecode(install: MsprobeInstall) -> None:
    for cached in (install.bench_dir / "__pycache__").glob(f"{Path(MODULE_NAME).stem}.*.pyc"):
        with contextlib.suppress(FileNotFoundError):
            cached.unlink()


# --------------------------------------------------------------------------------------------------
# register / unregister / status
# --------------------------------------------------------------------------------------------------


def register(install: MsprobeInstall) -> list[str]:
    """Install moegrad's bench functions into ``install`` (idempotent: again refreshes them).

    Returns:
        What was done, one line per file.

    Raises:
        MsprobeSetupError: msprobe too old (no YAML loader), a file not writable or not as expected,
            or an operator already registered by someone else (nothing is written then).
    """
    _check_loader(install)
    _check_writable(install)
    previous = _manifest(install) or {}
    original = install.config_path.read_text(encoding="utf-8")
    base = _without_block(original)
    document, operators = _operators(base, install.config_path)
    taken = sorted(set(OPERATORS) & set(operators))
    if taken:
        raise MsprobeSetupError(
            f"{install.config_path} already registers {', '.join(taken)} (not moegrad's entries): remove them first"
        )
    updated = _with_block(base, install.config_path)
    new_document, new_operators = _operators(updated, install.config_path)
    expected = dict(operators)
    for operator, (forward, backward, description) in OPERATORS.items():
        expected[operator] = {"forward": forward, "backward": backward, "description": description}
    rest = {key: value for key, value in document.items() if key != "operators"}
    if new_operators != expected or {k: v for k, v in new_document.items() if k != "operators"} != rest:
        raise MsprobeSetupError(f"{install.config_path}: adding moegrad's entries would change others; nothing written")
    settings = _ut_settings(install)
    added = []
    if install.ut_setting_path.parent.is_dir():
        added = [op for op in OPERATORS if op not in settings or op in previous.get("ut_settings", [])]
    for operator in added:
        settings[operator] = {"grad_index": GRAD_INDEX}
    manifest = {"moegrad": __version__, "ut_settings": added}
    _write(install.module_path, _module_text(manifest))
    _drop_bytecode(install)
    done = [f"wrote {install.module_path}"]
    if updated != original:
        _write(install.config_path, updated)
    done.append(f"registered {', '.join(OPERATORS)} in {install.config_path}")
    if install.ut_setting_path.parent.is_dir():
        _write(install.ut_setting_path, json.dumps(settings, indent=2))
        done.append(
            f"grad_index {GRAD_INDEX} for {', '.join(added) or 'none (already set)'} in {install.ut_setting_path}"
        )
    return done


def unregister(install: MsprobeInstall) -> list[str]:
    """Remove what :func:`register` wrote (idempotent). Returns what was done, one line per file.

    Raises:
        MsprobeSetupError: a file is not writable, or not as ``register`` left it.
    """
    _check_writable(install)
    manifest = _manifest(install)
    done = []
    if install.config_path.is_file():
        text = install.config_path.read_text(encoding="utf-8")
        stripped = _without_block(text)
        if stripped != text:
            _write(install.config_path, stripped)
            done.append(f"removed moegrad's entries from {install.config_path}")
    if manifest is not None:
        settings = _ut_settings(install)
        ours = [op for op in manifest.get("ut_settings", []) if settings.get(op) == {"grad_index": GRAD_INDEX}]
        if ours:
            for operator in ours:
                del settings[operator]
            _write(install.ut_setting_path, json.dumps(settings, indent=2))
            done.append(f"removed grad_index of {', '.join(ours)} from {install.ut_setting_path}")
        install.module_path.unlink()
        _drop_bytecode(install)
        done.append(f"removed {install.module_path}")
    return done or ["nothing to remove: moegrad's bench functions are not registered here"]


def status(install: MsprobeInstall) -> tuple[bool, list[str]]:
    """Whether moegrad's bench functions are fully registered in ``install``, and a report, one fact a line."""
    lines = [f"msprobe {install.version or '(version unknown)'} at {install.package_dir}"]
    try:
        _check_loader(install)
    except MsprobeSetupError as exc:
        return False, [*lines, str(exc)]
    manifest = _manifest(install)
    complete = manifest is not None
    lines.append(
        f"module: {install.module_path} (moegrad {manifest.get('moegrad')})" if manifest else "module: not written"
    )
    _, operators = _operators(install.config_path.read_text(encoding="utf-8"), install.config_path)
    settings = _ut_settings(install)
    for operator, (forward, backward, _) in OPERATORS.items():
        entry = operators.get(operator)
        ours = isinstance(entry, dict) and entry.get("forward") == forward and entry.get("backward") == backward
        complete = complete and ours and operator in settings
        state = "moegrad's" if ours else "absent" if entry is None else f"someone else's ({entry})"
        lines.append(f"{operator}: YAML entry {state}; torch_ut_setting {settings.get(operator, 'absent')}")
    lines.append(f"profile: {os.environ.get(ORDER_ENV) or DEFAULT_PROFILE} ({ORDER_ENV})")
    lines.append(f"backwards computed: {os.environ.get(URL_ENV) or 'in-process'} ({URL_ENV})")
    lines.append("registered" if complete else "not registered (python -m moegrad.msprobe register)")
    return complete, lines


_DESCRIPTION = f"""\
Register moegrad's bench functions for npu_moe_token_permute and npu_moe_init_routing_v2 (forward and
backward) in an installed msprobe (mindstudio-probe >= {MIN_MSPROBE_VERSION}), so that `msprobe acc_check`
checks these operators against moegrad's emulation.

  register     write bench_functions/{MODULE_NAME}, add the two operators to
               bench_functions/fusion_operator_config.yaml (a marked block; the rest of the file is
               kept) and grad_index 0 to acc_check's torch_ut_setting.json; again: refresh
  unregister   remove exactly what register wrote
  status       show what is registered (exit 0 when all of it is, 1 otherwise)
"""

_EPILOG = """\
environment, read by the bench functions at each call:
  MOEGRAD_MSPROBE_ORDER   the device profile whose bits the backwards reproduce, CHIP@RELEASE:
                          ascend910b / ascend910_93 (Atlas A2/A3) or ascend950 at 8.5, 9.0, 9.1
                          (default ascend910b@9.1; a bare chip: its newest release), or sequential
  MOEGRAD_MSPROBE_URL     compute the backwards on this moegrad service (default: in-process)
  MOEGRAD_MSPROBE_TOKEN   the service's bearer token
  MOEGRAD_MSPROBE_DTYPE   auto (default), bfloat16, float16 or float32: the device dtype of a float32
                          grad (msprobe raises float16 and bfloat16 to float32)

exit codes: 0 ok, 1 torch or msprobe missing, msprobe too old, not writable or not as expected
(the reason is printed, with what to install), 2 usage. moegrad's docs/msprobe.md has the details.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m moegrad.msprobe",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=("register", "unregister", "status"))
    parser.add_argument(
        "--msprobe-dir",
        metavar="DIR",
        help="the msprobe package folder to change (default: the msprobe this Python imports)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command != "unregister":  # taking back what register wrote needs no torch
            _check_torch()
        install = find_msprobe(args.msprobe_dir)
        if args.command == "status":
            complete, lines = status(install)
        else:
            complete, lines = True, (register if args.command == "register" else unregister)(install)
    except MsprobeSetupError as exc:
        print(f"python -m moegrad.msprobe {args.command}: error: {exc}", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    return 0 if complete else 1
