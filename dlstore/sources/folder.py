"""Scanning an image folder and decoding one file, the way torchvision does.

Sample ``i`` of a scanned folder is sample ``i`` of
``torchvision.datasets.ImageFolder`` on the same folder: class folders sorted by
name, a recursive walk of each in sorted order, torchvision's image extensions
matched case-insensitively. ``class_order="natural"`` orders the class folders as
timm's reader does instead (``c1, c2, c10``; see ``class_order``), the walk of
each class unchanged. Two deliberate differences, both about junk that
ImageFolder would happily train on:

* names starting with ``.`` (``.DS_Store``, ``.ipynb_checkpoints``, ``._x.jpg``)
  are neither classes nor samples;
* an empty class folder keeps its index (as ``ImageFolder(allow_empty=True)``)
  and is reported, instead of crashing.

Symlinked folders are followed, as torchvision follows them. A symlink loop (a
link to a folder above it: the class folder, the root, or higher) is refused
with a SourceError naming the link: ImageFolder walks such a loop until the
system's symlink limit (40 levels on Linux), filing the same images again under
that class dozens of times, an order no store should copy.

A folder with images at its top level and no class folders is *unlabelled*:
every sample gets label ``-1`` and there are no classes.

This module knows nothing about stores.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, overload

import numpy as np
from PIL import Image

from ..errors import SampleIndexError, SourceError
from .class_order import check_class_order, order_classes
from .decode import channels_of, check_mode, mode_conflict, mode_fingerprint, pil_loader

# Same tuple as torchvision.datasets.folder.IMG_EXTENSIONS (a test keeps them in sync).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

UNLABELLED = -1


def is_image_file(name: str) -> bool:
    """True for a non-hidden file name with one of torchvision's image extensions."""
    return not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS)


def find_classes(root: str | os.PathLike, class_order: str = "imagefolder") -> tuple[list[str], dict[str, int]]:
    """Class folder names in ``class_order`` and their indices: sorted, as torchvision's (default),
    or ``"natural"``, as timm's.

    Hidden folders (``.name``) are not classes.

    Raises:
        SourceError: natural order of names it cannot order (see ``class_order.order_classes``).
    """
    with os.scandir(root) as entries:
        names = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    classes = order_classes(names, class_order, where=f"{root}: ")
    return classes, {name: i for i, name in enumerate(classes)}


def _walk_images(folder: str) -> list[str]:
    """Image files under ``folder``, in torchvision's order, skipping hidden names.

    Follows symlinked folders like torchvision (``followlinks=True``); a folder that
    leads back to one the walk is in (a symlink loop) is a SourceError naming it.
    """
    found: list[tuple[str, list[str]]] = []
    ancestors = {folder: {os.path.realpath(folder)}}
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        above = ancestors.pop(dirpath)
        here = os.path.realpath(dirpath)
        keep = []
        for name in dirnames:
            if name.startswith("."):
                continue
            path = os.path.join(dirpath, name)
            real = os.path.realpath(path)
            # back to a folder this walk is in, or to one holding it (the root, or higher)
            if real in above or here.startswith(os.path.join(real, "")):
                raise SourceError(
                    f"{path}: a symlink loop (it leads to {real}, which holds it); torchvision's ImageFolder "
                    "follows it until the system's symlink limit, filing the same images again under this "
                    "class dozens of times, so dlstore refuses it: remove the link, or point it outside the "
                    "folder it sits in")
            ancestors[path] = above | {real}
            keep.append(name)
        dirnames[:] = keep
        found.append((dirpath, filenames))
    # torchvision iterates sorted(os.walk(...)): ordered by folder path, then file name.
    paths = []
    for dirpath, filenames in sorted(found, key=lambda item: item[0]):
        for name in sorted(filenames):
            if is_image_file(name):
                paths.append(os.path.join(dirpath, name))
    return paths


