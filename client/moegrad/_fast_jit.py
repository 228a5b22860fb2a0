"""The compiled body of the fast path: numba functions, imported only by :mod:`moegrad._fast`.

Importing this module imports numba; :mod:`moegrad._fast` does so lazily, on the first call that can
use it, and falls back to the NumPy path when numba is missing.

Numerics (DESIGN.md section 3), and how this code keeps them exact:

- The element type travels as a bit view that also names the format: float32 rows as ``float32``,
  float16 rows as ``int16`` words, bfloat16 rows as ``uint16`` words. One specialisation each.
- Widening works on the bits and is exact: bfloat16 is the upper half of a float32; float16 moves
  its exponent and mantissa into float32 fields (a subnormal is the exact ``int -> float`` of its
  mantissa with 24 taken off the exponent field). NaNs keep their payload, as NumPy's cast does.
- Every add is one IEEE float32 add of a bin and a value: no fastmath flags, so LLVM neither
  reassociates nor contracts into FMAs. It vectorises the loops over H, which only runs the adds of
  different output elements side by side; the adds of one element stay in the schedule's order.
  (LLVM may swap the two operands of an add. That changes nothing but which NaN's payload and sign
  a NaN + NaN keeps; NumPy's own add does not fix that either, see tests/unit/test_reference_paths.py.)
- Narrowing rounds half to even exactly as NumPy (float16) and ml_dtypes (bfloat16) cast: overflow
  goes to inf, subnormals are rounded, and a NaN gets the same bits those casts give it.
- The conversions are written as 32-bit LLVM IR (numba would type the same Python integer code as
  64-bit, which halves the vector width); the loops around them are plain numba.
- The schedule (``accumulation_schedule``) is data: an int32 [steps, 3] table of (op, dst, src).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

__all__ = ["OP_ADD", "OP_MERGE", "OP_SET", "OP_ZERO", "narrow_bf16", "narrow_f16", "run_rows", "widen_bf16",
           "widen_f16"]

OP_SET, OP_ADD, OP_MERGE, OP_ZERO = 0, 1, 2, 3

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _i32(value: int) -> ir.Constant:
    return ir.Constant(_I32, value)


@intrinsic
def _widen_f16(typingctx, word):
    """float32 of the float16 whose bits are ``word`` (int16): exact; NaNs keep payload and sign."""
    if word != types.int16:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        u = b.zext(args[0], _I32)
        sign = b.shl(b.and_(u, _i32(0x8000)), _i32(16))
        shifted = b.shl(b.and_(u, _i32(0x7FFF)), _i32(13))  # exponent and mantissa in float32's places
        normal = b.add(shifted, _i32(112 << 23))  # re-bias the exponent: 15 -> 127
        special = b.or_(shifted, _i32(0x7F800000))  # exponent 31: inf or NaN, payload kept
        mantissa = b.and_(u, _i32(0x3FF))
        scaled = b.sub(b.bitcast(b.sitofp(mantissa, _F32), _I32), _i32(24 << 23))  # m * 2**-24, exact
        tiny = b.select(b.icmp_unsigned("==", mantissa, _i32(0)), _i32(0), scaled)
        exponent = b.and_(u, _i32(0x7C00))
        body = b.select(b.icmp_unsigned("==", exponent, _i32(0x7C00)), special,
                        b.select(b.icmp_unsigned("==", exponent, _i32(0)), tiny, normal))
        return b.bitcast(b.or_(sign, body), _F32)

    return types.float32(types.int16), codegen


@intrinsic
def _widen_bf16(typingctx, word):
    """float32 of the bfloat16 whose bits are ``word`` (uint16): its upper half, exact."""
    if word != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.shl(builder.zext(args[0], _I32), _i32(16)), _F32)

    return types.float32(types.uint16), codegen


@intrinsic
def _narrow_f16(typingctx, value):
    """float16 bits (int16) of the float32 ``value``, rounded half to even, as NumPy casts."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        bits = b.bitcast(args[0], _I32)
        sign = b.and_(b.lshr(bits, _i32(16)), _i32(0x8000))
        magnitude = b.and_(bits, _i32(0x7FFFFFFF))
        # NaN: NumPy keeps the top 10 payload bits and sets the lowest if they are all 0 (else: inf)
        payload = b.lshr(b.and_(magnitude, _i32(0x7FFFFF)), _i32(13))
        nan = b.or_(_i32(0x7C00), b.select(b.icmp_unsigned("==", payload, _i32(0)), _i32(1), payload))
        # normal float16 range: re-bias the exponent, add 0xfff + the kept lsb, drop 13 bits
        lsb = b.and_(b.lshr(magnitude, _i32(13)), _i32(1))
        normal = b.lshr(b.add(b.add(b.sub(magnitude, _i32(112 << 23)), _i32(0xFFF)), lsb), _i32(13))
        # below 2**-14: the ulp of 0.5 + x is 2**-24, so this float32 add rounds x half to even for us
        half_plus = b.fadd(b.bitcast(magnitude, _F32), ir.Constant(_F32, 0.5))
        tiny = b.sub(b.bitcast(half_plus, _I32), _i32(0x3F000000))
        body = b.select(
            b.icmp_unsigned(">", magnitude, _i32(0x7F800000)), nan,
            b.select(b.icmp_unsigned(">=", magnitude, _i32(0x477FF000)), _i32(0x7C00),  # >= 65520: inf
                     b.select(b.icmp_unsigned(">=", magnitude, _i32(0x38800000)), normal, tiny)))
        return b.trunc(b.or_(sign, body), _I16)

    return types.int16(types.float32), codegen


