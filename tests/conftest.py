"""Fixtures shared by test modules: small synthetic image folders, and a store of them.

Pixels are a function of (class, index) (``dlstore.demo.synthetic_image``), so a
mix-up of samples or labels shows as wrong pixels. The folders and stores are
session-scoped and shared: tests must not modify them (copy one first).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

import dlstore
from dlstore.sources.demo import make_image_folder, synthetic_image


@pytest.fixture(scope="session")
def rgb_folder(tmp_path_factory) -> Path:
    """3 classes x 8 RGB JPEGs of 32x40 (height x width): 24 samples."""
    return make_image_folder(tmp_path_factory.mktemp("rgb") / "images", classes=3, per_class=8, size=(32, 40))


@pytest.fixture(scope="session")
def varsize_folder(tmp_path_factory) -> Path:
    """2 classes x 5 JPEGs, each with its own height and width (24..40 x 30..50)."""
    return make_image_folder(tmp_path_factory.mktemp("varsize") / "images", classes=2, per_class=5,
                             size=(32, 40), vary_size=True)


@pytest.fixture(scope="session")
def mixed_folder(tmp_path_factory) -> Path:
    """2 classes, 10 files in every mode ImageFolder meets: JPEG, PNG RGB/RGBA/palette/grayscale, BMP."""
    root = make_image_folder(tmp_path_factory.mktemp("mixed") / "images", classes=2, per_class=3, size=(26, 22))
    Image.fromarray(synthetic_image(0, 90, (30, 24))).convert("RGBA").save(root / "class_00" / "rgba.png")
    Image.fromarray(synthetic_image(0, 91, (22, 28))).convert("P").save(root / "class_00" / "palette.png")
    Image.fromarray(synthetic_image(1, 92, (24, 24))).convert("L").save(root / "class_01" / "gray.png")
    Image.fromarray(synthetic_image(1, 93, (25, 27))).save(root / "class_01" / "plain.bmp")
    return root


@pytest.fixture(scope="session")
def jpeg_store(tmp_path_factory) -> Path:
    """A shards store of 2 classes x 7 JPEG records (quality 90), each of its own size (45..75 x 60..100)."""
    root = tmp_path_factory.mktemp("jpeg")
    src = make_image_folder(root / "src", classes=2, per_class=7, size=(60, 80), vary_size=True)
    dlstore.convert(src, root / "s.shards", encoding="jpeg", quality=90, workers=0, progress=False)
    return root / "s.shards"
