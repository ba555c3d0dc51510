"""Synthetic image folders: the built-in demo dataset, and fixtures for tests and benchmarks.

Pixels are a function of (class, index), so a mix-up of samples or labels shows
up as wrong pixels: class ``c`` has its own base colour and stripe direction,
index ``i`` shifts the stripes and seeds a little noise (so JPEG sizes are
realistic rather than degenerate).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image


def synthetic_image(cls: int, index: int, size: tuple[int, int] = (375, 500)) -> np.ndarray:
    """uint8 (H, W, 3) image determined by (cls, index)."""
    h, w = size
    rng = np.random.default_rng(cls * 100_003 + index)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.array([(cls * 67) % 256, (cls * 131 + 50) % 256, (cls * 29 + 100) % 256], np.float32)
    angle = (cls * 0.7) % np.pi
    period = 8 + (index % 7) * 3
    wave = np.sin((xx * np.cos(angle) + yy * np.sin(angle) + index * 5) * (2 * np.pi / period))
    img = base[None, None, :] * 0.6 + 60 * wave[..., None] + 40 * (xx / w)[..., None]
    img += rng.normal(0, 8, size=(h, w, 3)).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_image_folder(
    root: str | os.PathLike,
    *,
    classes: int = 5,
    per_class: int = 60,
    size: tuple[int, int] = (375, 500),
    ext: str = ".jpg",
    vary_size: bool = False,
    quality: int = 90,
) -> Path:
    """Write an ImageFolder-layout tree ``root/class_XX/img_XXXX{ext}``; return ``root``.

    With ``vary_size`` each image gets its own height and width (within +-25%).
    """
    root = Path(root)
    for c in range(classes):
        folder = root / f"class_{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            hw = size
            if vary_size:
                rng = np.random.default_rng(c * 7919 + i)
                hw = (int(size[0] * rng.uniform(0.75, 1.25)), int(size[1] * rng.uniform(0.75, 1.25)))
            img = Image.fromarray(synthetic_image(c, i, hw))
            path = folder / f"img_{i:04d}{ext}"
            if ext.lower() in (".jpg", ".jpeg"):
                img.save(path, quality=quality)
            else:
                img.save(path)
    return root


def make_segmentation_folder(
    root: str | os.PathLike,
    *,
    count: int = 60,
    classes: int = 4,
    size: tuple[int, int] = (240, 320),
    vary_size: bool = True,
    quality: int = 90,
) -> Path:
    """Write ``root/images/img_XXXX.jpg`` and their masks ``root/masks/img_XXXX.png``; return ``root``.

    Each image is a textured background (class 0) with ellipses and rectangles of classes
    ``1..classes-1`` drawn on it, each class with its own colour; each mask is a palette PNG of the
    class indices, with a 3-pixel ``255`` ("ignore") band along every shape's edge, as VOC marks
    its boundaries. With ``vary_size`` each pair gets its own height and width (within +-25%).
    """
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    palette = [0, 0, 0] + [v for c in range(1, 256) for v in ((c * 97) % 256, (c * 53 + 80) % 256, (c * 151) % 256)]
    for i in range(count):
        rng = np.random.default_rng(1_000_003 + i)
        h, w = size
        if vary_size:
            h, w = int(h * rng.uniform(0.75, 1.25)), int(w * rng.uniform(0.75, 1.25))
        image = synthetic_image(0, i, (h, w)).astype(np.float32) * 0.5
        mask = np.zeros((h, w), dtype=np.uint8)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        edge = np.zeros((h, w), dtype=bool)
        for _ in range(int(rng.integers(2, 6))):
            cls = int(rng.integers(1, classes))
            cy, cx = rng.uniform(0, h), rng.uniform(0, w)
            ry, rx = rng.uniform(0.08, 0.3) * h, rng.uniform(0.08, 0.3) * w
            if rng.random() < 0.5:   # an ellipse (distance 1 at its edge)
                dist = np.sqrt(((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2)
                inside, band = dist <= 1, np.abs(dist - 1) * min(ry, rx) <= 1.5
            else:                    # a rectangle
                dist = np.maximum(np.abs(yy - cy) - ry, np.abs(xx - cx) - rx)
                inside, band = dist <= 0, np.abs(dist) <= 1.5
            colour = np.array(palette[3 * cls:3 * cls + 3], np.float32)
            image[inside] = colour * 0.7 + image[inside] * 0.3
            mask[inside] = cls
            edge |= band
        mask[edge] = 255
        name = f"img_{i:04d}"
        Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(root / "images" / f"{name}.jpg", quality=quality)
        png = Image.fromarray(mask, "P")
        png.putpalette(palette)
        png.save(root / "masks" / f"{name}.png")
    return root
