"""The compiled body of the fast path: numba functions, imported only by :mod:`moegrad.numerics._fast`.

Importing this module imports numba; :mod:`moegrad.numerics._fast` does so lazily, on the first call that can
use it, and falls back to the NumPy path when numba is missing.

Why one file of 800 lines: numba's on-disk cache (``cache=True``) checks only the source file of
the function it cached, so the intrinsics and inlined helpers that the kernels compile in must live
in the kernels' own file, or an edit to them would be served stale from the cache.

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
  a NaN + NaN keeps; NumPy's own add does not fix that either, see tests/unit/numerics/test_reference_paths.py.)
- Narrowing rounds half to even exactly as NumPy (float16) and ml_dtypes (bfloat16) cast: overflow
  goes to inf, subnormals are rounded. A NaN gets the bits those casts give it, except that the
  CPU's float16 conversion (where used) returns it quiet with the top payload bits.
- The conversions are written as 32-bit LLVM IR (numba would type the same Python integer code as
  64-bit, which halves the vector width); the loops around them are plain numba.
- Prefetch hints (``llvm.prefetch``) for the rows of the tokens a few ahead change no value: with
  random routing at small H, a token's rows otherwise wait for memory one token at a time.
- Streaming stores (``_stream_line``) for a large grad_x move finished bits only: the tile is
  narrowed into a staging row as it would be into grad_x, then copied out line by line, and a fence
  before the kernel returns makes the stores visible to the thread that reads grad_x.
- The schedule (``accumulation_schedule``) is data: per-bin chains of slots (see ``run_rows`` and
  ``moegrad.numerics._fast._plan``), so both A2/A3-shaped orders run through the same compiled code. The
  Ascend 950 order (one accumulator, groups of four restarting every chunk of slots) has its own
  loop, ``run_rows_950``, with the same conversions.
"""

from __future__ import annotations

import platform

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
    from llvmlite import binding

    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return bool(binding.get_host_cpu_features().get("f16c", False))
    return machine in ("aarch64", "arm64")


_HARDWARE_HALF = _hardware_half()
_X86 = platform.machine().lower() in ("x86_64", "amd64")
HARDWARE_HALF = _HARDWARE_HALF  #: whether float16 is widened and narrowed by the CPU's conversion instructions


def _compiled(function=None, **options):
    """njit(nogil=True, **options), cached on disk where numba finds a writable place for its cache.

    numba looks beside this file, then in NUMBA_CACHE_DIR or the user's cache folder; with none
    writable (a read-only install and home, as in a container with a read-only root filesystem)
    ``cache=True`` raises at decoration time. The kernel then compiles once per process instead.
    ``@_compiled`` or, with numba options, ``@_compiled(fastmath=...)``.
    """
    if function is None:
        return lambda function: _compiled(function, **options)
    try:
        return njit(nogil=True, cache=True, **options)(function)
    except RuntimeError as error:
        if "cannot cache" not in str(error):
            raise
        return njit(nogil=True, **options)(function)


def _inlined(function):
    """njit, inlined into its callers at numba's level: a helper that takes arrays then costs no call
    (a call passes each array as a struct of seven fields and takes and drops a reference to it)."""
    return njit(inline="always")(function)


_PREFETCH_BYTES = 512  # of each row read soon: what the hardware's stream prefetcher needs to take over
_PREFETCH_SLOTS = 32  # slots read ahead: tokens ahead = ceil(32 / K), so that misses overlap at small K


@intrinsic
def _data(typingctx, array):
    """A pointer to the first element of a C-contiguous array; no reference is taken.

    The caller keeps the array alive while the pointer is used: the kernels take their pointers in
    a function whose caller holds the arrays. ``p[i]`` reads and writes element i of the array (in
    C order); nothing checks i.
    """
    if not isinstance(array, types.Array) or array.layout != "C":
        return None

    def codegen(context, builder, signature, args):
        return context.make_array(signature.args[0])(context, builder, args[0]).data

    return types.CPointer(array.dtype)(array), codegen


