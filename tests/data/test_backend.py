"""``dlstore.loader(backend=...)``: each back-end chosen by name builds that loader, the choice
does not change the batches where the back-ends promise the same ones, and a combination that
contradicts the back-end is refused naming both arguments."""

from __future__ import annotations

import re

import pytest
import torch
from torchvision.transforms import v2

import dlstore
from dlstore.errors import ArgumentError
from dlstore.sources.demo import make_image_folder

CROP_FLIP = v2.Compose([v2.RandomCrop(10, padding=2), v2.RandomHorizontalFlip()])


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("backend")
    src = make_image_folder(root / "images", classes=2, per_class=7, size=(14, 12))
    fixed = dlstore.convert(src, root / "f.shards", static="center_crop=12", workers=0, progress=False).path
    variable = dlstore.convert(src, root / "v.shards", workers=0, progress=False).path
    return fixed, variable


@pytest.mark.parametrize(("options", "kind"), [
    ({}, "threads"),
    ({"backend": "threads", "num_threads": 3}, "threads"),
    ({"num_threads": 3}, "threads"),
    ({"backend": "ring", "num_workers": 1}, "ring"),
    ({"num_workers": 1}, "ring"),
    ({"backend": "dataloader"}, "dataloader"),
    ({"backend": "dataloader", "num_workers": 1}, "dataloader"),
    ({"device": "cpu"}, "threads"),
    ({"device": "cpu", "num_workers": 1}, "ring"),
])
def test_each_backend_is_one_loader_class(stores, options, kind):
    dl = dlstore.loader(dlstore.open_dataset(stores[0]), 4, **options)
    assert type(dl) is dlstore.Loader and dl.backend == kind
    if "num_threads" in options:
        assert dl.num_threads == options["num_threads"]


def test_a_gpu_dataset_is_the_resident_backend(stores):
    gpu = dlstore.GPUDataset(stores[0], device="cpu", dtype=torch.uint8)
    for dl in (dlstore.loader(gpu, 4, backend="resident"), dlstore.loader(gpu, 4)):
        assert type(dl) is dlstore.Loader and dl.backend == "resident"


def test_threads_and_ring_give_the_same_batches(stores):
    ds = dlstore.open_dataset(stores[0], transform=CROP_FLIP)

    def epoch(**options):
        dl = dlstore.loader(ds, 4, shuffle=True, generator=torch.Generator().manual_seed(5), **options)
        return [(x.clone(), y.clone()) for x, y in dl]

    threads = epoch(backend="threads", num_threads=2)
    assert len(threads) == 4
    for options in ({"backend": "ring", "num_workers": 2}, {"backend": "dataloader"},
                    {"backend": "dataloader", "num_workers": 2}):
        other = epoch(**options)
        assert all(torch.equal(a, b) and torch.equal(u, w) for (a, u), (b, w) in zip(threads, other)), options


CONFLICTS = [
    ({"backend": "threads", "num_workers": 2}, "backend='threads'", "num_workers=2"),
    ({"backend": "threads", "num_workers": 1, "persistent_workers": True}, "backend='threads'", "num_workers=1"),
    ({"backend": "ring"}, "backend='ring'", "num_workers=0"),
    ({"backend": "ring", "num_workers": 1, "num_threads": 2}, "backend='ring'", "num_threads=2"),
    ({"backend": "dataloader", "num_threads": 2}, "backend='dataloader'", "num_threads=2"),
    ({"backend": "resident"}, "backend='resident'", "ShardsDataset"),
    ({"backend": "gpu"}, "backend='gpu'", "backend='resident'"),
    ({"persistent_workers": True}, "persistent_workers=", "num_workers >= 1"),
    ({"backend": "process"}, "backend must be one of", "'ring'"),
]


@pytest.mark.parametrize(("options", "first", "second"), CONFLICTS, ids=[str(c[0]) for c in CONFLICTS])
def test_a_contradiction_names_both_arguments(stores, options, first, second):
    with pytest.raises(ArgumentError) as info:
        dlstore.loader(dlstore.open_dataset(stores[0]), 4, **options)
    assert first in str(info.value) and second in str(info.value), str(info.value)


def test_the_ring_needs_one_batch_shape(stores):
    with pytest.raises(ArgumentError, match=re.escape("backend='ring' needs batches of one fixed shape")):
        dlstore.loader(dlstore.open_dataset(stores[1]), 4, backend="ring", num_workers=1)
    assert dlstore.loader(dlstore.open_dataset(stores[1]), 4, num_workers=1).backend == "dataloader"


def test_a_gpu_dataset_refuses_a_host_backend(stores):
    gpu = dlstore.GPUDataset(stores[0], device="cpu", dtype=torch.uint8)
    with pytest.raises(ArgumentError, match="backend='threads' with a GPUDataset"):
        dlstore.loader(gpu, 4, backend="threads")
