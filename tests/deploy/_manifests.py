"""The Kubernetes manifests as the cluster would get them: rendered by ``kubectl kustomize``.

kubectl bundles kustomize (``kubectl kustomize DIR`` prints the rendered resources and needs no
cluster). Where kubectl is not installed, the tests that need rendered manifests skip and say so.
"""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

__all__ = ["kustomize"]

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
