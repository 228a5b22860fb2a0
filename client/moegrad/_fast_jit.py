"""The compiled body of the fast path: numba functions, imported only by :mod:`moegrad._fast`.

Importing this module imports numba; :mod:`moegrad._fast` does so lazily, on the first call that can
use it, and falls back to the NumPy path when numba is missing.

Numerics (docs/semantics.md), and how this code keeps them exact:

- The element type travels as a bit view that also names the format: float32 rows as ``float32``,
  float16 rows as ``int16`` words, bfloat16 rows as ``uint16`` words. One specialisation each.
- Widening is exact: bfloat16 is the upper half of a float32; float16 goes through the CPU's own
  conversion (x86 F16C, ARMv8) or, where there is none, moves its exponent and mantissa into float32
  fields and rescales by 2**112 (exact). NaNs keep sign and payload (the CPU quiets a signalling one).
- Every add is one IEEE float32 add, written out in the schedule's order (a chain's elements one
  after the other, S4's tree as written): no fastmath flags, so LLVM neither reassociates nor
  contracts into FMAs. It vectorises the loops over H, which only runs the adds of
  different output elements side by side; the adds of one element stay in the schedule's order.
  (LLVM may swap the two operands of an add. That changes nothing but which NaN's payload and sign
  a NaN + NaN keeps; NumPy's own add does not fix that either, see tests/unit/test_reference_paths.py.)
- Narrowing rounds half to even exactly as NumPy (float16) and ml_dtypes (bfloat16) cast: overflow
  goes to inf, subnormals are rounded. A NaN gets the bits those casts give it, except that the
  CPU's float16 conversion (where used) returns it quiet with the top payload bits.
- The conversions are written as 32-bit LLVM IR (numba would type the same Python integer code as
  64-bit, which halves the vector width); the loops around them are plain numba.
- Prefetch hints (``llvm.prefetch``) for the rows of the tokens a few ahead change no value: with
  random routing at small H, a token's rows otherwise wait for memory one token at a time.
- The schedule (``accumulation_schedule``) is data: per-bin chains of slots (see ``run_rows`` and
  ``moegrad._fast._plan``), so both A2/A3-shaped orders run through the same compiled code. The
  Ascend 950 order (one accumulator, groups of four restarting every chunk of slots) has its own
  loop, ``run_rows_950``, with the same conversions.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

__all__ = [
    "HARDWARE_HALF",
    "narrow_bf16",
    "narrow_f16",
    "narrow_f16_portable",
    "run_rows",
    "run_rows_950",
    "widen_bf16",
    "widen_f16",
    "widen_f16_portable",
]

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _hardware_half() -> bool:
    """Whether LLVM turns a half -> float conversion into one instruction here (else: a library call)."""
    import platform

    from llvmlite import binding

    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return bool(binding.get_host_cpu_features().get("f16c", False))
    return machine in ("aarch64", "arm64")


_HARDWARE_HALF = _hardware_half()
HARDWARE_HALF = _HARDWARE_HALF  #: whether float16 is widened and narrowed by the CPU's conversion instructions


def _compiled(function):
    """njit(nogil=True), cached on disk where numba finds a writable place for its cache.

    numba looks beside this file, then in NUMBA_CACHE_DIR or the user's cache folder; with none
    writable (a read-only install and home, as in a container with a read-only root filesystem)
    ``cache=True`` raises at decoration time. The kernel then compiles once per process instead.
    """
    try:
        return njit(nogil=True, cache=True)(function)
    except RuntimeError as error:
        if "cannot cache" not in str(error):
            raise
        return njit(nogil=True)(function)


def _inlined(function):
    """njit, inlined into its callers at numba's level: the row slices the passes take then cost no
    reference counting (on the benchmark machine a call per pass cost more than the pass at small H)."""
    return njit(inline="always")(function)


_PREFETCH_BYTES = 512  # of each row read soon: what the hardware's stream prefetcher needs to take over
_PREFETCH_SLOTS = 32  # slots read ahead: tokens ahead = ceil(32 / K), so that misses overlap at small K


@intrinsic
def _prefetch(typingctx, array, row, column):
    """Hint the cache line of ``array[row, column]`` (2-D, C-contiguous) into the caches; no load, no fault."""
    if not isinstance(array, types.Array) or array.ndim != 2:
        return None

    def codegen(context, builder, signature, args):
        arraytype = signature.args[0]
        view = context.make_array(arraytype)(context, builder, args[0])
        row_value = context.cast(builder, args[1], signature.args[1], types.intp)
        column_value = context.cast(builder, args[2], signature.args[2], types.intp)
        pointer = cgutils.get_item_pointer(
            context, builder, arraytype, view, [row_value, column_value], wraparound=False
        )
        bytes_pointer = ir.IntType(8).as_pointer()
        function_type = ir.FunctionType(ir.VoidType(), [bytes_pointer, _I32, _I32, _I32])
        function = cgutils.get_or_insert_function(builder.module, function_type, "llvm.prefetch.p0")
        # read (0), high locality (3), data cache (1)
        builder.call(function, [builder.bitcast(pointer, bytes_pointer), _i32(0), _i32(3), _i32(1)])
        return context.get_dummy_value()

    return types.void(array, row, column), codegen


def _i32(value: int) -> ir.Constant:
    return ir.Constant(_I32, value)


def _widen_f16_integer(builder, word):
    """float32 of float16 bits with integer operations: exact, NaNs keep payload and sign (as NumPy)."""
    b = builder
    u = b.zext(word, _I32)
    sign = b.shl(b.and_(u, _i32(0x8000)), _i32(16))
    shifted = b.shl(b.and_(u, _i32(0x7FFF)), _i32(13))  # exponent and mantissa in float32's places
    # times 2**112 re-biases the exponent (15 -> 127); exact, subnormals included. The product is a
    # float16 value, so no add that meets it could be fused with it into a different result.
    finite = b.bitcast(b.fmul(b.bitcast(shifted, _F32), ir.Constant(_F32, 2.0**112)), _I32)
    special = b.or_(shifted, _i32(0x7F800000))  # exponent 31: inf or NaN, payload kept
    is_special = b.icmp_unsigned("==", b.and_(u, _i32(0x7C00)), _i32(0x7C00))
    return b.bitcast(b.or_(sign, b.select(is_special, special, finite)), _F32)


@intrinsic
def _widen_f16(typingctx, word):
    """float32 of the float16 whose bits are ``word`` (int16): exact.

    Where the CPU converts half precision itself (x86 F16C, ARMv8), one instruction; it returns a
    signalling NaN quieted, the only bit it can differ in from the integer version.
    """
    if word != types.int16:
        return None

    def codegen(context, builder, signature, args):
        if _HARDWARE_HALF:
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)
        return _widen_f16_integer(builder, args[0])

    return types.float32(types.int16), codegen


@intrinsic
def _widen_f16_portable(typingctx, word):
    """:func:`_widen_f16` with integer operations on every CPU (what runs where F16C is missing)."""
    if word != types.int16:
        return None

    def codegen(context, builder, signature, args):
        return _widen_f16_integer(builder, args[0])

    return types.float32(types.int16), codegen


@intrinsic
def _widen_bf16(typingctx, word):
    """float32 of the bfloat16 whose bits are ``word`` (uint16): its upper half, exact."""
    if word != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.shl(builder.zext(args[0], _I32), _i32(16)), _F32)

    return types.float32(types.uint16), codegen


def _narrow_f16_integer(builder, value):
    """float16 bits of a float32 with integer operations: round half to even; NaN bits as NumPy's."""
    b = builder
    bits = b.bitcast(value, _I32)
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
        b.icmp_unsigned(">", magnitude, _i32(0x7F800000)),
        nan,
        b.select(
            b.icmp_unsigned(">=", magnitude, _i32(0x477FF000)),
            _i32(0x7C00),  # >= 65520: inf
            b.select(b.icmp_unsigned(">=", magnitude, _i32(0x38800000)), normal, tiny),
        ),
    )
    return b.trunc(b.or_(sign, body), _I16)


