"""Source adapters: datasets, arrays and list files present one interface to the conversion."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

from dlstore.errors import ArgumentError, ArgumentTypeError, DecodeError, SourceError
from dlstore.sources import ArraySource, DatasetSource, open_source, read_list, scan
from dlstore.sources.demo import synthetic_image
from dlstore.sources.items import to_image, to_label


def test_images_are_normalised_to_pil_or_chw_tensors():
    hwc = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    assert torch.equal(to_image(hwc, "x"), torch.from_numpy(hwc).permute(2, 0, 1))
    chw = torch.from_numpy(hwc).permute(2, 0, 1)
    assert torch.equal(to_image(chw, "x"), chw)
    assert to_image(hwc[..., 0], "x").shape == (1, 4, 5)
    assert to_image(Image.new("P", (3, 2)), "x").mode == "RGB"
    assert to_image(Image.new("L", (3, 2)), "x").mode == "L"
    with pytest.raises(DecodeError, match="item 4: yields a float32 image"):
        to_image(torch.zeros(3, 4, 4), "item 4")
    with pytest.raises(DecodeError, match="no axis of 1 or 3 channels"):
        to_image(torch.zeros(5, 4, 4, dtype=torch.uint8), "x")


def test_labels():
    assert to_label(np.int64(3), "x") == 3 and to_label(torch.tensor(2), "x") == 2 and to_label(None, "x") == -1
    with pytest.raises(DecodeError, match="expected an int class index"):
        to_label([0, 1], "x")


def test_array_layouts_and_checks():
    assert ArraySource(np.zeros((2, 3, 8, 9), np.uint8)).sample_shape == (3, 8, 9)
    assert ArraySource(np.zeros((2, 8, 9, 3), np.uint8)).sample_shape == (3, 8, 9)
    assert ArraySource(np.zeros((2, 8, 9), np.uint8)).sample_shape == (1, 8, 9)
    with pytest.raises(ArgumentError, match="uint8"):
        ArraySource(np.zeros((2, 8, 9, 3), np.float32))
    with pytest.raises(ArgumentError, match="labels must be 2 integers"):
        ArraySource(np.zeros((2, 8, 9, 3), np.uint8), [0, 1, 2])
    part = ArraySource(np.zeros((6, 4, 4, 3), np.uint8), np.arange(6)).part(2, 5)
    assert list(part.item_keys()) == [2, 3, 4] and list(part.item_keys(1)) == [3, 4] and part.origin(3) == 3


class HFLike:
    """The parts of a Hugging Face datasets.Dataset a source uses: dict items, features."""

    class _ClassLabel:
        names = ("neg", "pos")

    features: ClassVar[dict] = {"label": _ClassLabel(), "img": object()}

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return {"img": Image.fromarray(synthetic_image(0, i, (8, 8))), "label": i % 2}


def test_dict_items_and_classlabel_names():
    source = DatasetSource(HFLike(), image_key="img")
    assert source.classes == ["neg", "pos"]
    image, label = source.loader()(1)
    assert image.size == (8, 8) and label == 1
    with pytest.raises(DecodeError, match="has no key 'image'.*pass image_key="):
        DatasetSource(HFLike())


def test_open_source_dispatch(tmp_path, rgb_folder):
    assert open_source(rgb_folder).kind == "folder"
    assert open_source((np.zeros((1, 4, 4, 3), np.uint8), [0])).kind == "arrays"
    assert open_source([(Image.new("RGB", (4, 4)), 0)]).kind == "dataset"
    with pytest.raises(ArgumentTypeError, match="cannot convert a int"):
        open_source(3)
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(SourceError, match="not a folder nor a list file"):
        open_source(tmp_path / "notes.md")


def test_list_files(tmp_path, rgb_folder):
    listing = tmp_path / "l.csv"
    listing.write_text("class_01/img_0000.jpg,1\nclass_00/img_0003.jpg,0\n")
    source = read_list(listing, rgb_folder)
    assert source.classes == ["0", "1"] and next(iter(source.item_keys())) == (str(rgb_folder / "class_01/img_0000.jpg"), 1)
    assert source.origin(list(source.item_keys())[1]) == "class_00/img_0003.jpg"
    listing.write_text("a.jpg,cat\nb.jpg\n")
    with pytest.raises(SourceError, match="b.jpg has no label but others have"):
        read_list(listing, tmp_path)
    listing.write_text(f"{rgb_folder}/x.jpg,0\n")
    with pytest.raises(SourceError, match=r"l.csv:1: path .* leads outside the root"):
        read_list(listing, tmp_path)
    (tmp_path / "l.jsonl").write_text('{"path": "a.jpg"}\n{"path": "b.jpg"}\n')
    assert read_list(tmp_path / "l.jsonl").classes == []  # unlabelled


def test_folder_source_fingerprint_is_unchanged(rgb_folder):
    # a folder's resume fingerprint keys are what interrupted conversions of earlier versions recorded
    assert set(scan(rgb_folder).fingerprint()) == {"source_root", "source_files", "source_listing"}


def test_hugging_face_dataset_converts_with_its_classlabel_names(tmp_path):
    datasets = pytest.importorskip("datasets", exc_type=ImportError)   # (numpy 1.x: pandas 3 refuses to import)
    import dlstore

    images = [Image.fromarray(synthetic_image(k % 2, k, (10, 12))) for k in range(6)]
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["neg", "pos"])})
    hf = datasets.Dataset.from_dict({"img": images, "label": [k % 2 for k in range(6)]}, features=features)
    dlstore.convert(hf, tmp_path / "hf.shards", image_key="img", progress=False, workers=2)
    store = dlstore.open_dataset(tmp_path / "hf.shards")
    assert store.classes == ["neg", "pos"] and store.targets == [k % 2 for k in range(6)]
    assert list(store.samples) == [(k, k % 2) for k in range(6)]
    assert torch.equal(store[3][0], torch.from_numpy(np.asarray(hf[3]["img"]).copy()).permute(2, 0, 1))


def test_hugging_face_dataset_with_static_ops_and_vector_targets(tmp_path):
    """A multi-label HF dataset (Sequence feature) through a static resize + crop: torchvision's pixels, (N, K) targets."""
    datasets = pytest.importorskip("datasets", exc_type=ImportError)   # (numpy 1.x: pandas 3 refuses to import)
    import torchvision.transforms.v2 as v2

    import dlstore

    images = [Image.fromarray(synthetic_image(k % 3, k, (20 + k, 26))) for k in range(5)]
    vectors = [[float(k), k / 2, -1.5] for k in range(5)]
    features = datasets.Features({"image": datasets.Image(), "tags": datasets.Sequence(datasets.Value("float32"))})
    hf = datasets.Dataset.from_dict({"image": images, "tags": vectors}, features=features)
    dlstore.convert(hf, tmp_path / "hf.lmdb", label_key="tags", static="resize=12,center_crop=10", progress=False,
                    workers=0)
    store = dlstore.open_dataset(tmp_path / "hf.lmdb")
    np.testing.assert_array_equal(store.targets, np.asarray(vectors, dtype=np.float32))
    reference = v2.Compose([v2.Resize(12), v2.CenterCrop(10), v2.PILToTensor()])
    for k in range(5):
        assert torch.equal(store[k][0], reference(hf[k]["image"])), k
