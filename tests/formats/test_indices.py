"""Out-of-range sample indices: an IndexError (SampleIndexError) from every reader and dataset.

The rule (formats/checks.py): readers take positions 0..N-1 and refuse anything
else, negative indices included; StoreDataset indexes like a Python sequence
(-1 is the last sample) and refuses what is out of range. Never reported as
damage (StoreCorruptError), never an OverflowError from a C library.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dlstore
from dlstore.errors import SampleIndexError, StoreCorruptError
from dlstore.formats import get_format
from dlstore.sources.demo import make_image_folder

FORMATS = {"shards": "s.shards", "lmdb": "s.lmdb", "hdf5": "s.h5"}
N = 6


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("indices")
    src = make_image_folder(root / "images", classes=2, per_class=3, size=(16, 20))
    out = {}
    for fmt, name in FORMATS.items():
        for kind, static in (("fixed", "center_crop=12"), ("variable", None)):
            dst = root / kind / name
            dlstore.convert(src, dst, static=static, workers=0, progress=False)
            out[fmt, kind] = dst
    return out


BAD = [N, N + 5, -1, -N, -N - 1, 2**40, -(2**40)]


@pytest.mark.parametrize("kind", ["fixed", "variable"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_readers_refuse_every_out_of_range_index(stores, fmt, kind):
    reader = get_format(fmt).Reader(stores[fmt, kind])
    assert len(reader) == N
    for i in BAD:
        for call in (lambda: reader.get(i), lambda: reader.get_many([0, i]),
                     *([lambda: reader.get_batch(np.array([0, i]))] if kind == "fixed" else [])):
            with pytest.raises(SampleIndexError, match=f"index {i} out of range") as caught:
                call()
            assert isinstance(caught.value, IndexError) and not isinstance(caught.value, StoreCorruptError)
    if kind == "fixed":
        for start, stop in ((0, N + 1), (-1, 2), (3, 2)):
            with pytest.raises(SampleIndexError):
                reader.read_range(start, stop)
    assert reader.get(N - 1).shape[0] == 3  # the last valid position still reads


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_datasets_index_like_a_sequence(stores, fmt):
    ds = dlstore.open_dataset(stores[fmt, "fixed"])
    assert torch.equal(ds[-1][0], ds[N - 1][0]) and torch.equal(ds[-N][0], ds[0][0])
    for i in (N, N + 5, -N - 1, 2**40, -(2**40)):
        with pytest.raises(IndexError, match=f"index {i} out of range"):
            ds[i]
        with pytest.raises(SampleIndexError):
            ds.read(i)
    assert len(list(iter(ds))) == N  # iteration stops at the IndexError, as for a sequence
