"""Shards reader ``willneed``: the kernel is told a batch's samples ahead of the gather.

Pixels must not change (compared with numpy's own load of the shard files), and the advice
must name the right bytes: after evicting a store from the page cache, advising samples
3 and 7 makes exactly their pages resident (checked with mincore(2) through ctypes here,
not through dlstore's own probe).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dlstore
from dlstore.errors import ArgumentError

SHAPE = (3, 64, 96)   # 18 KiB a sample: several pages, not page-aligned


def _store(tmp_path: Path, n: int, per_shard: int) -> Path:
    images = np.random.default_rng(n).integers(0, 256, (n, SHAPE[1], SHAPE[2], SHAPE[0]), dtype=np.uint8)
    dst = tmp_path / f"s{n}-{per_shard}.shards"
    dlstore.convert((images, np.arange(n) % 3), dst, workers=0, progress=False,
                    shard_size=per_shard * int(np.prod(SHAPE)))
    return dst


def _numpy_samples(dst: Path) -> np.ndarray:
    files = sorted(dst.glob("shard-*.npy"))
    return np.concatenate([np.load(f) for f in files])


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 23), per_shard=st.integers(1, 9), data=st.data())
def test_willneed_gives_the_same_batches(tmp_path_factory, n, per_shard, data):
    dst = _store(tmp_path_factory.mktemp("w"), n, per_shard)
    expected = _numpy_samples(dst)
    indices = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n)))
    on = dlstore.open_dataset(dst, reader_options={"willneed": True})
    off = dlstore.open_dataset(dst, reader_options={"willneed": False})
    assert on.reader.willneed and not off.reader.willneed
    np.testing.assert_array_equal(on.reader.get_batch(indices), expected[indices])
    np.testing.assert_array_equal(off.reader.get_batch(indices), expected[indices])


def test_default_is_off_for_a_store_that_fits_in_memory_and_bad_values_are_refused(tmp_path):
    dst = _store(tmp_path, 4, 2)
    assert dlstore.open_dataset(dst).reader.willneed is False
    with pytest.raises(ArgumentError, match="willneed"):
        dlstore.open_dataset(dst, reader_options={"willneed": "yes"})


def _resident(path: Path) -> np.ndarray:
    """mincore(2) vector of a file: True for each page in the page cache."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)


def _pages(offset: int, nbytes: int) -> range:
    return range(offset // mmap.PAGESIZE, (offset + nbytes - 1) // mmap.PAGESIZE + 1)


def test_advice_names_exactly_the_batch_samples(tmp_path):
    dst = _store(tmp_path, 12, 12)
    shard = dst / "shard-00000.npy"
    ds = dlstore.open_dataset(dst, reader_options={"willneed": True})
    sample = int(np.prod(SHAPE))
    header = int(np.load(shard, mmap_mode="r").offset)
    fd = os.open(shard, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _resident(shard).any():
        pytest.skip(f"this filesystem keeps {shard} cached after POSIX_FADV_DONTNEED (tmpfs?): "
                    "cannot observe the advice")
    ds.reader._ensure_open()
    ds.reader._advise(np.array([0, 0]), np.array([7, 3]))
    wanted = set(_pages(header + 3 * sample, sample)) | set(_pages(header + 7 * sample, sample))
    deadline = time.monotonic() + 5
    while not _resident(shard)[sorted(wanted)].all() and time.monotonic() < deadline:
        time.sleep(0.01)
    resident = _resident(shard)
    assert resident[sorted(wanted)].all()
    untouched = set(_pages(header + 5 * sample, sample)) - wanted   # sample 5: between, never advised
    assert untouched and not resident[sorted(untouched)].any()