@intrinsic
def _narrow_f16(typingctx, value):
    """float16 bits (int16) of the float32 ``value``, rounded half to even, as NumPy casts.

    Where the CPU converts half precision itself, one instruction (IEEE round to nearest even in the
    default rounding mode); a NaN then keeps its sign and top payload bits and comes out quiet, where
    NumPy keeps a signalling one signalling (and makes an all-zero payload 1). Nothing else differs.
    """
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        if _HARDWARE_HALF:
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)
        return _narrow_f16_integer(builder, args[0])

    return types.int16(types.float32), codegen


@intrinsic
def _narrow_f16_portable(typingctx, value):
    """:func:`_narrow_f16` with integer operations on every CPU (what runs where F16C is missing)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return _narrow_f16_integer(builder, args[0])

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


@_compiled
def widen_f16(words, out):
    """out[i] = float32 of the float16 bits words[i] (int16). For the conversion's own tests."""
    for i in range(words.shape[0]):
        out[i] = _widen_f16(words[i])


@_compiled
def widen_f16_portable(words, out):
    """widen_f16 with the integer conversion, whatever the CPU. For the conversion's own tests."""
    for i in range(words.shape[0]):
        out[i] = _widen_f16_portable(words[i])


@_compiled
def widen_bf16(words, out):
    """out[i] = float32 of the bfloat16 bits words[i] (uint16). For the conversion's own tests."""
    for i in range(words.shape[0]):
        out[i] = _widen_bf16(words[i])


