"""``dataset.transform = t`` after opening is planned exactly as ``open_dataset(path, transform=t)``
plans it, on every read path: ``ds[i]``, torch's DataLoader, ``get_batch``, every loader back-end and
the device stage; timm's ``create_loader`` (which assigns its transform) reads what timm reads."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader
from torchvision.transforms import v2

import dlstore
from dlstore.errors import StaticMismatchError
from dlstore.sources.demo import make_image_folder

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("assign") / "images", classes=2, per_class=6, size=(40, 48))


@pytest.fixture(scope="module")
def store(folder, tmp_path_factory):
    return dlstore.convert(folder, tmp_path_factory.mktemp("assign-store") / "s.shards",
                           static="resize=36,center_crop=32", workers=0, progress=False).path


def _pipeline():
    # deterministic (a crop the size of the image, a certain flip) so every path can be compared
    return v2.Compose([v2.Resize(36), v2.CenterCrop(32), v2.PILToTensor(), v2.RandomCrop(32), v2.RandomHorizontalFlip(1.0),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def _every_path(ds) -> dict[str, torch.Tensor]:
    n = len(ds)
    return {
        "ds[i]": torch.stack([ds[i][0] for i in range(n)]),
        "DataLoader": torch.cat([x for x, _ in DataLoader(ds, batch_size=5)]),
        "get_batch": ds.get_batch(list(range(n)))[0],
        "threads": torch.cat([x for x, _ in dlstore.loader(ds, 5, backend="threads")]),
        "ring": torch.cat([x for x, _ in dlstore.loader(ds, 5, num_workers=2)]),
        "dataloader": torch.cat([x for x, _ in dlstore.loader(ds, 5, backend="dataloader", num_workers=1)]),
        "device": torch.cat([x for x, _ in dlstore.loader(ds, 5, device="cpu")]),
    }


def test_an_assigned_transform_is_planned_on_every_path(store, folder):
    from torchvision import datasets

    want = torch.stack([x for x, _ in datasets.ImageFolder(str(folder), transform=_pipeline())])
    opened = dlstore.open_dataset(store, transform=_pipeline())
    assigned = dlstore.open_dataset(store)
    plain = _every_path(assigned)["get_batch"]
    assigned.transform = _pipeline()
    assert [type(t).__name__ for t in assigned.already_applied] == ["Resize", "CenterCrop", "PILToTensor"]
    assert repr(assigned).splitlines()[1:] == repr(opened).splitlines()[1:]      # the same plan
    for path, got in _every_path(assigned).items():
        assert got.dtype == torch.float32 and torch.equal(got, want), path
    assert plain.dtype == torch.uint8                          # before: the stored samples as they are
    assigned.transform = None                                  # and back
    assert torch.equal(assigned.get_batch(list(range(len(assigned))))[0], plain)


def test_an_assigned_transform_that_disagrees_with_the_store_is_refused_at_the_assignment(store):
    ds = dlstore.open_dataset(store)
    with pytest.raises(StaticMismatchError, match="resize=40"):
        ds.transform = v2.Compose([v2.Resize(40), v2.CenterCrop(32)])
    assert ds.transform is None                                # left as it was
    ds.static_mismatch = "allow"
    ds.transform = v2.Compose([v2.Resize(40), v2.CenterCrop(32)])
    assert "STATIC MISMATCH ALLOWED" in repr(ds)


def test_timm_create_loader_assigns_and_reads_what_timm_reads(store, folder):
    timm_data = pytest.importorskip("timm.data")
    from torchvision import datasets

    # timm's eval transform: resize to 36 (img_size / crop_pct), center crop 32, ToTensor, Normalize
    ds = dlstore.open_dataset(store)
    ours = timm_data.create_loader(ds, input_size=(3, 32, 32), batch_size=4, is_training=False, use_prefetcher=False,
                                   crop_pct=32 / 36, interpolation="bilinear", num_workers=0)
    assert ds.transform is not None and ds.already_applied            # assigned, and planned
    reference = datasets.ImageFolder(str(folder))
    theirs = timm_data.create_loader(reference, input_size=(3, 32, 32), batch_size=4, is_training=False,
                                     use_prefetcher=False, crop_pct=32 / 36, interpolation="bilinear", num_workers=0)
    got, want = torch.cat([x for x, _ in ours]), torch.cat([x for x, _ in theirs])
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
