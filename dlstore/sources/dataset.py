"""A map-style dataset as a source: torchvision datasets, Hugging Face datasets, any ``Dataset``.

Item ``i`` of the store is ``dataset[i]``: an ``(image, target)`` pair, or a dict
(Hugging Face) read with ``image_key`` / ``label_key``. The image is whatever the
dataset yields (PIL image, uint8 ndarray or tensor; see ``sources.items``), so the
stored pixels are what the user's torchvision pipeline would get from it.
Provenance is the index ``i``.

Class names, first found wins: ``dataset.classes`` (torchvision), the
``ClassLabel`` feature of ``label_key`` (Hugging Face), ``num_classes``
(``FakeData``: names ``"0"``...); otherwise None, and the conversion names the
classes ``"0"``... up to the largest label it met.

Target vectors: when item 0's target is a list, tuple, 1-D ndarray or tensor of K
numbers, every item's must be K numbers of the same kind (ints or bools: stored
int64; floats: float32), and the store has no classes (see ``items.to_target``).

Worker processes get the dataset by ``fork`` (no pickling). Where processes start
by ``spawn`` a dataset that cannot be pickled (a lambda transform, an open file) is
decoded in the main process instead, with a warning (``conversion.pool``).
"""

from __future__ import annotations

import hashlib
from typing import Any

from PIL import Image

from ..errors import ArgumentError, DecodeError, SourceError
from .decode import channels_of, check_mode, mode_fingerprint, storable_mode
from .items import image_mode, source_image, to_image, to_target


class DatasetLoader:
    """``i -> (image, label)`` for a map-style dataset (runs in worker processes)."""

    def __init__(self, dataset: Any, image_key: str | int | None, label_key: str | int | None, name: str,
                 mode: str | None = None, given: bool = False):
        self.dataset = dataset
        self.image_key = image_key
        self.label_key = label_key
        self.name = name
        self.mode, self.given = mode, given  # None: each image in its storable mode (the first probe)

    def __call__(self, i: int) -> tuple[Any, Any]:
        obj, target, where = self.item(i)
        return source_image(obj, where, self.mode, self.given), to_target(target, where)

    def item(self, i: int) -> tuple[Any, Any, str]:
        """``(image as the dataset yields it, target, where)`` of item ``i``."""
        where = f"{self.name} item {i}"
        try:
            item = self.dataset[i]
        except Exception as exc:  # user code: any failure is this item's failure
            raise DecodeError(where, f"dataset[{i}] raised {type(exc).__name__}: {exc}") from exc
        if isinstance(item, dict):
            image_key = self.image_key or "image"
            label_key = self.label_key or "label"
            if image_key not in item:
                raise DecodeError(where, f"has no key {image_key!r} (keys: {', '.join(map(str, item))}); "
                                         "pass image_key=")
            return item[image_key], item.get(label_key), where
        if self.image_key is not None or self.label_key is not None:  # tuple items, keys are positions
            image_key = 0 if self.image_key is None else self.image_key
            label_key = 1 if self.label_key is None else self.label_key
            return item[image_key], item[label_key], where
        if isinstance(item, (tuple, list)) and len(item) == 2:
            return item[0], item[1], where
        return item, None, where

    def storable_mode(self, i: int) -> str | None:
        """``"L"`` or ``"RGB"`` for item ``i`` without decoding a lazily opened PIL image (its
        ``.mode`` is read from the header); None for an item that fails (the conversion reports it)."""
        try:
            obj, _, where = self.item(i)
            return storable_mode(obj.mode) if isinstance(obj, Image.Image) else image_mode(to_image(obj, where))
        except DecodeError:
            return None


def _class_names(dataset: Any, label_key: str | None) -> list[str] | None:
    classes = getattr(dataset, "classes", None)
    if isinstance(classes, (list, tuple)) and classes and all(isinstance(c, str) for c in classes):
        return list(classes)
    features = getattr(dataset, "features", None)  # Hugging Face datasets.Dataset
    if features is not None:
        names = getattr(features.get(label_key or "label"), "names", None)
        if isinstance(names, (list, tuple)) and names:
            return [str(n) for n in names]
    num = getattr(dataset, "num_classes", None)
    if isinstance(num, int) and not isinstance(num, bool) and num > 0:
        return [str(k) for k in range(num)]
    return None


def _known_uniform(dataset: Any) -> bool:
    """True for datasets known to hold one image size: torchvision's in-memory ones, FakeData."""
    data = getattr(dataset, "data", None)
    return (hasattr(data, "shape") and len(getattr(data, "shape", ())) >= 3) or hasattr(dataset, "image_size")