@intrinsic
def _offset(typingctx, pointer, count):
    """``pointer`` moved on by ``count`` elements (an integer); unchecked."""
    if not isinstance(pointer, types.CPointer) or not isinstance(count, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        step = context.cast(builder, args[1], signature.args[1], types.intp)
        return builder.gep(args[0], [step])

    return pointer(pointer, count), codegen


@intrinsic
def _prefetch(typingctx, pointer):
    """Hint the cache line at ``pointer`` into the caches; no load, no fault."""
    if not isinstance(pointer, types.CPointer):
        return None

    def codegen(context, builder, signature, args):
        bytes_pointer = ir.IntType(8).as_pointer()
        function_type = ir.FunctionType(ir.VoidType(), [bytes_pointer, _I32, _I32, _I32])
        function = cgutils.get_or_insert_function(builder.module, function_type, "llvm.prefetch.p0")
        # read (0), high locality (3), data cache (1)
        builder.call(function, [builder.bitcast(args[0], bytes_pointer), _i32(0), _i32(3), _i32(1)])
        return context.get_dummy_value()

    return types.void(pointer), codegen


@intrinsic
def _address(typingctx, pointer):
    """The address ``pointer`` holds, as an integer (for alignment only)."""
    if not isinstance(pointer, types.CPointer):
        return None

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], context.get_value_type(types.intp))

    return types.intp(pointer), codegen


@intrinsic
def _stream_line(typingctx, target, source):
    """The 64 bytes at ``source`` stored at ``target`` (64-byte aligned) past the caches.

    A non-temporal store: the line is written without being read first (an ordinary store reads
    each line it writes into the cache, a third memory stream for grad_x). Such stores are weakly
    ordered; :func:`_order_stores` makes them visible before the kernel returns.
    """
    if not isinstance(target, types.CPointer) or target != source:
        return None

    def codegen(context, builder, signature, args):
        line = ir.VectorType(ir.IntType(64), 8).as_pointer()
        value = builder.load(builder.bitcast(args[1], line), align=1)
        store = builder.store(value, builder.bitcast(args[0], line), align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([_i32(1)]))
        return context.get_dummy_value()

    return types.void(target, source), codegen


@intrinsic
def _order_stores(typingctx):
    """A full memory fence: every store before it, non-temporal ones included, is visible after it."""

    def codegen(context, builder, signature, args):
        # On x86, LLVM may make the fence a locked instruction (it did here: no mfence in the
        # kernel's code), which the manuals do not promise orders non-temporal stores; sfence does.
        if _X86:
            function_type = ir.FunctionType(ir.VoidType(), [])
            builder.call(cgutils.get_or_insert_function(builder.module, function_type, "llvm.x86.sse.sfence"), [])
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


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
# fast as 8 passes over one row). _pass_GxM runs G bins side by side, M chain elements each, over
# ``n`` elements. With ``first`` and ``last`` it needs no bins: -0.0 + x is x, so the chain starts at
# its first element; otherwise the bins hold the chain so far (filled with -0.0 before the first
# pass). ``last`` reduces the G bins by S4's levels inside the group and writes the result to ``out``,
# narrowed when ``out`` points into grad_x's bit view, as is when it points at a float32 row of group
# results. Every add is written out in the schedule's order; LLVM only vectorises over h.
#
# Inside the row loop, everything travels as pointers (``_data``, ``_offset``) and integers, never as
# arrays: numba takes and drops a reference (an atomic add, out of line) for each array slice and
# each array a helper receives, and at small H that cost more than the row's arithmetic (W5: 480 ->
# 220 ns per row on one thread). The kernels' entry points allocate their float32 bins and hand
# them, with the caller's arrays, to a loop function (``_run_rows``, ``_run_rows_950``) that takes
# its pointers once: the arrays outlive every pointer into them.


@njit
def _pass_4x2(n, first, last, out, w0, w1, w2, w3, a0, b0, a1, b1, a2, b2, a3, b3):
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
def _pass_1x4(n, first, last, out, w0, a0, b0, c0, d0):
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
def _pass_1x2(n, first, last, out, w0, a0, b0):
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


@njit
def _add_bin(n, target, other):
    for h in range(n):
        target[h] = target[h] + other[h]


@njit
def _store(n, total, out):
    for h in range(n):
        out[h] = _narrow(total[h], out)


@njit
def _fill(n, target, value):
    for h in range(n):
        target[h] = value


