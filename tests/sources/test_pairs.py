"""Segmentation sources of files: an images folder paired with a masks folder, a list of pairs."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
from PIL import Image
from torchvision import datasets

from dlstore.errors import ArgumentError, DecodeError, SourceError
from dlstore.sources import PairSource, load_mask, open_source, pil_loader, read_list, read_pair_list, scan, \
    scan_pairs
from dlstore.sources.demo import synthetic_image


def _image(path, index=0, size=(12, 10), ext=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(synthetic_image(index % 3, index, size))
    img.save(path, quality=90) if path.suffix == ".jpg" else img.save(path)


def _mask(path, index=0, size=(12, 10)):
    """A palette mask whose indices are a function of ``index`` (so a mix-up shows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    values = (np.arange(size[0] * size[1]).reshape(size) + index * 7) % 21
    mask = Image.fromarray(values.astype(np.uint8), "P")
    # a palette of its own, as VOC's masks have (Pillow 10.3 writes a BMP without one that it cannot read)
    mask.putpalette([c for k in range(256) for c in (k, 7 * k % 256, 13 * k % 256)])
    mask.save(path)


def _pair(root, rel, index, size=(12, 10), image_ext=".jpg", mask_ext=".png"):
    _image(root / "images" / f"{rel}{image_ext}", index, size)
    _mask(root / "masks" / f"{rel}{mask_ext}", index, size)


@pytest.fixture
def nested(tmp_path):
    """ADE20K-like: images/{training,validation}/..., masks alike, plus a top-level pair and subfolders."""
    for k, rel in enumerate(["validation/b", "training/z", "training/a", "training/sub/c", "training/Sub2/d",
                             "top", "training-extra/e"]):
        _pair(tmp_path, rel, k, size=(10 + k, 12 + 2 * k), image_ext=".png" if k == 3 else ".jpg",
              mask_ext=".bmp" if k == 4 else ".png")
    return tmp_path


def _rel(source, root):
    return [(os.path.relpath(i, root / "images"), os.path.relpath(m, root / "masks")) for i, m in source.item_keys()]


def test_nested_folder_order_is_imagefolders_with_top_level_images_first(nested):
    source = scan_pairs(nested / "images", nested / "masks")
    assert isinstance(source, PairSource) and source.fields == ("image", "mask")
    # the folders' images in ImageFolder's order (its classes here are splits: the labels are not used)
    reference = datasets.ImageFolder(str(nested / "images")).samples
    keys = _rel(source, nested)
    assert keys[0] == ("top.jpg", "top.png")
    assert [os.path.join(nested / "images", i) for i, _ in keys[1:]] == [p for p, _ in reference]
    assert [os.path.splitext(i)[0] for i, _ in keys] == [os.path.splitext(m)[0] for _, m in keys]
    assert ("training/Sub2/d.jpg", "training/Sub2/d.bmp") in keys and ("training/sub/c.png", "training/sub/c.png") in keys
    assert source.classes == [] and source.skipped == [] and len(source) == 7


def test_a_flat_folder_is_in_the_order_of_a_flat_scan(tmp_path):
    for k, name in enumerate(["2007_000129", "2007_000033", "2008_000002", "10", "9"]):
        _pair(tmp_path, name, k)
    _image(tmp_path / "images" / ".hidden.jpg")                # hidden names are neither images nor masks
    _mask(tmp_path / "masks" / "._x.png")
    source = scan_pairs(tmp_path / "images", tmp_path / "masks")
    assert [i for i, _ in source.item_keys()] == [p for p, _ in scan(tmp_path / "images").samples]


def test_unpaired_files_are_listed_both_ways(nested):
    _image(nested / "images" / "training" / "lonely.jpg")
    _mask(nested / "masks" / "validation" / "orphan.png")
    with pytest.raises(SourceError) as info:
        scan_pairs(nested / "images", nested / "masks")
    text = str(info.value)
    assert "1 image(s) and 1 mask(s) without a pair" in text
    assert "training/lonely.jpg: no mask: expected training/lonely.<ext>" in text
    assert "validation/orphan.png: a mask without an image" in text
    assert "on_error=\"skip\"" in text


def test_skip_leaves_unpaired_and_ambiguous_files_out_with_their_reasons(nested):
    _image(nested / "images" / "training" / "lonely.jpg")
    _mask(nested / "masks" / "validation" / "orphan.png")
    _image(nested / "images" / "training" / "a.png")             # a second image of the stem training/a
    _mask(nested / "masks" / "top.bmp")                         # a second mask of the stem top
    source = scan_pairs(nested / "images", nested / "masks", on_error="skip")
    keys = _rel(source, nested)
    assert len(keys) == 5 and not any(i.startswith(("top.", "training/a.")) for i, _ in keys)
    reasons = {(s["path"], s.get("field", "image")): s["reason"] for s in source.skipped}
    assert reasons.keys() == {("training/lonely.jpg", "image"), ("validation/orphan.png", "mask"),
                              ("training/a.jpg", "image"), ("training/a.png", "image"), ("training/a.png", "mask"),
                              ("top.jpg", "image"), ("top.png", "mask"), ("top.bmp", "mask")}
    assert reasons[("training/a.jpg", "image")].startswith("2 images share the stem 'training/a'")
    assert reasons[("top.jpg", "image")].startswith("2 masks share its stem")
    assert reasons[("validation/orphan.png", "mask")].startswith("a mask without an image")
    with pytest.raises(SourceError, match="2 image"):
        scan_pairs(nested / "images", nested / "masks")


def test_folders_inside_each_other_and_bad_arguments_are_refused(nested, tmp_path):
    with pytest.raises(SourceError, match="one folder"):
        scan_pairs(nested / "images", nested / "images")
    with pytest.raises(SourceError, match="lies inside"):
        scan_pairs(nested / "images", nested / "images" / "training")
    with pytest.raises(SourceError, match="lies inside"):
        scan_pairs(nested / "images" / "training", nested / "images")
    with pytest.raises(SourceError, match="not a folder"):
        scan_pairs(nested / "images", tmp_path / "missing")
    with pytest.raises(ArgumentError, match="on_error"):
        scan_pairs(nested / "images", nested / "masks", on_error="ignore")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no images"):
        scan_pairs(tmp_path / "empty", nested / "masks")
    only = tmp_path / "only"
    _image(only / "x.jpg")
    with pytest.raises(SourceError, match="none of its 1 images has a mask"):
        scan_pairs(only, nested / "masks", on_error="skip")


def test_items_are_the_decoded_image_and_its_mask(nested):
    source = scan_pairs(nested / "images", nested / "masks", mode="L")
    load = pickle.loads(pickle.dumps(source.loader({"exif_transpose": False, "max_pixels": None})))
    for image_path, mask_path in source.item_keys():
        image, mask = load((image_path, mask_path))
        assert image.mode == "L" and image.tobytes() == pil_loader(image_path, mode="L").tobytes()
        assert np.array_equal(mask, load_mask(mask_path)) and mask.shape == (image.size[1], image.size[0])
    part = source.part(2, 5)
    assert list(part.item_keys()) == list(source.item_keys())[2:5] == list(source.item_keys(2))[:3]
    assert source.origin(next(source.item_keys())) == "top.jpg"
    assert source.mask_origin(next(source.item_keys())) == "top.png"


def test_a_mask_of_another_size_is_a_decode_error_naming_both_files(nested):
    _mask(nested / "masks" / "top.png", size=(9, 9))
    source = scan_pairs(nested / "images", nested / "masks")
    with pytest.raises(DecodeError) as info:
        source.loader()(next(source.item_keys()))
    assert str(nested / "images" / "top.jpg") in str(info.value) and str(nested / "masks" / "top.png") in str(info.value)


def test_the_fingerprint_follows_the_masks(nested):
    before = scan_pairs(nested / "images", nested / "masks").fingerprint()
    os.rename(nested / "masks" / "top.png", nested / "masks" / "top.bmp")
    after = scan_pairs(nested / "images", nested / "masks").fingerprint()
    assert before["source_listing"] != after["source_listing"] and before["source_files"] == after["source_files"]


def test_open_source_pairs_a_folder_with_masks(nested):
    source = open_source(nested / "images", masks=nested / "masks")
    assert isinstance(source, PairSource) and len(source) == 7
    with pytest.raises(ArgumentError, match="no classes to order"):
        open_source(nested / "images", masks=nested / "masks", class_order="natural")


# --- lists of pairs ---------------------------------------------------------------------------------

def test_a_csv_list_of_pairs_with_a_header_is_read_as_pairs(nested):
    rows = ["image,mask", "images/training/z.jpg,masks/training/z.png", "images/top.jpg,masks/top.png"]
    (nested / "lists").mkdir()
    (nested / "lists" / "pairs.csv").write_text("\n".join(rows) + "\n")
    source = read_list(nested / "lists" / "pairs.csv", nested)      # paths relative to the root given
    assert isinstance(source, PairSource) and source.kind == "pair list" and source.mode == "RGB"
    load = source.loader()
    image, mask = load(next(source.item_keys()))
    assert np.array_equal(mask, load_mask(nested / "masks" / "training" / "z.png"))
    (nested / "plain.csv").write_text("images/top.jpg,masks/top.png\n")     # no header: read_pair_list says pairs
    assert len(read_pair_list(nested / "plain.csv")) == 1
    assert read_pair_list(nested / "plain.csv").origin(next(read_pair_list(nested / "plain.csv").item_keys())) == \
        "images/top.jpg"


def test_json_lines_of_pairs(nested):
    rows = [{"image": "images/top.jpg", "mask": "masks/top.png"}, {"path": "images/training/a.jpg",
                                                                   "mask": "masks/training/a.png"}]
    (nested / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    source = open_source(nested / "pairs.jsonl")
    assert isinstance(source, PairSource) and [os.path.relpath(m, nested) for _, m in source.item_keys()] == \
        ["masks/top.png", "masks/training/a.png"]
    (nested / "bad.jsonl").write_text(json.dumps({"image": "images/top.jpg"}) + "\n")
    with pytest.raises(SourceError, match=r"bad\.jsonl:1: expected an object"):
        read_pair_list(nested / "bad.jsonl")


@pytest.mark.parametrize("row, message", [
    ("images/top.jpg,../outside.png", r"pairs\.csv:2: path '\.\./outside\.png' leads outside the root"),
    ("/etc/passwd,masks/top.png", r"pairs\.csv:2: path '/etc/passwd' leads outside the root"),
    ("images/top.jpg,masks/top.png,3", r"pairs\.csv:2: 3 column\(s\), expected two"),
])
def test_list_paths_follow_the_list_rules(nested, row, message):
    (nested / "pairs.csv").write_text(f"image,mask\n{row}\n")
    with pytest.raises(SourceError, match=message):
        read_list(nested / "pairs.csv")


def test_a_label_list_is_still_a_label_list(nested):
    (nested / "labels.csv").write_text("path,label\nimages/top.jpg,cat\nimages/training/z.jpg,dog\n")
    source = read_list(nested / "labels.csv")
    assert not isinstance(source, PairSource) and source.classes == ["cat", "dog"]


def test_the_mask_is_decoded_with_its_images_orientation_and_pixel_guard(tmp_path):
    """A phone photo stored sideways (EXIF orientation 6) with a mask drawn on the upright picture:
    exif_transpose turns both; max_pixels guards the mask file too."""
    raw = Image.fromarray(synthetic_image(0, 0, (10, 16)))                  # stored 16 wide, 10 high
    exif = raw.getexif()
    exif[0x0112] = 6                                                         # rotate 90 degrees to display
    (tmp_path / "images").mkdir()
    raw.save(tmp_path / "images" / "x.jpg", exif=exif, quality=95)
    upright = (np.arange(16 * 10).reshape(16, 10) % 7).astype(np.uint8)     # the displayed image: 10 wide, 16 high
    mask_raw = Image.fromarray(np.rot90(upright, 1).copy(), "L")            # stored as the image is, same EXIF
    (tmp_path / "masks").mkdir()
    mask_raw.save(tmp_path / "masks" / "x.png", exif=exif)
    source = scan_pairs(tmp_path / "images", tmp_path / "masks")
    key = next(source.item_keys())
    image, mask = source.loader({"exif_transpose": True})(key)
    assert image.size == (10, 16) and np.array_equal(mask, upright)
    image, mask = source.loader({"exif_transpose": False})(key)
    assert image.size == (16, 10) and mask.shape == (10, 16)
    Image.fromarray(np.zeros((10, 160), np.uint8), "L").save(tmp_path / "masks" / "x.png")   # 1600 px, image 160
    with pytest.raises(DecodeError, match=r"x\.png: mask is 160x10 = 1,600 pixels, over the limit of 500"):
        source.loader({"exif_transpose": False, "max_pixels": 500})(key)


def test_open_source_refuses_a_mask_argument_for_the_wrong_kind_of_source(nested):
    from dlstore.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match="masks= pairs a folder of images with a folder of masks; got a list"):
        open_source([(Image.new("RGB", (2, 2)), Image.new("L", (2, 2)))], masks=nested / "masks")
    with pytest.raises(ArgumentTypeError, match="mask_key= names the mask of a dataset's items; got a PosixPath"):
        open_source(nested / "images", mask_key="mask")
    skipped = open_source(nested / "images", masks=nested / "masks", on_error="skip")
    assert skipped.describe() == {"kind": "folder pairs", "root": str(nested / "images"),
                                  "masks_root": str(nested / "masks"), "fields": ["image", "mask"], "mode": "RGB",
                                  "mode_given": False, "empty_classes": []}
