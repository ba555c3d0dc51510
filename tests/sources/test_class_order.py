"""Class order of a folder scan: torchvision's ImageFolder by default, timm's natural order on request.

The references are the libraries themselves: ``torchvision.datasets.ImageFolder`` and timm's
``natural_key`` / ``find_images_and_targets`` (skipped where timm does not import).
"""

from __future__ import annotations

import os
import random

import pytest
from PIL import Image
from torchvision import datasets

from dlstore.errors import ArgumentError, SourceError
from dlstore.sources import CLASS_ORDERS, open_source, scan
from dlstore.sources.class_order import natural_key, order_classes

# Each pair of these differs between the two orders (case, numbers of several digits, letters).
NAMES = ["c1", "c2", "c10", "C3", "b"]
# timm's key on its own corner cases: leading zeros, no digits, only digits, several numbers,
# non-ASCII decimal digits (Arabic-Indic, fullwidth: \d matches them and int() reads them), dots.
KEY_CASES = ["c1", "C10", "c010", "b", "", "123", "a1b22c333", "x_9.5", "Ä2", "class٣", "n１２", "İ7", "007",
             "a-1", "A 2", "z99999999999999999999"]


def _timm_misc():
    return pytest.importorskip("timm.utils.misc")


def _timm_folder_reader():
    return pytest.importorskip("timm.data.readers.reader_image_folder")


def _folder(root, names, per_class=2):
    """A folder of small real PNGs (timm's reader sees .png, .jpg and .jpeg only), pixels per (class, image)."""
    for c, name in enumerate(names):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (6, 5), (c * 20 % 256, i * 40, 7)).save(root / name / f"{i}.png")
    return root


def test_natural_key_is_timms(tmp_path):
    timm_misc = _timm_misc()
    for name in KEY_CASES + NAMES:
        assert natural_key(name) == timm_misc.natural_key(name), name


def test_a_name_timms_key_cannot_order_fails_in_timm_too():
    timm_misc = _timm_misc()
    for name in ("²", "a1²"):   # str.isdigit() says yes, int() says no
        with pytest.raises(ValueError):
            timm_misc.natural_key(name)
        with pytest.raises(ValueError):
            natural_key(name)


def test_a_name_without_a_natural_key_is_refused_naming_it(tmp_path):
    with pytest.raises(SourceError, match=r"'a1²'.*--class-order imagefolder"):
        scan(_folder(tmp_path / "f", ["b", "a1²"]), class_order="natural")
    assert scan(tmp_path / "f").classes == ["a1²", "b"]   # ImageFolder's order has no such limit


def test_natural_order_equals_sorting_by_timms_key_on_random_names():
    timm_misc = _timm_misc()
    rng = random.Random(44)
    alphabet = "aAbBzZ_-. 0123456789"
    checked = 0
    for _ in range(400):
        names = {"".join(rng.choices(alphabet, k=rng.randint(1, 7))) for _ in range(rng.randint(2, 12))}
        keys = [timm_misc.natural_key(n) for n in names]
        if len({repr(k) for k in keys}) < len(keys):
            continue   # ties: timm's order is its set's hash order (refused; tested below)
        assert order_classes(sorted(names), "natural") == sorted(names, key=timm_misc.natural_key)
        assert order_classes(list(names), "imagefolder") == sorted(names)
        checked += 1
    assert checked > 200


def test_default_order_is_imagefolders_on_a_real_folder(tmp_path):
    root = _folder(tmp_path / "f", NAMES)
    source = scan(root)
    reference = datasets.ImageFolder(str(root))
    assert source.classes == reference.classes == ["C3", "b", "c1", "c10", "c2"]
    assert source.class_to_idx == reference.class_to_idx
    assert list(source.samples) == reference.samples
    assert source.class_order == "imagefolder"


def test_natural_order_is_timms_on_a_real_folder(tmp_path):
    reader = _timm_folder_reader()
    root = _folder(tmp_path / "f", NAMES + ["class_007", "x9y10", "x9y9"])
    source = scan(root, class_order="natural")
    pairs, timm_class_to_idx = reader.find_images_and_targets(str(root))
    assert source.class_to_idx == timm_class_to_idx
    assert source.classes[:5] == ["b", "c1", "c2", "C3", "c10"]
    # every file gets timm's label (timm orders the samples by natural path, dlstore class by class)
    assert dict(source.samples) == dict(pairs)
    # the samples follow their labels, each class walked as ImageFolder walks it
    assert [y for _, y in source.samples] == sorted(y for _, y in source.samples)
    folder_order = datasets.ImageFolder(str(root)).samples
    for name in NAMES:
        assert [p for p, _ in source.samples if os.path.basename(os.path.dirname(p)) == name] == \
            [p for p, _ in folder_order if os.path.basename(os.path.dirname(p)) == name]
    assert source.class_order == "natural"


@pytest.mark.parametrize("pair", [("C3", "c3"), ("c1", "c01")])
def test_names_equal_in_natural_order_are_refused_where_timms_order_is_its_hash_order(tmp_path, pair):
    root = _folder(tmp_path / "f", ["b", *pair])
    first, second = sorted(pair)
    with pytest.raises(SourceError, match=rf"{first!r} and {second!r}.*PYTHONHASHSEED.*--class-order imagefolder"):
        scan(root, class_order="natural")
    assert scan(root).classes == sorted(["b", *pair])


def test_an_unknown_order_is_refused_listing_the_orders(tmp_path):
    root = _folder(tmp_path / "f", ["a"])
    with pytest.raises(ArgumentError, match="'imagefolder', 'natural'.*got 'timm'"):
        scan(root, class_order="timm")
    assert CLASS_ORDERS == ("imagefolder", "natural")


def test_natural_order_is_refused_for_a_source_that_is_not_a_folder(tmp_path):
    root = _folder(tmp_path / "f", ["b", "a"])
    listing = tmp_path / "list.csv"
    listing.write_text("f/b/0.png,b\nf/a/0.png,a\n")
    with pytest.raises(ArgumentError, match="list file keeps its own order"):
        open_source(listing, class_order="natural")
    assert open_source(listing, class_order="imagefolder").classes == ["a", "b"]
    with pytest.raises(ArgumentError, match="give class_order= to scan"):
        open_source(scan(root), class_order="natural")
    assert open_source(scan(root, class_order="natural"), class_order="natural").class_order == "natural"
    assert open_source(root, class_order="natural").class_order == "natural"


def test_a_flat_folder_has_no_class_order(tmp_path):
    Image.new("RGB", (4, 4)).save(tmp_path / "1.png")
    assert scan(tmp_path, class_order="natural").class_order is None


def test_the_order_is_part_of_the_resume_fingerprint_only_when_not_the_default(tmp_path):
    root = _folder(tmp_path / "f", ["a", "b"])   # both orders agree here: same files, same labels
    default, natural = scan(root).fingerprint(), scan(root, class_order="natural").fingerprint()
    assert "class_order" not in default   # checkpoints written before the option still match
    assert natural == {**default, "class_order": "natural"}
