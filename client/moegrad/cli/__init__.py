"""The ``moegrad`` command: a client of the library, never a second code path.

It imports the library only through its public faces (``moegrad``, ``moegrad.accuracy``,
``moegrad.wire``...): an import-linter contract in pyproject.toml keeps it so.
"""

from moegrad.cli._main import main

__all__ = ["main"]
