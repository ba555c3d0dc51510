"""numba code of :mod:`dlstore.transforms.compiled` (imported by it on first use, never at
``import dlstore``): module-level functions, so that numba's disk cache keeps the compiled
kernel between processes (nested functions were compiled again in every process, ~0.8 s,
each forked or spawned loader worker included)."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def as_pointer(typingctx: Any, address: Any) -> Any:
    """An integer address as a void pointer (numba.carray takes pointers only)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
    return types.voidptr(address), codegen


@intrinsic
def memcpy(typingctx: Any, dst: Any, src: Any, n: Any) -> Any:
    """libc's memcpy of ``n`` bytes between addresses (LLVM's memcpy intrinsic)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        to, frm, count = args
        byte_ptr = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(to, byte_ptr), builder.inttoptr(frm, byte_ptr), count, 1)
        return context.get_dummy_value()
    return types.void(types.uintp, types.uintp, types.uintp), codegen


uintp = numba.uintp


def jit(fn: Any) -> Any:
    """numba's njit, GIL released, no bounds checks, cached on disk where numba finds a writable
    place for it (beside this file, else ~/.cache); without one (a read-only install and HOME),
    compiled in each process instead of not at all."""
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False)(fn)
    except RuntimeError:        # "cannot cache function ...: no locator available"
        return numba.njit(nogil=True, boundscheck=False)(fn)


# Unsigned loop indices: numba checks a signed index for wraparound on every access,
# which keeps LLVM from vectorising the loop (a reversed copy ran 13x slower).
@jit
def fill_row(dst: Any, start: int, n: int, value: Any) -> None:
    base = uintp(start)
    for i in range(uintp(n)):
        dst[base + i] = value


@jit
def copy_row(dst: Any, start: int, src: Any, first: int, n: int) -> None:
    d, s = uintp(start), uintp(first)
    for i in range(uintp(n)):
        dst[d + i] = src[s + i]


def _pairs(width: int) -> Any:
    """An intrinsic ``(address, count, stride, length, value)``: ``value`` in ``count`` runs of
    ``length`` bytes (``width <= length <= 2 * width``), ``stride`` apart, each as two ``width``-byte
    vector stores, the second ending where the run ends."""
    @intrinsic
    def pairs(typingctx: Any, address: Any, count: Any, stride: Any, length: Any, value: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            to, runs, step, size, byte = args
            i8, i32 = ir.IntType(8), ir.IntType(32)
            vec = ir.VectorType(i8, width)
            lane = builder.insert_element(ir.Constant(vec, None), byte, ir.Constant(i32, 0))
            filled = builder.shuffle_vector(lane, lane, ir.Constant(ir.VectorType(i32, width), [0] * width))
            base = builder.inttoptr(to, i8.as_pointer())
            tail = builder.sub(size, ir.Constant(size.type, width))
            with cgutils.for_range(builder, runs) as loop:
                at = builder.gep(base, [builder.mul(loop.index, step)])
                builder.store(filled, builder.bitcast(at, vec.as_pointer()), align=1)
                builder.store(filled, builder.bitcast(builder.gep(at, [tail]), vec.as_pointer()), align=1)
            return context.get_dummy_value()
        return types.void(types.uintp, types.uintp, types.uintp, types.uintp, types.uint8), codegen
    return pairs


pairs32, pairs16, pairs8, pairs4, pairs2, pairs1 = (_pairs(width) for width in (32, 16, 8, 4, 2, 1))


@jit
def fill_runs(dst: Any, start: int, count: int, stride: int, length: int, value: Any) -> None:
    """``value`` in ``count`` runs of ``length`` bytes of ``dst`` from ``start``, ``stride`` apart:
    the strips of padding beside the rows of a crop, inline vector stores where a run is 64 bytes
    or less (a loop of ``fill_row`` made each strip a call to memset: the fills cost a padded
    crop a quarter more than a plain copy)."""
    if count <= 0 or length <= 0:
        return
    at, runs, step, size = uintp(dst.ctypes.data) + uintp(start), uintp(count), uintp(stride), uintp(length)
    if length > 64:
        for k in range(count):
            fill_row(dst, start + k * stride, length, value)
    elif length >= 32:
        pairs32(at, runs, step, size, value)
    elif length >= 16:
        pairs16(at, runs, step, size, value)
    elif length >= 8:
        pairs8(at, runs, step, size, value)
    elif length >= 4:
        pairs4(at, runs, step, size, value)
    elif length >= 2:
        pairs2(at, runs, step, size, value)
    else:
        pairs1(at, runs, step, size, value)


@intrinsic
def flip_row(typingctx: Any, dst: Any, src: Any, n: Any, d0: Any, tw: Any, fill: Any) -> Any:
    """One output row of a flipped crop, inline: ``dst[d0 + i] = src[n - 1 - i]`` for ``i < n``,
    ``fill`` in ``dst[:d0]`` and ``dst[d0 + n:tw]`` (addresses). Where ``n`` and ``tw`` are 32 or
    more and each fill is 32 bytes or less (a padded crop of a photo), two 32-byte stores of
    ``fill`` and then the reversed copy, 32 bytes a vector reversed by one shuffle, its last vector
    overlapping the one before; else byte by byte. A loop numba compiles from Python spent a
    call on each fill (LLVM makes a short fill loop a memset call) and its remainder bytes one
    at a time: a flipped batch ran at 0.63-0.75x a plain copy's rate, this at 0.79-0.87x (two
    threads, 224x224 samples, docs/reading.md)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        to, frm, count, start, width, value = args
        i8, i32 = ir.IntType(8), ir.IntType(32)
        vec = ir.VectorType(i8, 32)
        dst_ptr, src_ptr = builder.inttoptr(to, i8.as_pointer()), builder.inttoptr(frm, i8.as_pointer())
        out = builder.gep(dst_ptr, [start])
        reverse = ir.Constant(ir.VectorType(i32, 32), list(range(31, -1, -1)))
        lane = builder.insert_element(ir.Constant(vec, None), value, ir.Constant(i32, 0))
        filled = builder.shuffle_vector(lane, lane, ir.Constant(ir.VectorType(i32, 32), [0] * 32))
        size, zero, one = (ir.Constant(count.type, k) for k in (32, 0, 1))

        def store(vector: Any, ptr: Any) -> None:
            builder.store(vector, builder.bitcast(ptr, vec.as_pointer()), align=1)

        def move(out_at: Any, in_at: Any) -> None:
            v = builder.load(builder.bitcast(builder.gep(src_ptr, [in_at]), vec.as_pointer()), align=1)
            store(builder.shuffle_vector(v, v, reverse), builder.gep(out, [out_at]))

        right = builder.sub(width, builder.add(start, count))
        wide = builder.and_(builder.icmp_unsigned(">=", count, size), builder.icmp_unsigned(">=", width, size))
        short_fills = builder.and_(builder.icmp_unsigned("<=", start, size), builder.icmp_unsigned("<=", right, size))
        with builder.if_else(builder.and_(wide, short_fills)) as (vectors, bytewise):
            with vectors:
                store(filled, dst_ptr)
                store(filled, builder.gep(dst_ptr, [builder.sub(width, size)]))
                with cgutils.for_range(builder, builder.udiv(count, size)) as loop:
                    at = builder.mul(loop.index, size)
                    move(at, builder.sub(builder.sub(count, at), size))
                move(builder.sub(count, size), zero)
            with bytewise:
                with cgutils.for_range(builder, start) as loop:
                    builder.store(value, builder.gep(dst_ptr, [loop.index]))
                with cgutils.for_range(builder, right) as loop:
                    builder.store(value, builder.gep(out, [builder.add(count, loop.index)]))
                with cgutils.for_range(builder, count) as loop:
                    byte = builder.load(builder.gep(src_ptr, [builder.sub(builder.sub(count, loop.index), one)]))
                    builder.store(byte, builder.gep(out, [loop.index]))
        return context.get_dummy_value()
    return types.void(types.uintp, types.uintp, types.uintp, types.uintp, types.uintp, types.uint8), codegen


