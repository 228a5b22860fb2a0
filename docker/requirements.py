"""Print the requirements a moegrad image installs, read from ``pyproject.toml``, one per line.

Usage: ``python requirements.py PYPROJECT [EXTRA ...]``

The output is ``[project].dependencies`` followed by each named ``[project.optional-dependencies]``
extra, in that order, as PEP 508 strings (``uvicorn[standard]>=0.29``) that ``pip install -r``
accepts. The Dockerfile installs them in a layer of their own before it copies the source, so a
change to the source reuses the cached dependency layer. Standard library only (``tomllib``:
Python 3.11+), because it runs on the bare base image.

Exit status 2 (with a message on stderr) for an unknown extra or an extra that names the project
itself (``moegrad[...]``), which ``pip install -r`` could not resolve before the project is built.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

__all__ = ["requirements", "main"]


def requirements(pyproject: dict, extras: Sequence[str]) -> list[str]:
    """The dependencies of ``pyproject`` (a parsed pyproject.toml) plus those of ``extras``.

    Raises:
        ValueError: an extra is not defined, or one of its entries names the project itself.
    """
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    lines = list(project.get("dependencies", []))
    for extra in extras:
        if extra not in optional:
            raise ValueError(f"unknown extra {extra!r}; pyproject.toml defines {sorted(optional)}")
        for line in optional[extra]:
            if line.split("[")[0].strip().lower() == project["name"].lower():
                raise ValueError(f"extra {extra!r} names the project itself ({line!r})")
            lines.append(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    pyproject = tomllib.loads(Path(args[0]).read_text(encoding="utf-8"))
    try:
        lines = requirements(pyproject, args[1:])
    except ValueError as exc:
        print(f"requirements.py: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
