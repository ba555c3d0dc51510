"""``StoreDataset.__getitems__`` (what a torch DataLoader calls with a batch's indices) gives exactly
``[ds[i] for i in indices]``: every format, fixed and variable shapes, raw and JPEG records,
with and without transforms, over indices that repeat, go backwards and wrap (hypothesis).
Readahead on and off (``willneed``) must not change a pixel; a DataLoader over the dataset
yields the default collate of the same samples.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, SequentialSampler
from torchvision.transforms import v2

import dlstore

SUFFIXES = (".shards", ".lmdb", ".h5")
KINDS = ("fixed", "variable", "jpeg")


@pytest.fixture(scope="module")
def stores(tmp_path_factory, rgb_folder, varsize_folder):
    out = {}
    root = tmp_path_factory.mktemp("getitems")
    for suffix in SUFFIXES:
        for kind in KINDS:
            dst = root / f"{kind}{suffix}"
            source = varsize_folder if kind == "variable" else rgb_folder
            options = {"encoding": "jpeg"} if kind == "jpeg" else {}
            dlstore.convert(source, dst, workers=0, progress=False, **options)
            out[suffix, kind] = dst
    return out


def _double(images, generator=None):
    return images * 2   # deterministic, and uint8 wraps the same way per sample and per batch


TRANSFORMS = {
    "none": {},
    "transform": {"transform": v2.RandomHorizontalFlip(p=1.0), "target_transform": lambda y: y + 100},
    "batch_transform": {"batch_transform": _double, "target_transform": lambda y: float(y) / 2},
}


def _same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (image, label), (image_ref, label_ref) in zip(got, want):
        assert image.dtype == image_ref.dtype and image.shape == image_ref.shape
        assert torch.equal(image, image_ref)
        assert type(label) is type(label_ref) and label == label_ref


@pytest.mark.parametrize("willneed", [False, True])
@pytest.mark.parametrize("transforms", list(TRANSFORMS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("suffix", SUFFIXES)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_getitems_equals_getitem_one_by_one(stores, suffix, kind, transforms, willneed, data):
    ds = dlstore.open_dataset(stores[suffix, kind], reader_options={"willneed": willneed}, **TRANSFORMS[transforms])
    n = len(ds)
    indices = data.draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=2 * n), label="indices")
    _same(ds.__getitems__(indices), [ds[i] for i in indices])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_dataloader_collates_the_same_samples(stores, suffix, workers):
    ds = dlstore.open_dataset(stores[suffix, "fixed"], reader_options={"willneed": True})
    loader = DataLoader(ds, batch_size=5, sampler=SequentialSampler(ds), num_workers=workers)
    images, labels = zip(*[(x, y) for x, y in loader])
    assert torch.equal(torch.cat(images), torch.stack([ds[i][0] for i in range(len(ds))]))
    assert torch.cat(labels).tolist() == ds.targets
