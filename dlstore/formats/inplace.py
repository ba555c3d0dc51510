"""Samples read in place: a map of a store's file, and batches gathered from it at the samples' offsets.

A fixed-shape sample that is one run of uncompressed bytes at a known offset of a file (a
shards row, an LMDB value, an HDF5 chunk holding whole samples) needs no library call to be
read: a batch is one pass over its samples' bytes, from the page cache into the batch, and a
kernel given the samples' addresses (``StoreReader.sample_addresses``, the fused crop +
flip) reads them where they lie, with no copy before it::

    map_file(path, readahead)        the whole file as a uint8 array over a private map
    gather(data, offsets, out)       out[k] = the bytes at data[offsets[k]:], one pass
    views(data, offsets, shapes)     each sample as an array over the map, no copy
    addresses(data, offsets)         where each sample starts in this process's memory

The map is copy-on-write (as the shards reader's ``np.load(mmap_mode="c")``): a view handed
out is writable for torch, and a write to it changes the caller's copy of that page, never
the file. numpy keeps the map open while any view of it lives, so a view outlives the reader
safely, in this process and in a forked child. A published store is never written in
place (a conversion renames a new one over it, and this map keeps the old file), so offsets
read once stay right.

``readahead=False`` maps with ``MADV_RANDOM``, as the shards reader does for a store that
cannot stay cached: a fault then reads its own page, not the disk's readahead unit around it
(see ``readahead.py``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np

from ..errors import StoreCorruptError

# below this many bytes a sample is gathered by a numpy index, not a memmove of its own (see gather)
SMALL_SAMPLE = 32 << 10

IN_PLACE = "in place"   # ``StoreReader.read_path``: batches gathered from a map of the store's file
NATIVE = "native"       # ``StoreReader.read_path``: through the format's library, sample by sample


def map_file(path: Path, readahead: bool) -> np.ndarray:
    """The whole of ``path`` as a uint8 array over a private, copy-on-write map (see the module doc)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return np.zeros(0, dtype=np.uint8)
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise StoreCorruptError(f"{path}: missing (moved or deleted while the store was open?)") from None
    if not readahead and hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=np.uint8)


def addresses(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Where the byte at each of ``offsets`` of ``data`` lies in this process (uintp)."""
    base = np.uint64(data.__array_interface__["data"][0])
    return (base + np.asarray(offsets, dtype=np.uint64)).astype(np.uintp)


def gather(data: np.ndarray, offsets: np.ndarray, out: np.ndarray) -> None:
    """Fill each row of the C-contiguous ``out`` (B, ...) with the bytes at ``offsets[k]`` of
    ``data``; the caller has checked that every one lies inside ``data``.

    One pass over the bytes: the compiled kernel (a memcpy per channel, the GIL released for
    the batch) where this process built it already (a fused crop did), else one ``memmove``
    per sample (the GIL released in each). A plain read never builds the kernel itself:
    numba's libraries, read from a cold disk, would cost a first epoch time and a
    memory-limited process the page cache its store needs. Samples under ``SMALL_SAMPLE``
    bytes are gathered by one numpy index of a strided view instead (two passes, but one
    call: a call per sample cost more than the second pass). numpy's ``take`` would copy the
    overlapping rows of the view first.
    """
    from ..transforms import compiled

    b = len(offsets)
    if b == 0:
        return
    where = addresses(data, offsets)
    if out.ndim == 4 and compiled.built():
        zeros = np.zeros(b, dtype=np.int64)
        compiled.crop_flip_at(where, out.shape[1:], out, zeros, zeros, np.zeros(b, dtype=np.bool_), (0, 0, 0, 0), 0)
        return
    flat = out.reshape(b, -1)
    nbytes = flat.shape[1]
    if nbytes < SMALL_SAMPLE:
        flat[...] = np.lib.stride_tricks.as_strided(data, shape=(len(data) - nbytes + 1, nbytes),
                                                    strides=(1, 1), writeable=False)[offsets]
        return
    first = flat.__array_interface__["data"][0]
    for k, at in enumerate(where.tolist()):
        ctypes.memmove(first + k * nbytes, at, nbytes)


def views(data: np.ndarray, offsets: np.ndarray, shapes: list[tuple[int, int, int]]) -> list[np.ndarray]:
    """Each sample as a (C, H, W) array over ``data`` (no copy); offsets checked by the caller."""
    return [data[o:o + c * h * w].reshape(c, h, w) for o, (c, h, w) in zip(offsets.tolist(), shapes)]


def inside(offsets: np.ndarray, lengths: np.ndarray, size: int) -> bool:
    """Whether every extent ``[offset, offset + length)`` lies inside a file of ``size`` bytes."""
    offsets = np.asarray(offsets, dtype=np.int64)
    return bool(len(offsets) == 0 or (offsets.min() >= 0 and (offsets + lengths).max() <= size))
