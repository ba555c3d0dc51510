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


@jit
def copy_row_reversed(dst: Any, start: int, src: Any, last: int, n: int) -> None:
    d, s = uintp(start), uintp(last)
    for i in range(uintp(n)):
        dst[d + i] = src[s - i]


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
                for r in range(r0, r1 - 1):
                    fill_row(dst, top + r * tw + d0 + n, tw - n, fill)
                fill_row(dst, top + (r1 - 1) * tw + d0 + n, tw - d0 - n, fill)
                continue
            for r in range(r0, r1):
                o = top + r * tw
                row = (ch * h + r + y) * w
                fill_row(dst, o, d0, fill)
                if flips[j]:
                    copy_row_reversed(dst, o + d0, src, row + sx1 - 1, n)
                else:
                    copy_row(dst, o + d0, src, row + sx0, n)
                fill_row(dst, o + d0 + n, tw - d0 - n, fill)
