"""Reader ``willneed``: the kernel is told a batch's samples ahead of the gather, in every format.

Pixels must not change (compared with the arrays the store was converted from), and the
advice must name the right bytes: after evicting a store's data file from the page cache,
advising samples 3 and 7 makes exactly their pages resident. Where a sample lies is found
in the file itself (its bytes, random, occur once), and residency is read with mincore(2)
through ctypes here, not through dlstore's own probe.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from _helpers import evict, pages_holding, resident_pages, seen_resident
from hypothesis import given, settings
from hypothesis import strategies as st

import dlstore
from dlstore._system import resident
from dlstore.errors import ArgumentError
from dlstore.formats.readahead import Extents, _cached, advice_limit, advise, ranges

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
    wanted = pages_holding(data, expected[3]) | pages_holding(data, expected[7])
    untouched = pages_holding(data, expected[5]) - wanted   # sample 5: between, never advised
    evict(data)
    if resident_pages(data)[sorted(wanted | untouched)].any():
        pytest.skip(f"this filesystem keeps {data} cached after POSIX_FADV_DONTNEED (tmpfs?): "
                    "cannot observe the advice")
    extents = ds.reader._extents(np.array([7, 3]))
    # finding where the samples lie reads none of their bytes (py-lmdb's get() would: it
    # faults a value in before returning it, one sample at a time, before any advice)
    assert not resident_pages(data)[sorted(wanted)].any()
    advise(extents)
    assert seen_resident(data, wanted) == wanted
    assert untouched and not resident_pages(data)[sorted(untouched)].any()


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

    def record(extents, **options):
        advised.append(_which_samples(_data_file(dst), extents, _images(12).transpose(0, 3, 1, 2)))
        real(extents, **options)

    monkeypatch.setattr(reader_module, "advise", record)
    on = dlstore.open_dataset(dst, reader_options={"willneed": True})
    on.reader.get_batch([9, 2, 2, 5])
    on.reader.get_many([4, 0])
    assert advised == [[9, 2, 2, 5], [4, 0]]
    dlstore.open_dataset(dst, reader_options={"willneed": False}).reader.get_batch([1, 2])
    assert len(advised) == 2


@pytest.mark.parametrize("probe", [0, 8])
def test_advice_reads_a_range_longer_than_one_call_reads(tmp_path, probe):
    """Linux reads at most the disk's readahead limit per WILLNEED call and drops the rest of a
    longer range: advise() reads the whole range, in pieces (also after probing the cache)."""
    path = tmp_path / "data.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        limit = advice_limit(fd)
        size = 3 * limit + 5000                  # three calls' worth and a partial page
        os.write(fd, np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    finally:
        os.close(fd)
    evict(path)
    if resident_pages(path).any():
        pytest.skip(f"this filesystem keeps {path} cached after POSIX_FADV_DONTNEED (tmpfs?): "
                    "cannot observe the advice")
    advise(Extents([path], np.zeros(1, dtype=np.int64), np.array([0]), np.array([size])), probe=probe)
    assert len(seen_resident(path)) == len(resident_pages(path))


@settings(max_examples=300, deadline=None)
@given(extents=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), min_size=1, max_size=12),
       gap=st.integers(0, 30))
def test_ranges_cover_the_extents_and_merge_only_gaps_up_to_gap(extents, gap):
    offset = np.array([o for o, _ in extents], dtype=np.int64)
    end = offset + np.array([n for _, n in extents], dtype=np.int64)
    starts, stops = ranges(offset, end, gap)
    covered = np.zeros(400, dtype=bool)
    for o, e in zip(offset.tolist(), end.tolist()):
        covered[o:e] = True
    assert (starts < stops).all() and (starts[1:] > stops[:-1] + gap).all()   # sorted, apart by more than gap
    for o, e in zip(offset.tolist(), end.tolist()):                            # each extent in one range
        assert ((starts <= o) & (e <= stops)).sum() == 1
    for s, e in zip(starts.tolist(), stops.tolist()):
        assert covered[s] and covered[e - 1]                                   # no range starts or ends in a gap
        holes = np.flatnonzero(np.diff(np.concatenate([[1], covered[s:e].astype(np.int8), [1]])))
        assert all(b - a <= gap for a, b in zip(holes[::2], holes[1::2]))     # and holds no gap wider than gap


def test_a_cached_batch_is_not_advised_and_an_uncached_one_is(tmp_path, monkeypatch):
    """With ``probe``, a batch whose probed samples are all in the page cache costs no advice;
    one probed sample evicted, and the batch is advised."""
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 64 * 8192, dtype=np.uint8).tobytes())
    extents = Extents([path], np.zeros(16, dtype=np.int64), np.arange(16) * 4 * 8192, np.array(4096))
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, how: (calls.append(how), real(fd, o, n, how)))
    path.read_bytes()                                   # all cached
    advise(extents, probe=8)
    assert os.POSIX_FADV_WILLNEED not in calls
    evict(path)
    if resident_pages(path).any():
        pytest.skip(f"this filesystem keeps {path} cached after POSIX_FADV_DONTNEED (tmpfs?)")
    advise(extents, probe=8)
    assert calls.count(os.POSIX_FADV_WILLNEED) == 16    # 16 extents 28 KiB apart: none merged


@pytest.mark.parametrize("cachestat", [True, False], ids=["cachestat", "mincore"])
def test_the_cache_probe_reads_nothing_and_sees_the_cached_pages(tmp_path, monkeypatch, cachestat):
    """The probe only looks: probing evicted pages leaves them evicted and says not cached (a
    probe that read its page on a miss saw it cached on a fast disk, and the batch went
    unadvised), and it agrees page by page with mincore on a half-read file."""
    import dlstore._system as pagecache

    if cachestat and not pagecache.HAS_CACHESTAT:
        pytest.skip("this kernel has no cachestat(2) (Linux < 6.5): the mincore case covers it")
    monkeypatch.setattr(pagecache, "HAS_CACHESTAT", cachestat)
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(2).integers(0, 256, 64 * mmap.PAGESIZE, dtype=np.uint8).tobytes())
    evict(path)
    if resident_pages(path).any():
        pytest.skip(f"this filesystem keeps {path} cached after POSIX_FADV_DONTNEED (tmpfs?)")
    offsets = np.arange(64) * mmap.PAGESIZE + 4095
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(20):
            assert not _cached(fd, offsets[::8])
        assert not resident_pages(path).any()
        os.pread(fd, 8 * mmap.PAGESIZE, 24 * mmap.PAGESIZE)
        expected = resident_pages(path)
        assert expected.any() and not expected.all()
        assert (resident(fd, offsets) == expected).all()
        assert (resident(fd) == expected).all()
        assert not resident(fd, np.array([-1, 64 * mmap.PAGESIZE])).any()   # outside the file
        assert _cached(fd, offsets[24:32]) and not _cached(fd, offsets[20:32])
    finally:
        os.close(fd)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_default_is_on_for_a_store_bigger_than_half_the_memory_whatever_its_sample_size(tmp_path, monkeypatch, suffix):
    """18 KiB samples (below the 64 KiB the default once required): on once the store exceeds half
    of the memory limit the process has, off while it fits."""
    import dlstore.formats.readahead as readahead

    dst = _store(tmp_path, 12, suffix)
    size = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file()) if dst.is_dir() else dst.stat().st_size
    monkeypatch.setattr(readahead, "memory_limit_bytes", lambda: size)          # the store: more than half
    assert dlstore.open_dataset(dst).reader.willneed is True
    monkeypatch.setattr(readahead, "memory_limit_bytes", lambda: 4 * size)
    assert dlstore.open_dataset(dst).reader.willneed is False


@pytest.mark.parametrize("suffix", [".shards", ".lmdb"])
def test_readahead_off_reads_only_the_faulted_pages(tmp_path, suffix):
    """``readahead=False`` (the default for a store bigger than half the memory): reading a
    sample from the cold map reads its own pages, not the disk's readahead unit around them;
    with readahead on, the same read brings in neighbours."""
    dst = _store(tmp_path, 24, suffix)
    data = _data_file(dst)
    chw = _images(24).transpose(0, 3, 1, 2)
    wanted = pages_holding(data, chw[12])
    resident = {}
    for readahead in (False, True):
        reader = dlstore.open_dataset(dst, reader_options={"readahead": readahead, "willneed": False}).reader
        reader._ensure_open()
        reader.prefetch([0])            # LMDB's lookups touch leaves: done before the eviction
        evict(data)
        before = set(np.flatnonzero(resident_pages(data)).tolist())
        if before >= wanted:
            pytest.skip(f"this filesystem keeps {data} cached after POSIX_FADV_DONTNEED (tmpfs?)")
        np.testing.assert_array_equal(np.array(reader.get(12)), chw[12])
        resident[readahead] = set(np.flatnonzero(resident_pages(data)).tolist()) - before
        del reader
    assert resident[False] and resident[False] <= wanted
    assert len(resident[True] - wanted) > 0


def _whole_pages(path: Path, sample: np.ndarray) -> set[int]:
    """The pages of ``path`` lying wholly inside ``sample``'s bytes (found by searching the file)."""
    offset = path.read_bytes().find(sample.tobytes())
    assert offset >= 0
    return set(range(-(-offset // mmap.PAGESIZE), (offset + sample.nbytes) // mmap.PAGESIZE))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_release_drops_the_samples_pages_though_the_reader_maps_them(tmp_path, suffix):
    """Samples read through the reader's map (in place) leave the page cache on ``release``, their
    whole pages only: a sample between them stays; reading them again gives the same pixels.
    (``posix_fadvise(DONTNEED)`` alone leaves a mapped page cached.)"""
    probe = tmp_path / "probe"
    probe.write_bytes(os.urandom(1 << 16))
    evict(probe)
    if resident_pages(probe).any():
        pytest.skip(f"this filesystem keeps {probe} cached after POSIX_FADV_DONTNEED (tmpfs?)")
    dst = _store(tmp_path, 12, suffix)
    expected = _images(12).transpose(0, 3, 1, 2)
    data = _data_file(dst)
    ds = dlstore.open_dataset(dst, reader_options={"readahead": False, "willneed": False})
    np.testing.assert_array_equal(ds.reader.get_batch(np.arange(12)), expected)
    gone = _whole_pages(data, expected[3]) | _whole_pages(data, expected[7])
    kept = _whole_pages(data, expected[5])
    assert gone and kept and resident_pages(data)[sorted(gone | kept)].all()
    assert ds.reader.release([7, 3]) is True
    cached = resident_pages(data)
    assert not cached[sorted(gone)].any()
    assert cached[sorted(kept)].all()
    np.testing.assert_array_equal(ds.reader.get_batch(np.arange(12)), expected)


def test_release_default_is_on_only_for_a_store_bigger_than_half_the_memory(monkeypatch):
    import dlstore.formats.readahead as readahead

    monkeypatch.setattr(readahead, "memory_limit_bytes", lambda: 1000)
    assert readahead.release_default(501) is True
    assert readahead.release_default(500) is False
    monkeypatch.setattr(readahead, "memory_limit_bytes", lambda: None)   # unknown: keep the cache
    assert readahead.release_default(10 ** 12) is False