@_compiled
def narrow_f16(values, out):
    """out[i] = float16 bits (int16) of values[i] (float32). For the conversion's own tests."""
    for i in range(values.shape[0]):
        out[i] = _narrow_f16(values[i])


@_compiled
def narrow_f16_portable(values, out):
    """narrow_f16 with the integer conversion, whatever the CPU. For the conversion's own tests."""
    for i in range(values.shape[0]):
        out[i] = _narrow_f16_portable(values[i])


@_compiled
def narrow_bf16(values, out):
    """out[i] = bfloat16 bits (uint16) of values[i] (float32). For the conversion's own tests."""
    for i in range(values.shape[0]):
        out[i] = _narrow_bf16(values[i])


# Passes over one tile of H. Each reads several rows at once, one stream each: a core keeps more
# loads in flight that way (on the benchmark machine one pass over 8 rows read memory about twice as
# fast as 8 passes over one row). _pass_GxM runs G bins side by side, M chain elements each. With
# ``first`` and ``last`` it needs no bins: -0.0 + x is x, so the chain starts at its first element;
# otherwise the bins hold the chain so far (filled with -0.0 before the first pass). ``last`` reduces
# the G bins by S4's levels inside the group and writes the result to ``out``, narrowed when ``out``
# is a bit view of grad_x, as is when it is a float32 row of group results. Every add is written out
# in the schedule's order; LLVM only vectorises over h.


@njit
def _pass_4x2(first, last, out, w0, w1, w2, w3, a0, b0, a1, b1, a2, b2, a3, b3):
    n = a0.shape[0]
    if first and last:
        for h in range(n):
            v0 = _widen(a0[h]) + _widen(b0[h])
            v1 = _widen(a1[h]) + _widen(b1[h])
            v2 = _widen(a2[h]) + _widen(b2[h])
            v3 = _widen(a3[h]) + _widen(b3[h])
            out[h] = _narrow((v0 + v1) + (v2 + v3), out)
    elif last:
        for h in range(n):
            v0 = (w0[h] + _widen(a0[h])) + _widen(b0[h])
            v1 = (w1[h] + _widen(a1[h])) + _widen(b1[h])
            v2 = (w2[h] + _widen(a2[h])) + _widen(b2[h])
            v3 = (w3[h] + _widen(a3[h])) + _widen(b3[h])
            out[h] = _narrow((v0 + v1) + (v2 + v3), out)
    else:  # the bins start at -0.0
        for h in range(n):
            w0[h] = (w0[h] + _widen(a0[h])) + _widen(b0[h])
            w1[h] = (w1[h] + _widen(a1[h])) + _widen(b1[h])
            w2[h] = (w2[h] + _widen(a2[h])) + _widen(b2[h])
            w3[h] = (w3[h] + _widen(a3[h])) + _widen(b3[h])


