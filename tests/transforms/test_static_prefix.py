"""A whole torchvision pipeline given at read time does not rerun the store's static ops.

Reference: torchvision's ``ImageFolder(folder, transform=pipeline)`` on the folder the store was
converted from (the same pipeline, run on PIL images), or torchvision applied to the stored sample
where the pipeline is meant to run as given.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms as v1
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torchvision import datasets
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

import dlstore
from dlstore.errors import StaticMismatchError
from dlstore.sources.demo import make_image_folder
from dlstore.transforms.hybrid import strip_static_prefix
from dlstore.transforms.planner import plan
from dlstore.transforms.static import apply_static, parse_static

FORMATS = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}
STATIC = "resize=40,center_crop=32"
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def det() -> v2.Compose:
    return v2.Compose([v2.Resize(40), v2.CenterCrop(32), v2.PILToTensor()])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """2 classes x 3 JPEGs of varied sizes, all larger than the static size (so Resize matters)."""
    return make_image_folder(tmp_path_factory.mktemp("prefix") / "images", classes=2, per_class=3,
                             size=(56, 72), vary_size=True)


@pytest.fixture(scope="module")
def stores(folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_stores")
    return {fmt: dlstore.convert(folder, root / f"s{suffix}", static=STATIC, workers=0, progress=False).path
            for fmt, suffix in FORMATS.items()}


def _reference(folder, pipeline) -> list[tuple[torch.Tensor, int]]:
    return list(datasets.ImageFolder(str(folder), transform=pipeline))


def _seeded(ds, i: int):
    torch.manual_seed(1000 + i)
    return ds[i]


@pytest.mark.parametrize("fmt", FORMATS)
def test_full_deterministic_pipeline_equals_imagefolder(stores, folder, fmt):
    given = det()
    ds = dlstore.open_dataset(stores[fmt], transform=given)
    reference = _reference(folder, det())
    assert len(ds) == len(reference)
    for i, (want, label) in enumerate(reference):
        image, got_label = ds[i]
        assert image.dtype == torch.uint8 and got_label == label
        assert torch.equal(image, want), f"{fmt} sample {i}"
    assert [type(t).__name__ for t in ds.already_applied] == ["Resize", "CenterCrop", "PILToTensor"]
    assert ds.transform is given and ds.per_sample_ops == [] and ds.batch_ops == []   # as given; nothing runs


@pytest.mark.parametrize("fmt", FORMATS)
def test_full_pipeline_with_random_ops_after_equals_imagefolder(stores, folder, fmt):
    pipeline = v2.Compose([v2.Resize(40), v2.CenterCrop(32), v2.PILToTensor(),
                           v2.RandomCrop(28, padding=2), v2.RandomHorizontalFlip()])
    ds = dlstore.open_dataset(stores[fmt], transform=pipeline)
    reference = datasets.ImageFolder(str(folder), transform=pipeline)
    for i in range(len(ds)):
        assert torch.equal(_seeded(ds, i)[0], _seeded(reference, i)[0]), f"{fmt} sample {i}"


def test_v1_pipeline_equals_imagefolder(stores, folder):
    uint8 = v1.Compose([v1.Resize(40), v1.CenterCrop(32), v1.PILToTensor(), v1.RandomHorizontalFlip(p=1.0)])
    ds = dlstore.open_dataset(stores["shards"], transform=uint8)
    for i, (want, _) in enumerate(_reference(folder, uint8)):
        assert torch.equal(ds[i][0], want)
    floats = v1.Compose([v1.Resize(40), v1.CenterCrop(32), v1.ToTensor(), v1.Normalize(MEAN, STD)])
    ds = dlstore.open_dataset(stores["lmdb"], transform=floats)
    for i, (want, _) in enumerate(_reference(folder, floats)):
        got = ds[i][0]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_store_spec_a_leading_part_of_the_pipeline_runs_the_remaining_static_ops(folder, tmp_path):
    """A store of resize=40 (variable shape) read with Resize(40), CenterCrop(32): only the crop runs."""
    store = dlstore.convert(folder, tmp_path / "r.h5", static="resize=40", workers=0, progress=False).path
    ds = dlstore.open_dataset(store, transform=det())
    for i, (want, _) in enumerate(_reference(folder, det())):
        assert torch.equal(ds[i][0], want)
    assert [type(t).__name__ for t in ds.already_applied] == ["Resize"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_different_static_prefix_is_refused_unless_asked_for(stores, fmt):
    """A validation pipeline of other sizes: run on the stored 32x32 crops it would resize them again."""
    pipeline = v2.Compose([v2.Resize(24), v2.CenterCrop(20), v2.PILToTensor()])
    with pytest.raises(StaticMismatchError) as err:
        dlstore.open_dataset(stores[fmt], transform=pipeline)
    text = str(err.value)
    assert "'resize=40,center_crop=32x32'" in text and "Resize(size=[24]" in text and "static_mismatch='allow'" in text
    assert "static='resize=24,center_crop=20x20'" in text
    ds = dlstore.open_dataset(stores[fmt])
    planned = plan(pipeline, ds.manifest["static"], where=ds.path, static_mismatch="allow")
    assert planned.already_applied == [] and planned.mismatch and "STATIC MISMATCH ALLOWED" in planned.describe()
    for i in range(len(ds)):   # as given: on the stored sample, as a PIL image (the pipeline's input)
        image = planned.sample_transform(ds.read(i))
        assert image.shape == (3, 20, 20)
        assert torch.equal(image, pipeline(F.to_pil_image(ds.read(i))))


def test_pipeline_with_only_part_of_the_static_ops_is_refused_and_can_opt_in(stores):
    pipeline = v2.Compose([v2.Resize(40), v2.RandomCrop(32), v2.PILToTensor()])
    path = stores["shards"]
    with pytest.raises(StaticMismatchError) as err:
        dlstore.open_dataset(path, transform=pipeline)
    text = str(err.value)
    assert str(path) in text and "'resize=40,center_crop=32x32'" in text and "RandomCrop" in text
    assert "split_transforms" in text and "HybridTransform" in text
    with pytest.raises(StaticMismatchError):
        dlstore.open_dataset(path, transform=v2.Resize(40))
    # the way the message gives to run it as given: every op on the stored sample
    ds = dlstore.open_dataset(path, transform=dlstore.HybridTransform(STATIC, pipeline))
    for i in range(len(ds)):
        torch.manual_seed(i)
        want = pipeline(ds.read(i))
        torch.manual_seed(i)
        assert torch.equal(ds[i][0], want)


def test_a_static_op_of_the_store_under_other_settings_is_refused(stores):
    """timm's eval Resize is bicubic: on a bilinear store it would resize the stored 32x32 crop again."""
    bicubic = v2.Compose([v2.Resize(40, interpolation=v2.InterpolationMode.BICUBIC), v2.CenterCrop(32)])
    with pytest.raises(StaticMismatchError) as err:
        dlstore.open_dataset(stores["hdf5"], transform=bicubic)
    assert "'interpolation': 'bicubic'" in str(err.value) and "'interpolation': 'bilinear'" in str(err.value)
    no_antialias = v2.Compose([v2.Resize(40, antialias=False), v2.CenterCrop(32)])
    with pytest.raises(StaticMismatchError):
        dlstore.open_dataset(stores["hdf5"], transform=no_antialias)


