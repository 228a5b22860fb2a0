"""Harness for the tests of the reference's two kernel paths (compiled with numba, and NumPy).

Not oracles: these run the code under test and record how it ran. :func:`record_stream_flags`
records whether each compiled kernel call streamed its stores; :func:`streamed_into_offset_buffer`
writes grad_x into a view inside a buffer of sentinel bits, so a test sees both the result and
whether anything outside the view was written. The expected values come from
:mod:`support.slow_loops`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["record_stream_flags", "streamed_into_offset_buffer"]


def record_stream_flags(monkeypatch, name: str) -> list[bool]:
    """The ``stream`` argument of each call of ``_fast_jit.<name>`` (run_rows or run_rows_950, whose
    eighth argument it is); the kernel still runs."""
    from moegrad.numerics import _fast_jit  # imports numba: only the tests of the compiled path get here

    flags = []
    kernel = getattr(_fast_jit, name)

    def recording(*args):
        flags.append(args[7])
        return kernel(*args)

    monkeypatch.setattr(_fast_jit, name, recording)
    return flags


def streamed_into_offset_buffer(call_kwargs, tokens, hidden, dtype, offset):
    """grad_x written by the streaming kernel into a view ``offset`` elements into a buffer of
    sentinel bits; returns (grad_x, the buffer's words outside the view)."""
    from moegrad import moe_init_routing_v2_grad

    words = np.dtype(f"u{dtype.itemsize}")
    buffer = np.full(offset + tokens * hidden + 64, 0x5A5A5A5A & np.iinfo(words).max, dtype=words)
    out = buffer[offset:offset + tokens * hidden].view(dtype).reshape(tokens, hidden)
    moe_init_routing_v2_grad(**call_kwargs, out=out)
    return out, np.concatenate([buffer[:offset], buffer[offset + tokens * hidden:]])
