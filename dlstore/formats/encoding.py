"""Encoded sample storage: JPEG or PNG bytes of the statically transformed image.

A raw 224x224 RGB sample is 150,528 bytes; as a quality-90 JPEG it is typically
10-30 kB. The price is a decode per read. This is the trade-off FFCV users weigh
(raw ImageNet at 256 px is ~170 GB, JPEG ~10-22 GB); ``dlstore bench`` shows
both axes on your disk.

How an encoded sample is stored: every format already stores variable-shape
records (an array and its shape), so an encoded sample is stored as the uint8
array of its bytes with shape ``(1, 1, nbytes)``. The manifest says
``"encoding": "jpeg"``, ``"shape": null`` (the records vary) and
``"decoded_shape"``: the (C, H, W) every decoded sample has, or null.

Reading: :class:`DecodingReader` wraps a format's Reader and decodes with PIL,
so the pixels are exactly what ``PIL.Image.open`` of those bytes gives. Readers
themselves only fetch bytes. A batch of JPEG records (``get_many``/``get_batch``)
is decoded by ``torchvision.io.decode_jpeg`` on the list, 1.3-1.7x PIL's speed on
one core (measured, 224x224 q90) and straight to (C, H, W): both bundle
libjpeg-turbo and gave identical pixels on every record tried (Pillow 13.0,
torchvision 0.29), but versions may round differently, so each reader checks
once, on the first records it decodes, that torchvision's pixels equal PIL's,
and keeps to PIL if they do not.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

from ..errors import ArgumentError, StoreCorruptError, VariableShapeError
from ._common import batch_out

ENCODINGS = ("raw", "jpeg", "png")
_PIL_FORMATS = {"jpeg": "JPEG", "png": "PNG"}


def encode(sample: np.ndarray, encoding: str, *, quality: int = 90) -> np.ndarray:
    """Encode a uint8 (C, H, W) sample (C = 1 or 3) as a (1, 1, nbytes) uint8 record."""
    if encoding not in _PIL_FORMATS:
        raise ArgumentError(f"cannot encode as {encoding!r}; valid encodings: {', '.join(_PIL_FORMATS)} "
                            "('raw' samples are stored as they are, without encode)")
    hwc = sample[0] if sample.shape[0] == 1 else np.ascontiguousarray(sample.transpose(1, 2, 0))
    buffer = io.BytesIO()
    options: dict[str, Any] = {"quality": int(quality)} if encoding == "jpeg" else {"compress_level": 6}
    Image.fromarray(hwc).save(buffer, format=_PIL_FORMATS[encoding], **options)
    return np.frombuffer(buffer.getvalue(), dtype=np.uint8).reshape(1, 1, -1)


def decode(record: np.ndarray, *, where: str = "sample") -> np.ndarray:
    """Decode a stored record (any shape, its bytes are the file) to a uint8 (C, H, W) array."""
    try:
        with Image.open(io.BytesIO(memoryview(np.ascontiguousarray(record)).cast("B"))) as img:
            img.load()
            arr = np.asarray(img)
    except (OSError, ValueError, SyntaxError) as exc:
        raise StoreCorruptError(f"{where}: stored image bytes do not decode ({type(exc).__name__}: {exc})") from exc
    if arr.ndim == 2:
        return arr[None].copy()
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


class DecodingReader:
    """A format Reader whose samples are encoded: same interface, decoded arrays out."""

    def __init__(self, reader: Any):
        self.raw = reader
        self.manifest = reader.manifest
        self.labels = reader.labels
        self.count = reader.count if hasattr(reader, "count") else len(reader)
        shape = self.manifest["sample"].get("decoded_shape")
        self.shape = tuple(shape) if shape is not None else None
        self._where = str(getattr(reader, "path", "store"))
        # JPEG batches through torchvision.io.decode_jpeg: None until checked against PIL
        self._batch_jpeg: bool | None = None if self.manifest["sample"]["encoding"] == "jpeg" else False

    def __len__(self) -> int:
        return self.count

    def _decoded(self, record: np.ndarray, i: int) -> np.ndarray:
        sample = decode(record, where=f"{self._where} sample {i}")
        if self.shape is not None and sample.shape != self.shape:
            raise StoreCorruptError(f"{self._where} sample {i}: decodes to {sample.shape}, manifest says {self.shape}")
        return sample

    def get(self, i: int) -> np.ndarray:
        return self._decoded(self.raw.get(i), i)

    def get_many(self, indices: list[int]) -> list[np.ndarray]:
        return [np.ascontiguousarray(sample) for sample in self._samples(indices)]

    def _samples(self, indices: list[int]) -> list[np.ndarray]:
        """Samples ``indices`` decoded; torchvision's are (C, H, W) views of (H, W, C) memory."""
        records = self.raw.get_many(indices)  # one transaction / one sorted read per batch
        if len(records) > 1 and self._batch_jpeg is not False:
            decoded = self._decode_jpegs(records)
            if decoded is not None:
                for sample, i in zip(decoded, indices):
                    if self.shape is not None and sample.shape != self.shape:
                        raise StoreCorruptError(f"{self._where} sample {i}: decodes to {sample.shape}, "
                                                f"manifest says {self.shape}")
                return decoded
        return [self._decoded(r, i) for r, i in zip(records, indices)]

    def _decode_jpegs(self, records: list[np.ndarray]) -> list[np.ndarray] | None:
        """``records`` decoded by torchvision in one call, or None: use PIL (a record that does
        not decode, whose error PIL's path then names, or pixels that differ from PIL's)."""
        try:
            import torch
            from torchvision.io import decode_jpeg
        except ImportError:   # torchvision deprecates its decoders (0.29) for TorchCodec's
            self._batch_jpeg = False
            return None
        tensors = [torch.from_numpy(np.ascontiguousarray(r).reshape(-1)) for r in records]
        try:
            images = [image.numpy() for image in decode_jpeg(tensors)]
        except RuntimeError:
            return None
        if self._batch_jpeg is None:   # once per reader: the first records against PIL
            self._batch_jpeg = all(np.array_equal(image, decode(r)) for image, r in zip(images[:4], records))
            if not self._batch_jpeg:
                return None
        return images

    def get_batch(self, indices: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if self.shape is None:
            raise VariableShapeError(f"{self._where}: get_batch needs a store whose samples decode to one shape")
        out = batch_out(out, len(indices), self.shape)
        for j, sample in enumerate(self._samples([int(i) for i in indices])):
            out[j] = sample   # the (H, W, C) -> (C, H, W) copy, straight into the batch
        return out
