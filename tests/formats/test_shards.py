"""Conversion to tensor shards and reading back: pixels, labels, layout, errors, DataLoader."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2

import dlstore
from dlstore.errors import DecodeError, StoreCorruptError, StoreExistsError
from dlstore.sources.demo import make_image_folder, synthetic_image
from dlstore.transforms import parse_static

STATIC = "resize=20,center_crop=16"
REFERENCE = v2.Compose([v2.Resize(20), v2.CenterCrop(16), v2.PILToTensor()])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """3 classes x 7 images of mixed formats and modes: JPEG, PNG, grayscale, RGBA, palette."""
    root = tmp_path_factory.mktemp("src") / "images"
    make_image_folder(root, classes=3, per_class=5, size=(24, 30))
    extra = root / "class_01"
    Image.fromarray(synthetic_image(1, 90, (26, 22))).convert("L").save(extra / "gray.png")
    Image.fromarray(synthetic_image(1, 91, (26, 22))).convert("RGBA").save(extra / "rgba.png")
    Image.fromarray(synthetic_image(2, 92, (26, 22))).convert("P").save(root / "class_02" / "pal.png")
    Image.fromarray(synthetic_image(2, 93, (26, 22))).save(root / "class_02" / "z.bmp")
    return root


def _convert(src, dst, **kw):
    kw.setdefault("static", STATIC)
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    return dlstore.convert(src, dst, **kw)


def test_round_trip_is_bit_identical_to_imagefolder(folder, tmp_path):
    result = _convert(folder, tmp_path / "s.shards", shard_size=16 * 16 * 3 * 4)  # 4 samples per shard
    ds = dlstore.open_dataset(tmp_path / "s.shards")
    reference = datasets.ImageFolder(str(folder), transform=REFERENCE)
    assert result.count == len(ds) == len(reference) == 19
    assert ds.classes == reference.classes and ds.class_to_idx == reference.class_to_idx
    assert ds.targets == reference.targets
    assert ds.shape == (3, 16, 16)
    for i in range(len(ds)):
        image, label = ds[i]
        ref_image, ref_label = reference[i]
        assert image.dtype == torch.uint8
        assert torch.equal(image, ref_image), f"sample {i} differs"
        assert label == ref_label
    shards = sorted(p.name for p in (tmp_path / "s.shards").glob("shard-*.npy"))
    assert len(shards) == 5  # 4+4+4+4+3: the last shard is shorter and still a valid .npy
    assert np.load(tmp_path / "s.shards" / shards[-1], mmap_mode="r").shape == (3, 3, 16, 16)


def test_manifest_describes_the_store(folder, tmp_path):
    _convert(folder, tmp_path / "s.shards")
    m = json.loads((tmp_path / "s.shards" / "manifest.json").read_text())
    assert m["format"] == "shards" and m["format_version"] == 1 and m["count"] == 19
    assert m["sample"] == {"dtype": "uint8", "layout": "CHW", "encoding": "raw", "shape": [3, 16, 16]}
    assert m["classes"] == ["class_00", "class_01", "class_02"]
    assert m["static"] == parse_static(STATIC)
    assert m["source"]["files"] == 19 and m["source"]["skipped"] == []
    files = m["checksums"]["files"]
    assert set(files) == {"shard-00000.npy", "labels.npy"}
    import hashlib
    for name, digest in files.items():
        assert hashlib.sha256((tmp_path / "s.shards" / name).read_bytes()).hexdigest() == digest


def test_output_is_identical_whatever_the_worker_count(folder, tmp_path):
    _convert(folder, tmp_path / "w1.shards", workers=1, shard_size=3000)
    _convert(folder, tmp_path / "w2.shards", workers=2, shard_size=3000)
    names = sorted(os.listdir(tmp_path / "w1.shards"))
    assert names == sorted(os.listdir(tmp_path / "w2.shards"))
    for name in names:
        assert (tmp_path / "w1.shards" / name).read_bytes() == (tmp_path / "w2.shards" / name).read_bytes(), name


def test_variable_shape_store(folder, tmp_path):
    _convert(folder, tmp_path / "v.shards", static="resize=11", shard_size=2000)
    ds = dlstore.open_dataset(tmp_path / "v.shards")
    reference = datasets.ImageFolder(str(folder), transform=v2.Compose([v2.Resize(11), v2.PILToTensor()]))
    assert ds.shape is None
    shapes = set()
    for i in range(len(ds)):
        assert torch.equal(ds[i][0], reference[i][0])
        shapes.add(tuple(ds[i][0].shape))
    assert len(shapes) > 1
    assert len(list((tmp_path / "v.shards").glob("data-*.bin"))) > 1
    index = np.load(tmp_path / "v.shards" / "index.npy")
    assert index.shape == (len(ds), 5)


def test_no_static_spec_keeps_original_pixels(folder, tmp_path):
    _convert(folder, tmp_path / "raw.shards", static=None)
    ds = dlstore.open_dataset(tmp_path / "raw.shards")
    reference = datasets.ImageFolder(str(folder), transform=v2.PILToTensor())
    assert all(torch.equal(ds[i][0], reference[i][0]) for i in range(len(ds)))


def test_getitems_returns_requested_order(folder, tmp_path):
    _convert(folder, tmp_path / "s.shards", shard_size=3000)
    ds = dlstore.open_dataset(tmp_path / "s.shards")
    order = [18, 0, 7, 7, 3, -1]
    batch = ds.__getitems__(order)
    for (image, label), i in zip(batch, order):
        assert torch.equal(image, ds[i][0]) and label == ds[i][1]
    images, labels = ds.read_batch(order)
    assert images.shape == (6, 3, 16, 16)
    assert all(torch.equal(images[j], ds[i][0]) for j, i in enumerate(order))
    assert labels.tolist() == [ds.targets[i] for i in order]
    with pytest.raises(IndexError):
        ds[19]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_with_workers(folder, tmp_path, context):
    _convert(folder, tmp_path / "s.shards", shard_size=3000)
    ds = dlstore.open_dataset(tmp_path / "s.shards", transform=v2.RandomHorizontalFlip(p=0.0))
    ds[0]  # open handles in the parent first: workers must not inherit them
    loader = DataLoader(ds, batch_size=4, shuffle=False, num_workers=2, multiprocessing_context=context)
    images = torch.cat([x for x, _ in loader])
    labels = torch.cat([y for _, y in loader])
    expected = torch.stack([ds[i][0] for i in range(len(ds))])
    assert torch.equal(images, expected)
    assert labels.tolist() == ds.targets


def test_existing_destination_needs_overwrite(folder, tmp_path):
    dst = tmp_path / "s.shards"
    _convert(folder, dst)
    before = (dst / "manifest.json").read_text()
    with pytest.raises(StoreExistsError, match="overwrite"):
        _convert(folder, dst, static="resize=10,center_crop=8")
    assert (dst / "manifest.json").read_text() == before
    _convert(folder, dst, static="resize=10,center_crop=8", overwrite=True)
    assert dlstore.open_dataset(dst).shape == (3, 8, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.shards"]  # no staging or lock left


def test_corrupt_file_fails_and_writes_nothing(folder, tmp_path):
    src = tmp_path / "src"
    make_image_folder(src, classes=2, per_class=3, size=(20, 20))
    (src / "class_01" / "img_0001.jpg").write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    dst = tmp_path / "bad.shards"
    with pytest.raises(DecodeError) as info:
        _convert(src, dst, workers=2)
    assert "class_01/img_0001.jpg" in str(info.value) and "--on-error skip" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_corrupt_file_skipped_and_recorded(tmp_path):
    src = tmp_path / "src"
    make_image_folder(src, classes=2, per_class=3, size=(20, 20))
    (src / "class_01" / "img_0001.jpg").write_bytes(b"")
    result = _convert(src, tmp_path / "s.shards", on_error="skip")
    assert result.count == 5
    assert [s["path"] for s in result.skipped] == ["class_01/img_0001.jpg"]
    assert "class_01/img_0001.jpg" in str(result)
    ds = dlstore.open_dataset(tmp_path / "s.shards")
    assert ds.manifest["source"]["skipped"][0]["path"] == "class_01/img_0001.jpg"
    assert ds.targets == [0, 0, 0, 1, 1]


def test_unlabelled_flat_folder(tmp_path):
    src = tmp_path / "flat"
    src.mkdir()
    for i in range(4):
        Image.fromarray(synthetic_image(0, i, (20, 20))).save(src / f"{i}.png")
    _convert(src, tmp_path / "u.shards")
    ds = dlstore.open_dataset(tmp_path / "u.shards")
    assert ds.classes == [] and ds.targets == [-1] * 4
    assert ds[2][1] == -1


def test_damaged_manifest_is_a_clear_error(folder, tmp_path):
    dst = tmp_path / "s.shards"
    _convert(folder, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["count"] = 25
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreCorruptError, match="declares 25"):
        dlstore.open_dataset(dst)
    m["count"] = 19
    m["layout"]["shards"][0]["file"] = "../../etc/passwd"
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreCorruptError, match="unsafe"):
        dlstore.open_dataset(dst)
    (dst / "manifest.json").write_text("{not json")
    with pytest.raises(StoreCorruptError, match="not valid JSON"):
        dlstore.open_dataset(dst)


def test_files_of_unequal_counts_are_indexed_by_their_starts(folder, tmp_path):
    """A store assembled from several writers (e.g. one per rank) has short files mid-store."""
    dst = tmp_path / "s.shards"
    _convert(folder, dst, shard_size=16 * 16 * 3 * 4)  # files of 4,4,4,4,3 samples
    expected = [dlstore.open_dataset(dst)[i][0].clone() for i in range(19)]
    # split shard-00001 into two files of 2 samples: files of 4, 2, 2, 4, 4, 3
    m = json.loads((dst / "manifest.json").read_text())
    first = np.load(dst / "shard-00001.npy")
    np.save(dst / "shard-00001.npy", first[:2])
    np.save(dst / "shard-00001b.npy", first[2:])
    m["layout"]["shards"][1:2] = [{"file": "shard-00001.npy", "count": 2}, {"file": "shard-00001b.npy", "count": 2}]
    (dst / "manifest.json").write_text(json.dumps(m))
    ds = dlstore.open_dataset(dst)
    assert all(torch.equal(ds[i][0], expected[i]) for i in range(19))
    order = [18, 5, 6, 4, 0, 7]
    images, _ = ds.read_batch(order)
    assert all(torch.equal(images[j], expected[i]) for j, i in enumerate(order))


def test_compression_is_refused_for_shards(folder, tmp_path):
    with pytest.raises(ValueError, match="compression applies to hdf5"):
        _convert(folder, tmp_path / "s.shards", compression="gzip")
    assert not list(tmp_path.iterdir())