@intrinsic
def _narrow_bf16(typingctx, value):
    """bfloat16 bits (uint16) of the float32 ``value``, rounded half to even, as ml_dtypes casts."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        bits = b.bitcast(args[0], _I32)
        high = b.lshr(bits, _i32(16))
        rounded = b.lshr(b.add(b.add(bits, _i32(0x7FFF)), b.and_(high, _i32(1))), _i32(16))
        quiet = b.or_(b.and_(high, _i32(0x8000)), _i32(0x7FC0))  # ml_dtypes: any NaN -> quiet NaN, sign kept
        is_nan = b.icmp_unsigned(">", b.and_(bits, _i32(0x7FFFFFFF)), _i32(0x7F800000))
        return b.trunc(b.select(is_nan, quiet, rounded), _I16)

    return types.uint16(types.float32), codegen


def _widen(word):
    """The exact float32 value of one element in its bit view (compile-time dispatch, below)."""
    raise NotImplementedError  # only called from compiled code


@overload(_widen)
def _widen_overload(word):
    if word == types.float32:
        return lambda word: word
    if word == types.int16:
        return lambda word: _widen_f16(word)
    if word == types.uint16:
        return lambda word: _widen_bf16(word)
    return None


def _narrow(value, like):
    """``value`` (float32) rounded to the format of the bit-view array ``like`` (compile-time dispatch)."""
    raise NotImplementedError  # only called from compiled code


@overload(_narrow)
def _narrow_overload(value, like):
    if like.dtype == types.float32:
        return lambda value, like: value
    if like.dtype == types.int16:
        return lambda value, like: _narrow_f16(value)
    if like.dtype == types.uint16:
        return lambda value, like: _narrow_bf16(value)
    return None


@njit(nogil=True, cache=True)
def widen_f16(words, out):
    """out[i] = float32 of the float16 bits words[i] (int16). For the conversion's own tests."""
    for i in range(words.shape[0]):
        out[i] = _widen_f16(words[i])


@njit(nogil=True, cache=True)
def widen_bf16(words, out):
    """out[i] = float32 of the bfloat16 bits words[i] (uint16). For the conversion's own tests."""
    for i in range(words.shape[0]):
        out[i] = _widen_bf16(words[i])


@njit(nogil=True, cache=True)
def narrow_f16(values, out):
    """out[i] = float16 bits (int16) of values[i] (float32). For the conversion's own tests."""
    for i in range(values.shape[0]):
        out[i] = _narrow_f16(values[i])


@njit(nogil=True, cache=True)
def narrow_bf16(values, out):
    """out[i] = bfloat16 bits (uint16) of values[i] (float32). For the conversion's own tests."""
    for i in range(values.shape[0]):
        out[i] = _narrow_bf16(values[i])


@njit
def _set_row(target, segment):
    for h in range(target.shape[0]):
        target[h] = _widen(segment[h])


@njit
def _add_row(target, segment):
    for h in range(target.shape[0]):
        target[h] = target[h] + _widen(segment[h])


@njit
def _add_bin(target, other):
    for h in range(target.shape[0]):
        target[h] = target[h] + other[h]


@njit
def _store(total, segment):
    for h in range(total.shape[0]):
        segment[h] = _narrow(total[h], segment)


@njit(nogil=True, cache=True)
def run_rows(rows, index, top_k, schedule, nbins, tile, out, start, stop):
    """grad_x rows [start, stop) into ``out`` (same bit type as ``rows``), following ``schedule``.

    Args:
        rows: [R, H] C-contiguous float32 / int16 (float16 bits) / uint16 (bfloat16 bits).
        index: [N*K] int32. A slot whose index is outside [0, R) is skipped (validation leaves only
            the mode's skips there: -1 in drop/pad mode, >= A in active mode).
        top_k: K.
        schedule: [steps, 3] int32 (op, dst, src), ops OP_SET / OP_ADD / OP_MERGE / OP_ZERO.
        nbins: 1 + the largest bin in the schedule.
        tile: elements of H per pass; ``nbins * tile`` float32 bins stay in the core's cache.
        out: [N, H] C-contiguous, the type of ``rows``.
        start, stop: the rows of ``out`` to compute.
    """
    nrows = rows.shape[0]
    hidden = rows.shape[1]
    steps = schedule.shape[0]
    bins = np.empty((nbins, tile), dtype=np.float32)
    for i in range(start, stop):
        base = i * top_k
        for h0 in range(0, hidden, tile):
            h1 = min(hidden, h0 + tile)
            width = h1 - h0
            for s in range(steps):
                op = schedule[s, 0]
                target = bins[schedule[s, 1], :width]
                if op == OP_MERGE:
                    _add_bin(target, bins[schedule[s, 2], :width])
                elif op == OP_ZERO:
                    target[:] = 0.0
                else:
                    r = index[base + schedule[s, 2]]
                    if 0 <= r < nrows:
                        if op == OP_SET:
                            _set_row(target, rows[r, h0:h1])
                        else:
                            _add_row(target, rows[r, h0:h1])
                    elif op == OP_SET:  # a skipped slot sets +0.0; a skipped add adds nothing
                        target[:] = 0.0
            _store(bins[0, :width], out[i, h0:h1])
