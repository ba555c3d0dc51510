"""A segmentation set with real structure, for benchmarks/segmentation.py and seg_parity.py.

Each image is a photo-like background (``_photos.derived_photo``: a crop of scikit-learn's two
real photos) with 1 to ``max_shapes`` shapes drawn on it; each shape is one of four classes,
and each class has its own colour and texture, so a small net can learn it from a few pixels,
and its own outline family::

    index  class     outline                    colour (RGB)      texture
    0      background (the photo)
    1      disc      filled ellipse             (205, 45, 40)     fine noise
    2      wedge     triangle or quadrilateral  (190, 60, 200)    horizontal stripes, period 4
    3      box       axis-aligned rectangle     (50, 75, 210)     4x4 checker
    4      bar       thin long rectangle        (225, 200, 45)    vertical stripes, period 3
    255    ignore    a band of ``border`` px on each side of every boundary between two labels

Shapes may overlap (a later one is drawn over an earlier one, in pixels and in labels), and
each shape's colour gets a gain in [0.8, 1.2] so the cue is consistent, not constant. The
ignore band follows VOC, whose masks outline every object with 255: a pixel is ignore when a
pixel within ``border`` (Chebyshev distance) carries another label.

Written as ``images/<split>/NNNNN.jpg`` (RGB JPEG, quality 90) and ``masks/<split>/NNNNN.png``
(palette "P" PNG holding the class indices, VOC's colour map), so ``scan_pairs(images/train,
masks/train)`` pairs them. The same seed writes the same files. ``PairFolder`` reads a split back
the way a torchvision user's segmentation Dataset does (the benchmarks' baseline).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset
from torchvision import tv_tensors

from _photos import base_photos, derived_photo

CLASSES = ("background", "disc", "wedge", "box", "bar")
IGNORE = 255
COLOURS = {1: (205, 45, 40), 2: (190, 60, 200), 3: (50, 75, 210), 4: (225, 200, 45)}
JPEG_QUALITY = 90


@dataclasses.dataclass(frozen=True)
class Sample:
    """One written pair: what its mask holds (the class indices present, the ignore pixels)."""

    split: str
    name: str
    classes: tuple[int, ...]   # the indices present in the mask, 255 excluded, sorted
    ignore: int                # pixels labelled 255


@dataclasses.dataclass(frozen=True)
class SegSet:
    """A written segmentation set: ``images/<split>`` and ``masks/<split>`` under ``root``."""

    root: Path
    size: tuple[int, int]      # (H, W) of every image and mask
    samples: tuple[Sample, ...]

    def images(self, split: str) -> Path:
        return self.root / "images" / split

    def masks(self, split: str) -> Path:
        return self.root / "masks" / split

    def split(self, split: str) -> list[Sample]:
        return [s for s in self.samples if s.split == split]

    def pair(self, sample: Sample) -> tuple[Path, Path]:
        return self.images(sample.split) / f"{sample.name}.jpg", self.masks(sample.split) / f"{sample.name}.png"

    def nbytes(self, split: str) -> int:
        """Bytes of the split's JPEGs and PNGs on disk."""
        return sum(p.stat().st_size for folder in (self.images(split), self.masks(split))
                   for p in folder.iterdir() if p.is_file())


def palette() -> list[int]:
    """VOC's colour map (768 values): index i's colour from the bits of i; 255 is (224, 224, 192)."""
    out = []
    for i in range(256):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        out += [r, g, b]
    return out


