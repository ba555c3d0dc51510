"""The fields of a sample beyond its image: where each lies in the stored record.

A store of images and labels has no ``fields`` entry in its manifest: a record is the image.
A segmentation store (``dlstore convert IMAGES DST --masks MASKS``) stores each sample's mask as
planes of the same record, after the image's channels::

    manifest "fields"   {"image": {"channels": 3},
                         "mask": {"kind": "planes", "dtype": "uint8" | "uint16", "planes": 1 | 2}}
    record              uint8 (C + P, H, W): the image's C channels, then the mask's P planes
                        (a uint16 mask: its low bytes, then its high bytes)

so every format stores, checks (the per-sample sums cover the mask), reads in place, shuffles by
block and crops a sample's image and mask in one record, and a kernel cropping the image's
``C*H*W`` bytes at a sample's address crops its mask at ``address + C*H*W`` with the same window.
The manifest's ``sample.shape`` is the record's; ``RecordFields.image_shape`` the image's.

A field of another ``kind`` (a ragged one, such as boxes: a variable number per sample) is
not planes of the record and would be stored beside it, as target vectors are
(``formats.targets``); ``RecordFields`` refuses a kind it does not know, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StoreCorruptError

MASK_DTYPES = {"uint8": 1, "uint16": 2}   # dtype -> planes


@dataclass(frozen=True)
class RecordFields:
    """How a record holds its image and mask (see the module doc)."""

    channels: int        # the image's
    mask_dtype: str      # "uint8" or "uint16"

    @property
    def planes(self) -> int:
        return MASK_DTYPES[self.mask_dtype]

    @classmethod
    def for_mask(cls, channels: int, mask_dtype: str) -> RecordFields:
        return cls(int(channels), str(mask_dtype))

    @classmethod
    def of(cls, manifest: dict[str, Any], where: Any = "store") -> RecordFields | None:
        """The fields the manifest declares, or None (a store of images and labels)."""
        fields = manifest.get("fields")
        if fields is None:
            return None
        check(manifest, str(where))
        return cls(int(fields["image"]["channels"]), fields["mask"]["dtype"])

    def describe(self) -> dict[str, Any]:
        """The manifest's ``fields`` entry."""
        return {"image": {"channels": self.channels},
                "mask": {"kind": "planes", "dtype": self.mask_dtype, "planes": self.planes}}

    def record_shape(self, image_shape: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        if image_shape is None:
            return None
        c, h, w = image_shape
        return (c + self.planes, h, w)

    def image_shape(self, record_shape: tuple[int, ...] | None) -> tuple[int, int, int] | None:
        if record_shape is None:
            return None
        return (self.channels, int(record_shape[1]), int(record_shape[2]))

    @property
    def torch_dtype(self) -> Any:
        """The dtype masks are handed out in: uint8, or int32 for uint16 masks (torch's uint16
        lacks most operations, among them the indexing a loss does)."""
        import torch

        return torch.uint8 if self.mask_dtype == "uint8" else torch.int32

    def pack(self, image: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One record of a uint8 (C, H, W) image and its (H, W) mask."""
        if mask.dtype == np.uint8:
            planes = mask[None]
        else:   # little-endian bytes as planes: low, then high
            planes = np.ascontiguousarray(mask.astype("<u2").view(np.uint8).reshape(*mask.shape, 2).transpose(2, 0, 1))
        return np.concatenate([np.asarray(image, dtype=np.uint8), planes], axis=0)

    def split(self, records: Any) -> tuple[Any, Any]:
        """(images, masks) of a record (C + P, H, W) or a batch of them (B, C + P, H, W), numpy or
        torch: the images a view, the masks (H, W) / (B, H, W) of ``torch_dtype`` (a view for uint8)."""
        c = self.channels
        images = records[..., :c, :, :]
        masks = join_planes(records[..., c:, :, :], self.mask_dtype)
        return images, masks

    def mask_fill_planes(self, fill: int) -> list[int]:
        """The byte of each mask plane that stands for the class index ``fill``."""
        return [fill & 0xFF] if self.planes == 1 else [fill & 0xFF, (fill >> 8) & 0xFF]

    def mask_max(self) -> int:
        return 255 if self.planes == 1 else 65535


def join_planes(planes: Any, mask_dtype: str) -> Any:
    """(..., P, H, W) uint8 planes as (..., H, W) masks: uint8 (a view), or uint16 values as int32."""
    if mask_dtype == "uint8":
        return planes[..., 0, :, :]
    if isinstance(planes, np.ndarray):
        return planes[..., 0, :, :].astype(np.int32) | (planes[..., 1, :, :].astype(np.int32) << 8)
    import torch

    return planes[..., 0, :, :].to(torch.int32) | (planes[..., 1, :, :].to(torch.int32) << 8)


def check(manifest: dict[str, Any], where: str) -> None:
    """StoreCorruptError unless the manifest's ``fields`` describe its records (manifest.validate)."""
    fields = manifest["fields"]
    shape = manifest["sample"].get("shape") or manifest["sample"].get("decoded_shape")
    ok = isinstance(fields, dict) and set(fields) == {"image", "mask"} and isinstance(fields["image"], dict) \
        and isinstance(fields["mask"], dict)
    if ok:
        channels = fields["image"].get("channels")
        mask = fields["mask"]
        if mask.get("kind") != "planes":
            raise StoreCorruptError(f"{where}: the mask field is of kind {mask.get('kind')!r}, which this dlstore "
                                    "does not read (it reads 'planes'); upgrade dlstore")
        ok = channels in (1, 3) and mask.get("dtype") in MASK_DTYPES \
            and mask.get("planes") == MASK_DTYPES[mask.get("dtype")] \
            and (shape is None or shape[0] == channels + mask["planes"])
    if not ok:
        raise StoreCorruptError(f"{where}: invalid 'fields' {fields!r} for records of shape {shape} (expected an "
                                "image of 1 or 3 channels and a uint8 (1 plane) or uint16 (2 planes) mask after it)")
