"""Reader ``willneed``: the kernel is told a batch's samples ahead of the gather, in every format.

Pixels must not change (compared with the arrays the store was converted from), and the
advice must name the right bytes: after evicting a store's data file from the page cache,
advising samples 3 and 7 makes exactly their pages resident. Where a sample lies is found
in the file itself (its bytes, random, occur once), and residency is read with mincore(2)
through ctypes here, not through dlstore's own probe.
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
from dlstore.formats.readahead import advise

SHAPE = (3, 64, 96)   # 18 KiB a sample: several pages, not page-aligned
SUFFIXES = (".shards", ".lmdb", ".h5")


def _images(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, SHAPE[1], SHAPE[2], SHAPE[0]), dtype=np.uint8)


def _store(tmp_path: Path, n: int, suffix: str, per_shard: int | None = None) -> Path:
    dst = tmp_path / f"s{n}-{per_shard}{suffix}"
    options = {"shard_size": per_shard * int(np.prod(SHAPE))} if per_shard else {}
    dlstore.convert((_images(n), np.arange(n) % 3), dst, workers=0, progress=False, **options)
    return dst


def _data_file(dst: Path) -> Path:
    return {".shards": dst / "shard-00000.npy", ".lmdb": dst / "data.mdb", ".h5": dst}[dst.suffix]


@pytest.mark.parametrize("suffix", SUFFIXES)
@settings(max_examples=8, deadline=None)
@given(n=st.integers(2, 23), per_shard=st.integers(1, 9), data=st.data())
def test_willneed_gives_the_same_samples(tmp_path_factory, suffix, n, per_shard, data):
    dst = _store(tmp_path_factory.mktemp("w"), n, suffix, per_shard if suffix == ".shards" else None)
    expected = _images(n).transpose(0, 3, 1, 2)
    indices = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n)))
    on = dlstore.open_dataset(dst, reader_options={"willneed": True})
    off = dlstore.open_dataset(dst, reader_options={"willneed": False})
    assert on.reader.willneed and not off.reader.willneed
    for ds in (on, off):
        np.testing.assert_array_equal(ds.reader.get_batch(indices), expected[indices])
        for got, want in zip(ds.reader.get_many(indices), expected[indices], strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_default_is_off_for_a_store_that_fits_in_memory_and_bad_values_are_refused(tmp_path, suffix):
    dst = _store(tmp_path, 4, suffix)
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


def _pages(path: Path, sample: np.ndarray) -> set[int]:
    """The pages of ``path`` holding ``sample``'s bytes, found by searching the file for them."""
    content = path.read_bytes()
    offset = content.find(sample.tobytes())
    assert offset >= 0 and content.find(sample.tobytes(), offset + 1) < 0
    return set(range(offset // mmap.PAGESIZE, (offset + sample.nbytes - 1) // mmap.PAGESIZE + 1))


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_advice_names_exactly_the_batch_samples(tmp_path, suffix):
    dst = _store(tmp_path, 12, suffix)
    expected = _images(12).transpose(0, 3, 1, 2)
    data = _data_file(dst)
    # (LMDB without its own readahead: a page fault in its map would read the neighbours too)
    options = {"willneed": True, "readahead": False} if suffix == ".lmdb" else {"willneed": True}
    ds = dlstore.open_dataset(dst, reader_options=options)
    ds.reader._ensure_open()
    ds.reader._extents(np.array([0]))   # what finding samples reads (HDF5's chunk index) is read now
    wanted = _pages(data, expected[3]) | _pages(data, expected[7])
    untouched = _pages(data, expected[5]) - wanted   # sample 5: between, never advised
    _evict(data)
    if _resident(data)[sorted(wanted | untouched)].any():
        pytest.skip(f"this filesystem keeps {data} cached after POSIX_FADV_DONTNEED (tmpfs?): "
                    "cannot observe the advice")
    extents = ds.reader._extents(np.array([7, 3]))
    # finding where the samples lie reads none of their bytes (py-lmdb's get() would: it
    # faults a value in before returning it, one sample at a time, before any advice)
    assert not _resident(data)[sorted(wanted)].any()
    advise(extents)
    deadline = time.monotonic() + 5
    while not _resident(data)[sorted(wanted)].all() and time.monotonic() < deadline:
        time.sleep(0.01)
    resident = _resident(data)
    assert resident[sorted(wanted)].all()
    assert untouched and not resident[sorted(untouched)].any()


def _which_samples(path: Path, extents, samples: np.ndarray) -> list[int]:
    """The index of the sample whose bytes each extent of ``path`` holds."""
    data = path.read_bytes()
    flat = samples.reshape(len(samples), -1)
    lengths = np.broadcast_to(extents.length, extents.offset.shape).tolist()
    return [int(np.flatnonzero((flat == np.frombuffer(data[o:o + n], np.uint8)).all(axis=1))[0])
            for o, n in zip(extents.offset.tolist(), lengths)]


def test_lmdb_extents_of_values_small_and_big_hold_their_bytes(tmp_path):
    """Values small enough to sit in their B-tree leaf and values in overflow pages, in one store
    (variable sizes): each extent holds exactly its sample's bytes."""
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (h, 7, 3), dtype=np.uint8) for h in (2, 40, 3, 700, 1, 90)]
    dst = tmp_path / "mixed.lmdb"
    dlstore.convert([(im, 0) for im in images], dst, workers=0, progress=False)
    reader = dlstore.open_dataset(dst, reader_options={"willneed": True}).reader
    reader._ensure_open()
    order = np.array([3, 0, 5, 2, 4, 1])
    extents = reader._extents(order)
    content = (dst / "data.mdb").read_bytes()
    for k, i in enumerate(order.tolist()):
        o, n = int(extents.offset[k]), int(extents.length[k])
        assert content[o:o + n] == images[i].transpose(2, 0, 1).tobytes(), f"sample {i}"


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_every_batch_read_advises_its_samples(tmp_path, monkeypatch, suffix):
    """get_batch and get_many (what StoreDataset's batch paths and __getitems__ call) advise the
    extents of exactly the samples they read, before reading them; willneed off: no advice."""
    import dlstore.formats.reader as reader_module

    dst = _store(tmp_path, 12, suffix)
    advised: list[list[int]] = []
    real = reader_module.advise

    def record(extents):
        advised.append(_which_samples(_data_file(dst), extents, _images(12).transpose(0, 3, 1, 2)))
        real(extents)

    monkeypatch.setattr(reader_module, "advise", record)
    on = dlstore.open_dataset(dst, reader_options={"willneed": True})
    on.reader.get_batch([9, 2, 2, 5])
    on.reader.get_many([4, 0])
    assert advised == [[9, 2, 2, 5], [4, 0]]
    dlstore.open_dataset(dst, reader_options={"willneed": False}).reader.get_batch([1, 2])
    assert len(advised) == 2