def texture(cls: int, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """The (H, W, 3) float colour of class ``cls`` over a whole image: its colour, its pattern, a gain."""
    yy, xx = np.mgrid[0:h, 0:w]
    colour = np.asarray(COLOURS[cls], np.float32) * rng.uniform(0.8, 1.2)
    if cls == 1:
        shade = 1.0 + rng.normal(0.0, 0.06, (h, w))
    elif cls == 2:
        shade = np.where(yy % 4 < 2, 1.0, 0.6)
    elif cls == 3:
        shade = np.where((yy // 4 + xx // 4) % 2 == 0, 1.0, 0.55)
    else:
        shade = np.where(xx % 3 == 0, 0.5, 1.0)
    return colour * shade[..., None]


def outline(cls: int, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """A boolean (H, W) region of class ``cls``'s outline family, centred anywhere in the middle 80 %."""
    canvas = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(canvas)
    side = min(h, w)
    cy, cx = rng.uniform(0.1, 0.9) * h, rng.uniform(0.1, 0.9) * w
    ry, rx = rng.uniform(0.08, 0.22, 2) * side
    if cls == 1:
        draw.ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=1)
    elif cls == 2:
        corners = int(rng.integers(3, 5))
        # corners spread around the centre (jittered), so a wedge is never a sliver
        angles = rng.uniform(0, 2 * np.pi) + 2 * np.pi * np.arange(corners) / corners + rng.uniform(-0.3, 0.3, corners)
        radius = rng.uniform(0.2, 0.32) * side
        draw.polygon([(cx + radius * np.cos(a), cy + radius * np.sin(a)) for a in angles], fill=1)
    elif cls == 3:
        draw.rectangle([cx - rx, cy - ry, cx + rx, cy + ry], fill=1)
    else:
        long, thin = rng.uniform(0.25, 0.45) * side, rng.uniform(0.04, 0.07) * side
        half = (long, thin) if rng.random() < 0.5 else (thin, long)
        draw.rectangle([cx - half[0], cy - half[1], cx + half[0], cy + half[1]], fill=1)
    return np.asarray(canvas, dtype=bool)


def ignore_band(labels: np.ndarray, border: int) -> np.ndarray:
    """Where a pixel within ``border`` (Chebyshev distance) carries another label than this one's."""
    h, w = labels.shape
    padded = np.pad(labels, border, mode="edge")
    band = np.zeros((h, w), dtype=bool)
    for dy in range(-border, border + 1):
        for dx in range(-border, border + 1):
            band |= padded[border + dy:border + dy + h, border + dx:border + dx + w] != labels
    return band


def draw_pair(rng: np.random.Generator, base: np.ndarray, size: tuple[int, int], *, max_shapes: int,
              border: int) -> tuple[Image.Image, np.ndarray]:
    """(the RGB image, the (H, W) uint8 labels with the ignore band) of one sample."""
    h, w = size
    pixels = np.asarray(derived_photo(rng, base, h, w), dtype=np.float32)
    labels = np.zeros((h, w), dtype=np.uint8)
    for _ in range(int(rng.integers(1, max_shapes + 1))):
        cls = int(rng.integers(1, len(CLASSES)))
        region = outline(cls, h, w, rng)
        pixels[region] = texture(cls, h, w, rng)[region]
        labels[region] = cls
    labels[ignore_band(labels, border)] = IGNORE
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)), labels


def make_segmentation_set(root: str | Path, splits: dict[str, int], *, size: tuple[int, int] = (96, 128),
                          seed: int = 0, max_shapes: int = 4, border: int = 1) -> SegSet:
    """Write the pairs of every split under ``root`` (see the module doc).

    Args:
        root: the folder to write ``images/`` and ``masks/`` into.
        splits: samples per split, e.g. ``{"train": 384, "val": 128}``.
        size: (H, W) of every image and mask.
        seed: the pixels and shapes are a function of it (each split draws from its own stream).
        max_shapes: shapes per image, 1 to this many.
        border: the half-width of the ignore band, in pixels (0: no ignore pixels).

    Raises:
        RuntimeError: scikit-learn (which ships the photos) is missing.
    """
    bases = base_photos()
    if bases is None:
        raise RuntimeError("the segmentation set needs scikit-learn's sample photos: pip install -e '.[examples]'")
    root = Path(root)
    colours = palette()
    samples = []
    for index, (split, count) in enumerate(splits.items()):
        rng = np.random.default_rng([seed, index])
        for folder in ("images", "masks"):
            (root / folder / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image, labels = draw_pair(rng, bases[i % len(bases)], size, max_shapes=max_shapes, border=border)
            name = f"{i:05d}"
            image.save(root / "images" / split / f"{name}.jpg", quality=JPEG_QUALITY)
            mask = Image.fromarray(labels)
            mask.putpalette(colours)
            mask.save(root / "masks" / split / f"{name}.png")
            present = np.unique(labels)
            samples.append(Sample(split, name, tuple(int(c) for c in present if c != IGNORE),
                                  int((labels == IGNORE).sum())))
    return SegSet(root, tuple(size), tuple(samples))


class PairFolder(Dataset):
    """A segmentation Dataset as users write one: ``images/x.jpg`` with ``masks/x.png``, both opened
    by PIL per sample (the mask's indices kept, as a ``tv_tensors.Mask``), then ``transform(image, mask)``."""

    def __init__(self, images: Path, masks: Path, transform: Callable[..., Any]):
        self.pairs = [(p, masks / f"{p.stem}.png") for p in sorted(images.glob("*.jpg"))]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int):
        image_path, mask_path = self.pairs[index]
        with Image.open(image_path) as image:
            image = image.convert("RGB")
        with Image.open(mask_path) as mask:
            mask = tv_tensors.Mask(torch.from_numpy(np.array(mask)))
        return self.transform(image, mask)
