"""Plain h5py beside an open dlstore HDF5 dataset in the same process.

dlstore opens HDF5 stores without file locking (``locking=False``: a published
store is never modified in place, and locks fail on some network filesystems).
HDF5 shares one file handle per file within a process and refuses a second open
with other locking flags, so plain h5py must open the store the same way:
``h5py.File(path, "r", locking=False)`` (documented in docs/robustness.md).
"""

from __future__ import annotations

import h5py
import numpy as np

import dlstore
from dlstore.sources.demo import make_image_folder


def test_h5py_with_locking_false_reads_beside_an_open_dataset(tmp_path):
    src = make_image_folder(tmp_path / "images", classes=2, per_class=2, size=(16, 16))
    path = tmp_path / "s.h5"
    dlstore.convert(src, path, static="center_crop=12", workers=0, progress=False)

    ds = dlstore.open_dataset(path)
    first = ds[0][0].numpy()
    with h5py.File(path, "r", locking=False) as f:   # while the dataset holds the file open
        np.testing.assert_array_equal(f["images"][0], first)
        assert list(f["labels"][()]) == ds.targets
    np.testing.assert_array_equal(ds[0][0].numpy(), first)  # the dataset still reads after h5py closed

    with h5py.File(path, "r", locking=False) as f:   # the other order: h5py first
        again = dlstore.open_dataset(path)
        np.testing.assert_array_equal(again[1][0].numpy(), f["images"][1])