@jit
def kernel(addresses: Any, out: Any, ys: Any, xs: Any, flips: Any, fill: Any,
           c: int, h: int, w: int, th: int, tw: int) -> None:
    """Crop (padded with ``fill``) and flip each sample at ``addresses[j]`` into ``out[j]``; numba
    takes arrays and ints only, so the batch's geometry comes as separate arguments."""
    size = c * h * w
    for j in range(out.shape[0]):
        src = numba.carray(as_pointer(addresses[j]), (size,), np.uint8)
        dst = out[j]
        y, x = ys[j], xs[j]
        sx0, sx1 = max(x, 0), min(x + tw, w)
        n = sx1 - sx0 if sx1 > sx0 else 0
        # output columns [d0, d0 + n) hold image columns [sx0, sx1), mirrored if flipped
        d0 = tw if n == 0 else (tw - (sx1 - x) if flips[j] else sx0 - x)
        if n == 0:
            fill_row(dst, 0, c * th * tw, fill)
            continue
        # output rows [r0, r1) show image rows [r0 + y, r1 + y)
        r0 = min(max(-y, 0), th)
        r1 = max(min(h - y, th), r0)
        for ch in range(c):
            top = ch * th * tw
            fill_row(dst, top, r0 * tw, fill)
            fill_row(dst, top + r1 * tw, (th - r1) * tw, fill)
            if r1 == r0:
                continue
            if not flips[j] and tw == w:
                # rows as wide as the image's: the rows' parts and the bytes between them
                # are one run in both, copied by one libc memcpy per channel instead of a loop
                # per row; the strips are filled over it
                first = top + r0 * tw + d0
                last = top + (r1 - 1) * tw + d0 + n
                memcpy(uintp(dst.ctypes.data) + uintp(first),
                       uintp(addresses[j]) + uintp((ch * h + r0 + y) * w + sx0), uintp(last - first))
                fill_row(dst, top + r0 * tw, d0, fill)
                fill_runs(dst, top + r0 * tw + d0 + n, r1 - 1 - r0, tw, tw - n, fill)
                fill_row(dst, top + (r1 - 1) * tw + d0 + n, tw - d0 - n, fill)
                continue
            if flips[j]:
                for r in range(r0, r1):
                    flip_row(uintp(dst.ctypes.data) + uintp(top + r * tw),
                             uintp(addresses[j]) + uintp((ch * h + r + y) * w + sx0), uintp(n), uintp(d0), uintp(tw), fill)
                continue
            for r in range(r0, r1):
                o = top + r * tw
                fill_row(dst, o, d0, fill)
                copy_row(dst, o + d0, src, (ch * h + r + y) * w + sx0, n)
                fill_row(dst, o + d0 + n, tw - d0 - n, fill)
