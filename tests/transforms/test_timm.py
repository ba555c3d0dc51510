"""timm's transform idioms planned on the fast path (skipped without timm, the examples extra).

Reference: timm's own ops (``create_transform``'s pipelines run by ``ImageFolder`` on the JPEGs,
its RandomErasing run sample by sample), with the global generators seeded alike.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torchvision import datasets
from torchvision.transforms import v2

import dlstore
from dlstore.sources.demo import make_image_folder
from dlstore.transforms import parse_static, split_transforms
from dlstore.transforms.planner import PerSample, WholeBatch, plan

timm_data = pytest.importorskip("timm.data", reason="timm is not installed (pip install -e '.[examples]')")
from timm.data.random_erasing import RandomErasing  # noqa: E402
from timm.data.transforms import MaybeToTensor, ToNumpy, ToTensor  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("timm") / "images", classes=2, per_class=3, size=(40, 52),
                             vary_size=True)


def _names(ops) -> list[str]:
    return [type(op).__name__ for op in ops]


def test_training_transform_runs_per_batch_with_reprob_after_normalize():
    t = timm_data.create_transform(32, is_training=True, re_prob=0.25, re_mode="pixel")
    planned = plan(t, parse_static("resize_max=64"))
    head, tail = planned.split(fixed_shape=False)
    assert _names(head) == ["RandomResizedCropAndInterpolation"]      # fixes the size of a resize_max store
    assert _names(tail) == ["BatchRandomHorizontalFlip", "PerSample", "BatchNormalize", "WholeBatch"]
    assert tail[2].divide and tail[2].mean == pytest.approx([0.485, 0.456, 0.406])   # not dragged per sample
    steps = planned.split(fixed_shape=True)[1]
    assert _names(steps)[0] == "BatchRandomResizedCrop" and steps[0].kernel == "v1"
    random_interpolation = timm_data.create_transform(32, is_training=True, interpolation="random")
    head, _ = plan(random_interpolation, []).split(fixed_shape=False)
    assert _names(head) == ["OnPIL"]       # 'random' interpolation: timm's own op on a PIL image


def test_timm_random_erasing_on_a_batch_is_its_per_sample_draws_in_order():
    erasing = RandomErasing(probability=0.8, mode="pixel", max_count=2, device="cpu")
    step = plan([v2.ToDtype(torch.float32, scale=True), erasing]).split(fixed_shape=True)[1][1]
    assert isinstance(step, WholeBatch)
    images = torch.rand(6, 3, 20, 24)
    got = step.apply(images.clone(), {"seed": torch.tensor(1234)})
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    want = torch.stack([erasing(x.clone()) for x in images])
    assert torch.equal(got, want) and not torch.equal(got, images)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(step(images.clone(), g1), step(images.clone(), g2))      # from the loader's generator
    split = RandomErasing(probability=1.0, num_splits=2, device="cpu")    # skips a clean first half on a batch
    assert isinstance(plan([v2.ToDtype(torch.float32), split]).split(fixed_shape=True)[1][1], PerSample)


def test_conversions_are_handled_like_torchvisions():
    x = torch.randint(0, 256, (3, 8, 9), dtype=torch.uint8)
    scaled = plan([MaybeToTensor()]).sample_transform(x)
    assert torch.equal(scaled, x.float() / 255)                       # what it does to a PIL image
    assert torch.equal(plan([ToTensor()]).sample_transform(x), x.float())   # timm's ToTensor does not scale
    assert plan([ToNumpy()]).ops == [] and plan([v2.PILToTensor(), ToNumpy()]).ops == []
    after = plan([v2.PILToTensor(), MaybeToTensor()])                 # a tensor passes through it, unscaled
    assert after.ops == [] and "passes a tensor through" in after.describe()
    prefetcher = timm_data.create_transform(32, is_training=False, use_prefetcher=True)
    assert _names(plan(prefetcher, parse_static("resize=36,center_crop=32")).ops) == []


@pytest.mark.parametrize("crop_pct,interpolation", [(0.875, "bilinear"), (0.95, "bicubic")])
def test_eval_transform_is_a_static_spec_and_its_store_equals_timm(folder, tmp_path, crop_pct, interpolation):
    t = timm_data.create_transform(32, is_training=False, crop_pct=crop_pct, interpolation=interpolation)
    hybrid = split_transforms(t)
    size = int(32 / crop_pct)
    assert hybrid.static_spec == parse_static(f"resize={size}:{interpolation},center_crop=32")
    assert _names(hybrid.dynamic_ops) == ["ConvertImageDtype", "Normalize"]
    store = dlstore.convert(folder, tmp_path / "val.shards", static=hybrid, workers=0, progress=False).path
    want = torch.stack([x for x, _ in datasets.ImageFolder(str(folder), transform=t)])
    for transform in (t, hybrid):
        ds = dlstore.open_dataset(store, transform=transform)
        assert torch.equal(torch.stack([ds[i][0] for i in range(len(ds))]), want)
        assert torch.equal(ds.get_batch(list(range(len(ds))))[0], want)
        assert torch.equal(torch.cat([x for x, _ in dlstore.loader(ds, 4, shuffle=False)]), want)
