"""Ops that need a PIL image get one made from the uint8 sample, with ImageFolder's pixels; or are refused.

Reference: torchvision's ``ImageFolder(folder, transform=pipeline)`` with the global generators
(torch's, Python's, numpy's) seeded alike, on a store converted with the pipeline's static center
crop (its samples are ImageFolder's decoded images, cropped); on the batch paths, the op on ``F.to_pil_image`` of the stored sample
with the generators seeded as the plan's per-sample step seeds them from the loader's generator.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torchvision.transforms as v1
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as F

import dlstore
from dlstore.errors import TransformSpecError
from dlstore.sources.demo import make_image_folder
from dlstore.transforms.planner import PerSample, plan
from dlstore.transforms.recognise import needs_pil, tensor_safe
from dlstore.transforms.wrappers import AsWritten, OnPIL

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
CROP = (28, 34)     # the store's static center crop: one shape, so batches are stacked


def _rand_augment():
    auto_augment = pytest.importorskip("timm.data.auto_augment", reason="timm is not installed")
    return auto_augment.rand_augment_transform("rand-m9-mstd0.5", {})


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("pil") / "images", classes=2, per_class=3, size=(30, 36))


@pytest.fixture(scope="module")
def store(folder, tmp_path_factory):
    return dlstore.convert(folder, tmp_path_factory.mktemp("pil_store") / "s.shards", static=v1.CenterCrop(CROP),
                           workers=0, progress=False).path


def _equals_imagefolder_per_sample(ds, folder, pipeline) -> None:
    reference = datasets.ImageFolder(str(folder), transform=pipeline)
    for i in range(len(ds)):
        _seed(i)
        got = ds[i][0]
        _seed(i)
        want = reference[i][0]
        assert torch.equal(got, want), i
    batches = iter(DataLoader(ds, batch_size=len(ds)))    # (it draws its base seed first)
    _seed(99)                   # torch's DataLoader: __getitems__, the samples in order
    got = next(batches)[0]
    _seed(99)
    assert torch.equal(got, torch.stack([reference[i][0] for i in range(len(ds))]))


def _seeded_like_the_step(op, raw: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """What a per-sample batch step gives: one seed drawn from the loader's generator, the global
    generators seeded with it, the op on each sample's PIL image."""
    seed = int(PerSample(op).sample(raw.shape, generator=generator)["seed"])
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.stack([F.pil_to_tensor(op(F.to_pil_image(x))) for x in raw])


