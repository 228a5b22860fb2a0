"""docs/architecture.md names every module of both packages, and no module that is gone.

Oracle: the source tree itself. A module is named by its dotted name inside its package, in
backticks (``_client``, ``accuracy._compare``, ``api.v1.codec``, ``engine.ascend._abi``), or by its
full dotted name (``moegrad.http._client``); a package by its name (``api.v1``) or full name.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"moegrad": ROOT / "client" / "moegrad", "moegrad_service": ROOT / "service" / "moegrad_service"}


def _modules() -> dict[str, str]:
    """Full dotted name -> name inside its package, for every module and package of both packages."""
    found = {}
    for top, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if not parts:
                continue
            inner = ".".join(parts)
            found[f"{top}.{inner}"] = inner
    return found


def _named() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return set(re.findall(r"`([\w.]+)`", text))


def test_every_module_is_named():
    named = _named()
    missing = [full for full, inner in _modules().items() if full not in named and inner not in named]
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_every_module_named_exists():
    modules = _modules()
    known = set(modules) | set(modules.values())
    full_names = {name for name in _named() if name.startswith(("moegrad.", "moegrad_service."))}
    gone = sorted(name for name in full_names if name not in known and not _is_attribute(name, known))
    assert not gone, f"docs/architecture.md names modules that do not exist: {', '.join(gone)}"


def _is_attribute(name: str, known: set[str]) -> bool:
    """``moegrad.accuracy.compare``-like names: an attribute of a module that exists."""
    return name.rsplit(".", 1)[0] in known