def test_repr_shows_what_was_taken_as_applied_and_what_runs(stores):
    pipeline = v2.Compose([v2.ToImage(), v2.Resize(40), v2.CenterCrop(32), v2.RandomHorizontalFlip(p=1.0)])
    ds = dlstore.open_dataset(stores["lmdb"], transform=pipeline)
    text = repr(ds)
    assert "static (in store): resize=40,center_crop=32x32" in text
    assert "not run again: ToImage, Resize, CenterCrop;" in text
    assert "runs: [RandomHorizontalFlip(p=1.0)]" in text
    assert any("Resize: not run again" in note for note in ds.hybrid.notes)
    assert torch.equal(ds[0][0], ds.read(0).flip(-1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_loader_and_get_batch_equal_imagefolder(stores, folder, fmt):
    flip = v2.Compose([v2.Resize(40), v2.CenterCrop(32), v2.PILToTensor(), v2.RandomHorizontalFlip(p=1.0)])
    ds = dlstore.open_dataset(stores[fmt], transform=flip)
    reference = _reference(folder, flip)
    want = torch.stack([image for image, _ in reference])
    labels = torch.tensor([label for _, label in reference])
    images, got = ds.get_batch(list(range(len(ds))))
    assert torch.equal(images, want) and torch.equal(got, labels)
    batches = list(dlstore.loader(ds, batch_size=4, shuffle=False))
    assert torch.equal(torch.cat([b for b, _ in batches]), want)
    assert torch.equal(torch.cat([lab for _, lab in batches]), labels)


def test_device_loader_equals_imagefolder(stores, folder):
    pipeline = v2.Compose([v2.Resize(40), v2.CenterCrop(32), v2.PILToTensor(), v2.RandomHorizontalFlip(p=1.0),
                           v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    ds = dlstore.open_dataset(stores["shards"], transform=pipeline)
    want = torch.stack([image for image, _ in _reference(folder, pipeline)])
    got = torch.cat([b for b, _ in dlstore.loader(ds, batch_size=4, shuffle=False, device="cpu")])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shard", [False, True])
def test_gpu_loader_equals_imagefolder_and_refuses_a_partial_prefix(stores, folder, shard):
    flip = v2.Compose([v2.Resize(40), v2.CenterCrop(32), v2.PILToTensor(), v2.RandomHorizontalFlip(p=1.0)])
    gpu = dlstore.GPUDataset(stores["shards"], device="cpu", dtype=torch.uint8, shard=shard,
                             rank=0, world_size=2 if shard else 1, transform=flip)
    loader = dlstore.loader(gpu, 64, seed=0)
    assert [type(t).__name__ for t in gpu.already_applied] == ["Resize", "CenterCrop", "PILToTensor"]
    reference = _reference(folder, flip)
    images, labels = next(iter(loader))                          # shuffle=False: the held samples in order
    held = gpu.store_indices.tolist()
    assert torch.equal(images, torch.stack([reference[i][0] for i in held]))
    assert labels.tolist() == [reference[i][1] for i in held]
    with pytest.raises(StaticMismatchError):
        gpu.transform = v2.Compose([v2.Resize(40), v2.RandomCrop(32)])
    with pytest.raises(StaticMismatchError):   # a hybrid is checked on a rank's share too
        gpu.transform = dlstore.HybridTransform("resize=64,center_crop=32", v2.RandomHorizontalFlip())


@settings(max_examples=12, deadline=None)
@given(st.integers(20, 48), st.integers(8, 20), st.integers(24, 60), st.integers(24, 60), st.booleans())
def test_stripped_plan_on_static_output_equals_the_pipeline(resize, crop, height, width, v1_ops):
    """The plan's dynamic part on the stored sample (the static ops' output) == the whole pipeline on the image."""
    tv = v1 if v1_ops else v2
    pipeline = tv.Compose([tv.Resize(resize), tv.CenterCrop(crop), tv.PILToTensor(), tv.RandomHorizontalFlip(p=1.0)])
    rng = np.random.default_rng(resize * 1000 + height * 7 + width)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    stored = parse_static(f"resize={resize},center_crop={crop}")
    hybrid, skipped = strip_static_prefix(pipeline, stored)
    assert [type(t).__name__ for t in skipped] == ["Resize", "CenterCrop", "PILToTensor"]
    assert torch.equal(hybrid.dynamic(torch.from_numpy(apply_static(image, stored))), pipeline(image))