@njit
def _pass_1x4(first, last, out, w0, a0, b0, c0, d0):
    n = a0.shape[0]
    if first and last:
        for h in range(n):
            v0 = ((_widen(a0[h]) + _widen(b0[h])) + _widen(c0[h])) + _widen(d0[h])
            out[h] = _narrow(v0, out)
    elif last:
        for h in range(n):
            v0 = (((w0[h] + _widen(a0[h])) + _widen(b0[h])) + _widen(c0[h])) + _widen(d0[h])
            out[h] = _narrow(v0, out)
    else:  # the bins start at -0.0
        for h in range(n):
            w0[h] = (((w0[h] + _widen(a0[h])) + _widen(b0[h])) + _widen(c0[h])) + _widen(d0[h])


@njit
def _pass_1x2(first, last, out, w0, a0, b0):
    n = a0.shape[0]
    if first and last:
        for h in range(n):
            v0 = _widen(a0[h]) + _widen(b0[h])
            out[h] = _narrow(v0, out)
    elif last:
        for h in range(n):
            v0 = (w0[h] + _widen(a0[h])) + _widen(b0[h])
            out[h] = _narrow(v0, out)
    else:  # the bins start at -0.0
        for h in range(n):
            w0[h] = (w0[h] + _widen(a0[h])) + _widen(b0[h])


@_inlined
def _add_bin(target, other):
    for h in range(target.shape[0]):
        target[h] = target[h] + other[h]


@_inlined
def _store(total, segment):
    for h in range(total.shape[0]):
        segment[h] = _narrow(total[h], segment)


@_inlined
def _row(rows, aux, index, base, chains, chain, layer, h0, h1):
    """The slice [h0, h1) of the row a chain element reads; a skipped slot or a pad reads aux."""
    slot = chains[chain, layer, 0]
    if slot >= 0:
        r = index[base + slot]
        if 0 <= r < rows.shape[0]:
            return rows[r, h0:h1]
    return aux[chains[chain, layer, 1], h0:h1]


@_inlined
def _group_layers(chains, first_bin, group):
    """The group's chain length without the pairs of pads all its bins end with (adding -0.0 changes
    no bit, so those passes can go): at least 2, even."""
    layers = chains.shape[1]
    while layers > 2:
        for b in range(first_bin, first_bin + group):
            for layer in range(layers - 2, layers):
                if chains[b, layer, 0] != -1 or chains[b, layer, 1] != 1:
                    return layers
        layers -= 2
    return layers