class SampleList(Sequence):
    """``(path, label)`` pairs of a scanned folder, held compactly.

    A list of tuples costs ~190 bytes per file (tuple, str object, list slot);
    this holds the paths relative to ``root`` in one byte string plus int64
    offsets and labels: ~16 bytes per file plus the relative path's bytes, so a
    14M-file folder fits in under 1 GiB. Indexing gives ``(path, label)`` with the
    full path (``root`` joined), like ImageFolder's ``samples``; slicing gives a
    compact SampleList of its own (copying only its part).
    """

    def __init__(self, root: str, blob: bytes, offsets: np.ndarray, labels: np.ndarray):
        self.root = root
        self._blob = blob
        self._offsets = offsets  # int64 (n + 1,): path i is blob[offsets[i]:offsets[i + 1]]
        self._labels = labels  # int64 (n,)
        self._prefix = os.path.join(root, "")

    @classmethod
    def build(cls, root: str, pairs: Sequence[tuple[str, int]] | Iterator[tuple[str, int]]) -> SampleList:
        """From ``(full path, label)`` pairs whose paths start with ``root``."""
        prefix = len(os.path.join(root, ""))
        blob, ends, labels = bytearray(), array("q"), array("q")
        for path, label in pairs:
            blob += os.fsencode(path[prefix:])
            ends.append(len(blob))
            labels.append(label)
        offsets = np.concatenate([np.zeros(1, np.int64), np.frombuffer(ends, dtype=np.int64)])
        return cls(root, bytes(blob), offsets, np.frombuffer(labels, dtype=np.int64).copy())

    def __len__(self) -> int:
        return len(self._labels)

    @overload
    def __getitem__(self, i: int) -> tuple[str, int]: ...

    @overload
    def __getitem__(self, i: slice) -> SampleList: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return SampleList.build(self.root, (self[k] for k in range(start, stop, step)))
            stop = max(start, stop)
            a, b = int(self._offsets[start]), int(self._offsets[stop])
            return SampleList(self.root, self._blob[a:b], self._offsets[start:stop + 1] - a,
                              self._labels[start:stop].copy())
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise SampleIndexError(f"sample {i} out of range for {n} samples")
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        return self._prefix + os.fsdecode(self._blob[a:b]), int(self._labels[i])

    def __iter__(self) -> Iterator[tuple[str, int]]:
        prefix, blob = self._prefix, self._blob
        offsets, labels = self._offsets.tolist(), self._labels.tolist()
        for k, label in enumerate(labels):
            yield prefix + os.fsdecode(blob[offsets[k]:offsets[k + 1]]), label

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SampleList):
            return list(self) == list(other)
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"SampleList({len(self)} files under {self.root!r})"


class FileLoader:
    """Loads the item ``(path, label)`` of a file source: ``(pil_loader(path, mode=mode), label)``.

    Picklable (it holds only the decode options), so worker processes get it cheaply.
    A mode chosen as L (every file scanned was grayscale) refuses a colour file with a
    SourceError, which ``on_error="skip"`` does not hide.
    """

    def __init__(self, decode: dict[str, Any] | None = None, targets: np.ndarray | None = None,
                 mode: str = "RGB", given: bool = False):
        self.decode = dict(decode or {})
        self.targets = targets   # (N, K) target vectors: the label of a key is its row
        self.mode, self.given = mode, given

    def __call__(self, key: tuple[str, int]) -> tuple[Image.Image, int | np.ndarray]:
        path, label = key
        strict = not self.given and self.mode != "RGB"
        image = pil_loader(path, **self.decode, mode=None if strict else self.mode)
        if image.mode != self.mode:
            raise SourceError(mode_conflict(path, "a colour image", channels_of(image.mode), self.mode))
        return image, label if self.targets is None else self.targets[label]


