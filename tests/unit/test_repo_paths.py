"""Every repository path that the documentation and the code's docstrings and comments name exists.

A path is named as ``client/...``, ``service/...``, ``tests/...``, ``bench/...``, ``docs/...``,
``deploy/...``, ``docker/...`` (from the repository's root), or ``moegrad/...`` /
``moegrad_service/...`` (inside client/ and service/). A name with a wildcard or a placeholder
(``*``, ``<case>``, ``{name}``, ``...``) names a pattern, not a file: the folder of its fixed part
must exist. A path is looked up from the root, then beside the file that names it (tests/README.md
names tests/deploy's helpers as ``deploy/...``). docs/ is one flat folder, so a ``docs/a/b`` is
another repository's, cited with its repo and commit, and is not looked up. Oracle: the work tree.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    ROOT / "README.md",
    ROOT / "tests" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "client").rglob("*.py")),
    *sorted((ROOT / "service").rglob("*.py")),
]
_PATH = re.compile(
    r"(?<![\w./-])((?:client|service|tests|bench|docs|deploy|docker|moegrad|moegrad_service)/[\w.*<>{}/-]*[\w*>}/])"
)
_PATTERN = re.compile(r"[*<>{}]|\.\.\.")
_INSIDE = {"moegrad": "client", "moegrad_service": "service"}
#: Names that look like this repository's paths but are another's (cited with its repo and commit)
#: or a Kubernetes object's (kind/name).
ELSEWHERE = {
    "docs/release_process.md": "Ascend/cann-container-image",
    "service/moegrad-npu-predictor": "a Kubernetes Service",
    "tests/assets/golden.py": "ops-transformer's aclnnMoeInitRoutingV4 golden",
}


def _named() -> dict[str, set[str]]:
    named: dict[str, set[str]] = {}
    for source in SOURCES:
        for match in _PATH.finditer(source.read_text(encoding="utf-8")):
            path = match.group(1).rstrip(".")
            if path.startswith("moegrad/") and path.endswith("/"):  # a prose "moegrad/" (the package), not a path
                continue
            if path in ELSEWHERE or (path.startswith("docs/") and path.count("/") > 1):  # ours is flat
                continue
            named.setdefault(path, set()).add(str(source.relative_to(ROOT)))
    return named


def _exists(path: str, beside: Path | None = None) -> bool:
    top = path.split("/", 1)[0]
    bases = [ROOT / _INSIDE[top] if top in _INSIDE else ROOT, *([beside] if beside is not None else [])]
    fixed = _PATTERN.split(path)[0]
    if fixed != path:  # a pattern: the folder of its fixed part
        path = fixed if fixed.endswith("/") else fixed.rsplit("/", 1)[0]
    return any((base / path).exists() for base in bases)


def test_the_checker_tells_a_path_that_is_gone():
    assert _exists("client/moegrad/wire/_codec.py") and _exists("moegrad/numerics/_fast_jit.py")
    assert not _exists("client/moegrad/_wire.py") and not _exists("moegrad/_orders.py")
    assert _exists("tests/unit/*/test_*.py") and not _exists("tests/nowhere/*.py")


@pytest.mark.parametrize(("path", "where"), sorted((path, ", ".join(sorted(w))) for path, w in _named().items()))
def test_a_named_path_exists(path, where):
    sources = [ROOT / source for source in where.split(", ")]
    assert any(_exists(path, source.parent) for source in sources), f"{where} names {path}, which does not exist"
