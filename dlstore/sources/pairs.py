"""Segmentation sources of files: a folder of images paired with a folder of masks, or a list of pairs.

A pair is an image and the mask that labels its pixels (one class index per pixel)::

    images/a/x.jpg  <->  masks/a/x.png        (same relative folder, same stem; any image extension)

``scan_pairs`` walks the images folder the way an image folder is scanned (``folder``): hidden
names skipped, symlinked folders followed and loops refused, torchvision's extensions. The
labels are not classes (a segmentation folder usually has none, or folders such as ``training/``
that are splits, not classes), so every image of the folder counts, in ImageFolder's order:

* the images at the top level first, sorted by name (a flat folder, as ``scan`` orders one);
* then each top-level folder, in sorted order, walked as ImageFolder walks a class folder.

A folder of class folders is therefore in ``ImageFolder``'s order; ``ImageFolder`` itself would
ignore the top-level images of a folder that also has folders.

An image without a mask, a mask without an image, or a stem that names two images or two masks
(``x.jpg`` and ``x.png``) is a SourceError listing them, both ways; with ``on_error="skip"``
they are left out and recorded in ``PairSource.skipped`` as the conversion records a file it
skips (``{"path", "reason"}``, the path relative to the images folder; for a mask,
``{"path", "field": "mask", "reason"}``, the path relative to the masks folder).

A pair source's items are ``(image, mask)``: the image decoded as an image folder's (``pil_loader``,
converted to ``mode``), the mask by ``load_mask`` (class indices, never colour-converted); a mask
of another size than its image is a DecodeError naming both files.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..errors import ArgumentError, SourceError
from .decode import DEFAULT_MAX_PIXELS, channels_of, check_mode, load_mask, mode_fingerprint
from .folder import IMG_EXTENSIONS, UNLABELLED, FileLoader, SampleList, _walk_images, is_image_file
from .items import check_pair

ON_ERROR = ("fail", "skip")
FIELDS = ("image", "mask")
_LISTED = 20   # unpaired files named in an error, per direction


class PairLoader:
    """Loads the item ``(image path, mask path)`` of a pair source: ``(image, mask)``.

    The image as ``FileLoader`` loads a file (a PIL image in the source's mode); the mask by
    ``load_mask`` with the same ``exif_transpose`` and ``max_pixels``, a (H, W) uint8 or uint16
    array. Picklable: it holds only the decode options.
    """

    def __init__(self, decode: dict[str, Any] | None = None, mode: str = "RGB", given: bool = False):
        self.images = FileLoader(decode, None, mode, given)
        self.decode = dict(decode or {})

    def __call__(self, key: tuple[str, str]) -> tuple[Image.Image, np.ndarray]:
        image_path, mask_path = key
        image, _ = self.images((image_path, UNLABELLED))
        mask = load_mask(mask_path, exif_transpose=bool(self.decode.get("exif_transpose", False)),
                         max_pixels=self.decode.get("max_pixels", DEFAULT_MAX_PIXELS))
        check_pair(image, mask, image_path, mask_path)
        return image, mask


@dataclass
class PairSource:
    """Image files paired with mask files, in order (see the module doc).

    Implements the source interface the conversion consumes (``dlstore.sources``) with items
    ``(image, mask)`` (``fields``): keys are ``(image path, mask path)``, provenance is the image's
    path relative to ``root`` (``mask_origin``: the mask's, relative to ``masks_root``). Images
    have no class (no ``classes``, label -1).
    """

    root: str
    masks_root: str
    images: SampleList                 # image paths under root, in order (labels -1)
    masks: SampleList                  # the mask of each image, under masks_root
    skipped: list[dict[str, str]] = field(default_factory=list)   # what on_error="skip" left out, and why
    kind: str = "folder pairs"
    list_file: str | None = None       # the CSV/JSON-lines list a "pair list" source was read from
    mode: str = "RGB"                  # what every image is converted to
    mode_given: bool = False

    fields = FIELDS
    origin_kind = "path"
    sample_shape = None   # files differ in size
    target_spec = None
    class_order = None

    @property
    def classes(self) -> list[str]:
        return []

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {}

    @property
    def empty_classes(self) -> list[str]:
        return []

    @property
    def channels(self) -> int:
        return channels_of(self.mode)

    labelled = False

    def __len__(self) -> int:
        return len(self.images)

    def item_keys(self, start: int = 0) -> Iterator[tuple[str, str]]:
        pairs = zip(self.images, self.masks)
        return ((image, mask) for (image, _), (mask, _) in itertools.islice(pairs, start, None))

    def loader(self, decode: dict[str, Any] | None = None) -> PairLoader:
        return PairLoader(decode, self.mode, self.mode_given)

    def origin(self, key: tuple[str, str]) -> str:
        return os.path.relpath(key[0], self.root)

    def mask_origin(self, key: tuple[str, str]) -> str:
        """The mask's path relative to ``masks_root``."""
        return os.path.relpath(key[1], self.masks_root)

    def where(self, key: tuple[str, str]) -> str:
        return key[0]

    def files(self, key: tuple[str, str]) -> tuple[str, str]:
        """The image and the mask of an item: both are printed for ``--resume`` (``conversion.journal``)."""
        return key

    def part(self, start: int, stop: int) -> PairSource:
        return replace(self, images=self.images[start:stop], masks=self.masks[start:stop])

    def fingerprint(self) -> dict[str, Any]:
        listing = hashlib.sha256()
        for (image, _), (mask, _) in zip(self.images, self.masks):
            listing.update(f"{os.path.relpath(image, self.root)}\0{os.path.relpath(mask, self.masks_root)}\n"
                           .encode("utf-8", "surrogateescape"))
        return {"source_root": os.path.abspath(self.root), "source_masks": os.path.abspath(self.masks_root),
                "source_files": len(self), "source_listing": listing.hexdigest(), **mode_fingerprint(self.mode)}

    def describe(self) -> dict[str, Any]:
        out = {"kind": self.kind, "root": os.path.abspath(self.root), "masks_root": os.path.abspath(self.masks_root),
               "fields": list(self.fields), "mode": self.mode, "mode_given": self.mode_given,
               "empty_classes": []}
        if self.list_file is not None:
            out["list"] = self.list_file
        return out


def check_on_error(on_error: Any) -> str:
    if on_error not in ON_ERROR:
        raise ArgumentError(f"on_error must be one of {', '.join(map(repr, ON_ERROR))}, got {on_error!r}")
    return on_error


def walk_tree(root: str) -> list[str]:
    """Every image file under ``root``: the top-level ones sorted by name, then each top-level folder
    in sorted order, walked as ImageFolder walks a class folder (see the module doc)."""
    with os.scandir(root) as entries:
        found = [(e.name, e.path, e.is_dir()) for e in entries if not e.name.startswith(".")]
    top = sorted(path for name, path, is_dir in found if not is_dir and is_image_file(name) and os.path.isfile(path))
    for name in sorted(name for name, _, is_dir in found if is_dir):
        top += _walk_images(os.path.join(root, name))
    return top


def scan_pairs(images_root: str | os.PathLike, masks_root: str | os.PathLike, *, on_error: str = "fail",
               mode: str | None = None) -> PairSource:
    """Pair the images under ``images_root`` with the masks under ``masks_root`` by relative path and stem.

    ``images/a/x.jpg`` pairs with ``masks/a/x.png`` (the mask's extension is any image one). The
    images are in the order the module doc gives (ImageFolder's, for a folder of folders).

    Args:
        images_root: the folder of images (flat, or nested in any depth).
        masks_root: the folder of masks, laid out as the images are.
        on_error: ``"fail"`` raises a SourceError listing every unpaired or ambiguous file;
            ``"skip"`` leaves them out and records each in ``skipped`` with the reason.
        mode: ``"RGB"`` (default, as torchvision's loader) or ``"L"``: what every image is
            converted to. Masks are never converted.

    Raises:
        SourceError: a folder that does not exist or holds no image; folders that lie inside each
            other; unpaired or ambiguous files (with ``on_error="fail"``); no pair at all.
        ArgumentError: an unknown ``on_error`` or ``mode``.
    """
    check_on_error(on_error)
    check_mode(mode)
    images_dir, masks_dir = str(Path(images_root)), str(Path(masks_root))
    for what, folder in (("images", images_dir), ("masks", masks_dir)):
        if not Path(folder).is_dir():
            raise SourceError(f"{folder}: not a folder (the {what} of a segmentation source: IMAGES/a/x.jpg "
                              "paired with MASKS/a/x.png)")
    _check_apart(images_dir, masks_dir)
    images = walk_tree(images_dir)
    if not images:
        raise SourceError(f"{images_dir}: no images (extensions: {', '.join(IMG_EXTENSIONS)})")
    pairs, unpaired = match(images_dir, images, masks_dir, walk_tree(masks_dir))
    if unpaired and on_error == "fail":
        raise SourceError(unpaired_message(images_dir, masks_dir, unpaired))
    if not pairs:
        raise SourceError(f"{images_dir}: none of its {len(images)} images has a mask under {masks_dir} (paired by "
                          "relative path and stem: IMAGES/a/x.jpg <-> MASKS/a/x.png)")
    return PairSource(images_dir, masks_dir, SampleList.build(images_dir, ((i, UNLABELLED) for i, _ in pairs)),
                      SampleList.build(masks_dir, ((m, UNLABELLED) for _, m in pairs)), skipped=unpaired,
                      mode=mode or "RGB", mode_given=mode is not None)


def _check_apart(images: str, masks: str) -> None:
    a, b = os.path.realpath(images), os.path.realpath(masks)
    if a == b:
        raise SourceError(f"{images}: the images and the masks are one folder; pair files of one folder "
                          "(x.jpg with x_mask.png) with a CSV list of image,mask rows instead")
    for inner, outer, what in ((b, a, "masks"), (a, b, "images")):
        if inner.startswith(os.path.join(outer, "")):
            raise SourceError(f"{inner}: the {what} folder lies inside {outer}, so its files would be scanned as "
                              f"{'images' if what == 'masks' else 'masks'} too; give two folders side by side")


def _stem_key(root: str, path: str) -> str:
    """``a/x`` for ``ROOT/a/x.png``: the relative path without its extension."""
    return os.path.splitext(os.path.relpath(path, root))[0]


def match(images_root: str, images: Sequence[str], masks_root: str, masks: Sequence[str]
          ) -> tuple[list[tuple[str, str]], list[dict[str, str]]]:
    """(the (image, mask) pairs in image order, the unpaired and ambiguous files as skipped entries)."""
    by_stem: dict[str, list[str]] = {}
    for mask in masks:
        by_stem.setdefault(_stem_key(masks_root, mask), []).append(mask)
    image_stems: dict[str, list[str]] = {}
    for image in images:
        image_stems.setdefault(_stem_key(images_root, image), []).append(image)
    pairs, unpaired = [], []
    for image in images:
        stem = _stem_key(images_root, image)
        rel = os.path.relpath(image, images_root)
        found, twins = by_stem.get(stem, []), image_stems[stem]
        if len(twins) > 1:
            reason = f"{len(twins)} images share the stem {stem!r} ({', '.join(map(os.path.basename, twins))})"
        elif len(found) > 1:
            reason = f"{len(found)} masks share its stem: {', '.join(os.path.relpath(m, masks_root) for m in found)}"
        elif not found:
            reason = f"no mask: expected {stem}.<ext> under {masks_root}"
        else:
            pairs.append((image, found[0]))
            continue
        unpaired.append({"path": rel, "reason": reason})
    for stem, found in by_stem.items():
        if stem not in image_stems:
            reason = f"a mask without an image: expected {stem}.<ext> under {images_root}"
        elif len(image_stems[stem]) > 1 or len(found) > 1:
            reason = f"its stem {stem!r} names {len(image_stems[stem])} image(s) and {len(found)} masks"
        else:
            continue
        unpaired += [{"path": os.path.relpath(m, masks_root), "field": "mask", "reason": reason} for m in found]
    return pairs, unpaired


def unpaired_message(images_root: str, masks_root: str, unpaired: list[dict[str, str]]) -> str:
    """The SourceError text for unpaired files: how many each way, the first of each, and the fixes."""
    images = [u for u in unpaired if u.get("field") != "mask"]
    masks = [u for u in unpaired if u.get("field") == "mask"]
    lines = [f"{images_root} (images) and {masks_root} (masks): {len(images)} image(s) and {len(masks)} mask(s) "
             "without a pair; pairs share a relative path and stem (IMAGES/a/x.jpg <-> MASKS/a/x.png)"]
    for title, entries in (("images", images), ("masks", masks)):
        if entries:
            lines.append(f"  {title}:")
            lines += [f"    {u['path']}: {u['reason']}" for u in entries[:_LISTED]]
            if len(entries) > _LISTED:
                lines.append(f"    ... and {len(entries) - _LISTED} more")
    lines.append("Pass on_error=\"skip\" (--on-error skip) to leave them out (each is recorded with its reason), "
                 "or list the pairs in a CSV of image,mask rows")
    return "\n".join(lines)
