"""Decoding segmentation masks: class indices as torchvision reads them, never colour-converted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from dlstore.errors import DecodeError
from dlstore.sources import check_pair, load_mask, pil_loader, to_mask


def _palette_mask(path, values: np.ndarray) -> None:
    """A palette PNG whose colours are not its indices (VOC's layout: index k drawn in colour palette[k])."""
    img = Image.fromarray(values, "P")
    img.putpalette([(k * 37 + c * 91) % 256 for k in range(256) for c in range(3)])
    img.save(path)


def _tv_indices(path) -> np.ndarray:
    """What torchvision reads from the file: ``F.pil_to_tensor(Image.open(path))`` (the reference)."""
    with Image.open(path) as img:
        return F.pil_to_tensor(img).numpy()[0]


def test_a_palette_mask_keeps_its_indices_not_its_colours(tmp_path):
    values = np.random.default_rng(0).integers(0, 21, (13, 17)).astype(np.uint8)
    values[0, 0] = 255                                         # VOC's "ignore" border value
    _palette_mask(tmp_path / "m.png", values)
    mask = load_mask(tmp_path / "m.png")
    assert mask.dtype == np.uint8 and mask.shape == (13, 17)
    assert np.array_equal(mask, values) and np.array_equal(mask, _tv_indices(tmp_path / "m.png"))
    # what an image loader would make of it: colours, not classes
    assert not np.array_equal(np.asarray(pil_loader(tmp_path / "m.png", mode="L")), values)


def test_gray_and_sixteen_bit_masks_keep_their_values_uint16_only_above_255(tmp_path):
    gray = np.arange(12 * 9, dtype=np.uint8).reshape(12, 9)
    Image.fromarray(gray, "L").save(tmp_path / "l.png")
    wide = (np.arange(12 * 9, dtype=np.uint16) * 600).reshape(12, 9)     # up to 64,200 classes
    Image.fromarray(wide).save(tmp_path / "wide.png")
    narrow = np.arange(12 * 9, dtype=np.uint16).reshape(12, 9)            # a 16-bit file of small values
    Image.fromarray(narrow).save(tmp_path / "narrow.png")
    assert Image.open(tmp_path / "wide.png").mode.startswith("I;16")
    assert load_mask(tmp_path / "l.png").dtype == np.uint8
    assert np.array_equal(load_mask(tmp_path / "l.png"), _tv_indices(tmp_path / "l.png"))
    got = load_mask(tmp_path / "wide.png")
    assert got.dtype == np.uint16 and np.array_equal(got, wide) and np.array_equal(got, _tv_indices(tmp_path / "wide.png"))
    got = load_mask(tmp_path / "narrow.png")
    assert got.dtype == np.uint8 and np.array_equal(got, narrow)


def test_a_bilevel_mask_is_zero_and_one(tmp_path):
    values = np.zeros((6, 8), dtype=bool)
    values[2:4, 3:7] = True
    Image.fromarray(values).save(tmp_path / "b.png")
    assert Image.open(tmp_path / "b.png").mode == "1"
    got = load_mask(tmp_path / "b.png")
    assert got.dtype == np.uint8 and np.array_equal(got, values.astype(np.uint8))


def test_colour_masks_and_bad_files_are_decode_errors_naming_the_file(tmp_path):
    Image.new("RGB", (4, 4), (128, 0, 0)).save(tmp_path / "colour.png")
    with pytest.raises(DecodeError, match=r"colour\.png: a RGB image is not a mask of class indices"):
        load_mask(tmp_path / "colour.png")
    Image.fromarray(np.full((3, 3), -5, np.int32), "I").save(tmp_path / "negative.tif")   # 32-bit signed
    with pytest.raises(DecodeError, match=r"negative\.tif: mask values -5\.\.-5"):
        load_mask(tmp_path / "negative.tif")
    good = tmp_path / "good.png"
    _palette_mask(good, np.zeros((64, 64), np.uint8) + np.arange(64, dtype=np.uint8))
    (tmp_path / "cut.png").write_bytes(good.read_bytes()[:200])
    with pytest.raises(DecodeError, match=r"cut\.png: cannot decode mask"):
        load_mask(tmp_path / "cut.png")
    with pytest.raises(DecodeError, match="over the limit"):
        load_mask(good, max_pixels=100)


def test_in_memory_masks_become_class_index_arrays():
    values = torch.arange(35).reshape(7, 5) % 30   # 0..29, each value present
    assert np.array_equal(to_mask(tv_tensors.Mask(values), "x"), values.numpy())           # int64 Mask
    assert to_mask(tv_tensors.Mask(values), "x").dtype == np.uint8
    assert to_mask(tv_tensors.Mask(values[None]), "x").shape == (7, 5)                      # (1, H, W)
    assert to_mask(values.numpy()[..., None], "x").shape == (7, 5)                           # (H, W, 1)
    assert to_mask(values.numpy() + 1000, "x").dtype == np.uint16
    assert np.array_equal(to_mask(Image.fromarray(values.numpy().astype(np.uint8), "P"), "x"), values.numpy())
    assert np.array_equal(to_mask(values > 15, "x"), (values > 15).numpy().astype(np.uint8))
    with pytest.raises(DecodeError, match="item 3: yields a float32 mask"):
        to_mask(values.float(), "item 3")
    with pytest.raises(DecodeError, match=r"values -1\.\.29.*map an ignore value such as -1 to 255"):
        to_mask(torch.where(values == 0, -1, values), "x")
    with pytest.raises(DecodeError, match="instance masks"):
        to_mask(torch.zeros(3, 7, 5, dtype=torch.uint8), "x")
    with pytest.raises(DecodeError, match="yields a str mask"):
        to_mask("m.png", "x")


def test_a_mask_of_another_size_than_its_image_names_both():
    image = Image.new("RGB", (10, 6))
    check_pair(image, np.zeros((6, 10), np.uint8), "a.jpg", "a.png")
    check_pair(torch.zeros(3, 6, 10, dtype=torch.uint8), np.zeros((6, 10), np.uint8), "item 0")
    with pytest.raises(DecodeError, match=r"a\.jpg: image is 10x6 .* but its mask a\.png is 6x10"):
        check_pair(image, np.zeros((10, 6), np.uint8), "a.jpg", "a.png")
