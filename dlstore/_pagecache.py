"""Which pages of a file are in the page cache: ``cachestat(2)`` (Linux 6.5+) per page asked,
else ``mincore(2)`` over a read-only shared mapping (3x the cost for a few pages: it maps the file).

Both only look: they start no read. (A one-byte ``preadv(RWF_NOWAIT)`` looks too, but
on a miss it starts the read of that page, and on a fast disk the read is done before the call
checks the page, so it reports a hit: one probe in five on this VM's disk, every probe on a
faster one, which made a cold batch look cached and left it unadvised.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import mmap
import os

import numpy as np

from .errors import SystemProbeError


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.syscall.restype = ctypes.c_long
    return libc


_CACHESTAT = 451   # the same number in every architecture's table (the generic one)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


HAS_CACHESTAT = hasattr(os, "uname") and os.uname().sysname == "Linux"   # until a call says ENOSYS


def _cachestat(fd: int, offsets: list[int]) -> np.ndarray | None:
    """Per offset, whether its page is cached (past the end: no); None where this kernel has no
    cachestat."""
    libc, span, stat = _libc(), _Range(0, mmap.PAGESIZE), _Stat()
    out = np.zeros(len(offsets), dtype=bool)
    for k, offset in enumerate(offsets):
        if offset >= 0:
            span.off = offset - offset % mmap.PAGESIZE
            if libc.syscall(_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
                if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):   # (EPERM: a seccomp filter)
                    global HAS_CACHESTAT
                    HAS_CACHESTAT = False
                    return None
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            out[k] = stat.cache > 0
    return out


def resident(fd: int, offsets: np.ndarray | None = None, *, name: object = None) -> np.ndarray:
    """For each byte offset in ``offsets``, whether its page is cached; without offsets, one bool per
    page of the file. Raises ``SystemProbeError`` (naming ``name``, else the fd) where the file
    cannot be mapped; an offset past the end reads as not cached."""
    if offsets is not None and HAS_CACHESTAT:
        out = _cachestat(fd, np.asarray(offsets, dtype=np.int64).tolist())
        if out is not None:
            return out
    size = os.fstat(fd).st_size
    pages = -(-size // mmap.PAGESIZE)
    if pages == 0:
        return np.zeros(0 if offsets is None else len(offsets), dtype=bool)
    libc, label = _libc(), name or f"fd {fd}"
    # libc's mmap, not Python's: a read-only mmap.mmap cannot give ctypes an address.
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise SystemProbeError(err, f"mmap of {label} for mincore failed: {os.strerror(err)}")
    try:
        if offsets is None:
            vec = (ctypes.c_ubyte * pages)()
            _mincore(libc, addr, 0, pages, vec, label)
            return (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)
        # one page a call: probes spread over a large file would otherwise walk all of it
        page = np.asarray(offsets, dtype=np.int64) // mmap.PAGESIZE
        out = np.zeros(len(page), dtype=bool)
        vec = (ctypes.c_ubyte * 1)()
        for k, p in enumerate(page.tolist()):
            if 0 <= p < pages:
                _mincore(libc, addr, p, 1, vec, label)
                out[k] = vec[0] & 1
        return out
    finally:
        libc.munmap(addr, size)


def _mincore(libc: ctypes.CDLL, addr: int, first: int, count: int, vec: ctypes.Array, name: object) -> None:
    if libc.mincore(addr + first * mmap.PAGESIZE, count * mmap.PAGESIZE, vec) != 0:
        err = ctypes.get_errno()
        raise SystemProbeError(err, f"mincore on {name} failed: {os.strerror(err)}")