@dataclass
class Source:
    """A scanned image folder: what will become the samples of a store, in order.

    Implements the source interface the conversion consumes (see ``dlstore.sources``):
    items are ``(path, label)`` pairs, provenance is the path relative to ``root``.
    """

    root: str
    classes: list[str]
    class_to_idx: dict[str, int]
    samples: Sequence[tuple[str, int]]  # a SampleList from scan()
    empty_classes: list[str] = field(default_factory=list)
    kind: str = "folder"
    list_file: str | None = None  # the CSV/JSON-lines list a "list" source was read from
    targets: np.ndarray | None = None  # (N, K) target vectors of a list; the label of sample i is its row
    mode: str = "RGB"  # what every file is converted to: a folder's is RGB, as torchvision's loader
    mode_given: bool = False  # by the caller (else chosen: a folder's default, or a list's scan)
    class_order: str | None = None  # the rule that ordered a folder's classes (class_order.CLASS_ORDERS)

    @property
    def target_spec(self) -> tuple[int, str] | None:
        """(K, dtype) of target vectors, None for int labels (see conversion.job)."""
        return None if self.targets is None else (int(self.targets.shape[1]), str(self.targets.dtype))

    origin_kind = "path"  # provenance: path relative to root
    sample_shape = None  # files differ in size

    @property
    def channels(self) -> int:
        return channels_of(self.mode)

    @property
    def labelled(self) -> bool:
        return bool(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def item_keys(self, start: int = 0) -> Iterator[tuple[str, int]]:
        return itertools.islice(self.samples, start, None)

    def loader(self, decode: dict[str, Any] | None = None) -> FileLoader:
        return FileLoader(decode, self.targets, self.mode, self.mode_given)

    def origin(self, key: tuple[str, int]) -> str:
        return os.path.relpath(key[0], self.root)

    def where(self, key: tuple[str, int]) -> str:
        return key[0]

    def part(self, start: int, stop: int) -> Source:
        return replace(self, samples=self.samples[start:stop])

    def fingerprint(self) -> dict[str, Any]:
        listing = hashlib.sha256()
        for path, label in self.samples:
            listing.update(f"{os.path.relpath(path, self.root)}\0{label}\n".encode("utf-8", "surrogateescape"))
        if self.targets is not None:
            listing.update(np.ascontiguousarray(self.targets).tobytes())
        return {"source_root": os.path.abspath(self.root), "source_files": len(self),
                "source_listing": listing.hexdigest(), **mode_fingerprint(self.mode),
                # (absent for the default, so checkpoints written before the option still match)
                **({"class_order": self.class_order} if self.class_order not in (None, "imagefolder") else {})}

    def describe(self) -> dict[str, Any]:
        out = {"kind": self.kind, "root": os.path.abspath(self.root), "empty_classes": self.empty_classes,
               "mode": self.mode, "mode_given": self.mode_given}
        if self.list_file is not None:
            out["list"] = self.list_file
        return out


def scan(root: str | os.PathLike, mode: str | None = None, *, class_order: str = "imagefolder") -> Source:
    """Scan an ImageFolder-layout folder (or a flat folder of images).

    Every file is converted to ``mode``: ``"RGB"`` (default, as torchvision's loader) or ``"L"``.
    ``class_order``: ``"imagefolder"`` (sorted names) or ``"natural"`` (timm's order); the samples
    follow their classes' labels, each class walked in ImageFolder's order.

    Raises:
        SourceError: the folder does not exist or holds no image at all; natural order of names that
            have none (see ``class_order.order_classes``).
        ArgumentError: an unknown ``class_order``.
    """
    root_path = Path(root)
    if not root_path.is_dir():
        raise SourceError(f"{root}: not a folder (expected an ImageFolder layout: ROOT/CLASS/IMAGE)")
    root_str = str(root_path)
    classes, class_to_idx = find_classes(root_str, check_class_order(class_order))
    if classes:
        empty = []

        def pairs() -> Iterator[tuple[str, int]]:
            for name in classes:  # one class folder's file list at a time
                files = _walk_images(os.path.join(root_str, name))
                if not files:
                    empty.append(name)
                yield from ((path, class_to_idx[name]) for path in files)

        samples = SampleList.build(root_str, pairs())
        if not len(samples):
            raise SourceError(
                f"{root}: none of the {len(classes)} class folders holds an image "
                f"(extensions: {', '.join(IMG_EXTENSIONS)})"
            )
        return Source(root_str, classes, class_to_idx, samples, empty, **_mode_fields(mode),
                      class_order=class_order)
    with os.scandir(root_str) as entries:
        flat = sorted(e.path for e in entries if e.is_file() and is_image_file(e.name))
    if not flat:
        raise SourceError(
            f"{root}: no class folders and no images (expected ROOT/CLASS/IMAGE, or a flat "
            f"folder of images; extensions: {', '.join(IMG_EXTENSIONS)})"
        )
    return Source(root_str, [], {}, SampleList.build(root_str, ((p, UNLABELLED) for p in flat)), [],
                  **_mode_fields(mode))


def _mode_fields(mode: str | None) -> dict[str, Any]:
    return {"mode": check_mode(mode) or "RGB", "mode_given": mode is not None}