@_inlined
def _stream_row(n, source, target, line):
    """``n`` elements from ``source`` to ``target``: the whole 64-byte lines of ``target`` by
    :func:`_stream_line`, the partial lines at either end by ordinary stores. ``line`` is the
    elements per 64 bytes; ``target`` is aligned to its element size (``moegrad.numerics._fast._streams``
    streams no other grad_x): otherwise no element would start a line, and the line stores fault."""
    head = min(n, ((-_address(target)) & 63) // (64 // line))
    for h in range(head):
        target[h] = source[h]
    h = head
    while h + line <= n:
        _stream_line(_offset(target, h), _offset(source, h))
        h += line
    for t in range(h, n):
        target[t] = source[t]


@_inlined
def _prefetch_token(rows, nrows, hidden, index, lookahead, token):
    """Prefetch the first bytes of each row token ``token`` reads (nothing past the last token).

    ``lookahead`` is (N*K, K, elements per cache line, elements to prefetch of each row).
    """
    nslots, top_k, line, lead = lookahead
    if token * top_k + top_k <= nslots:
        for t in range(top_k):
            r = index[token * top_k + t]
            if 0 <= r < nrows:
                for h in range(0, lead, line):
                    _prefetch(_offset(rows, r * hidden + h))


def _lookahead(rows, index, top_k):
    """_prefetch_token's constants for a call, and how many tokens ahead to prefetch."""
    raise NotImplementedError  # only called from compiled code


@overload(_lookahead)
def _lookahead_overload(rows, index, top_k):
    itemsize = rows.dtype.bitwidth // 8
    line, lead = 64 // itemsize, _PREFETCH_BYTES // itemsize

    def lookahead(rows, index, top_k):
        return (index.shape[0], top_k, line, min(rows.shape[1], lead)), max(1, -(-_PREFETCH_SLOTS // top_k))

    return lookahead


@_inlined
def _row(source, base, chain, layer, h0):
    """Where the tile at h0 of the row a chain element reads starts; a skipped slot or a pad reads aux.

    ``source`` is (rows, R, H, aux, index, chains, L) as pointers and counts.
    """
    rows, nrows, hidden, aux, index, chains, length = source
    entry = (chain * length + layer) * 2
    slot = chains[entry]
    if slot >= 0:
        r = index[base + slot]
        if 0 <= r < nrows:
            return _offset(rows, r * hidden + h0)
    return _offset(aux, chains[entry + 1] * hidden + h0)


@njit
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


@_inlined
def _run_group(source, base, first_bin, group, layers, work, tile, h0, width, out):
    """Bins first_bin .. first_bin + group - 1 over the tile of ``width`` at h0, reduced into ``out``.

    ``group`` is 4 or 1; ``layers`` the group's chain length (even); ``work`` the group's float32
    bins, ``tile`` apart; ``out`` a pointer.
    """
    layer = 0
    if group == 4:
        w0, w1, w2, w3 = work, _offset(work, tile), _offset(work, 2 * tile), _offset(work, 3 * tile)
        if layers > 2:
            for w in (w0, w1, w2, w3):
                _fill(width, w, np.float32(-0.0))
        while layer < layers:
            _pass_4x2(
                width,
                layer == 0,
                layer + 2 == layers,
                out,
                w0,
                w1,
                w2,
                w3,
                _row(source, base, first_bin, layer, h0),
                _row(source, base, first_bin, layer + 1, h0),
                _row(source, base, first_bin + 1, layer, h0),
                _row(source, base, first_bin + 1, layer + 1, h0),
                _row(source, base, first_bin + 2, layer, h0),
                _row(source, base, first_bin + 2, layer + 1, h0),
                _row(source, base, first_bin + 3, layer, h0),
                _row(source, base, first_bin + 3, layer + 1, h0),
            )
            layer += 2
    else:
        if layers > 4:
            _fill(width, work, np.float32(-0.0))
        while layer + 4 <= layers:
            _pass_1x4(
                width,
                layer == 0,
                layer + 4 == layers,
                out,
                work,
                _row(source, base, first_bin, layer, h0),
                _row(source, base, first_bin, layer + 1, h0),
                _row(source, base, first_bin, layer + 2, h0),
                _row(source, base, first_bin, layer + 3, h0),
            )
            layer += 4
        if layer < layers:
            _pass_1x2(
                width,
                layer == 0,
                True,
                out,
                work,
                _row(source, base, first_bin, layer, h0),
                _row(source, base, first_bin, layer + 1, h0),
            )


@_compiled
def run_rows(rows, aux, index, top_k, chains, group, tile, stream, out, start, stop):
    """grad_x rows [start, stop) into ``out`` (same bit type as ``rows``).

    Each bin is its chain of adds, in order, started from -0.0: -0.0 + x is x (so a set is an add)
    and adding the aux row of -0.0 changes no bit (a skipped add, a pad). Groups of ``group`` bins
    run side by side and are reduced by S4's levels inside the group; with more than one group the
    group results are then reduced by S4's remaining levels, in S4's order.

    Args:
        rows: [R, H] C-contiguous float32 / int16 (float16 bits) / uint16 (bfloat16 bits).
        aux: [2, H] the same type: row 0 all +0.0, row 1 all -0.0.
        index: [N*K] int32. A slot whose index is outside [0, R) is skipped (validation leaves only
            the profile's skips there: -1 in drop/pad mode, >= A in active mode; on 950@9.1 more).
        top_k: K.
        chains: [B, L, 2] int32, C-contiguous: bin b's L elements, in order: (slot or -1, the aux
            row read when the slot is -1 or skipped: 0 = +0.0 for a set, 1 = -0.0 for an add or a pad).
        group: 4, or 1 when B < 4 (B a power of two); L is even.
        tile: elements of H per pass.
        stream: write ``out`` past the caches (each tile is finished in a staging row, then stored
            with non-temporal stores): for a grad_x far larger than the caches.
        out: [N, H] C-contiguous, the type of ``rows``.
        start, stop: the rows of ``out`` to compute, 0 <= start <= stop <= N (not checked).
    """
    ngroups = chains.shape[0] // group
    work = np.empty((group, tile), dtype=np.float32)
    results = np.empty((ngroups, tile), dtype=np.float32)
    layers = np.empty(ngroups, dtype=np.intp)
    for g in range(ngroups):
        layers[g] = _group_layers(chains, g * group, group)
    staging = np.empty(tile if stream else 0, dtype=out.dtype)
    _run_rows(rows, aux, index, top_k, chains, group, work, results, layers, staging, out, start, stop)


@njit
def _run_rows(rows, aux, index, top_k, chains, group, work, results, layers, staging, out, start, stop):
    """run_rows' loop; ``work`` [group, tile] and ``results`` [groups, tile] float32 bins, ``layers``
    [groups] each group's chain length, ``staging`` [tile] (streaming) or [0] the type of ``out``.
    The caller holds every array while this runs."""
    nrows, hidden = rows.shape
    tile = work.shape[1]
    ngroups = results.shape[0]
    stream, line = staging.shape[0] > 0, 64 // out.itemsize
    rows_at, index_at, out_at, staging_at = _data(rows), _data(index), _data(out), _data(staging)
    source = (rows_at, nrows, hidden, _data(aux), index_at, _data(chains), chains.shape[1])
    work_at, results_at, layers_at = _data(work), _data(results), _data(layers)
    lookahead, ahead = _lookahead(rows, index, top_k)
    for i in range(start, min(stop, start + ahead)):
        _prefetch_token(rows_at, nrows, hidden, index_at, lookahead, i)
    for i in range(start, stop):
        _prefetch_token(rows_at, nrows, hidden, index_at, lookahead, i + ahead)
        base = i * top_k
        for h0 in range(0, hidden, tile):
            width = min(hidden, h0 + tile) - h0
            target = staging_at if stream else _offset(out_at, i * hidden + h0)
            if ngroups == 1:
                _run_group(source, base, 0, group, layers_at[0], work_at, tile, h0, width, target)
            else:
                for g in range(ngroups):
                    bins = _offset(results_at, g * tile)
                    _run_group(source, base, g * group, group, layers_at[g], work_at, tile, h0, width, bins)
                stride = 1
                while stride < ngroups:  # S4's remaining levels, over the group results
                    for j in range(stride, ngroups, 2 * stride):
                        _add_bin(width, _offset(results_at, (j - stride) * tile), _offset(results_at, j * tile))
                    stride *= 2
                _store(width, results_at, target)
            if stream:
                _stream_row(width, staging_at, _offset(out_at, i * hidden + h0), line)
    if stream:
        _order_stores()


# The Ascend 950 order (moegrad.numerics._ascend950): one float32 accumulator per element from +0.0; groups of
# four slots added as ((a + b) + (c + d)), leftovers one by one; a skipped slot reads the +0.0 row.


@_inlined
def _slot(source, position, h0):
    """Where the tile at h0 of the row slot ``position`` reads starts; a skipped slot reads the +0.0 row.

    ``source`` is (rows, R, H, zero, index) as pointers and counts.
    """
    rows, nrows, hidden, zero, index = source
    r = index[position]
    if 0 <= r < nrows:
        return _offset(rows, r * hidden + h0)
    return _offset(zero, h0)


@njit
def _add_group(n, total, a, b, c, d):
    for h in range(n):
        total[h] = total[h] + ((_widen(a[h]) + _widen(b[h])) + (_widen(c[h]) + _widen(d[h])))


@njit
def _add_chain(n, total, a, b, c, d):
    for h in range(n):
        total[h] = (((total[h] + _widen(a[h])) + _widen(b[h])) + _widen(c[h])) + _widen(d[h])


@njit
def _add_one(n, total, a):
    for h in range(n):
        total[h] = total[h] + _widen(a[h])


@_compiled
def run_rows_950(rows, zero, index, top_k, k_chunk, grouped, tile, stream, out, start, stop):
    """grad_x rows [start, stop) in the Ascend 950 order into ``out`` (same bit type as ``rows``).

    Args:
        rows: [R, H] C-contiguous float32 / int16 (float16 bits) / uint16 (bfloat16 bits).
        zero: [1, H] the same type, all +0.0: what a skipped slot (index outside [0, R)) adds.
        index: [N*K] int32.
        top_k: K.
        k_chunk: slots per pass; the groups of four restart at each pass (1 <= k_chunk <= K).
        grouped: True for groups of four, False for a plain chain (CANN 8.5).
        tile: elements of H per pass.
        stream: write ``out`` past the caches, as :func:`run_rows` does.
        out: [N, H] C-contiguous, the type of ``rows``.
        start, stop: the rows of ``out`` to compute, 0 <= start <= stop <= N (not checked).
    """
    work = np.empty(tile, dtype=np.float32)
    staging = np.empty(tile if stream else 0, dtype=out.dtype)
    _run_rows_950(rows, zero, index, top_k, k_chunk, grouped, work, staging, out, start, stop)


@njit
def _run_rows_950(rows, zero, index, top_k, k_chunk, grouped, work, staging, out, start, stop):
    """run_rows_950's loop; ``work`` [tile] the float32 accumulator, ``staging`` as in :func:`_run_rows`.
    The caller holds every array."""
    nrows, hidden = rows.shape
    tile = work.shape[0]
    stream, line = staging.shape[0] > 0, 64 // out.itemsize
    rows_at, index_at, out_at, total = _data(rows), _data(index), _data(out), _data(work)
    staging_at = _data(staging)
    source = (rows_at, nrows, hidden, _data(zero), index_at)
    lookahead, ahead = _lookahead(rows, index, top_k)
    for i in range(start, min(stop, start + ahead)):
        _prefetch_token(rows_at, nrows, hidden, index_at, lookahead, i)
    for i in range(start, stop):
        _prefetch_token(rows_at, nrows, hidden, index_at, lookahead, i + ahead)
        base = i * top_k
        for h0 in range(0, hidden, tile):
            width = min(hidden, h0 + tile) - h0
            _fill(width, total, np.float32(0.0))
            first = 0
            while first < top_k:
                last = min(first + k_chunk, top_k)
                t = first
                while t + 4 <= last:
                    a = _slot(source, base + t, h0)
                    b = _slot(source, base + t + 1, h0)
                    c = _slot(source, base + t + 2, h0)
                    d = _slot(source, base + t + 3, h0)
                    if grouped:
                        _add_group(width, total, a, b, c, d)
                    else:
                        _add_chain(width, total, a, b, c, d)
                    t += 4
                while t < last:
                    _add_one(width, total, _slot(source, base + t, h0))
                    t += 1
                first = last
            if stream:
                _store(width, total, staging_at)
                _stream_row(width, staging_at, _offset(out_at, i * hidden + h0), line)
            else:
                _store(width, total, _offset(out_at, i * hidden + h0))
    if stream:
        _order_stores()
