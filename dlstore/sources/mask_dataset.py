"""A map-style dataset of (image, mask) items as a segmentation source.

Item ``i`` is ``dataset[i]``:

* a pair ``(image, mask)``: torchvision's ``VOCSegmentation`` and ``Cityscapes(target_type="semantic")``
  (a PIL image and a PIL mask), a dataset yielding ``(tv_tensors.Image, tv_tensors.Mask)``, any
  ``Dataset`` returning an image and an integer array (positions: ``image_key`` / ``mask_key``);
* a dict (a Hugging Face dataset): the image under ``image_key`` (default ``"image"``), the mask under
  ``mask_key``, the column the user names (default ``"mask"``).

The image is made uniform as a dataset source makes it (``items.source_image``: a PIL image stays
one, in the source's mode; a tensor or ndarray becomes a uint8 (C, H, W) tensor). The mask becomes
the (H, W) array of its class indices (``items.to_mask``: a palette PNG keeps its indices, uint8,
or uint16 above 255); a mask of another size than its image is a DecodeError naming the item.
Provenance is the index ``i``; the images have no class.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ..errors import ArgumentError, DecodeError, SourceError
from .dataset import DatasetLoader, _choose_mode, _known_uniform
from .decode import channels_of, check_mode, mode_fingerprint
from .items import check_pair, image_mode, image_size, source_image, to_mask
from .pairs import FIELDS


class MaskDatasetLoader(DatasetLoader):
    """``i -> (image, mask)`` for a map-style dataset of pairs (runs in worker processes)."""

    def __init__(self, dataset: Any, image_key: str | int | None, mask_key: str | int | None, name: str,
                 mode: str | None = None, given: bool = False):
        super().__init__(dataset, image_key, None, name, mode, given)
        self.mask_key = mask_key

    def __call__(self, i: int) -> tuple[Any, np.ndarray]:
        obj, mask, where = self.item(i)
        image = source_image(obj, where, self.mode, self.given)
        mask = to_mask(mask, where)
        check_pair(image, mask, where)
        return image, mask

    def item(self, i: int) -> tuple[Any, Any, str]:
        """``(image as the dataset yields it, mask as it yields it, where)`` of item ``i``."""
        where = f"{self.name} item {i}"
        try:
            item = self.dataset[i]
        except Exception as exc:  # user code: any failure is this item's failure
            raise DecodeError(where, f"dataset[{i}] raised {type(exc).__name__}: {exc}") from exc
        if isinstance(item, dict):
            keys = (self.image_key or "image", self.mask_key or "mask")
            missing = [k for k in keys if k not in item]
            if missing:
                raise DecodeError(where, f"has no key {missing[0]!r} (keys: {', '.join(map(str, item))}); pass "
                                         "image_key= and mask_key= naming the image and mask columns")
            return item[keys[0]], item[keys[1]], where
        if not isinstance(item, (tuple, list)):
            raise DecodeError(where, f"yields a {type(item).__name__}, expected an (image, mask) pair or a dict")
        image_key = 0 if self.image_key is None else self.image_key
        mask_key = 1 if self.mask_key is None else self.mask_key
        if not all(isinstance(k, int) and -len(item) <= k < len(item) for k in (image_key, mask_key)):
            raise DecodeError(where, f"yields a {len(item)}-tuple; image_key={image_key!r} and mask_key={mask_key!r} "
                                     "must be positions in it")
        return item[image_key], item[mask_key], where


class MaskDatasetSource:
    """Items ``start..stop-1`` of a map-style dataset of (image, mask) pairs; see the module doc.

    Presents the source interface (``dlstore.sources``) with items ``(image, mask)`` (``fields``).
    """

    kind = "dataset"
    origin_kind = "index"
    fields = FIELDS
    target_spec = None

    def __init__(self, dataset: Any, *, image_key: str | int | None = None, mask_key: str | int | None = None,
                 fixed_shape: bool | None = None, mode: str | None = None, start: int = 0,
                 stop: int | None = None, _probe: tuple | None = None):
        """
        Args:
            dataset: supports ``len()`` and ``dataset[i]``, each item an (image, mask) pair or a dict.
            image_key, mask_key: dict keys (default ``"image"``, ``"mask"``) or tuple positions
                (default 0, 1).
            fixed_shape: every image has one shape (None: known for torchvision's in-memory datasets).
            mode: ``"RGB"`` or ``"L"``, every image converted to it; None: chosen as a dataset
                source chooses (RGB if any image is colour). Masks are never converted.

        Raises:
            ArgumentError: ``dataset`` is not map-style; an unknown ``mode``.
            SourceError: the dataset is empty.
            DecodeError: item 0 is not a pair of an image and a mask of its size.
        """
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ArgumentError(f"{type(dataset).__name__} is not a map-style dataset (needs len() and [i])")
        self.dataset = dataset
        self.image_key, self.mask_key = image_key, mask_key
        self.name = type(dataset).__name__
        self.root = f"<{self.name}>"
        n = len(dataset)
        self.start, self.stop = start, n if stop is None else stop
        if _probe is None:
            if n == 0:
                raise SourceError(f"{self.name}: the dataset is empty")
            probe = MaskDatasetLoader(dataset, image_key, mask_key, self.name)
            first, _ = probe(0)
            known = _known_uniform(dataset)
            given = check_mode(mode) is not None
            mode = mode if given else _choose_mode(probe, image_mode(first), n, known)
            uniform = (channels_of(mode), *image_size(first))
            if not fixed_shape and (fixed_shape is not None or not known):
                uniform = None
            _probe = (uniform, mode, given)
        self.sample_shape, self.mode, self.mode_given = _probe
        self._probe = _probe
        self.channels = channels_of(self.mode)
        self.empty_classes: list[str] = []

    @property
    def classes(self) -> list[str]:
        """No image-level classes."""
        return []

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {}

    def __len__(self) -> int:
        return self.stop - self.start

    def item_keys(self, start: int = 0) -> range:
        return range(self.start + start, self.stop)

    def loader(self, decode: dict[str, Any] | None = None) -> MaskDatasetLoader:
        return MaskDatasetLoader(self.dataset, self.image_key, self.mask_key, self.name, self.mode, self.mode_given)

    def origin(self, key: int) -> int:
        return key

    def where(self, key: int) -> str:
        return f"{self.name} item {key}"

    def part(self, start: int, stop: int) -> MaskDatasetSource:
        return MaskDatasetSource(self.dataset, image_key=self.image_key, mask_key=self.mask_key,
                                 start=self.start + start, stop=self.start + stop, _probe=self._probe)

    def fingerprint(self) -> dict[str, Any]:
        # As a dataset source: the content is not hashed; the type, length, range and keys are.
        ident = hashlib.sha256(repr((self.name, len(self.dataset), self.start, self.stop, self.image_key,
                                     self.mask_key, FIELDS)).encode()).hexdigest()
        return {"source_kind": self.kind, "source_files": len(self), "source_listing": ident,
                **mode_fingerprint(self.mode)}

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "root": self.root, "type": self.name, "fields": list(FIELDS), "mode": self.mode,
                "mode_given": self.mode_given, "image_key": self.image_key, "mask_key": self.mask_key}