@njit
def _run_group(rows, aux, index, base, chains, first_bin, group, work, h0, h1, out):
    """Bins first_bin .. first_bin + group - 1 over the tile [h0, h1), reduced into ``out``.

    ``group`` is 4 or 1; the chains have an even length L (the plan pads them with -0.0).
    """
    layers = _group_layers(chains, first_bin, group)
    width = h1 - h0
    layer = 0
    if group == 4:
        w0, w1, w2, w3 = work[0, :width], work[1, :width], work[2, :width], work[3, :width]
        if layers > 2:
            work[:, :width] = -0.0
        while layer < layers:
            _pass_4x2(
                layer == 0,
                layer + 2 == layers,
                out,
                w0,
                w1,
                w2,
                w3,
                _row(rows, aux, index, base, chains, first_bin, layer, h0, h1),
                _row(rows, aux, index, base, chains, first_bin, layer + 1, h0, h1),
                _row(rows, aux, index, base, chains, first_bin + 1, layer, h0, h1),
                _row(rows, aux, index, base, chains, first_bin + 1, layer + 1, h0, h1),
                _row(rows, aux, index, base, chains, first_bin + 2, layer, h0, h1),
                _row(rows, aux, index, base, chains, first_bin + 2, layer + 1, h0, h1),
                _row(rows, aux, index, base, chains, first_bin + 3, layer, h0, h1),
                _row(rows, aux, index, base, chains, first_bin + 3, layer + 1, h0, h1),
            )
            layer += 2
    else:
        w0 = work[0, :width]
        if layers > 4:
            w0[:] = -0.0
        while layer + 4 <= layers:
            _pass_1x4(
                layer == 0,
                layer + 4 == layers,
                out,
                w0,
                _row(rows, aux, index, base, chains, first_bin, layer, h0, h1),
                _row(rows, aux, index, base, chains, first_bin, layer + 1, h0, h1),
                _row(rows, aux, index, base, chains, first_bin, layer + 2, h0, h1),
                _row(rows, aux, index, base, chains, first_bin, layer + 3, h0, h1),
            )
            layer += 4
        if layer < layers:
            _pass_1x2(
                layer == 0,
                True,
                out,
                w0,
                _row(rows, aux, index, base, chains, first_bin, layer, h0, h1),
                _row(rows, aux, index, base, chains, first_bin, layer + 1, h0, h1),
            )


