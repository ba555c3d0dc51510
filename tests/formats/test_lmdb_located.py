"""LMDB batches copied straight from the map at their values' places (read from the B-tree's
leaves), without a lookup per value: the same samples as the arrays the store was converted
from, in any order with repeats, for values inside leaf pages and in overflow pages; a value
whose size is not the manifest's is looked up, and the lookup's error names it."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dlstore
from dlstore.errors import StoreCorruptError
from dlstore.formats.lmdb.layout import sample_key

# heights of 7x3 images: 63 to 14,700 bytes, in leaf pages and in overflow pages of one store
HEIGHTS = (2, 40, 3, 700, 1, 90, 5, 300)


class _NoLookups:
    """An environment stand-in that fails any transaction: a read that looks values up fails."""

    def begin(self, *args, **kwargs):
        raise AssertionError("looked up in the B-tree")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    rng = np.random.default_rng(11)
    variable = [rng.integers(0, 256, (h, 7, 3), dtype=np.uint8) for h in HEIGHTS]
    fixed = rng.integers(0, 256, (40, 24, 32, 3), dtype=np.uint8)        # 2,304 bytes: overflow pages
    small = rng.integers(0, 256, (40, 4, 5, 3), dtype=np.uint8)          # 60 bytes: in the leaves
    root = tmp_path_factory.mktemp("located")
    paths = {}
    for name, images in (("variable", variable), ("fixed", fixed), ("small", small)):
        paths[name] = root / f"{name}.lmdb"
        items = [(im, 0) for im in images] if name == "variable" else (images, np.zeros(len(images), dtype=np.int64))
        dlstore.convert(items, paths[name], workers=0, progress=False)
    return paths, {"variable": variable, "fixed": list(fixed), "small": list(small)}


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(["variable", "fixed", "small"]), data=st.data())
def test_located_reads_equal_the_source_in_any_order(stores, name, data):
    paths, images = stores
    n = len(images[name])
    order = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3 * n))
    reader = dlstore.open_dataset(paths[name]).reader
    expected = [images[name][i].transpose(2, 0, 1) for i in order]
    for got, want in zip(reader.get_many(order), expected):
        np.testing.assert_array_equal(got, want)
    if name != "variable":
        np.testing.assert_array_equal(reader.get_batch(np.array(order)), np.stack(expected))


@pytest.mark.parametrize("name", ["variable", "fixed", "small"])
def test_a_located_batch_is_read_without_lookups(stores, name):
    paths, images = stores
    reader = dlstore.open_dataset(paths[name]).reader
    n = len(images[name])
    reader.get_many(list(range(n)))                 # finds every value's place
    reader._env = _NoLookups()                      # the map stays open: the reader's _mapped holds it
    order = np.random.default_rng(2).permutation(n)
    for got, i in zip(reader.get_many(order.tolist()), order.tolist()):
        np.testing.assert_array_equal(got, images[name][i].transpose(2, 0, 1))
    if name != "variable":
        expected = np.stack([images[name][i] for i in order]).transpose(0, 3, 1, 2)
        np.testing.assert_array_equal(reader.get_batch(order), expected)


@pytest.mark.parametrize("name", ["variable", "fixed"])
def test_a_value_of_the_wrong_size_is_looked_up_and_named(stores, tmp_path, name):
    """A value rewritten shorter (damage the manifest does not know of): the read does not copy
    the manifest's size from its place, it looks the value up and says which sample it is."""
    import shutil

    paths, images = stores
    dst = tmp_path / f"{name}.lmdb"
    shutil.copytree(paths[name], dst)
    with lmdb.open(str(dst), subdir=True) as env, env.begin(write=True) as txn:
        txn.put(sample_key(3), txn.get(sample_key(3))[:-1])
    reader = dlstore.open_dataset(dst).reader
    with pytest.raises(StoreCorruptError, match=r"sample 3 .* bytes, expected"):
        reader.get_many([1, 3])
    if name == "fixed":
        with pytest.raises(StoreCorruptError, match=r"sample 3 .* bytes, expected"):
            reader.get_batch(np.array([1, 3]))
    np.testing.assert_array_equal(reader.get_many([1])[0], images[name][1].transpose(2, 0, 1))
