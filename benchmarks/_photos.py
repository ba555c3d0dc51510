"""Photo-like JPEGs for the recipe benchmarks: crops of scikit-learn's two real photos.

Each image is a random crop (30-100 % of the area, the target's aspect) of ``china.jpg`` or
``flower.jpg``, flipped half the time, with a colour gain per channel, resized bicubic to the
target size: real image statistics (edges, texture, JPEG behaviour) at ImageNet-like sizes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

import dlstore


def base_photos() -> list[np.ndarray] | None:
    """scikit-learn's sample photos (HWC uint8), or None without scikit-learn."""
    try:
        from sklearn.datasets import load_sample_images
    except ImportError:
        return None
    return list(load_sample_images().images)


def derived_photo(rng: np.random.Generator, base: np.ndarray, h: int, w: int) -> Image.Image:
    """A random crop of ``base`` with the aspect of ``h x w``, maybe flipped, colour-gained, resized to it."""
    bh, bw = base.shape[:2]
    area = rng.uniform(0.3, 1.0) * bh * bw
    ch = int(min(bh, math.sqrt(area * h / w)))
    cw = int(min(bw, ch * w / h))
    top, left = int(rng.integers(0, bh - ch + 1)), int(rng.integers(0, bw - cw + 1))
    crop = base[top:top + ch, left:left + cw]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    crop = np.clip(crop * rng.uniform(0.8, 1.2, 3), 0, 255).astype(np.uint8)
    return Image.fromarray(crop).resize((w, h), Image.BICUBIC)


def photo_store(tmp: str | Path, photos: str | None, make: Any, count: int, static: str
                ) -> tuple[Path, str, Path, Any]:
    """(the source folder, what it holds, the JPEG store converted from it, the conversion's result):
    ``photos`` (an ImageFolder tree) when given, else ``make(folder, count)``'s images in ``tmp``."""
    tmp_path = Path(tmp)
    if photos:
        src, kind = Path(photos), f"real photos from {photos}"
    else:
        src = tmp_path / "train"
        kind = make(src, count)
    store = tmp_path / "train.shards"
    converted = dlstore.convert(src, store, static=static, encoding="jpeg", quality=90, progress=False)
    return src, kind, store, converted
