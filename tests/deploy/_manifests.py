"""The Kubernetes manifests as the cluster would get them: rendered by ``kubectl kustomize``.

kubectl bundles kustomize (``kubectl kustomize DIR`` prints the rendered resources and needs no
cluster). Where kubectl is not installed, the tests that need rendered manifests skip and say so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

__all__ = ["expand", "kustomize", "option", "quantity"]

RENDER_TIMEOUT_S = 120


@cache
def _render(directory: Path) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests are rendered with `kubectl kustomize`")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                            timeout=RENDER_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"`kubectl kustomize {directory}` failed:\n{result.stderr}")
    return tuple(resource for resource in yaml.safe_load_all(result.stdout) if resource)


def kustomize(directory: Path) -> list[dict]:
    """The resources ``kubectl kustomize directory`` renders (fresh copies: callers may modify them).

    Skips the calling test when kubectl is not installed.
    """
    import copy

    return copy.deepcopy(list(_render(Path(directory).resolve())))


def quantity(value: str | int) -> float:
    """A Kubernetes quantity (``4Gi``, ``500m``, ``1``) as a number."""
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value))
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number, suffix = float(match.group(1)), match.group(2)
    scale = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return number * scale[suffix]


def option(args: list[str], flag: str) -> str:
    """The value that follows ``flag`` in a container's ``args`` (given once)."""
    (at,) = [i for i, arg in enumerate(args) if arg == flag]
    return args[at + 1]


def expand(text: str, env: dict[str, str]) -> str:
    """``$(VAR)`` references expanded as the kubelet expands a container's command and args: a
    variable the container defines is replaced, ``$$`` is a literal ``$``, anything else stays."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)
