"""``python -m moegrad``: the ``moegrad`` command (see ``moegrad --help``)."""

from moegrad.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
