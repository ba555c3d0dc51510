"""The training scripts' own transform objects, planned as the pipelines they hold, on every read path.

Reference: torchvision's ``ImageFolder(folder, transform=t)`` on the JPEGs the store was converted
from, with ``t`` exactly as the script builds it (torchvision's reference ``presets.py`` classes,
reproduced below; ``weights.transforms()``, i.e. ``ImageClassification``). Every way of spelling
the validation pipeline either equals it exactly (float32 bits) on ``ds[i]``, torch's DataLoader,
``get_batch``, ``dlstore.loader`` (threads, device stage) and the GPU loader, or is refused with
StaticMismatchError.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision.transforms as v1
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms._presets import ImageClassification

import dlstore
from dlstore.errors import ArgumentError, StaticMismatchError, TransformSpecError
from dlstore.sources.demo import make_image_folder
from dlstore.transforms import ResizeMax, parse_static, split_transforms
from dlstore.transforms.planner import plan

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class ClassificationPresetEval:
    """torchvision's references/classification/presets.py, as the script has it."""

    def __init__(self, *, crop_size, resize_size=256, mean=MEAN, std=STD,
                 interpolation=InterpolationMode.BILINEAR, backend="pil", use_v2=False):
        T = v2 if use_v2 else v1
        transforms = [T.PILToTensor()] if backend == "tensor" else []
        transforms += [T.Resize(resize_size, interpolation=interpolation, antialias=True), T.CenterCrop(crop_size)]
        if backend == "pil":
            transforms.append(T.PILToTensor())
        transforms += [T.ToDtype(torch.float, scale=True) if use_v2 else T.ConvertImageDtype(torch.float),
                       T.Normalize(mean=mean, std=std)]
        if use_v2:
            transforms.append(T.ToPureTensor())
        self.transforms = T.Compose(transforms)

    def __call__(self, img):
        return self.transforms(img)


class ClassificationPresetTrain:
    def __init__(self, *, crop_size, mean=MEAN, std=STD, hflip_prob=0.5, random_erase_prob=0.0, use_v2=False):
        T = v2 if use_v2 else v1
        transforms = [T.RandomResizedCrop(crop_size, antialias=True), T.RandomHorizontalFlip(hflip_prob),
                      T.PILToTensor(),
                      T.ToDtype(torch.float, scale=True) if use_v2 else T.ConvertImageDtype(torch.float),
                      T.Normalize(mean=mean, std=std)]
        if random_erase_prob > 0:
            transforms.append(T.RandomErasing(p=random_erase_prob))
        self.transforms = T.Compose(transforms)

    def __call__(self, img):
        return self.transforms(img)


def _ways(resize: int, crop: int) -> dict:
    """Every spelling of one validation pipeline a script hands over."""
    return {
        "v1 Compose": v1.Compose([v1.Resize(resize), v1.CenterCrop(crop), v1.PILToTensor(),
                                  v1.ConvertImageDtype(torch.float), v1.Normalize(MEAN, STD)]),
        "v1 ToTensor": v1.Compose([v1.Resize(resize), v1.CenterCrop(crop), v1.ToTensor(), v1.Normalize(MEAN, STD)]),
        "v2 Compose": v2.Compose([v2.Resize(resize), v2.CenterCrop(crop), v2.PILToTensor(),
                                  v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD), v2.ToPureTensor()]),
        "preset v1": ClassificationPresetEval(crop_size=crop, resize_size=resize),
        "preset v2": ClassificationPresetEval(crop_size=crop, resize_size=resize, use_v2=True),
        "weights.transforms()": ImageClassification(crop_size=crop, resize_size=resize),
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """2 classes x 3 JPEGs of their own sizes (45..75 x 60..100)."""
    return make_image_folder(tmp_path_factory.mktemp("presets") / "images", classes=2, per_class=3,
                             size=(60, 80), vary_size=True)


