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