def _shape(image: Any) -> tuple[int, int, int]:
    """(C, H, W) of a PIL image (L or RGB) or a CHW tensor."""
    if isinstance(image, Image.Image):
        return (1 if image.mode == "L" else 3, image.size[1], image.size[0])
    return tuple(int(d) for d in image.shape)


def _choose_mode(loader: DatasetLoader, first: str, n: int, known_uniform: bool) -> str:
    """``"RGB"`` when any image is colour, else ``"L"``. Item 0's mode decides a colour first image
    (RGB whatever follows) and the datasets known to build every image alike; otherwise the items
    are read up to the first colour one (their ``.mode`` only: a lazily opened file is not decoded)."""
    if first == "RGB" or known_uniform:
        return first
    return "RGB" if any(loader.storable_mode(i) == "RGB" for i in range(1, n)) else "L"


class DatasetSource:
    """Items ``start..stop-1`` of a map-style dataset; see the module doc."""

    kind = "dataset"
    origin_kind = "index"

    def __init__(self, dataset: Any, *, image_key: str | int | None = None, label_key: str | int | None = None,
                 fixed_shape: bool | None = None, mode: str | None = None, start: int = 0,
                 stop: int | None = None, _probe: tuple | None = None):
        """
        Args:
            dataset: supports ``len()`` and ``dataset[i]``.
            image_key, label_key: for items that are dicts (default ``"image"``, ``"label"``)
                or tuples (an index).
            fixed_shape: every image has one shape (a fixed-shape store without a
                resize + crop). None: known for torchvision's in-memory datasets (an
                array ``data`` attribute: CIFAR, MNIST, ...) and ``FakeData``.
            mode: ``"RGB"`` or ``"L"``: every image converted to it (PIL ``img.convert(mode)``).
                None: RGB if any image is colour (mixed grayscale and colour: as ImageFolder's
                loader makes them), L if every image is grayscale (MNIST keeps one channel);
                see ``_choose_mode`` for what is read to decide.
        """
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ArgumentError(f"{type(dataset).__name__} is not a map-style dataset (needs len() and [i])")
        self.dataset = dataset
        self.image_key, self.label_key = image_key, label_key
        self.name = type(dataset).__name__
        self.root = f"<{self.name}>"
        n = len(dataset)
        self.start, self.stop = start, n if stop is None else stop
        if _probe is None:
            if n == 0:
                raise SourceError(f"{self.name}: the dataset is empty")
            probe = DatasetLoader(dataset, image_key, label_key, self.name)
            first, target = probe(0)
            vector = (len(target), str(target.dtype)) if hasattr(target, "dtype") else None
            known = _known_uniform(dataset)
            given = check_mode(mode) is not None
            mode = mode if given else _choose_mode(probe, image_mode(first), n, known)
            uniform = (channels_of(mode), *_shape(first)[1:])
            if not fixed_shape and (fixed_shape is not None or not known):
                uniform = None
            _probe = ([] if vector else _class_names(dataset, label_key), uniform, vector, mode, given)
        # target_spec: (K, dtype) of target vectors, None for int labels (see conversion.job)
        classes, self.sample_shape, self.target_spec, self.mode, self.mode_given = _probe
        self.channels = channels_of(self.mode)
        self._probe = _probe
        self.classes = classes  # None: named "0".. by the conversion, from the labels it meets
        self.class_to_idx = {c: i for i, c in enumerate(classes or [])}
        self.empty_classes: list[str] = []

    def __len__(self) -> int:
        return self.stop - self.start

    def item_keys(self, start: int = 0) -> range:
        return range(self.start + start, self.stop)

    def loader(self, decode: dict[str, Any] | None = None) -> DatasetLoader:
        return DatasetLoader(self.dataset, self.image_key, self.label_key, self.name, self.mode, self.mode_given)

    def origin(self, key: int) -> int:
        return key

    def where(self, key: int) -> str:
        return f"{self.name} item {key}"

    def part(self, start: int, stop: int) -> DatasetSource:
        return DatasetSource(self.dataset, image_key=self.image_key, label_key=self.label_key,
                             start=self.start + start, stop=self.start + stop, _probe=self._probe)

    def fingerprint(self) -> dict[str, Any]:
        # The dataset's content is not hashed (that would read it all): resume trusts that the
        # same dataset object is given again, and checks its type, length and keys.
        ident = hashlib.sha256(repr((self.name, len(self.dataset), self.start, self.stop, self.image_key,
                                     self.label_key)).encode()).hexdigest()
        return {"source_kind": self.kind, "source_files": len(self), "source_listing": ident,
                **mode_fingerprint(self.mode)}

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "root": self.root, "type": self.name, "mode": self.mode,
                               "mode_given": self.mode_given}
        if self.image_key or self.label_key:
            out.update(image_key=self.image_key, label_key=self.label_key)
        return out
