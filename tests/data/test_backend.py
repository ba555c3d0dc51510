"""``dlstore.loader(backend=...)``: each back-end chosen by name builds that loader, the choice
does not change the batches where the back-ends promise the same ones, and a combination that
contradicts the back-end is refused naming both arguments."""

from __future__ import annotations

import re

import pytest
import torch
from torchvision.transforms import v2

import dlstore
from dlstore.data.loaders.dataloader import StoreDataLoader
from dlstore.data.loaders.shm_ring import ShmRingLoader
from dlstore.data.loaders.threads import ThreadLoader
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
    ({}, ThreadLoader),
    ({"backend": "threads", "threads": 3}, ThreadLoader),
    ({"backend": "ring", "num_workers": 1}, ShmRingLoader),
    ({"num_workers": 1}, ShmRingLoader),
    ({"backend": "dataloader"}, StoreDataLoader),
    ({"backend": "dataloader", "num_workers": 1}, StoreDataLoader),
])
def test_each_backend_builds_its_loader(stores, options, kind):
    dl = dlstore.loader(dlstore.open_dataset(stores[0]), 4, **options)
    assert type(dl) is kind
    if "threads" in options:
        assert dl.threads == options["threads"]


def test_a_gpu_dataset_is_the_gpu_backend(stores):
    gpu = dlstore.GPUDataset(stores[0], device="cpu", dtype=torch.uint8)
    assert type(dlstore.loader(gpu, 4, backend="gpu")) is type(dlstore.loader(gpu, 4)) is dlstore.data.GPULoader


def test_threads_and_ring_give_the_same_batches(stores):
    ds = dlstore.open_dataset(stores[0], transform=CROP_FLIP)

    def epoch(**options):
        dl = dlstore.loader(ds, 4, shuffle=True, generator=torch.Generator().manual_seed(5), **options)
        return [(x.clone(), y.clone()) for x, y in dl]

    threads, ring = epoch(backend="threads", threads=2), epoch(backend="ring", num_workers=2)
    assert len(threads) == len(ring) == 4
    assert all(torch.equal(a, b) and torch.equal(u, w) for (a, u), (b, w) in zip(threads, ring))


CONFLICTS = [
    ({"backend": "threads", "num_workers": 2}, "backend='threads'", "num_workers=2"),
    ({"backend": "threads", "threads": 0}, "backend='threads'", "threads=0"),
    ({"backend": "threads", "shm_ring": True}, "backend='threads'", "shm_ring=True"),
    ({"backend": "threads", "persistent_workers": True}, "backend='threads'", "persistent_workers="),
    ({"backend": "ring"}, "backend='ring'", "num_workers=0"),
    ({"backend": "ring", "num_workers": 1, "threads": 2}, "backend='ring'", "threads=2"),
    ({"backend": "ring", "num_workers": 1, "shm_ring": False}, "backend='ring'", "shm_ring=False"),
    ({"backend": "dataloader", "threads": 2}, "backend='dataloader'", "threads=2"),
    ({"backend": "dataloader", "num_workers": 1, "shm_ring": True}, "backend='dataloader'", "shm_ring=True"),
    ({"backend": "gpu"}, "backend='gpu'", "ShardsDataset"),
    ({"threads": 2, "worker_init_fn": print}, "threads=2", "worker_init_fn="),
    ({"backend": "process"}, "backend must be one of", "'ring'"),
]


@pytest.mark.parametrize(("options", "first", "second"), CONFLICTS, ids=[str(c[0]) for c in CONFLICTS])
def test_a_contradiction_names_both_arguments(stores, options, first, second):
    with pytest.raises(ArgumentError) as info:
        dlstore.loader(dlstore.open_dataset(stores[0]), 4, **options)
    assert first in str(info.value) and second in str(info.value), str(info.value)


def test_the_ring_needs_one_batch_shape(stores):
    with pytest.raises(ArgumentError, match=re.escape("backend='ring' needs a batch path of fixed output shape")):
        dlstore.loader(dlstore.open_dataset(stores[1]), 4, backend="ring", num_workers=1)
    assert type(dlstore.loader(dlstore.open_dataset(stores[1]), 4, num_workers=1)) is StoreDataLoader


def test_a_gpu_dataset_refuses_a_host_backend(stores):
    gpu = dlstore.GPUDataset(stores[0], device="cpu", dtype=torch.uint8)
    with pytest.raises(ArgumentError, match="backend='threads' with a GPUDataset"):
        dlstore.loader(gpu, 4, backend="threads")
