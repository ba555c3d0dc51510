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

Reading: :class:`DecodingReader` wraps a format's Reader; readers themselves
only fetch bytes. Records are decoded by ``torchvision.io`` wherever its pixels
are PIL's (checked, below): one record (``get``, what ``dataset[i]`` and
DataLoader workers call) by ``decode_jpeg`` / ``decode_png``, a batch of records
(``get_many`` / ``get_batch``, what the loader threads call) with every JPEG of
the batch in one ``decode_jpeg`` call on the list, each PNG by ``decode_png``,
straight to (C, H, W); and on the GPU with
:meth:`DecodingReader.decode_many` ``(indices, device="cuda")`` (nvjpeg; PNG
decodes on the CPU and is then copied).

Pixels, torchvision against PIL, measured on the machine of ``benchmarks/loader.py``
(Pillow 13.0 with libjpeg-turbo 3.2, torchvision 0.29.1, both bundling libjpeg-turbo;
``tests/formats/test_encoding.py`` checks it again on every run):

* JPEG, RGB at quality 50-100 with 4:4:4, 4:2:2 and 4:2:0 subsampling, and grayscale:
  identical (max |d| = 0, every pixel equal), 1.2-1.6x PIL's speed on one core (224 px q90);
* PNG: identical (lossless; 1.15-1.25x PIL's speed);
* 4-component (CMYK/YCCK) JPEGs: *different* (PIL keeps Adobe's inverted CMYK; max |d| = 255),
  so such a record is decoded by PIL. ``encode`` never writes one (it takes 1 or 3
  channels); a store holding one got it from elsewhere.

Other libjpeg-turbo builds may round differently (the IDCT and upsampling are not
specified bit-exactly), so each reader checks once, on the first 4 records it
decodes, that torchvision's pixels equal PIL's, and keeps to PIL if they do not.
A batch in which a record does not decode falls back to PIL record by record,
whose error names the store and the sample.

Decode-time crops (``dlstore.data.decode_crop``): :meth:`DecodingReader.decode_records` decodes
the records of a batch as ``get_many_views`` does (one ``decode_jpeg`` call for the batch);
for the opt-in reduced decode, :func:`image_size` reads a record's (height, width) from its
header (JPEG SOF, PNG IHDR) without decoding it, so a crop box can be drawn first, and
:meth:`DecodingReader.decode_record` decodes one record at libjpeg's DCT scale 1/2, 1/4 or
1/8 (PIL's ``Image.draft``; not PIL's or torchvision's full-size pixels: see docs/reading.md).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

from ..errors import ArgumentError, StoreCorruptError, VariableShapeError
from .checks import batch_out
from .handles import open_lock

ENCODINGS = ("raw", "jpeg", "png")
_CHECKED = 4   # records each reader compares with PIL before it trusts torchvision's decoder
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


# JPEG start-of-frame markers (they hold the size): C0-CF but DHT (C4), JPG (C8) and DAC (CC)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def image_size(record: np.ndarray, *, where: str = "sample") -> tuple[int, int]:
    """(height, width) of an encoded record, read from its header (JPEG, PNG; else PIL opens it);
    StoreCorruptError naming ``where`` when it has none."""
    data = memoryview(np.ascontiguousarray(record)).cast("B")
    n = len(data)
    if n > 24 and data[:8] == b"\x89PNG\r\n\x1a\n":
        return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")
    if n > 4 and data[0] == 0xFF and data[1] == 0xD8:
        k = 2
        while k + 9 < n:
            if data[k] != 0xFF:
                break
            marker = data[k + 1]
            if marker == 0xFF:        # fill byte
                k += 1
                continue
            if marker in _SOF:
                return (data[k + 5] << 8) | data[k + 6], (data[k + 7] << 8) | data[k + 8]
            if marker == 0x01 or 0xD0 <= marker <= 0xD7:   # markers without a length
                k += 2
                continue
            k += 2 + ((data[k + 2] << 8) | data[k + 3])
    try:   # anything else (a header this scan does not know)
        with Image.open(io.BytesIO(data)) as img:
            return img.size[1], img.size[0]
    except (OSError, ValueError, SyntaxError) as exc:
        raise StoreCorruptError(f"{where}: stored image bytes have no image header ({type(exc).__name__}: "
                                f"{exc})") from exc


def reduced_scale(height: int, width: int, out: tuple[int, int]) -> int:
    """The largest DCT scale divisor (8, 4, 2 or 1) at which a ``height`` x ``width`` box of an
    image still holds at least ``out`` = (out_h, out_w) pixels."""
    for s in (8, 4, 2):
        if height >= s * out[0] and width >= s * out[1]:
            return s
    return 1


def decode_reduced(record: np.ndarray, scale: int, *, where: str = "sample") -> tuple[np.ndarray, int]:
    """A JPEG record decoded at 1/``scale`` of its size by libjpeg's DCT scaling (PIL's ``draft``):
    ((C, ceil(H/s), ceil(W/s)) uint8 array, the scale s applied (1 where the file allows none,
    e.g. progressive))."""
    try:
        with Image.open(io.BytesIO(memoryview(np.ascontiguousarray(record)).cast("B"))) as img:
            w, h = img.size
            drafted = img.draft(img.mode, (max(1, w // scale), max(1, h // scale))) if img.format == "JPEG" else None
            img.load()
            arr = np.array(img)   # writable (torch wants it); a reduced image is small
            applied = int(round(w / drafted[1][2])) if drafted is not None else 1
    except (OSError, ValueError, SyntaxError) as exc:
        raise StoreCorruptError(f"{where}: stored image bytes do not decode ({type(exc).__name__}: {exc})") from exc
    if arr.ndim == 2:
        return arr[None], applied
    return arr.transpose(2, 0, 1), applied


def decode_batch(records: list[np.ndarray], encoding: str, *, device: Any = "cpu") -> list[Any]:
    """Decode encoded records with ``torchvision.io``: uint8 (C, H, W) tensors on ``device``.

    JPEG: one ``decode_jpeg`` call on the whole list (on ``device``; "cuda" uses nvjpeg).
    PNG: ``decode_png`` per record on the CPU, then moved to ``device``. Channels as stored
    (``ImageReadMode.UNCHANGED``). Raises ``RuntimeError`` (torchvision's) when a record does
    not decode, and ``ImportError`` without torchvision's decoders.
    """
    import torch
    from torchvision.io import decode_jpeg, decode_png

    # records read from a bytes object are read-only; torch wants writable memory (a ~20 kB copy)
    tensors = [torch.from_numpy(np.array(r, copy=not r.flags.writeable).reshape(-1)) for r in records]
    if encoding == "jpeg":
        if torch.device(device).type == "cpu":
            return list(decode_jpeg(tensors))
        return list(decode_jpeg(tensors, device=device))
    if encoding == "png":
        return [decode_png(t).to(device) for t in tensors]
    raise ArgumentError(f"cannot batch-decode {encoding!r}; valid encodings: {', '.join(_PIL_FORMATS)}")


class DecodingReader:
    """A format Reader whose samples are encoded: same interface, decoded arrays out.

    Args:
        reader: the format's Reader (it fetches the encoded records).
    """

    def __init__(self, reader: Any):
        self.raw = reader
        self.path = reader.path
        self.manifest = reader.manifest
        self.labels = reader.labels
        self.targets = getattr(reader, "targets", None)   # (N, K) target vectors, or None
        self.count = reader.count if hasattr(reader, "count") else len(reader)
        shape = self.manifest["sample"].get("decoded_shape")
        self.shape = tuple(shape) if shape is not None else None
        self.where = str(getattr(reader, "path", "store"))   # the store, as errors name it
        self._encoding = self.manifest["sample"]["encoding"]
        # records through torchvision.io: None until its first _CHECKED records matched PIL's
        self._batch_jpeg: bool | None = None if self._encoding in _PIL_FORMATS else False
        self._checked = 0   # records compared with PIL so far (the verdict takes _CHECKED)

    def __len__(self) -> int:
        return self.count

    # what concerns the stored records, not their pixels: the format's reader answers
    @property
    def willneed(self) -> bool:
        return self.raw.willneed

    def prefetch(self, indices: Any) -> bool:
        return self.raw.prefetch(indices)

    def ensure_open(self) -> None:
        self.raw.ensure_open()

    def origins(self) -> Any:
        return self.raw.origins()

    def _decoded(self, record: np.ndarray, i: int) -> np.ndarray:
        sample = decode(record, where=f"{self.where} sample {i}")
        self._check_shape(sample.shape, i)
        return sample

    def _check_shape(self, shape: tuple[int, ...], i: int) -> None:
        if self.shape is not None and tuple(shape) != self.shape:
            raise StoreCorruptError(f"{self.where} sample {i}: decodes to {tuple(shape)}, manifest says {self.shape}")

    def get(self, i: int) -> np.ndarray:
        # one record as a batch of one: torchvision once checked against PIL (1.3-1.5x faster),
        # as a (C, H, W) view of (H, W, C) memory, the layout of torchvision's pil_to_tensor (no
        # copy; a resize reads it faster than contiguous CHW: 0.31 vs 0.43 ms, RRC 224)
        return self._samples([i])[0]

    def get_many(self, indices: list[int]) -> list[np.ndarray]:
        return [np.ascontiguousarray(sample) for sample in self._samples(indices)]

    def get_many_views(self, indices: list[int]) -> list[np.ndarray]:
        """Like :meth:`get_many`, without the copy to contiguous (C, H, W): torchvision's samples
        stay (C, H, W) views of (H, W, C) memory, the layout of its ``pil_to_tensor``. For
        per-sample transforms, which read any layout (a resize reads this one faster)."""
        return self._samples(indices)

    def _samples(self, indices: list[int]) -> list[np.ndarray]:
        """Samples ``indices`` decoded; torchvision's are (C, H, W) views of (H, W, C) memory."""
        return self.decode_records(self.raw.get_many(indices), indices)  # one transaction / sorted read

    def decode_records(self, records: list[np.ndarray], indices: list[int]) -> list[np.ndarray]:
        """``records`` (samples ``indices``, as :meth:`records` read them) decoded as ``get_many_views``
        decodes them: the JPEGs of the batch in one ``decode_jpeg`` call where torchvision's pixels
        are PIL's, else (and for a record that does not decode, whose error names it) by PIL."""
        if records and self._batch_jpeg is not False:
            decoded = self._decode_batch(records)
            if decoded is not None:
                samples = []
                for image, record, i in zip(decoded, records, indices):
                    sample = image.numpy() if image.shape[0] in (1, 3) else self._decoded(record, i)  # CMYK: PIL
                    self._check_shape(sample.shape, i)
                    samples.append(sample)
                return samples
        return [self._decoded(r, i) for r, i in zip(records, indices)]

    def _decode_batch(self, records: list[np.ndarray]) -> list[Any] | None:
        """``records`` decoded by torchvision, or None: use PIL (a record that does not decode,
        whose error PIL's path then names, or pixels that differ from PIL's)."""
        try:
            images = decode_batch(records, self._encoding)
        except ImportError:   # torchvision deprecates its decoders (0.29) for TorchCodec's
            self._batch_jpeg = False
            return None
        except RuntimeError:
            return None
        # Once per reader: the first 4 records against PIL (CMYK ones go to PIL), in one batch or
        # over several calls (single records: ``get``). Read the verdict once, after this thread's
        # decode: another thread may have just rejected these pixels. Threads that check at once
        # may disagree (their records differ): a rejection is never overturned.
        ok = self._batch_jpeg
        if ok is None:
            pairs = [(image, r) for image, r in zip(images, records) if image.shape[0] in (1, 3)][:_CHECKED]
            if pairs:
                equal = all(np.array_equal(image.numpy(), decode(r)) for image, r in pairs)
                with open_lock():
                    self._checked += len(pairs)
                    if self._batch_jpeg is not False and (not equal or self._checked >= _CHECKED):
                        self._batch_jpeg = equal
                    ok = self._batch_jpeg
        return None if ok is False else images

    def records(self, indices: list[int]) -> list[np.ndarray]:
        """The encoded records ``indices`` as stored (one read of the format's Reader)."""
        return self.raw.get_many(indices)

    def decode_record(self, record: np.ndarray, i: int, *, reduce: int = 1) -> tuple[np.ndarray, int]:
        """Record ``record`` (sample ``i``) decoded: ((C, H, W) array, its scale divisor). ``reduce``
        1: the pixels of ``get_many`` (a view of (H, W, C) memory) and divisor 1; 2, 4 or 8: a JPEG
        decoded at most that much smaller by :func:`decode_reduced`, with the divisor applied."""
        if reduce > 1 and self._encoding == "jpeg":
            sample, applied = decode_reduced(record, reduce, where=f"{self.where} sample {i}")
            if applied > 1 and sample.shape[0] in (1, 3):
                return sample, applied
        if self._batch_jpeg is not False:
            decoded = self._decode_batch([record])
            if decoded is not None and decoded[0].shape[0] in (1, 3):
                sample = decoded[0].numpy()
                self._check_shape(sample.shape, i)
                return sample, 1
        return self._decoded(record, i), 1

    def decode_many(self, indices: list[int], *, device: Any = "cpu") -> list[Any]:
        """Samples ``indices`` as uint8 (C, H, W) tensors on ``device``, decoded there where
        torchvision can (JPEG on "cuda": nvjpeg), else by PIL and copied to ``device``.

        The pixels are PIL's wherever the check of ``get_many`` holds (see the module
        docstring); nvjpeg's are not checked against PIL: they may differ by rounding.
        """
        import torch

        indices = [int(i) for i in indices]
        records = self.raw.get_many(indices)
        decoded = None
        if records and torch.device(device).type != "cpu":
            try:   # not checked against PIL: nvjpeg's rounding is its own
                decoded = decode_batch(records, self._encoding, device=device)
            except (ImportError, RuntimeError):
                decoded = None
        elif records and self._batch_jpeg is not False:
            decoded = self._decode_batch(records)
        out = []
        for k, (record, i) in enumerate(zip(records, indices)):
            image = decoded[k] if decoded is not None and decoded[k].shape[0] in (1, 3) else None
            if image is None:
                image = torch.from_numpy(self._decoded(record, i)).to(device)
            self._check_shape(tuple(image.shape), i)
            out.append(image)
        return out

    def get_batch(self, indices: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if self.shape is None:
            raise VariableShapeError(f"{self.where}: get_batch needs a store whose samples decode to one shape")
        out = batch_out(out, len(indices), self.shape)
        for j, sample in enumerate(self._samples([int(i) for i in indices])):
            out[j] = sample   # the (H, W, C) -> (C, H, W) copy, straight into the batch
        return out
