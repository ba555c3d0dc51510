"""Where every sample lies, read once per reader: LMDB's whole tree walked level by level
(``lmdb/pages.walk``) against what ``lmdb`` itself returns for each key, over stores written
in any order with values in leaf pages and overflow pages; an HDF5 store's recorded offsets
against its chunk index, and a rewritten file whose recorded offsets went stale."""

from __future__ import annotations

import h5py
import lmdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dlstore
from dlstore.formats.lmdb.layout import KEY_DIGITS, sample_key
from dlstore.formats.lmdb.pages import parse_leaf, walk


def _lmdb(path, values: dict[int, bytes], order, extra: dict[bytes, bytes] = {}, append: bool = False) -> None:
    with lmdb.open(str(path), map_size=256 << 20, max_dbs=2) as env:
        for i in order:
            with env.begin(write=True) as txn:
                txn.put(sample_key(i), values[i], append=append)
        if extra:
            named = env.open_db(b"named")
            with env.begin(write=True) as txn:
                for key, value in extra.items():
                    txn.put(key, value)
                txn.put(b"in a named database", b"x", db=named)


def _walk(path, count: int):
    """(walk's table, the pages it advised, the environment's own page counts)."""
    with lmdb.open(str(path), readonly=True, lock=False, max_dbs=2) as env:
        stat, info = env.stat(), env.info()
    page = stat["psize"]
    mem = np.fromfile(path / "data.mdb", dtype=np.uint8)[:(info["last_pgno"] + 1) * page]
    advised: list[int] = []
    table = walk(mem, page, count, KEY_DIGITS, lambda pgnos: advised.extend(pgnos.tolist()))
    return table, advised, stat, mem


def _check_against_lmdb(path, table, mem, count: int) -> None:
    offsets, lengths = table
    with lmdb.open(str(path), readonly=True, lock=False, max_dbs=2) as env, env.begin() as txn:
        for i in range(count):
            value = txn.get(sample_key(i))
            if value is None:
                assert (offsets[i], lengths[i]) == (0, 0), i
            else:
                assert lengths[i] == len(value), i
                assert mem[offsets[i]:offsets[i] + lengths[i]].tobytes() == value, i


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_the_walked_table_finds_every_value_lmdb_finds(tmp_path_factory, data):
    count = data.draw(st.integers(1, 300), label="count")
    sizes = data.draw(st.lists(st.sampled_from([1, 7, 600, 1900, 2100, 4096, 9000]), min_size=count,
                               max_size=count), label="value sizes")   # leaf values and overflow pages
    absent = set(data.draw(st.lists(st.integers(0, count - 1), max_size=3), label="keys never put"))
    in_order = data.draw(st.booleans(), label="appended in key order")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    values = {i: rng.integers(0, 256, sizes[i], dtype=np.uint8).tobytes() for i in range(count)}
    order = [i for i in (range(count) if in_order else rng.permutation(count).tolist()) if i not in absent]
    path = tmp_path_factory.mktemp("walk") / "s.lmdb"
    _lmdb(path, values, order, extra={b"__labels__": b"\0" * 64, b"__dlstore__": b"{}"},
          append=in_order and not absent)
    table, advised, stat, mem = _walk(path, count)
    assert table is not None
    _check_against_lmdb(path, table, mem, count)
    # every branch and leaf page asked for ahead, each once, before it was read
    assert len(advised) == len(set(advised)) == stat["branch_pages"] + stat["leaf_pages"]


def test_a_three_level_tree_is_walked_and_equals_the_leaf_by_leaf_lookup(tmp_path):
    count = 40_000                                   # small values: ~150 a leaf, ~200 leaves a branch
    rng = np.random.default_rng(3)
    values = {i: bytes([i % 251]) * (1 + i % 5) for i in range(count)}
    path = tmp_path / "deep.lmdb"
    _lmdb(path, values, rng.permutation(count).tolist())
    table, advised, stat, mem = _walk(path, count)
    assert stat["depth"] >= 3 and table is not None
    _check_against_lmdb(path, table, mem, count)
    # the one-leaf parse of a lookup gives the same extents
    page = stat["psize"]
    offsets, lengths = np.full(count, -1, dtype=np.int64), np.zeros(count, dtype=np.int64)
    for pgno in advised:
        parse_leaf(mem[pgno * page:(pgno + 1) * page].tobytes(), pgno * page, count, KEY_DIGITS, len(mem),
                   offsets, lengths)
    np.testing.assert_array_equal(offsets, table[0])
    np.testing.assert_array_equal(lengths, table[1])


