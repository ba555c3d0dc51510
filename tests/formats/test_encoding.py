"""Encoded storage (--encoding jpeg|png): same pixels as PIL decoding those bytes, in every format."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import datasets
from torchvision.transforms import v2

import dlstore
from dlstore import verify
from dlstore.sources.demo import make_image_folder

STATIC = "resize=20,center_crop=16"
FORMATS = ["s.shards", "s.lmdb", "s.h5"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("enc") / "images", classes=2, per_class=5, size=(30, 26))


@pytest.fixture(scope="module")
def reference(folder):
    return datasets.ImageFolder(str(folder), transform=v2.Compose([v2.Resize(20), v2.CenterCrop(16),
                                                                    v2.PILToTensor()]))


def _store(folder, tmp_path, name, **kw):
    dlstore.convert(folder, tmp_path / name, static=kw.pop("static", STATIC), workers=0, progress=False, **kw)
    return dlstore.open_dataset(tmp_path / name)


@pytest.mark.parametrize("name", FORMATS)
def test_jpeg_pixels_equal_pil_decoding_of_the_same_jpeg(folder, reference, tmp_path, name):
    ds = _store(folder, tmp_path, name, encoding="jpeg", quality=80)
    assert ds.manifest["sample"]["encoding"] == "jpeg" and ds.manifest["sample"]["quality"] == 80
    assert ds.manifest["sample"]["decoded_shape"] == [3, 16, 16] and ds.shape == (3, 16, 16)
    for i in range(len(ds)):
        exact = reference[i][0].permute(1, 2, 0).numpy()
        buffer = io.BytesIO()
        Image.fromarray(exact).save(buffer, format="JPEG", quality=80)
        expected = torch.from_numpy(np.asarray(Image.open(buffer)).copy()).permute(2, 0, 1)
        image, label = ds[i]
        assert torch.equal(image, expected), f"sample {i}"
        assert label == reference[i][1]
    images, labels = ds.read_batch([3, 1])
    assert torch.equal(images[0], ds[3][0]) and labels.tolist() == [ds.targets[3], ds.targets[1]]


@pytest.mark.parametrize("name", FORMATS)
def test_png_is_lossless_and_jpeg_is_smaller(folder, reference, tmp_path, name):
    png = _store(folder, tmp_path, "png-" + name, encoding="png")
    assert all(torch.equal(png[i][0], reference[i][0]) for i in range(len(png)))
    big = make_image_folder(tmp_path / "big", classes=1, per_class=4, size=(120, 160))
    jpeg = _store(big, tmp_path, "jpeg-" + name, static="resize=96,center_crop=96", encoding="jpeg")
    payload = sum(jpeg.reader.raw.get(i).size for i in range(len(jpeg)))
    assert payload < len(jpeg) * 3 * 96 * 96 / 2  # the records, not the format's fixed overhead


def test_variable_shape_and_grayscale_encoded(folder, tmp_path):
    ds = _store(folder, tmp_path, "v.shards", static="grayscale,resize=13", encoding="png")
    reference = datasets.ImageFolder(str(folder), transform=v2.Compose([v2.Grayscale(), v2.Resize(13),
                                                                        v2.PILToTensor()]))
    assert ds.shape is None
    assert all(torch.equal(ds[i][0], reference[i][0]) for i in range(len(ds)))


@pytest.mark.parametrize("name", FORMATS)
def test_verify_deep_decodes_every_encoded_sample(folder, tmp_path, name):
    _store(folder, tmp_path, name, encoding="jpeg")
    report = verify(tmp_path / name, deep=True)
    assert report.ok, str(report)
    assert "decoded" in str(report)


def test_encoded_store_through_a_dataloader_with_workers(folder, tmp_path):
    ds = _store(folder, tmp_path, "s.lmdb", encoding="jpeg")
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    images = torch.cat([x for x, _ in loader])
    assert torch.equal(images, torch.stack([ds[i][0] for i in range(len(ds))]))


def test_bad_encoding_is_refused(folder, tmp_path):
    with pytest.raises(ValueError, match="encoding must be one of raw, jpeg, png"):
        dlstore.convert(folder, tmp_path / "x.shards", encoding="webp", progress=False)
