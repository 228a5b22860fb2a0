"""docs/architecture.md names every module of both packages, and no module that is gone.

Oracle: the source tree itself. A module is named by its dotted name inside its package, in
backticks (``_client``, ``accuracy._compare``, ``api.v1.codec``, ``engine.ascend._abi``), or by its
full dotted name (``moegrad.http._client``); a package by its name (``api.v1``) or full name.
"""

from __future__ import annotations

import importlib
import re
import tomllib
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


def _member_names() -> list[tuple[str, str]]:
    """(module, dotted member) for every backticked name that is a module's name and then more: the
    longest module it starts with, and the rest (``http._core.ClientCore.grad_flow``)."""
    modules = _modules()
    names = {**{full: full for full in modules}, **{inner: full for full, inner in modules.items()}}
    found = set()
    for name in _named():
        if name in names:
            continue
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:cut]) in names:
                found.add((names[".".join(parts[:cut])], ".".join(parts[cut:])))
                break
    return sorted(found)


def test_every_member_named_exists():
    members = _member_names()
    assert ("moegrad_service.api.v1.routes", "moe_init_routing_v2_grad") in members  # the page's walk is read
    missing = []
    for module, rest in members:
        value = importlib.import_module(module)
        for part in rest.split("."):
            if not hasattr(value, part):
                missing.append(f"{module}.{rest}")
                break
            value = getattr(value, part)
    assert not missing, f"docs/architecture.md names members that do not exist: {', '.join(missing)}"


def test_the_rules_name_the_contracts_and_the_layers_in_order():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    kinds = {contract["type"] for contract in config["contracts"]}
    assert kinds == {"layers", "forbidden", "acyclic_siblings"}
    assert "layers contract" in text and "forbidden contract" in text and "acyclic-siblings contract" in text
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    rule = text[text.index("1. The client's wings import downward only") : text.index("2. The HTTP client")]
    named = re.findall(r"`(\w+)`", rule)
    wings = [name for layer in layers for name in re.split(r" *[|:] *", layer) if not name.startswith("_")]
    assert named == [w for w in wings if w != "__main__"], (named, wings)