@_inlined
def _prefetch_token(rows, index, top_k, token):
    """Prefetch the first bytes of each row token ``token`` reads (nothing past the last token)."""
    if token * top_k + top_k <= index.shape[0]:
        line = 64 // rows.itemsize
        lead = min(rows.shape[1], _PREFETCH_BYTES // rows.itemsize)
        for t in range(top_k):
            r = index[token * top_k + t]
            if 0 <= r < rows.shape[0]:
                for h in range(0, lead, line):
                    _prefetch(rows, r, h)


@_compiled
def run_rows(rows, aux, index, top_k, chains, group, tile, out, start, stop):
    """grad_x rows [start, stop) into ``out`` (same bit type as ``rows``).

    Each bin is its chain of adds, in order, started from -0.0: -0.0 + x is x (so a set is an add)
    and adding the aux row of -0.0 changes no bit (a skipped add, a pad). Groups of ``group`` bins
    run side by side and are reduced by S4's levels inside the group; with more than one group the
    group results are then reduced by S4's remaining levels, in S4's order.

    Args:
        rows: [R, H] C-contiguous float32 / int16 (float16 bits) / uint16 (bfloat16 bits).
        aux: [2, H] the same type: row 0 all +0.0, row 1 all -0.0.
        index: [N*K] int32. A slot whose index is outside [0, R) is skipped (validation leaves only
            the mode's skips there: -1 in drop/pad mode, >= A in active mode).
        top_k: K.
        chains: [B, L, 2] int32: bin b's L elements, in order: (slot or -1, the aux row read when the
            slot is -1 or skipped: 0 = +0.0 for a set, 1 = -0.0 for an add or a pad).
        group: 4, or 1 when B < 4 (B a power of two); L is even.
        tile: elements of H per pass.
        out: [N, H] C-contiguous, the type of ``rows``.
        start, stop: the rows of ``out`` to compute.
    """
    hidden = rows.shape[1]
    ngroups = chains.shape[0] // group
    work = np.empty((group, tile), dtype=np.float32)
    results = np.empty((ngroups, tile), dtype=np.float32)
    zero = start - start  # the first bin, typed as g * group is (a literal 0 would compile another version)
    ahead = max(1, -(-_PREFETCH_SLOTS // top_k))
    for i in range(start, min(stop, start + ahead)):
        _prefetch_token(rows, index, top_k, i)
    for i in range(start, stop):
        _prefetch_token(rows, index, top_k, i + ahead)
        base = i * top_k
        for h0 in range(0, hidden, tile):
            h1 = min(hidden, h0 + tile)
            width = h1 - h0
            if ngroups == 1:
                _run_group(rows, aux, index, base, chains, zero, group, work, h0, h1, out[i, h0:h1])
                continue
            for g in range(ngroups):
                _run_group(rows, aux, index, base, chains, g * group, group, work, h0, h1, results[g, :width])
            stride = 1
            while stride < ngroups:  # S4's remaining levels, over the group results
                for j in range(stride, ngroups, 2 * stride):
                    _add_bin(results[j - stride, :width], results[j, :width])
                stride *= 2
            _store(results[0, :width], out[i, h0:h1])


# The Ascend 950 order (moegrad._ascend950): one float32 accumulator per element from +0.0; groups of
# four slots added as ((a + b) + (c + d)), leftovers one by one; a skipped slot reads the +0.0 row.


@_inlined
def _slot(rows, zero, index, position, h0, h1):
    """The slice [h0, h1) of the row slot ``position`` reads; a skipped slot reads the +0.0 row."""
    r = index[position]
    if 0 <= r < rows.shape[0]:
        return rows[r, h0:h1]
    return zero[0, h0:h1]


@_inlined
def _add_group(total, a, b, c, d):
    for h in range(total.shape[0]):
        total[h] = total[h] + ((_widen(a[h]) + _widen(b[h])) + (_widen(c[h]) + _widen(d[h])))


@_inlined
def _add_chain(total, a, b, c, d):
    for h in range(total.shape[0]):
        total[h] = (((total[h] + _widen(a[h])) + _widen(b[h])) + _widen(c[h])) + _widen(d[h])


@_inlined
def _add_one(total, a):
    for h in range(total.shape[0]):
        total[h] = total[h] + _widen(a[h])


@_compiled
def run_rows_950(rows, zero, index, top_k, k_chunk, grouped, tile, out, start, stop):
    """grad_x rows [start, stop) in the Ascend 950 order into ``out`` (same bit type as ``rows``).

    Args:
        rows: [R, H] C-contiguous float32 / int16 (float16 bits) / uint16 (bfloat16 bits).
        zero: [1, H] the same type, all +0.0: what a skipped slot (index outside [0, R)) adds.
        index: [N*K] int32.
        top_k: K.
        k_chunk: slots per pass; the groups of four restart at each pass (1 <= k_chunk <= K).
        grouped: True for groups of four, False for a plain chain (the 2025-12 revision).
        tile: elements of H per pass.
        out: [N, H] C-contiguous, the type of ``rows``.
        start, stop: the rows of ``out`` to compute.
    """
    hidden = rows.shape[1]
    work = np.empty(tile, dtype=np.float32)
    ahead = max(1, -(-_PREFETCH_SLOTS // top_k))
    for i in range(start, min(stop, start + ahead)):
        _prefetch_token(rows, index, top_k, i)
    for i in range(start, stop):
        _prefetch_token(rows, index, top_k, i + ahead)
        base = i * top_k
        for h0 in range(0, hidden, tile):
            h1 = min(hidden, h0 + tile)
            total = work[: h1 - h0]
            total[:] = 0.0
            first = 0
            while first < top_k:
                last = min(first + k_chunk, top_k)
                t = first
                while t + 4 <= last:
                    a = _slot(rows, zero, index, base + t, h0, h1)
                    b = _slot(rows, zero, index, base + t + 1, h0, h1)
                    c = _slot(rows, zero, index, base + t + 2, h0, h1)
                    d = _slot(rows, zero, index, base + t + 3, h0, h1)
                    if grouped:
                        _add_group(total, a, b, c, d)
                    else:
                        _add_chain(total, a, b, c, d)
                    t += 4
                while t < last:
                    _add_one(total, _slot(rows, zero, index, base + t, h0, h1))
                    t += 1
                first = last
            _store(total, out[i, h0:h1])
