"""The tests' own layering: test modules import the support package, never each other nor bench.

What they share lives in tests/support (imported as ``support``, mapped in tests/README.md); bench
may import ``support``, not the reverse. Oracle: the test files' own import statements.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_test_modules_import_neither_each_other_nor_bench():
    modules = {path.stem for path in TESTS.rglob("test_*.py")}
    offenders = {}
    for path in TESTS.rglob("*.py"):
        if "support" in path.relative_to(TESTS).parts[:1]:
            continue
        bad = _imported(path) & (modules | {"bench", "oracle", "servicekit", "routing", "grpckit"})
        if bad:
            offenders[str(path.relative_to(TESTS))] = sorted(bad)
    assert not offenders, f"import what they share from tests/support instead: {offenders}"


def test_support_does_not_import_tests_or_bench():
    for path in (TESTS / "support").rglob("*.py"):
        assert not _imported(path) & {"bench", "tests"}, path
