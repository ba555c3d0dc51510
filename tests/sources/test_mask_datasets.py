"""Datasets of (image, mask) pairs as segmentation sources: torchvision's own segmentation datasets on
files in their layout, tv_tensors pairs, Hugging Face-like dicts with a mask column."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import datasets, tv_tensors
from torchvision.transforms.v2 import functional as F

from dlstore.errors import DecodeError
from dlstore.sources import DatasetSource, MaskDatasetSource, open_source
from dlstore.sources.demo import synthetic_image


def _save_mask(path, values, mode="P"):
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(values, mode) if mode else Image.fromarray(values)
    if mode == "P":
        img.putpalette([(k * 53 + c * 17) % 256 for k in range(256) for c in range(3)])
    img.save(path)


@pytest.fixture
def voc_root(tmp_path):
    """Three pairs in Pascal VOC 2012's layout (JPEGImages, SegmentationClass palette PNGs, a split file)."""
    base = tmp_path / "VOCdevkit" / "VOC2012"
    names = ["2007_000032", "2007_000039", "2007_000063"]
    for k, name in enumerate(names):
        (base / "JPEGImages").mkdir(parents=True, exist_ok=True)
        size = (20 + 3 * k, 25 + k)
        Image.fromarray(synthetic_image(k, k, size)).save(base / "JPEGImages" / f"{name}.jpg", quality=90)
        values = (np.arange(size[0] * size[1]).reshape(size) // 7 + k) % 21
        values[0] = 255
        _save_mask(base / "SegmentationClass" / f"{name}.png", values.astype(np.uint8))
    (base / "ImageSets" / "Segmentation").mkdir(parents=True)
    (base / "ImageSets" / "Segmentation" / "train.txt").write_text("\n".join(names) + "\n")
    return tmp_path


def _reference(dataset, i):
    """torchvision's item as a user's pipeline starts from it: the PIL image as RGB, the mask's indices."""
    image, target = dataset[i]
    return np.asarray(image.convert("RGB")), F.pil_to_tensor(target).numpy()[0]


def test_voc_segmentation_items_are_its_images_and_class_indices(voc_root):
    voc = datasets.VOCSegmentation(str(voc_root), year="2012", image_set="train")
    source = open_source(voc)                      # typed as pairs: a PIL image as the target
    assert isinstance(source, MaskDatasetSource) and source.fields == ("image", "mask")
    assert source.mode == "RGB" and source.sample_shape is None and source.classes == []
    load = pickle.loads(pickle.dumps(source.loader()))
    for i in source.item_keys():
        image, mask = load(i)
        ref_image, ref_mask = _reference(voc, i)
        assert np.array_equal(np.asarray(image), ref_image)
        assert mask.dtype == np.uint8 and np.array_equal(mask, ref_mask) and 255 in mask
    part = source.part(1, 3)
    assert list(part.item_keys()) == [1, 2] and part.origin(2) == 2 and part.where(2) == "VOCSegmentation item 2"


@pytest.mark.parametrize("target_type, dtype", [("semantic", np.uint8), ("instance", np.uint16)])
def test_cityscapes_semantic_and_instance_masks(tmp_path, target_type, dtype):
    for k, city in enumerate(["aachen", "bochum"]):
        stem = f"{city}_000000_00001{k}"
        (tmp_path / "leftImg8bit" / "train" / city).mkdir(parents=True)
        Image.fromarray(synthetic_image(k, k, (16, 32))).save(
            tmp_path / "leftImg8bit" / "train" / city / f"{stem}_leftImg8bit.png")
        labels = (np.arange(16 * 32).reshape(16, 32) % 34).astype(np.uint8)
        _save_mask(tmp_path / "gtFine" / "train" / city / f"{stem}_gtFine_labelIds.png", labels, mode="L")
        instances = (labels.astype(np.uint16) * 1000 + k)                 # Cityscapes' id * 1000 + instance
        _save_mask(tmp_path / "gtFine" / "train" / city / f"{stem}_gtFine_instanceIds.png", instances, mode=None)
    cityscapes = datasets.Cityscapes(str(tmp_path), split="train", mode="fine", target_type=target_type)
    source = open_source(cityscapes)
    load = source.loader()
    for i in source.item_keys():
        image, mask = load(i)
        ref_image, ref_mask = _reference(cityscapes, i)
        assert mask.dtype == dtype and np.array_equal(mask, ref_mask) and np.array_equal(np.asarray(image), ref_image)


class TvPairs:
    """Items ``(tv_tensors.Image, tv_tensors.Mask)``, as a dataset with a v2 pipeline yields them."""

    def __init__(self, n=4, size=(9, 11)):
        self.items = [(tv_tensors.Image(torch.from_numpy(synthetic_image(k, k, size)).permute(2, 0, 1).contiguous()),
                       tv_tensors.Mask(torch.full(size, k * 100, dtype=torch.int64))) for k in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_tv_tensor_pairs_are_typed_pairs(tmp_path):
    data = TvPairs()
    source = open_source(data)
    assert isinstance(source, MaskDatasetSource)
    image, mask = source.loader()(3)
    assert torch.equal(image, data.items[3][0].as_subclass(torch.Tensor)) and mask.dtype == np.uint16
    assert np.array_equal(mask, data.items[3][1].numpy())
    assert isinstance(open_source([(torch.zeros(3, 4, 4, dtype=torch.uint8), 1)]), DatasetSource)   # a label


class HFSegmentation:
    """A Hugging Face-like dataset: dict rows, the mask in a column the user names."""

    def __init__(self):
        size = (8, 6)
        self.rows = [{"image": Image.fromarray(synthetic_image(k, k, size)),
                      "annotation": Image.fromarray(np.full(size, k, np.uint8), "L"), "scene": "x"}
                     for k in range(3)]
        self.rows[2]["annotation"] = Image.fromarray(np.zeros((5, 5), np.uint8), "L")

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def test_a_dict_dataset_with_a_mask_column_named_by_the_user():
    data = HFSegmentation()
    source = open_source(data, mask_key="annotation")
    image, mask = source.loader()(1)
    assert np.array_equal(mask, np.full((8, 6), 1, np.uint8)) and image.size == (6, 8)
    with pytest.raises(DecodeError, match=r"HFSegmentation item 2: image is 6x8 .* but its mask is 5x5"):
        source.loader()(2)
    with pytest.raises(DecodeError, match=r"has no key 'mask' \(keys: image, annotation, scene\)"):
        MaskDatasetSource(data)


def test_positions_of_longer_tuples_and_bad_items():
    rows = [("meta", torch.zeros(3, 4, 5, dtype=torch.uint8), np.ones((4, 5), np.int32))]
    source = open_source(rows, image_key=1, mask_key=2)
    image, mask = source.loader()(0)
    assert image.shape == (3, 4, 5) and mask.dtype == np.uint8 and mask.sum() == 20
    with pytest.raises(DecodeError, match="must be positions in it"):
        MaskDatasetSource(rows, mask_key="mask")
    with pytest.raises(DecodeError, match="yields a float32 mask"):
        MaskDatasetSource([(torch.zeros(3, 4, 5, dtype=torch.uint8), torch.zeros(4, 5))], mask_key=1)


def test_a_hugging_face_dataset_with_image_and_palette_mask_columns():
    """A real ``datasets.Dataset`` as ADE20K's scene_parse_150 is laid out: Image features, the mask a
    palette PNG in a column the user names; its indices come through, not its colours."""
    hf = pytest.importorskip("datasets", exc_type=ImportError)   # (numpy 1.x: pandas 3 refuses to import)
    images, masks = [], []
    for k in range(3):
        size = (9 + k, 14)
        images.append(Image.fromarray(synthetic_image(k, k, size)))
        values = ((np.arange(size[0] * size[1]).reshape(size) // 5 + k) % 150).astype(np.uint8)
        mask = Image.fromarray(values, "P")
        mask.putpalette([(i * 97 + c * 31) % 256 for i in range(256) for c in range(3)])
        masks.append(mask)
    data = hf.Dataset.from_dict({"image": images, "annotation": masks, "scene": ["x"] * 3},
                                features=hf.Features({"image": hf.Image(), "annotation": hf.Image(),
                                                      "scene": hf.Value("string")}))
    source = open_source(data, mask_key="annotation")
    assert isinstance(source, MaskDatasetSource) and len(source) == 3 and source.mode == "RGB"
    load = pickle.loads(pickle.dumps(source.loader()))
    for i in source.item_keys():
        image, mask = load(i)
        assert data[i]["annotation"].mode == "P"
        assert mask.dtype == np.uint8 and np.array_equal(mask, np.asarray(masks[i]))
        assert np.array_equal(np.asarray(image), np.asarray(data[i]["image"].convert("RGB")))
