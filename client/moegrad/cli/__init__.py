"""The ``moegrad`` command: a client of the library, never a second code path."""