def test_timm_rand_augment_gets_imagefolders_pil_image(store, folder):
    ra = _rand_augment()
    pipeline = v1.Compose([v1.CenterCrop(CROP), ra, v1.PILToTensor()])
    ds = dlstore.open_dataset(store, transform=pipeline)
    assert ds.per_sample_ops == [] and [type(op) for op in ds.batch_ops] == [PerSample]
    assert type(ds.batch_ops[0].op) is OnPIL
    _equals_imagefolder_per_sample(ds, folder, pipeline)
    raw, _ = ds.read_batch(range(len(ds)))
    got, _ = ds.get_batch(list(range(len(ds))), generator=torch.Generator().manual_seed(5))
    assert torch.equal(got, _seeded_like_the_step(ra, raw, torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("name", ["auto_augment", "augmix"])
def test_timm_auto_augment_and_augmix_get_a_pil_image(store, folder, name):
    auto_augment = pytest.importorskip("timm.data.auto_augment", reason="timm is not installed")
    op = {"auto_augment": lambda: auto_augment.auto_augment_transform("original", {}),
          "augmix": lambda: auto_augment.augment_and_mix_transform("augmix-m5-w3", {})}[name]()
    pipeline = v1.Compose([v1.CenterCrop(CROP), op, v1.ToTensor(), v1.Normalize(MEAN, STD)])
    _equals_imagefolder_per_sample(dlstore.open_dataset(store, transform=pipeline), folder, pipeline)


def test_pil_ops_never_crash_in_a_worker(store):
    pipeline = v1.Compose([v1.RandomResizedCrop(16), _rand_augment(), v1.ToTensor(), v1.Normalize(MEAN, STD)])
    ds = dlstore.open_dataset(store, transform=pipeline)
    for options in ({"num_workers": 2}, {"num_workers": 1, "backend": "dataloader"}, {"num_threads": 2}):
        images = torch.cat([x for x, _ in dlstore.loader(ds, 4, **options)])
        assert images.shape == (len(ds), 3, 16, 16) and images.dtype == torch.float32


def test_a_torchvision_op_with_a_pil_only_argument_gets_a_pil_image(store, folder):
    box = v1.RandomResizedCrop(16, interpolation=InterpolationMode.BOX)   # tensors have no box filter
    assert needs_pil(box) and not tensor_safe(box)
    pipeline = v1.Compose([v1.CenterCrop(CROP), box, v1.PILToTensor()])
    _equals_imagefolder_per_sample(dlstore.open_dataset(store, transform=pipeline), folder, pipeline)
    ds = dlstore.open_dataset(store, transform=box)   # written for tensors: still given a PIL image
    assert ds[0][0].shape == (3, 16, 16) and ds[0][0].dtype == torch.uint8


def test_a_pil_round_trip_written_by_the_user_is_kept(store):
    ra = _rand_augment()
    pipeline = v2.Compose([v2.ToPILImage(), ra, v2.PILToTensor(), v2.RandomHorizontalFlip(p=1.0),
                           v2.ToDtype(torch.float32, scale=True)])
    planned = plan(pipeline, [])
    assert isinstance(planned.ops[0], AsWritten)
    assert [type(op).__name__ for op in planned.ops[0].ops] == ["ToPILImage", "RandAugment", "PILToTensor"]
    ds = dlstore.open_dataset(store, transform=pipeline)
    for i in range(len(ds)):
        _seed(i)
        got = ds[i][0]
        _seed(i)
        assert torch.equal(got, pipeline(ds.read(i))), i
    images, _ = ds.get_batch([0, 1, 2])
    assert images.shape == (3, 3, *CROP) and images.dtype == torch.float32


def test_what_cannot_get_its_input_is_refused_at_open(store):
    ra = _rand_augment()
    with pytest.raises(TransformSpecError, match=r"RandAugment.*needs a PIL image.*after ToDtype"):
        dlstore.open_dataset(store, transform=v2.Compose([v2.ToDtype(torch.float32, scale=True), ra]))
    with pytest.raises(TransformSpecError, match=r"ends on a PIL image.*add v2.PILToTensor\(\)"):
        dlstore.open_dataset(store, transform=v2.Compose([v2.ToPILImage(), ra]))
    with pytest.raises(TransformSpecError, match="ConvertImageDtype"):   # v1 ToTensor after the conversion
        dlstore.open_dataset(store, transform=v1.Compose([v1.PILToTensor(), v1.ToTensor()]))


def test_static_ops_the_store_did_not_record_run_on_pil_as_imagefolder_did(store, folder):
    """A resize at read time: on the PIL image, not the tensor (1-3 levels apart on ~1% of pixels)."""
    pipeline = v1.Compose([v1.CenterCrop(CROP), v1.Resize(23), v1.CenterCrop(18), v1.PILToTensor()])
    ds = dlstore.open_dataset(store, transform=pipeline)
    assert [type(op) for op in ds.per_sample_ops + ds.batch_ops] == [PerSample]
    assert [type(op).__name__ for op in ds.batch_ops[0].op.ops] == ["Resize", "CenterCrop"]
    reference = datasets.ImageFolder(str(folder), transform=pipeline)
    assert all(torch.equal(ds[i][0], reference[i][0]) for i in range(len(ds)))
    on_tensor = v2.Compose([v2.Resize(23), v2.CenterCrop(18)])
    assert any(not torch.equal(on_tensor(ds.read(i)), reference[i][0]) for i in range(len(ds)))


def test_the_tensor_safe_rule():
    """docs/fidelity.md: random torchvision ops without PIL-only arguments, dlstore's ops; not timm's
    (but its bilinear crop), not Lambda, not static ops, not unknown callables."""
    safe = [v1.RandomCrop(8), v2.RandomCrop(8), v1.ColorJitter(0.2), v2.RandAugment(), v1.TrivialAugmentWide(),
            v1.RandomApply([v1.RandomHorizontalFlip()]), v1.RandomResizedCrop(8, interpolation=InterpolationMode.BICUBIC),
            v2.RandomResizedCrop(8, interpolation=InterpolationMode.LANCZOS)]
    unsafe = [v1.Lambda(lambda x: x), v1.Resize(8), v2.CenterCrop(8), lambda x: x,
              v1.RandomResizedCrop(8, interpolation=InterpolationMode.LANCZOS),
              v1.RandomApply([v1.Resize(8)]), v2.RandomResizedCrop(8, interpolation=InterpolationMode.HAMMING)]
    timm_transforms = pytest.importorskip("timm.data.transforms", reason="timm is not installed")
    safe.append(timm_transforms.RandomResizedCropAndInterpolation(8, interpolation="bilinear"))
    unsafe += [timm_transforms.RandomResizedCropAndInterpolation(8, interpolation="random"), _rand_augment(),
               timm_transforms.ResizeKeepRatio(8)]
    assert [op for op in safe if not tensor_safe(op)] == []
    assert [op for op in unsafe if tensor_safe(op)] == []