def test_a_reader_walks_the_tree_at_its_first_batch_and_a_damaged_page_stops_the_walk(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (600, 8, 8, 3), dtype=np.uint8)
    path = tmp_path / "s.lmdb"
    dlstore.convert((images, np.arange(600) % 3), path, workers=0, progress=False)
    table, advised, stat, mem = _walk(path, 600)   # (before the reader: lmdb opens a path once a process)
    reader = dlstore.open_dataset(path).reader
    np.testing.assert_array_equal(reader.get_batch(np.array([0, 1])), images.transpose(0, 3, 1, 2)[:2])
    offsets, lengths = reader._values       # every sample placed (a lookup places one leaf's)
    assert (offsets > 0).all() and (lengths == 192).all() and reader.read_path == "in place"
    np.testing.assert_array_equal(table[0], offsets)
    page = stat["psize"]
    root = advised[0]                                # a branch page (600 samples: ~17 a leaf)
    assert stat["depth"] >= 2
    broken = mem.copy()
    broken[root * page + 10] = 0x10                  # its flags: no longer a branch page
    assert walk(broken, page, 600, KEY_DIGITS, lambda pgnos: None) is None


# --- HDF5: offsets recorded at conversion --------------------------------------------------

def _chunk_offsets(path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        ident = f["images"].id
        out = np.full(f["images"].shape[0], -1, dtype=np.int64)
        ident.chunk_iter(lambda info: out.__setitem__(info.chunk_offset[0], info.byte_offset))
    return out


@pytest.fixture(scope="module")
def hdf5_store(tmp_path_factory):
    images = np.random.default_rng(5).integers(0, 256, (97, 12, 10, 3), dtype=np.uint8)
    path = tmp_path_factory.mktemp("h5") / "s.h5"
    dlstore.convert((images, np.arange(97) % 4), path, workers=0, progress=False)
    return path, images.transpose(0, 3, 1, 2)


def test_a_converted_hdf5_store_records_where_its_chunks_lie(hdf5_store):
    path, samples = hdf5_store
    reader = dlstore.open_dataset(path).reader
    assert reader.manifest["layout"]["offsets"] == "offsets"
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["offsets"][()], _chunk_offsets(path))
    order = np.random.default_rng(2).permutation(97)
    np.testing.assert_array_equal(reader.get_batch(order), samples[order])
    assert reader.read_path == "in place"
    np.testing.assert_array_equal(reader._sample_table()[0], _chunk_offsets(path))


def test_recorded_offsets_gone_stale_in_a_rewritten_file_are_not_used(hdf5_store, tmp_path):
    """A file rewritten by another tool (h5repack, a copy with h5py) keeps the /offsets dataset
    with the old file's numbers; the chunks lie elsewhere now."""
    path, samples = hdf5_store
    copy = tmp_path / "rewritten.h5"
    with h5py.File(path, "r") as src, h5py.File(copy, "w") as dst:
        dst.create_dataset("padding", data=np.zeros(5000, np.uint8))    # moves every chunk
        for name in src:
            src.copy(src[name], dst, name=name)
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        stale = src["offsets"][()]
    assert not np.array_equal(stale, _chunk_offsets(copy))
    reader = dlstore.open_dataset(copy).reader
    order = np.random.default_rng(3).permutation(97)
    np.testing.assert_array_equal(reader.get_batch(order), samples[order])
    np.testing.assert_array_equal(reader._sample_table()[0], _chunk_offsets(copy))
