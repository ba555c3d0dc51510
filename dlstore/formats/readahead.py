"""Readahead of a batch: every sample's read in flight at once, for any format.

A gather from a cold page cache waits for one read at a time: a memory map faults one
page at a time, LMDB copies one value at a time out of its map, HDF5 reads one chunk at
a time. Before such a gather, ``StoreReader`` (``formats/reader.py``) tells the kernel
where every sample of the batch lies (``posix_fadvise(WILLNEED)``, nearby samples merged,
in file order), so the disk has them all queued at once and the gather that follows
finds them read or on their way. Each format says only where its samples are::

    Extents(files, file_no, offset, length)    sample k: bytes [offset[k], offset[k] + length[k])
                                               of files[file_no[k]]

Advice only: an error is ignored (the read that follows names any real one), and a
format that cannot say where a sample is reads without it.

Extents at most ``MERGE_GAP`` apart are advised as one range, and a range is advised in
pieces of at most what one call reads: Linux reads at most ``max(read_ahead_kb,
max_sectors_kb)`` of the file's disk per ``WILLNEED`` (``force_page_cache_ra``) and drops
the rest of a longer range without saying so (a 64 MiB call read 8 MiB on this machine's
disk; on the common 128 KiB setting a 4 MiB block would be read 3 % through).

The calls cost more than they save on a warm cache, so a batch is first looked up in the
page cache (``probe``: whether eight of its pages are cached, by ``mincore``) and not advised when
all are there; even so a warm store pays 0.8-0.9x for the lookups, so the default is on only
where reads cannot stay warm: a store larger than half the memory (physical, or the
process's cgroup limit), whatever its sample size (3 KB samples of a 1.45 GB LMDB store in a
926 MB cgroup: a full shuffle 2.7x, a sequential epoch 6.4x with it). The reader option
``willneed=True`` turns it on elsewhere (a cold first epoch, a network filesystem).

The other way: ``release`` lets the page cache drop samples read already, so a store that
cannot stay cached keeps room for what was advised (``data/order.py``'s windows: pages read
through a map count as used and outlive, in a small memory cgroup, advised pages not yet read).
Pages this process maps are handed back first (``madvise(MADV_PAGEOUT)``), since
``posix_fadvise(DONTNEED)`` leaves a mapped page in the cache; ``MADV_PAGEOUT`` pages out a
file's pages only for its owner, a user who may write it, or root, and elsewhere does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .._system import memory_limit_bytes, resident
from ..errors import ArgumentError

# A gap up to this is read with its neighbours: its pages cost less than another call, and
# LMDB's values (page headers, leaf pages between them) and HDF5's chunks are rarely adjacent.
MERGE_GAP = 16 << 10
FALLBACK_LIMIT = 128 << 10   # what one call reads where the disk's queue limits cannot be read


class Extents(NamedTuple):
    """Where samples lie: sample k is ``length[k]`` bytes at ``offset[k]`` of ``files[file_no[k]]``."""

    files: list[Path]
    file_no: np.ndarray
    offset: np.ndarray
    length: np.ndarray


def willneed_default(count: int, sample_bytes: float) -> bool:
    """On for a store of ``count`` samples larger than half the memory (physical, or this
    process's cgroup limit where lower)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    memory = memory_limit_bytes()
    return memory is not None and count * sample_bytes > memory // 2


_THREAD = threading.local()


def batches_advised_ahead() -> None:
    """Mark the calling thread as one whose batches its loader advises ahead (``ThreadLoader``'s
    builders): a reader's own advice of each batch there would repeat it."""
    _THREAD.ahead = True


def advised_ahead() -> bool:
    """Whether the calling thread's batches are advised ahead by its loader."""
    return getattr(_THREAD, "ahead", False)


def readahead_default(store_bytes: int) -> bool:
    """The map's OS readahead: on for a store that fits in half the memory (physical, or this
    process's cgroup limit).

    A page fault in a map reads ``read_ahead_kb`` of the disk around it (8 MiB on some virtual
    disks): a store the page cache holds is read in that few, large reads whatever the order;
    a random read of a bigger one reads neighbours only to evict them (shards of 3 KB samples
    in a cgroup holding a quarter of the store: 9x the store's bytes read per epoch's worth).
    """
    memory = memory_limit_bytes()
    return memory is None or store_bytes <= memory // 2


def release_default(store_bytes: int) -> bool:
    """Whether samples read already should leave the page cache (``release``): for a store that
    cannot stay cached, the one whose map readahead is off (``readahead_default``)."""
    return hasattr(os, "posix_fadvise") and not readahead_default(store_bytes)


def choose_willneed(willneed: Any, count: int, sample_bytes: float) -> bool:
    """The reader option ``willneed``: True/False as given, None the default above; else ArgumentError."""
    if willneed is None:
        return willneed_default(count, sample_bytes)
    if not isinstance(willneed, bool):
        raise ArgumentError(f"willneed must be True, False or None (chosen), got {willneed!r}")
    return willneed and hasattr(os, "posix_fadvise")


@functools.lru_cache(maxsize=64)
def _device_limit(device: int) -> int:
    queue = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    queue = queue / "queue" if (queue / "queue").is_dir() else queue / ".." / "queue"   # a partition: its disk's
    try:
        kib = max(int((queue / name).read_text()) for name in ("read_ahead_kb", "max_sectors_kb"))
    except (OSError, ValueError):
        return FALLBACK_LIMIT
    return max(kib << 10, 4096)


def advice_limit(fd: int) -> int:
    """Bytes one ``posix_fadvise(WILLNEED)`` on ``fd`` reads at most: the larger of its disk's
    ``read_ahead_kb`` and ``max_sectors_kb``; ``FALLBACK_LIMIT`` off a block device (tmpfs,
    NFS, FUSE)."""
    try:
        return _device_limit(os.fstat(fd).st_dev)
    except OSError:
        return FALLBACK_LIMIT


def ranges(offset: np.ndarray, end: np.ndarray, gap: int = MERGE_GAP) -> tuple[np.ndarray, np.ndarray]:
    """``[start, stop)`` byte ranges covering the extents ``[offset, end)`` of one file, extents
    at most ``gap`` apart merged: sorted and disjoint."""
    order = np.argsort(offset, kind="stable")
    offset, end = offset[order], np.maximum.accumulate(end[order])
    first = np.ones(len(offset), dtype=bool)
    first[1:] = offset[1:] > end[:-1] + gap
    last = np.append(first[1:], True)
    return offset[first], end[last]


def _cached(fd: int, offsets: np.ndarray) -> bool:
    """Whether the page at each of ``offsets`` is in the page cache (``mincore``, which reads nothing)."""
    try:
        return bool(resident(fd, offsets).all())
    except OSError:   # cannot map the file: advise
        return False


def advise(extents: Extents, *, probe: int = 0) -> None:
    """posix_fadvise(WILLNEED) for every extent: one open per file, nearby extents merged,
    each range in pieces of at most ``advice_limit``. ``probe``: first look whether the last
    page of that many of a file's extents, spread over it, is cached, and advise none of it if
    all are (one call per extent would cost a warm batch more than its gather)."""
    file_no = np.asarray(extents.file_no, dtype=np.int64)
    offset = np.asarray(extents.offset, dtype=np.int64)
    length = np.broadcast_to(np.asarray(extents.length, dtype=np.int64), offset.shape)
    keep = (offset >= 0) & (length > 0)
    file_no, offset, end = file_no[keep], offset[keep], offset[keep] + length[keep]
    for k in (np.unique(file_no).tolist() if len(extents.files) > 1 else [0] if len(offset) else []):
        mine = file_no == k if len(extents.files) > 1 else slice(None)
        try:
            fd = os.open(extents.files[k], os.O_RDONLY)
        except OSError:
            continue
        try:
            if probe:
                # the last byte of samples spread over the file's extents: a block merges into one
                # range, whose first page says little about the rest, and a sample's first page is
                # the one a lookup touches (LMDB reads a big value's header page to find it)
                last = end[mine] - 1
                if _cached(fd, last[::max(1, -(-len(last) // probe))]):
                    continue
            starts, stops = ranges(offset[mine], end[mine])
            limit = advice_limit(fd)
            for start, stop in zip(starts.tolist(), stops.tolist()):
                for piece in range(start, stop, limit):
                    os.posix_fadvise(fd, piece, min(limit, stop - piece), os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


MADV_PAGEOUT = 21   # Linux 5.4+; the same number on every architecture (Python's mmap lacks it)


@functools.cache
def _madvise() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def _mappings(st: os.stat_result) -> list[tuple[int, int, int]]:
    """(start address, end address, file offset of start) of each of this process's maps of the
    file ``st`` describes (``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    device, inode, found = (os.major(st.st_dev), os.minor(st.st_dev)), str(st.st_ino), []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) >= 5 and fields[4] == inode \
                and tuple(int(v, 16) for v in fields[3].split(":")) == device:
            start, end = (int(v, 16) for v in fields[0].split("-"))
            found.append((start, end, int(fields[2], 16)))
    return found


def release(extents: Extents) -> None:
    """Let the page cache drop the whole pages of every extent (nearby extents merged; a page
    partly outside stays): this process's maps of the file page them out first
    (``madvise(MADV_PAGEOUT)``, Linux only), then ``posix_fadvise(DONTNEED)``. Advice only:
    nothing read changes, a page dropped and read again is read from the disk again."""
    file_no = np.asarray(extents.file_no, dtype=np.int64)
    offset = np.asarray(extents.offset, dtype=np.int64)
    length = np.broadcast_to(np.asarray(extents.length, dtype=np.int64), offset.shape)
    keep = (offset >= 0) & (length > 0)
    file_no, offset, end = file_no[keep], offset[keep], offset[keep] + length[keep]
    page = mmap.PAGESIZE
    for k in np.unique(file_no).tolist():
        try:
            fd = os.open(extents.files[k], os.O_RDONLY)
        except OSError:
            continue
        try:
            starts, stops = ranges(offset[file_no == k], end[file_no == k])
            starts, stops = -(-starts // page) * page, stops // page * page
            spans = [(a, b) for a, b in zip(starts.tolist(), stops.tolist()) if b > a]
            maps = _mappings(os.fstat(fd)) if sys.platform.startswith("linux") else []
            for start, end_addr, base in maps:
                for a, b in spans:
                    lo, hi = max(a, base), min(b, base + end_addr - start)
                    if hi > lo:
                        _madvise()(start + lo - base, hi - lo, MADV_PAGEOUT)   # (an error: not paged out)
            for a, b in spans:
                os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def mapping_base(path: Path) -> int | None:
    """The address at which this process maps byte 0 of ``path`` (the first shared mapping of
    its inode in ``/proc/self/maps``), or None where it is not mapped or there is no such file.

    LMDB hands out values as pointers into its map and reports no map address
    (``env.info()["map_addr"]`` is 0 unless the map is fixed): a value's file offset is its
    address minus this base.
    """
    try:
        st = os.stat(path)
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return None
    device = (os.major(st.st_dev), os.minor(st.st_dev))
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) >= 5 and fields[4] == str(st.st_ino) and "s" in fields[1] \
                and tuple(int(v, 16) for v in fields[3].split(":")) == device:
            start = int(fields[0].split("-")[0], 16)
            return start - int(fields[2], 16)
    return None