@pytest.fixture(scope="module")
def stores(folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("preset_stores")
    made = {}
    for name, static in {"val": "resize=64,center_crop=56", "none": None, "max": "resize_max=70"}.items():
        made[name] = dlstore.convert(folder, root / f"{name}.shards", static=static, workers=0, progress=False).path
    return made


def _every_path(ds) -> dict[str, torch.Tensor]:
    n = len(ds)
    paths = {"ds[i]": torch.stack([ds[i][0] for i in range(n)]),
             "DataLoader": torch.cat([x for x, _ in DataLoader(ds, batch_size=4)]),
             "get_batch": ds.get_batch(list(range(n)))[0],
             "loader threads": torch.cat([x for x, _ in dlstore.loader(ds, 4, shuffle=False, backend="threads", num_threads=2)])}
    return paths


def _device_stage(ds) -> torch.Tensor:
    return torch.cat([x for x, _ in dlstore.loader(ds, 4, shuffle=False, device="cpu")])


@pytest.mark.parametrize("way", list(_ways(64, 56)))
@pytest.mark.parametrize("store", ["val", "none"])
def test_every_way_equals_imagefolder_on_every_path(stores, folder, store, way):
    t = _ways(64, 56)[way]
    want = torch.stack([x for x, _ in datasets.ImageFolder(str(folder), transform=t)])
    ds = dlstore.open_dataset(stores[store], transform=t)
    for path, got in _every_path(ds).items():
        assert got.dtype == torch.float32 and torch.equal(got, want), f"{way} on {store}: {path}"
    if store == "val":
        assert ds.per_sample_ops == [] and [type(b).__name__ for b in ds.batch_ops] == ["BatchNormalize"]
        gpu = dlstore.GPUDataset(stores[store], device="cpu", dtype=torch.uint8, transform=t)
        images, _ = next(iter(dlstore.loader(gpu, len(ds))))
        assert torch.equal(images, want), f"{way}: GPU loader"


@pytest.mark.parametrize("way", list(_ways(72, 56)))
@pytest.mark.parametrize("store", ["val", "max"])
def test_other_static_sizes_are_refused_or_asked_for(stores, folder, store, way):
    """--val-resize-size 72 on a store converted with 64 (or a resize_max store): never silently resized again."""
    t = _ways(72, 56)[way]
    with pytest.raises(StaticMismatchError) as err:
        dlstore.open_dataset(stores[store], transform=t)
    text = str(err.value)
    assert "resize=72" in text and "static_mismatch='allow'" in text and "static='resize=72,center_crop=56x56'" in text
    if store == "val":
        with pytest.raises(StaticMismatchError):
            dlstore.GPUDataset(stores[store], device="cpu", dtype=torch.uint8, transform=t)
    stored = dlstore.open_dataset(stores[store]).manifest["static"]
    allowed = plan(t, stored, where=stores[store], static_mismatch="allow")
    assert allowed.mismatch and "STATIC MISMATCH ALLOWED" in allowed.describe()
    assert len(allowed.ops) == 3 and type(allowed.ops[0]).__name__ == "OnPIL"   # the resize and crop run again


@pytest.mark.parametrize("way", ["v2 Compose", "preset v2", "v1 Compose", "weights.transforms()"])
def test_the_device_stage_equals_imagefolder(stores, folder, way):
    t = _ways(64, 56)[way]
    want = torch.stack([x for x, _ in datasets.ImageFolder(str(folder), transform=t)])
    assert torch.equal(_device_stage(dlstore.open_dataset(stores["val"], transform=t)), want)


def test_split_transforms_of_a_preset_gives_its_static_part_and_a_store_that_equals_it(folder, tmp_path):
    for t in (ClassificationPresetEval(crop_size=56, resize_size=64, use_v2=True),
              ImageClassification(crop_size=56, resize_size=64)):
        h = split_transforms(t)
        assert h.static_spec == parse_static("resize=64,center_crop=56")
        assert [type(op).__name__ for op in h.dynamic_ops][-1] == "Normalize"
    preset = ClassificationPresetEval(crop_size=56, resize_size=64)
    store = dlstore.convert(folder, tmp_path / "v.shards", static=split_transforms(preset), workers=0,
                            progress=False).path
    ds = dlstore.open_dataset(store, transform=preset)
    assert ds.shape == (3, 56, 56)
    want = torch.stack([x for x, _ in datasets.ImageFolder(str(folder), transform=preset)])
    assert torch.equal(ds.get_batch(list(range(len(ds))))[0], want)
    with pytest.raises(TransformSpecError, match="split_transforms"):   # the whole pipeline is no static spec
        parse_static(preset)


def test_a_train_preset_on_a_resize_max_store(stores):
    """The recipe: train store resize_max; the preset object works on every path, PILToTensor dropped."""
    for use_v2 in (False, True):
        preset = ClassificationPresetTrain(crop_size=24, random_erase_prob=0.5, use_v2=use_v2)
        ds = dlstore.open_dataset(stores["max"], transform=preset)
        assert [type(op).__name__ for op in ds.per_sample_ops] == ["RandomResizedCrop"]   # fixes the size
        assert [type(b).__name__ for b in ds.batch_ops] == ["BatchRandomHorizontalFlip", "BatchNormalize", "PerSample"]
        for got in _every_path(ds).values():
            assert got.shape == (len(ds), 3, 24, 24) and got.dtype == torch.float32
        with pytest.raises(StaticMismatchError, match=r"split_transforms\(pipeline, resize_max=70\)"):
            dlstore.open_dataset(stores["max"], transform=split_transforms(preset))
        hybrid = split_transforms(preset, resize_max=70)
        assert hybrid.static_spec == parse_static("resize_max=70")
        assert dlstore.open_dataset(stores["max"], transform=hybrid).batch_ops
        by_hand = dlstore.HybridTransform("resize_max=70", preset.transforms)   # its PILToTensor is dropped too
        assert "PILToTensor" not in [type(op).__name__ for op in by_hand.dynamic_ops]
        assert dlstore.open_dataset(stores["max"], transform=by_hand)[0][0].shape == (3, 24, 24)
        with pytest.raises(TransformSpecError, match="resize_max is for a pipeline"):
            split_transforms(ClassificationPresetEval(crop_size=56), resize_max=70)


def test_resize_max_is_public_and_planned_as_the_stores_static_op(stores, folder):
    assert dlstore.ResizeMax is ResizeMax and "ResizeMax" in dlstore.__all__
    pipeline = v2.Compose([ResizeMax(70), v2.PILToTensor(), v2.RandomHorizontalFlip(p=1.0)])
    planned = plan(pipeline, parse_static("resize_max=70"))
    assert [type(t).__name__ for t in planned.already_applied] == ["ResizeMax", "PILToTensor"]
    assert split_transforms(pipeline).static_spec == parse_static("resize_max=70")
    ds = dlstore.open_dataset(stores["max"], transform=pipeline)
    want = [x for x, _ in datasets.ImageFolder(str(folder), transform=pipeline)]
    assert all(torch.equal(ds[i][0], want[i]) for i in range(len(ds)))


def test_weights_transforms_is_planned_as_its_ops():
    planned = plan(ImageClassification(crop_size=224, resize_size=232, interpolation=InterpolationMode.BICUBIC))
    assert [type(t).__name__ for t in planned.ops] == ["OnPIL", "ConvertImageDtype", "Normalize"]
    resize, crop = planned.ops[0].ops
    assert resize.size == [232] and resize.interpolation == InterpolationMode.BICUBIC and crop.size == (224, 224)
    assert "weights.transforms()" in planned.describe()


def test_an_opaque_object_on_a_static_store_warns_with_the_fix(stores):
    class Hidden:      # a preset that keeps its pipeline under another name
        def __init__(self):
            self.pipeline = ClassificationPresetEval(crop_size=56, resize_size=64).transforms

        def __call__(self, img):
            return self.pipeline(img)

    with pytest.warns(UserWarning, match=r"cannot see inside Hidden.*transform=obj.transforms"):
        dlstore.open_dataset(stores["val"], transform=Hidden())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dlstore.open_dataset(stores["val"], transform=lambda x: x)   # a function: written for tensors
        dlstore.open_dataset(stores["none"], transform=Hidden())     # nothing recorded to repeat


def test_static_mismatch_takes_only_its_values():
    with pytest.raises(ArgumentError, match="'error', 'allow'"):
        plan(v2.RandomHorizontalFlip(), [], static_mismatch="ignore")


def test_describe_shows_every_stage(stores):
    planned = plan(ClassificationPresetTrain(crop_size=24, random_erase_prob=0.5), parse_static("resize_max=70"))
    text = planned.describe(fixed_shape=False)
    assert "static, recorded in the store (not run): resize_max=70" in text
    assert "not run: PILToTensor()" in text
    assert "per sample: [RandomResizedCrop(" in text
    assert "per batch: [BatchRandomHorizontalFlip(p=0.5), BatchNormalize(" in text and "divide=True" in text
    assert "device stage, with loader(device=...): [ConvertImageDtype(), Normalize(" in text
    assert "ClassificationPresetTrain: planned as the pipeline it holds in .transforms" in text
    assert repr(planned) == planned.describe()
