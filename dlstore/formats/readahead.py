"""Readahead of a batch: every sample's read in flight at once, for any format.

A gather from a cold page cache waits for one read at a time: a memory map faults one
page at a time, LMDB copies one value at a time out of its map, HDF5 reads one chunk at
a time. Before such a gather, ``StoreReader`` (``formats/reader.py``) tells the kernel
where every sample of the batch lies (``posix_fadvise(WILLNEED)``, one call per sample,
in file order), so the disk has them all queued at once and the gather that follows
finds them read or on their way. Each format says only where its samples are::

    Extents(files, file_no, offset, length)    sample k: bytes [offset[k], offset[k] + length[k])
                                               of files[file_no[k]]

Advice only: an error is ignored (the read that follows names any real one), and a
format that cannot say where a sample is reads without it.

The calls cost more than they save on a warm cache (0.94x the plain gather of shards,
``benchmarks/cold_cache.py``), so the default is on only where every epoch reads cold:
samples of 64 KiB or more in a store larger than half the memory (physical, or the
process's cgroup limit). The reader
option ``willneed=True`` turns it on elsewhere (a cold first epoch, a network filesystem).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .._system import memory_limit_bytes
from ..errors import ArgumentError

WILLNEED_MIN_SAMPLE_BYTES = 64 << 10   # below it one call per sample costs more than a page fault saves


class Extents(NamedTuple):
    """Where samples lie: sample k is ``length[k]`` bytes at ``offset[k]`` of ``files[file_no[k]]``."""

    files: list[Path]
    file_no: np.ndarray
    offset: np.ndarray
    length: np.ndarray


def willneed_default(count: int, sample_bytes: float) -> bool:
    """On for samples of 64 KiB or more (on average) in a store of ``count`` larger than half the
    memory (physical, or this process's cgroup limit where lower)."""
    if not hasattr(os, "posix_fadvise") or sample_bytes < WILLNEED_MIN_SAMPLE_BYTES:
        return False
    memory = memory_limit_bytes()
    return memory is not None and count * sample_bytes > memory // 2


def choose_willneed(willneed: Any, count: int, sample_bytes: float) -> bool:
    """The reader option ``willneed``: True/False as given, None the default above; else ArgumentError."""
    if willneed is None:
        return willneed_default(count, sample_bytes)
    if not isinstance(willneed, bool):
        raise ArgumentError(f"willneed must be True, False or None (chosen), got {willneed!r}")
    return willneed and hasattr(os, "posix_fadvise")


def advise(extents: Extents) -> None:
    """posix_fadvise(WILLNEED) for every extent, in file order, one open per file."""
    file_no = np.asarray(extents.file_no, dtype=np.int64)
    offset = np.asarray(extents.offset, dtype=np.int64)
    length = np.broadcast_to(np.asarray(extents.length, dtype=np.int64), offset.shape)
    order = np.lexsort((offset, file_no))
    fd, current = -1, -1
    try:
        for k, start, n in zip(file_no[order].tolist(), offset[order].tolist(), length[order].tolist()):
            if k != current:
                if fd >= 0:
                    os.close(fd)
                    fd = -1
                current = k
                fd = os.open(extents.files[k], os.O_RDONLY)
            if start >= 0 and n > 0:
                os.posix_fadvise(fd, start, n, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        if fd >= 0:
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
